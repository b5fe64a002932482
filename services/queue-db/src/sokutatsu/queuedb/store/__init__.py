"""Queue-db's SQL: every statement the service and the transfer daemon run on the schema or the
catalog, and the thin functions that run them (``queues``: queues, messages and leases;
``transfer``: the outbox, the batches in flight, the cursors, the recovery table and prepared
transactions). Transaction control (``BEGIN``, ``COMMIT``, ``ROLLBACK``) stays with the code that
holds the transaction, and the schema itself with its migrations (:mod:`sokutatsu.queuedb.schema`).

The invariants, kept here and nowhere else:

1. **A function runs its statements on the connection it is given**, in that connection's open
   transaction (or in autocommit, where the caller has it so): it never commits, and it decides
   nothing the caller's protocol decides.
2. **Batch-sized arrays go in binary format** (``%b``: a transfer batch's columns, a batch's
   outbox ids, a group's acked lease ids): in text format psycopg escapes every element in Python,
   10 ms of CPU for a batch of 1,000 (1.6 ms in binary).
3. **A statement on the hot path is one round trip**: a batch is one statement over arrays, never
   a statement per message.
"""

from __future__ import annotations

from typing import Any

import psycopg

Conn = psycopg.AsyncConnection[Any]
Row = tuple[Any, ...]

# The transaction commits without waiting for the WAL flush: for writes whose loss in an OS crash
# the protocol repairs.
LAZY = "SET LOCAL synchronous_commit = off"


async def commit_lazily(conn: Conn, prepare: bool | None = None) -> None:
    """The connection's transaction commits without waiting for the WAL flush (:data:`LAZY`)."""
    await conn.execute(LAZY, prepare=prepare)


async def fetch_one(conn: Conn, query: str, params: Any = None) -> Row | None:
    return await (await conn.execute(query, params)).fetchone()


async def fetch_all(conn: Conn, query: str, params: Any = None) -> list[Row]:
    return await (await conn.execute(query, params)).fetchall()


async def server_version(conn: Conn) -> str:
    row = await fetch_one(conn, "SHOW server_version")
    return str(row[0]) if row else "unknown"

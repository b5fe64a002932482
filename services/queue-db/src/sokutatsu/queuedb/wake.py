"""Waking the transfer daemon after ``Enqueue`` calls into immediate queues commit.

The SDK's ``enqueue`` wakes it with a ``NOTIFY`` inside the application's transaction, which
PostgreSQL delivers on commit; but a transaction that notifies holds the database's notify lock
from before its commit record until the commit is flushed, so concurrent notifying transactions
commit one at a time instead of sharing flushes (group commit). pgbench on this project's bench
machine, 8 clients, one single-row insert per transaction: 8,757 and 9,080 tx/s; the same with a
``pg_notify`` in the transaction: 3,163 and 2,781 tx/s. The queue-db API therefore enqueues
without the NOTIFY and sends it afterwards from here, as one statement on a connection of its own
in autocommit (a transaction that writes nothing: nothing to flush, one round trip), for every
node woken since the last one: one NOTIFY per round trip however many calls committed meanwhile,
and at most one per ``INTERVAL_SECONDS``: a daemon that is sending finds what committed meanwhile
without being told, so a NOTIFY per group of a busy node only cost CPU on node 1, in its database
and in the daemon (7 % of node 1's service at 16 callers, profiled). The first wake after a quiet
moment goes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg

from sokutatsu.core.dsn import error_line
from sokutatsu.queuedb.db import Database
from sokutatsu.queuedb.enqueue import TRANSFER_CHANNEL
from sokutatsu.queuedb.store import transfer

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 0.002


class Waker:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._nodes: set[str] = set()
        self._pending = asyncio.Event()

    def wake(self, node: str) -> None:
        """Wake the daemon that sends to ``node`` (soon, after this call's commit)."""
        self._nodes.add(node)
        self._pending.set()

    async def run(self) -> None:
        """Send the wake-ups (a background task for the service's life)."""
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                await self._pending.wait()
                self._pending.clear()
                nodes, self._nodes = sorted(self._nodes), set()
                try:
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(self.db.dsn, autocommit=True, connect_timeout=5)
                    await transfer.wake(conn, TRANSFER_CHANNEL, nodes)
                    await asyncio.sleep(INTERVAL_SECONDS)  # wakes asked for meanwhile go together
                except psycopg.Error as exc:
                    # The daemon's own poll (and its LISTEN reconnection) finds the messages anyway.
                    log.warning(
                        "could not wake the transfer daemon for %s: %s", ", ".join(nodes), error_line(exc, self.db.dsn)
                    )
                    if conn is not None:
                        await conn.close()
                        conn = None
                    await asyncio.sleep(0.1)
        finally:
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()

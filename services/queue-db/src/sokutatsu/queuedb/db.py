"""The node's connection pool, and database failures as gRPC statuses a caller can act on."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from sokutatsu.core.embedded_pg import error_line, redact_dsn
from sokutatsu.core.errors import ResourceExhausted, Unavailable

POOL_TIMEOUT_SECONDS = 10.0
# SQLSTATE class 53: out of memory or disk, too many connections, max_prepared_transactions reached.
INSUFFICIENT_RESOURCES = "53"


class Database:
    def __init__(self, dsn: str, size: int) -> None:
        self.dsn = dsn
        self.pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            dsn, min_size=1, max_size=size, open=False, timeout=POOL_TIMEOUT_SECONDS, kwargs={"connect_timeout": 5}
        )

    async def open(self) -> None:
        await self.pool.open(wait=True, timeout=POOL_TIMEOUT_SECONDS)

    async def close(self) -> None:
        await self.pool.close()

    @contextlib.asynccontextmanager
    async def transaction(self, *, durable: bool = True) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """One transaction: committed when the block ends, rolled back when it raises.

        ``durable=False`` commits without waiting for the WAL flush (``synchronous_commit = off``):
        for writes whose loss in an OS crash is repaired by the protocol (seed 001)."""
        try:
            async with self.pool.connection() as conn:
                if not durable:
                    await conn.execute("SET LOCAL synchronous_commit = off")
                yield conn
        except (psycopg.OperationalError, PoolTimeout) as exc:
            if isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith(INSUFFICIENT_RESOURCES):
                # It answers, but is short of something (max_prepared_transactions for PrepareBatch,
                # memory, disk): capacity, not an outage.
                line = error_line(exc, self.dsn)
                hint = f" ({exc.diag.message_hint})" if exc.diag.message_hint else ""
                if "prepared transactions" in line:
                    hint += "; each prepared batch holds one until FinishPrepared ends it (ListPrepared lists them)"
                raise ResourceExhausted(
                    f"the node's database {redact_dsn(self.dsn)} is short of a resource: {line}{hint}"
                ) from None
            raise Unavailable(
                f"the node's database {redact_dsn(self.dsn)} does not answer: {error_line(exc, self.dsn)}"
            ) from None

"""The node's PostgreSQL connection: checked at start and watched while serving."""

from __future__ import annotations

import asyncio
import logging

import psycopg

from sokutatsu.core.embedded_pg import error_line, redact_dsn

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 5


# One redaction for every DSN shown to a person: host:port/dbname, never the user or password.
redact = redact_dsn


async def server_version(dsn: str) -> str:
    """Connect once and return the server's version string."""
    async with await psycopg.AsyncConnection.connect(
        dsn, connect_timeout=CONNECT_TIMEOUT_SECONDS, autocommit=True
    ) as conn:
        cur = await conn.execute("SHOW server_version")
        row = await cur.fetchone()
        return str(row[0]) if row else "unknown"


async def watch(dsn: str, interval: float, on_change: asyncio.Queue[bool] | None = None) -> None:
    """Check the database every ``interval`` seconds; put each change of reachability on ``on_change``."""
    reachable = True
    while True:
        await asyncio.sleep(interval)
        try:
            await server_version(dsn)
            now = True
        except psycopg.Error as exc:
            now = False
            if reachable:
                log.warning("database %s does not answer: %s", redact(dsn), error_line(exc, dsn))
        if now != reachable:
            reachable = now
            if now:
                log.info("database %s answers again", redact(dsn))
            if on_change is not None:
                on_change.put_nowait(now)

"""The node's PostgreSQL connection: checked at start and watched while serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import psycopg

from sokutatsu.core.dsn import error_line, redact_dsn
from sokutatsu.queuedb import store

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 5
# While the database does not answer it is checked this often (at most), so health turns SERVING,
# and the senders watching it send again, within this long of the database answering.
RECHECK_DOWN_SECONDS = 0.25


async def server_version(dsn: str) -> str:
    """Connect once and return the server's version string."""
    async with await psycopg.AsyncConnection.connect(
        dsn, connect_timeout=CONNECT_TIMEOUT_SECONDS, autocommit=True
    ) as conn:
        return await store.server_version(conn)


async def watch(
    dsn: str, interval: float, on_change: asyncio.Queue[bool] | None = None, check_now: asyncio.Event | None = None
) -> None:
    """Check the database every ``interval`` seconds (every ``RECHECK_DOWN_SECONDS`` at most while it
    does not answer, and at once when ``check_now`` is set: a call found it not answering); put each
    change of reachability on ``on_change``."""
    reachable = True
    wake = check_now or asyncio.Event()
    loop = asyncio.get_running_loop()
    while True:
        checked = loop.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval if reachable else min(interval, RECHECK_DOWN_SECONDS))
        # Woken by failing calls: at most one check per RECHECK_DOWN_SECONDS all the same.
        await asyncio.sleep(max(0.0, checked + min(interval, RECHECK_DOWN_SECONDS) - loop.time()))
        wake.clear()
        try:
            await server_version(dsn)
            now = True
        except psycopg.Error as exc:
            now = False
            if reachable:
                log.warning("database %s does not answer: %s", redact_dsn(dsn), error_line(exc, dsn))
        if now != reachable:
            reachable = now
            if now:
                log.info("database %s answers again", redact_dsn(dsn))
            if on_change is not None:
                on_change.put_nowait(now)

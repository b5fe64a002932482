"""One task and one thread for all of a broker's disk I/O.

Flow-to-disk writes, reads and deletes run on a single worker thread, never on
the event loop. Jobs are coroutines executed one after the other by
:meth:`DiskWorker.run`, so the operations on one segment log are ordered and
the log needs no locks; a job hands its blocking part to the thread with
:meth:`DiskWorker.run_blocking`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
Job = Callable[[], Awaitable[None]]


class DiskWorker:
    def __init__(self) -> None:
        self._jobs: asyncio.Queue[Job] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="broker-disk")

    def submit(self, job: Job) -> None:
        """Run ``job`` after the jobs already submitted."""
        self._jobs.put_nowait(job)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn(*args)`` on the disk thread, in order with the submitted jobs."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        async def job() -> None:
            try:
                result = await self.run_blocking(fn, *args)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)

        self.submit(job)
        return await done

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run(self) -> None:
        """Execute jobs until cancelled. A failing job is logged; the broker goes on."""
        while True:
            job = await self._jobs.get()
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("disk job failed")

    def close(self) -> None:
        """Wait for the thread to finish what it is doing (used at shutdown)."""
        self._executor.shutdown(wait=True)

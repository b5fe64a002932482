"""The stop watchdog names the tasks a stop is still waiting for."""

from __future__ import annotations

import asyncio
import logging

import pytest

from sokutatsu.core.shutdown import watch_stop


async def _stuck_in_close(release: asyncio.Event) -> None:
    await release.wait()


async def test_an_overrunning_stop_logs_the_stack_of_each_pending_task(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()
    stuck = asyncio.create_task(_stuck_in_close(release), name="stuck")
    fired = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="sokutatsu.core.shutdown")
    handle = watch_stop("broker broker-a", 0)
    asyncio.get_running_loop().call_later(0, fired.set)
    await fired.wait()
    release.set()
    await stuck
    handle.cancel()
    text = caplog.text
    # The stuck task and this test's own (it waits for the watchdog too).
    assert "broker broker-a: still stopping after 0.0s; 2 tasks pending" in text
    assert "_stuck_in_close" in text
    assert "release.wait()" in text


async def test_a_stop_that_ends_in_time_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sokutatsu.core.shutdown")
    handle = watch_stop("sequencer seq-a", 0)
    handle.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert caplog.text == ""

"""The stop watchdog names the tasks a stop is still waiting for."""

from __future__ import annotations

import asyncio
import logging

import pytest

from sokutatsu.core.shutdown import stop_if_cancelled, watch_stop


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
    assert "test_shutdown.py:14 in _stuck_in_close" in text


async def test_a_stop_that_ends_in_time_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sokutatsu.core.shutdown")
    handle = watch_stop("sequencer seq-a", 0)
    handle.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert caplog.text == ""


class _CallFailed(Exception):
    pass


async def _call_that_swallows_cancellation() -> None:
    """As grpc.aio can: the interrupted call ends with its own error, not CancelledError."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        raise _CallFailed("CANCELLED") from None


async def _retrying_loop(turns: list[int], started: asyncio.Event) -> None:
    while True:
        stop_if_cancelled()
        turns.append(1)
        started.set()
        try:
            await asyncio.create_task(_call_that_swallows_cancellation())
        except _CallFailed:
            await asyncio.sleep(0)  # one more failed call: retry (without the check: forever)


async def test_a_loop_stops_although_a_call_turned_its_cancellation_into_an_error() -> None:
    turns: list[int] = []
    started = asyncio.Event()
    loop = asyncio.create_task(_retrying_loop(turns, started))
    await started.wait()
    loop.cancel()
    done, _ = await asyncio.wait([loop], timeout=30)  # only stops a hung test
    assert loop in done
    assert loop.cancelled()
    assert len(turns) == 1  # the call's error came back, and the next turn saw the request

"""A task cancelled while it awaits the SDK stops: the SDK never swallows a cancellation."""

from __future__ import annotations

import asyncio

from sokutatsu.client._accumulator import Accumulator


async def test_a_publish_cancelled_as_its_acknowledgement_arrives_is_cancelled() -> None:
    """asyncio.wait_for on Python 3.11 returns, instead of raising, when the task is cancelled just as
    what it waits for completes: a task cancelled in ``publish()`` as its acknowledgement came went on
    publishing, and a fuzz canary's close waited for it for good (a CI run, 120 s). Cancelled in that
    order fifty times, the wait raises CancelledError each time."""
    swallowed = 0
    for _ in range(50):
        accumulator = Accumulator(max_pending=10, ack_timeout=30.0)
        waiting = asyncio.create_task(accumulator.wait_acked(1))
        await asyncio.sleep(0)
        accumulator._waiters[1].set_result(None)  # the acknowledgement arrives
        await asyncio.sleep(0)
        waiting.cancel()  # as the task awaiting it is cancelled
        try:
            await waiting
        except asyncio.CancelledError:
            continue
        swallowed += 1
    assert swallowed == 0, f"the cancellation was swallowed {swallowed} times of 50"

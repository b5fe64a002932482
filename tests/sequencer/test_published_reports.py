"""The publisher's "published" reports reach the sequencer (issue #21, item 3).

A range the brokers acknowledged must be reported published, or the sequencer fills it with a
skip marker after ``FILL_AFTER_MS`` (and warns as if numbers were lost) although its messages
were delivered. Two ways a report used to be lost: the publisher closed before writing it (the
stamping task was cancelled), and the stream broke while it was being written (the report had
already been taken off the publisher's list).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from grpc import aio

from sokutatsu.client import OrderedPublisher, _retry, ordered_publisher
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc
from tests.broker.fix_broker import Pair, until
from tests.sequencer.fix_sequencer import GroupFactory, SequencerProcess
from tests.sequencer.test_ordered import TOPIC, _check_same_order, _wait_all, ordered_group

pytestmark = pytest.mark.timeout(120)


async def _settled(process: SequencerProcess) -> sequencer_pb2.SequencerStatus:
    """The sequencer's status once it holds no unsettled range (reported, or filled)."""
    status = await process.status()

    async def none_outstanding() -> bool:
        nonlocal status
        status = await process.status()
        return status.outstanding_ranges == 0

    # FILL_AFTER_MS is 500 ms in these tests: an unreported range is filled well within the bound.
    await until(none_outstanding, "no unsettled range on the sequencer")
    return status


async def _publish(pub: OrderedPublisher, name: str, rounds: int) -> list[int]:
    numbers: list[int] = []
    for r in range(rounds):
        stamps = await asyncio.wait_for(
            asyncio.gather(*(pub.publish_nowait("k", f"{name}:{r}:{i}".encode()) for i in range(10))), 30
        )
        numbers.extend(s.seq for s in stamps)
    return numbers


async def test_a_closed_publisher_reports_its_last_ranges_published(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a"], pair.addresses, TOPIC)
    sent: list[int] = []
    async with ordered_group(pair, group, readers=1) as readers:
        for i in range(5):
            async with OrderedPublisher(
                group["a"].address, pair.addresses, TOPIC, domain="a", client_id=f"brief-{i}"
            ) as pub:
                sent += await _publish(pub, f"brief-{i}", 3)
        status = await _settled(group["a"])
        await _wait_all(readers, len(sent), group)
    _check_same_order(readers, {"a": sorted(sent)})
    assert status.filled_ranges == 0, group["a"].log()[-3000:]
    assert "filled with a skip marker" not in group["a"].log()


async def test_a_report_lost_with_a_broken_stream_is_sent_again_on_the_next_one(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream breaks exactly while a report is written: the call is cancelled (for real, so
    the sequencer sees its client's stream end) just before the frame goes out. The moment
    cannot be hit reliably from outside the process, hence the hook on the SDK's write."""
    real_write = _retry.write_frame
    broken: list[sequencer_pb2.StampRequest] = []

    async def break_first_report(call: aio.StreamStreamCall[Any, Any], frame: object) -> None:
        if (
            not broken
            and isinstance(frame, sequencer_pb2.StampRequest)
            and frame.published
            and not frame.count
            and not frame.claims
        ):
            broken.append(frame)
            call.cancel()
        await real_write(call, frame)

    monkeypatch.setattr(ordered_publisher, "write_frame", break_first_report)
    pair = await pair_factory()
    group = sequencer_group(["a"], pair.addresses, TOPIC)
    async with ordered_group(pair, group, readers=1) as readers:
        async with OrderedPublisher(group["a"].address, pair.addresses, TOPIC, domain="a", client_id="torn") as pub:
            sent = await _publish(pub, "torn", 3)
            await until(lambda: _true(bool(broken)), "a report written to a broken stream")
            sent += await _publish(pub, "torn-after", 3)
        status = await _settled(group["a"])
        await _wait_all(readers, len(sent), group)
    _check_same_order(readers, {"a": sorted(sent)})
    assert broken
    assert status.filled_ranges == 0, group["a"].log()[-3000:]


async def _true(value: bool) -> bool:
    return value


async def test_a_range_its_client_never_got_is_filled_when_the_client_comes_back_without_it(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    """A new stream of a client begins with everything it holds (claims and published reports):
    a range of its ended stream it leaves out never reached it (a sequencer paused past the
    client's stamp timeout answers the abandoned stream once it runs again; `sokutatsu chaos
    --sequencers` found receivers waiting FILL_AFTER_MS for it). It is filled at once: here
    FILL_AFTER_MS is ten minutes, so only that can fill it."""
    pair = await pair_factory()
    group = sequencer_group(["a"], pair.addresses, TOPIC, fill_after_ms="600000")
    async with ordered_group(pair, group, readers=0):
        process = group["a"]
        await until(lambda: _installed(process), "the first distribution")
        async with aio.insecure_channel(process.address) as channel:
            stub = sequencer_pb2_grpc.SequencerStub(channel)
            ended = stub.Stamp()
            got = []
            for request_id in (1, 2):
                await ended.write(sequencer_pb2.StampRequest(request_id=request_id, count=3, client_id="x", domain="a"))
                response = await ended.read()
                assert isinstance(response, sequencer_pb2.StampResponse)
                got.append(response.range)
            ended.cancel()
            # Back (seen ended or not): the first range published; the second one it does not hold.
            again = stub.Stamp()
            await again.write(sequencer_pb2.StampRequest(client_id="x", domain="a", published=[got[0].first_seq]))
            status = await _settled(process)
            again.cancel()
    assert status.filled_ranges == 1
    assert "began a new stream without claiming it" in process.log()


async def _installed(process: SequencerProcess) -> bool:
    return (await process.status()).distribution.id >= 1

"""The publisher's frames follow its broker's pace (``max_in_flight``): a real broker process,
stopped with SIGSTOP so that a frame stays unacknowledged for as long as the test wants."""

from __future__ import annotations

import asyncio

import pytest

from sokutatsu.client import Publisher, Subscriber
from sokutatsu.client.publisher import DEFAULT_MAX_IN_FLIGHT
from tests.broker.fix_broker import BrokerProcess, until
from tests.broker.test_pair import TOPIC

pytestmark = pytest.mark.timeout(120)

HELD = 50


async def test_what_is_published_while_the_broker_has_not_acknowledged_a_frame_goes_in_one_frame(
    broker: BrokerProcess,
) -> None:
    """With one frame out and unacknowledged (the broker stopped), later messages are held, however
    they are paced, and leave in one frame when the acknowledgement comes; nothing is lost or
    reordered. Without the limit (``max_in_flight=0``, the rule before) each of these messages,
    published 5 ms apart with a 1 ms linger, left in a frame of its own: 52 frames."""
    assert DEFAULT_MAX_IN_FLIGHT == 1
    async with Subscriber(broker.address, "reader", TOPIC, durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 30)
        # max_hold far beyond the test: only the acknowledgement can let the held messages go.
        async with Publisher(broker.address, "paced", linger=0.001, max_hold=300, ack_timeout=60) as pub:
            pub.publish_nowait(TOPIC, "K", b"1")
            await pub.flush()
            assert pub.frames == 1
            broker.freeze()
            try:
                await asyncio.sleep(0.01)  # past the linger: the next message leaves at once
                pub.publish_nowait(TOPIC, "K", b"2")

                async def sent() -> bool:
                    return pub.frames == 2

                await until(sent, "message 2's frame written", 30)
                for i in range(HELD):
                    await asyncio.sleep(0.005)
                    pub.publish_nowait(TOPIC, "K", str(3 + i).encode())
                await asyncio.sleep(0.05)
                assert pub.frames == 2  # message 2's frame is out and unacknowledged: the rest wait
            finally:
                broker.thaw()
            await pub.flush()
            assert pub.frames == 3  # the acknowledgement let the 50 held messages go, in one frame
        seqs: list[int] = []
        async for m in sub:
            seqs.append(m.publisher_seq)
            if len(seqs) == HELD + 2:
                break
    assert seqs == list(range(1, HELD + 3))


async def _one_frame_out_unacknowledged(broker: BrokerProcess, pub: Publisher) -> None:
    """Message 1 acknowledged, then the broker stopped and message 2's frame written to it."""
    pub.publish_nowait(TOPIC, "K", b"1")
    await pub.flush()
    broker.freeze()
    await asyncio.sleep(0.01)  # past the linger: the next message leaves at once
    pub.publish_nowait(TOPIC, "K", b"2")
    await _until_frames(pub, 2)


async def _until_frames(pub: Publisher, frames: int) -> None:
    async def written() -> bool:
        return pub.frames >= frames

    await until(written, f"{frames} frames written", 30)


async def test_a_held_message_leaves_after_max_hold_when_no_acknowledgement_comes(broker: BrokerProcess) -> None:
    """A stopped broker (or one whose acknowledgements wait for a disk) holds nothing back for longer
    than ``max_hold``: message 3 leaves while the broker is still stopped."""
    async with Publisher(broker.address, "held", ack_timeout=60) as pub:
        try:
            await _one_frame_out_unacknowledged(broker, pub)
            pub.publish_nowait(TOPIC, "K", b"3")
            await _until_frames(pub, 3)
        finally:
            broker.thaw()
        await pub.flush()


async def test_a_frame_that_ends_at_a_change_of_topic_is_not_held(broker: BrokerProcess) -> None:
    """Waiting cannot make a frame fuller once the next message is for another topic: it leaves at
    once although a frame is unacknowledged (held, messages interleaving two topics would go one per
    acknowledgement)."""
    async with Publisher(broker.address, "two-topics", max_hold=300, ack_timeout=60) as pub:
        try:
            await _one_frame_out_unacknowledged(broker, pub)
            pub.publish_nowait(TOPIC, "K", b"3")
            pub.publish_nowait(f"{TOPIC}.other", "K", b"4")
            await _until_frames(pub, 3)  # message 3's frame; message 4's is held
        finally:
            broker.thaw()
        await pub.flush()
        assert pub.frames == 4


def test_max_in_flight_or_max_hold_below_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        Publisher("127.0.0.1:1", max_in_flight=-1)
    with pytest.raises(ValueError, match="max_hold"):
        Publisher("127.0.0.1:1", max_hold=-0.001)

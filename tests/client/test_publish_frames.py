"""The publisher's frames follow its broker's pace (``max_in_flight``): a real broker process,
stopped with SIGSTOP so that a frame stays unacknowledged for as long as the test wants."""

from __future__ import annotations

import asyncio
import os
import signal

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
        async with Publisher(broker.address, "paced", linger=0.001, ack_timeout=60) as pub:
            pub.publish_nowait(TOPIC, "K", b"1")
            await pub.flush()
            assert pub.frames == 1
            os.kill(broker.pid, signal.SIGSTOP)
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
                os.kill(broker.pid, signal.SIGCONT)
            await pub.flush()
            assert pub.frames == 3  # the acknowledgement let the 50 held messages go, in one frame
        seqs: list[int] = []
        async for m in sub:
            seqs.append(m.publisher_seq)
            if len(seqs) == HELD + 2:
                break
    assert seqs == list(range(1, HELD + 3))


def test_max_in_flight_below_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        Publisher("127.0.0.1:1", max_in_flight=-1)

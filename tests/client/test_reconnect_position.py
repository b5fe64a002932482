"""What a reconnect acknowledges: what the application processed, never what only sits in the SDK's
buffer. A real broker; the subscriber's connection is cut by a proxy, and the SDK reconnects on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sokutatsu.client import Message, Publisher, Subscriber
from tests.broker.fix_broker import BrokerProcess, until
from tests.monitor.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(120)


async def _drain(sub: Subscriber) -> list[Message]:
    got: list[Message] = []
    while True:
        try:
            got.append(await asyncio.wait_for(anext(sub), 3))
        except TimeoutError:
            return got


@pytest.mark.parametrize("handled_any_of_feed", [True, False])
async def test_messages_buffered_unprocessed_at_a_reconnect_stay_owed(
    broker_factory: Callable[..., BrokerProcess], handled_any_of_feed: bool
) -> None:
    """Found by an attacker's review: the application has handled 4 of feed's 50 messages, the rest wait
    in the SDK's buffer; the connection drops and the SDK reconnects by itself (as after any broken
    stream, a switchover's redirect or a failover); then the application stops and stores
    ``Subscriber.position``, as docs/broker.md says. Before, the SDK reopened with the position it had
    *received* (50), which the broker takes as acknowledged and releases: a later process resuming
    from the stored position (4) never got 5..50, told them as a gap when feed published again (and
    told nothing when the application had handled none of feed). Now the SDK reopens from what was
    processed; the broker sends the buffered messages again and the SDK drops them (its received
    numbers), so nothing is handed twice either."""
    broker = broker_factory()
    broker.start()
    proxy = TcpProxy(broker.address)
    await proxy.start()
    try:
        async with Subscriber(broker.address, "desk", "prices", durable=True) as sub:
            await asyncio.wait_for(sub.connected.wait(), 10)
        async with Publisher(broker.address, "other") as other:
            await other.publish("prices", "K0", b"o1")
        async with Publisher(broker.address, "feed") as feed:
            for i in range(50):
                feed.publish_nowait("prices", f"K{i % 5}", b"f")
            await feed.flush()
            sub = Subscriber(proxy.address, "desk", "prices", durable=True, on_gap="report")
            await sub.start()
            handed = [await sub.__anext__()]  # other 1
            if handled_any_of_feed:
                handed += [await sub.__anext__() for _ in range(4)]  # feed 1..4

            async def buffered() -> bool:
                return sub._received.get("feed", 0) == 50

            await until(buffered, "feed's 50 messages in the SDK's buffer")
            before = sub.broker_id, sub._call
            proxy.cut()

            async def reconnected() -> bool:
                return sub.connected.is_set() and sub._call is not None and sub._call is not before[1]

            await until(reconnected, "the SDK to reconnect")
            handed += [await sub.__anext__()]  # the application goes on a little, then stops
            await sub.close()
            stored = sub.position
            await feed.publish("prices", "K0", b"f51")
        again = Subscriber(broker.address, "desk", "prices", durable=True, position=stored, on_gap="report")
        async with again:
            handed += await _drain(again)
    finally:
        await proxy.close()
    numbers = [(m.publisher_id, m.publisher_seq) for m in handed]
    assert sorted(n for p, n in numbers if p == "feed") == list(range(1, 52)), numbers
    assert len(set(numbers)) == len(numbers), "a message handed twice"
    assert (sub.gaps, again.gaps) == ([], [])


async def test_after_a_reconnect_the_buffer_is_sent_again_dropped_and_the_stream_goes_on(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """The other half of the mend above: with the buffer full (``flow_limit`` 20 of 60 published) when the
    connection drops, the broker sends those 20 again within the new open's credits; the SDK drops
    them (not counted as duplicates) and the stream goes on to the last message: each handed once, in
    order, no gap."""
    broker = broker_factory()
    broker.start()
    proxy = TcpProxy(broker.address)
    await proxy.start()
    try:
        async with Subscriber(broker.address, "desk", "prices", durable=True) as sub:
            await asyncio.wait_for(sub.connected.wait(), 10)
        async with Publisher(broker.address, "feed") as feed:
            for i in range(60):
                feed.publish_nowait("prices", f"K{i % 5}", b"f")
            await feed.flush()
        sub = Subscriber(proxy.address, "desk", "prices", durable=True, flow_limit=20, on_gap="report")
        async with sub:
            handed = [await anext(sub) for _ in range(3)]

            async def full() -> bool:
                return sub._received.get("feed", 0) == 22  # 3 handed (2 processed), 20 more buffered

            await until(full, "the SDK's buffer to fill")
            before = sub._call
            proxy.cut()

            async def reconnected() -> bool:
                return sub.connected.is_set() and sub._call is not None and sub._call is not before

            await until(reconnected, "the SDK to reconnect")
            handed += await _drain(sub)
            assert (sub.duplicates, sub.gaps) == (0, [])
    finally:
        await proxy.close()
    assert [m.publisher_seq for m in handed] == list(range(1, 61))

"""Delivery guarantees against real broker processes: exactly once, in order, across reconnects and crashes."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import Message, Publisher, Subscriber
from tests.broker.fix_broker import BrokerProcess, subscriber_stats, until
from tests.broker.raw import batch, message, open_publish, publish

pytestmark = pytest.mark.timeout(120)


async def _publish(address: str, publisher_id: str, count: int, *, topic: str = "prices", keys: int = 50) -> None:
    async with Publisher(address, publisher_id) as pub:
        for i in range(count):
            while True:
                try:
                    pub.publish_nowait(topic, f"K{i % keys:03d}", f"{publisher_id}:{i + 1}".encode())
                    break
                except Exception:  # noqa: BLE001 - BufferFull: wait for acks
                    await pub.flush()
        await pub.flush()


async def _take_wire(sub: Subscriber, count: int) -> list[broker_pb2.Message]:
    """The broker's own messages (with previous_seq, which the SDK's Message keeps to itself)."""
    return [await sub._next_raw() for _ in range(count)]


async def _take(sub: Subscriber, count: int) -> list[Message]:
    got: list[Message] = []
    async for delivered in sub:
        got.append(delivered)
        if len(got) == count:
            break
    return got


def _check_exactly_once_in_order(messages: list[Message], expected: dict[str, int]) -> None:
    per_publisher: dict[str, list[int]] = defaultdict(list)
    for m in messages:
        per_publisher[m.publisher_id].append(m.publisher_seq)
        assert m.body == f"{m.publisher_id}:{m.publisher_seq}".encode()
    assert {p: len(s) for p, s in per_publisher.items()} == expected
    for publisher, seqs in per_publisher.items():
        assert seqs == list(range(1, expected[publisher] + 1)), f"{publisher}: not exactly once in order"


async def test_exactly_once_in_order_across_subscriber_reconnects(broker: BrokerProcess) -> None:
    """Two publishers; the subscriber leaves three times and resumes from its position."""
    total = {"pub-a": 3000, "pub-b": 3000}
    received: list[Message] = []
    position: dict[str, int] = {}
    async with Subscriber(broker.address, "desk", "prices", durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    publishing = asyncio.gather(*(_publish(broker.address, p, n) for p, n in total.items()))

    async def sessions() -> None:
        nonlocal position, received
        for chunk in (1000, 1500, 2000):
            async with Subscriber(broker.address, "desk", "prices", durable=True, position=position) as sub:
                received += await _take(sub, chunk)
                position = {**position, **{m.publisher_id: m.publisher_seq for m in received[-chunk:]}}
        await publishing
        async with Subscriber(broker.address, "desk", "prices", durable=True, position=position) as sub:
            received += await _take(sub, sum(total.values()) - len(received))
            assert sub.gaps == []

    try:
        await asyncio.wait_for(sessions(), 90)
    except TimeoutError:
        state = await subscriber_stats(broker.address, "desk")
        raise AssertionError(f"stalled after {len(received)} messages: {state}\n{broker.log()[-3000:]}") from None
    _check_exactly_once_in_order(received, total)


async def test_key_filters_deliver_exactly_the_matching_keys(broker: BrokerProcess) -> None:
    async with (
        Subscriber(broker.address, "exact", "prices", keys=["K001", "K007"]) as exact,
        Subscriber(broker.address, "prefix", "prices", prefixes=["K01"]) as prefix,
        Subscriber(broker.address, "all", "prices") as everything,
    ):
        for sub in (exact, prefix, everything):
            await asyncio.wait_for(sub.connected.wait(), 10)
        await _publish(broker.address, "feed", 500, keys=50)
        all_msgs = await _take(everything, 500)
        exact_msgs = await _take_wire(exact, 20)
        prefix_msgs = await _take(prefix, 100)
        assert {m.key for m in exact_msgs} == {"K001", "K007"}
        assert {m.key for m in prefix_msgs} == {f"K01{d}" for d in range(10)}
        assert [m.publisher_seq for m in exact_msgs] == [m.publisher_seq for m in all_msgs if m.key in {"K001", "K007"}]
        # Filtered-out numbers are not gaps: previous_seq tells the SDK what was skipped.
        assert exact.gaps == []
        assert prefix.gaps == []
        assert exact_msgs[1].previous_seq == exact_msgs[0].publisher_seq


async def test_persistent_spilled_messages_survive_kill_9(broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(queue_budget="64KiB")
    broker.start()
    async with Subscriber(broker.address, "late", "prices", durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    await _publish(broker.address, "feed", 2000)

    async def all_on_disk() -> bool:
        s = await subscriber_stats(broker.address, "late")
        return s.depth == 2000 and s.spilled_count == 2000

    await until(all_on_disk, "every message spilled")
    broker.kill9()
    broker.start()
    async with Subscriber(broker.address, "late", "prices", durable=True) as sub:
        received = await _take(sub, 2000)
        assert sub.gaps == []
    _check_exactly_once_in_order(received, {"feed": 2000})


async def test_messages_lost_with_a_killed_broker_are_reported_as_a_gap(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """Memory-only messages die with a single broker (the pair keeps them); the SDK must say so."""
    broker = broker_factory()
    broker.start()
    async with Subscriber(broker.address, "desk", "prices", durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
        async with aio.insecure_channel(broker.address) as channel:
            pub, _ = await open_publish(channel, "feed")
            await publish(pub, batch("prices", [message("feed", s) for s in (1, 2)]))
            assert [m.publisher_seq for m in await _take(sub, 2)] == [1, 2]
            position = sub.position | {"feed": 2}
    async with aio.insecure_channel(broker.address) as channel:
        pub, _ = await open_publish(channel, "feed")
        await publish(pub, batch("prices", [message("feed", s) for s in (3, 4, 5)]))  # held in memory only
    broker.kill9()
    broker.start()
    async with aio.insecure_channel(broker.address) as channel:
        pub, opened = await open_publish(channel, "feed")
        assert opened.last_seq == 0, "a restarted broker does not know the publisher any more"
        await publish(pub, batch("prices", [message("feed", 6)]))
    async with Subscriber(broker.address, "desk", "prices", durable=True, position=position, on_gap="report") as sub:
        [six] = await _take(sub, 1)
        assert six.publisher_seq == 6
        assert [(g.publisher_id, g.first_missing, g.last_missing) for g in sub.gaps] == [("feed", 3, 5)]


async def test_a_graceful_restart_keeps_the_backlog_of_durable_subscriptions(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory()
    broker.start()
    async with Subscriber(broker.address, "away", "prices", durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
        async with aio.insecure_channel(broker.address) as channel:
            pub, _ = await open_publish(channel, "feed")
            await publish(pub, batch("prices", [message("feed", s) for s in range(1, 11)]))
            got = await _take(sub, 3)  # 4.. are in flight or queued when the subscriber leaves
    assert [m.publisher_seq for m in got] == [1, 2, 3]
    async with aio.insecure_channel(broker.address) as channel:
        pub, _ = await open_publish(channel, "feed")
        await publish(pub, batch("prices", [message("feed", s) for s in range(11, 201)]))
    assert broker.stop() == 0  # SIGTERM: the in-memory backlog goes to disk
    broker.start()
    async with Subscriber(broker.address, "away", "prices", durable=True, position={"feed": 3}) as sub:
        rest = await asyncio.wait_for(_take(sub, 197), 30)
        assert sub.gaps == []
    assert [m.publisher_seq for m in rest] == list(range(4, 201))

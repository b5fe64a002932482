"""Retention and expiry of durable subscriptions, against real broker processes (docs/broker.md,
Retention and expiry): drop_oldest within the limit with the subscriber told, refuse_publish for
one topic only, age, expiry of an unattached subscription, limits above the broker's maximum."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import BrokerError, GapError, Publisher, Subscriber
from tests.broker.fix_broker import BrokerProcess, stats, subscriber_stats, until
from tests.broker.raw import batch, message, open_publish, open_subscribe, publish, read_seqs

pytestmark = pytest.mark.timeout(180)


async def _read(sub: Subscriber, count: int, seqs: list[int], gaps: list[GapError]) -> None:
    """Read ``count`` messages, recording each GapError raised before one (on_gap="raise")."""
    while len(seqs) < count:
        try:
            message = await sub.__anext__()
        except GapError as gap:
            gaps.append(gap)
            continue
        seqs.append(message.publisher_seq)


async def test_drop_oldest_keeps_the_disk_within_the_limit_and_tells_the_subscriber(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """A durable subscriber that stopped reading: its queue's segment files never exceed the
    limit, the oldest go, a live subscriber and the publisher are not affected, and the stalled
    one's SDK reports a gap naming the reason and the count, then gets every later message."""
    budget, limit, total = 64 * 1024, 256 * 1024, 1280
    broker = broker_factory(queue_budget=str(budget), retention_max_bytes=str(limit))
    broker.start()
    async with Subscriber(broker.address, "stalled", "feed", durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    live: list[int] = []

    async def read_live(sub: Subscriber) -> None:
        async for m in sub:
            live.append(m.publisher_seq)
            if len(live) == total:
                return

    largest = 0
    async with Subscriber(broker.address, "live", "feed", memory_budget=16 * 2**20) as live_sub:
        await asyncio.wait_for(live_sub.connected.wait(), 10)
        reading = asyncio.create_task(read_live(live_sub))
        async with Publisher(broker.address, "src", batch_messages=32) as pub:
            for block in range(total // 32):
                for i in range(32):
                    pub.publish_nowait("feed", "K", f"{block * 32 + i + 1:08d}".encode() + b"x" * 1016)
                await pub.flush()  # every batch acknowledged: drop_oldest refuses no publisher
                largest = max(largest, (await subscriber_stats(broker.address, "stalled")).disk_bytes)
        await asyncio.wait_for(reading, 60)
    assert live == list(range(1, total + 1))
    s = await subscriber_stats(broker.address, "stalled")
    assert 0 < largest <= limit
    assert s.disk_bytes <= limit
    assert s.retention.max_bytes == limit
    assert s.retention.policy == broker_pb2.RETENTION_POLICY_DROP_OLDEST
    dropped = s.dropped_retention_bytes
    assert dropped > 0
    assert s.dropped_retention_age == 0
    assert s.depth + dropped == total
    seqs: list[int] = []
    gaps: list[GapError] = []
    async with Subscriber(broker.address, "stalled", "feed", durable=True) as sub:
        await asyncio.wait_for(_read(sub, total - dropped, seqs, gaps), 60)
    # The oldest went: the first message it gets is the first one kept, with the gap before it.
    assert [(g.first_missing, g.last_missing, g.reason, g.over_bytes, g.dropped) for g in gaps] == [
        (1, dropped, "retention bytes", dropped, dropped)
    ]
    assert seqs == list(range(dropped + 1, total + 1))


async def test_a_subscription_may_only_lower_the_brokers_maximum(broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(retention_max_bytes="1MiB", retention_max_age="1h")
    broker.start()
    with pytest.raises(BrokerError) as raised:
        async with Subscriber(broker.address, "greedy", "feed", durable=True, retention_max_bytes=2 * 2**20):
            pass
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "SOKUTATSU_BROKER_RETENTION_MAX_BYTES" in raised.value.detail
    with pytest.raises(BrokerError) as raised:
        async with Subscriber(broker.address, "old", "feed", durable=True, retention_max_age=7200):
            pass
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "SOKUTATSU_BROKER_RETENTION_MAX_AGE" in raised.value.detail
    async with Subscriber(
        broker.address, "modest", "feed", durable=True, retention_max_bytes=2**19, retention_max_age=60
    ) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    s = await subscriber_stats(broker.address, "modest")
    assert (s.retention.max_bytes, s.retention.max_age_ms) == (2**19, 60_000)
    broker_stats = await stats(broker.address)
    assert (broker_stats.retention.max_bytes, broker_stats.retention.max_age_ms) == (2**20, 3_600_000)


async def test_refuse_publish_refuses_only_that_topics_persistent_publishes(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """A full refuse_publish queue: persistent publishes to its topic are refused naming the
    subscription and the limit, while another topic flows; once it drains, they are taken again."""
    limit = 128 * 1024
    broker = broker_factory(queue_budget="16KiB")
    broker.start()
    async with Subscriber(
        broker.address,
        "strict",
        "orders",
        durable=True,
        retention_max_bytes=limit,
        retention_policy="refuse_publish",
    ) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    body = b"x" * 1000
    async with aio.insecure_channel(broker.address) as channel:
        other = await open_subscribe(channel, "quotes-reader", "quotes", credits=1000)
        pub, _ = await open_publish(channel, "p1")
        seq = 0
        refusal: broker_pb2.PublishRejection | None = None
        while refusal is None and seq < 2000:
            ack = await publish(pub, batch("orders", [message("p1", seq + i, body=body) for i in range(1, 17)]))
            if ack.rejected:
                refusal = ack.rejected[0]
            seq = ack.acked_through_seq
        assert refusal is not None
        assert "subscription strict to orders retention max_bytes" in refusal.limit
        assert refusal.message.startswith("RESOURCE_EXHAUSTED")
        s = await subscriber_stats(broker.address, "strict")
        assert s.refused_publishes >= 1
        assert s.dropped_retention_bytes == 0
        # Another topic flows meanwhile (its own publisher).
        pub2, _ = await open_publish(channel, "p2")
        ack2 = await publish(pub2, batch("quotes", [message("p2", i, body=body) for i in range(1, 101)]))
        assert ack2.acked_through_seq == 100
        assert not ack2.rejected
        assert await read_seqs(other, 100) == list(range(1, 101))
        pub.cancel()
        pub2.cancel()
        other.cancel()
    # The subscriber drains its queue: nothing was lost, and the topic takes publishes again.
    seqs: list[int] = []
    gaps: list[GapError] = []
    async with Subscriber(
        broker.address, "strict", "orders", durable=True, retention_max_bytes=limit, retention_policy="refuse_publish"
    ) as sub:
        await asyncio.wait_for(_read(sub, seq, seqs, gaps), 60)
        assert seqs == list(range(1, seq + 1))
        assert gaps == []
        async with Publisher(broker.address, "p1-again") as again:
            await again.publish("orders", "K", b"after")
        await asyncio.wait_for(_read(sub, seq + 1, seqs, gaps), 30)
    assert gaps == []


async def test_messages_older_than_the_maximum_age_go_and_the_subscriber_is_told(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """An unattached durable subscription with a small maximum age: what it holds goes once
    older (polled in the broker's stats, no timing assumed); a later message carries the gap."""
    broker = broker_factory()
    broker.start()
    async with Subscriber(broker.address, "aging", "ticks", durable=True, retention_max_age=0.5) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    async with Publisher(broker.address, "src") as pub:
        for i in range(1, 51):
            pub.publish_nowait("ticks", "K", str(i).encode())
        await pub.flush()

        async def aged_out() -> bool:
            s = await subscriber_stats(broker.address, "aging")
            return s.dropped_retention_age == 50 and s.depth == 0

        await until(aged_out, "the 50 messages to age out", limit=60)
        seqs: list[int] = []
        gaps: list[GapError] = []
        async with Subscriber(broker.address, "aging", "ticks", durable=True, retention_max_age=0.5) as sub:
            await asyncio.wait_for(sub.connected.wait(), 10)
            await pub.publish("ticks", "K", b"51")
            await asyncio.wait_for(_read(sub, 1, seqs, gaps), 30)
    assert seqs == [51]
    assert [(g.first_missing, g.last_missing, g.reason, g.over_age) for g in gaps] == [(1, 50, "retention age", 50)]


async def test_a_subscription_nobody_attaches_to_expires_and_its_disk_is_freed(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(subscription_expiry="2s", queue_budget="16KiB")
    broker.start()
    async with Subscriber(broker.address, "gone", "feed", durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    async with Publisher(broker.address, "src") as pub:
        for i in range(200):
            pub.publish_nowait("feed", "K", b"x" * 1000 + str(i).encode())
        await pub.flush()
    folder = broker.state_dir / "queues" / "feed" / "gone"
    assert folder.exists()  # it spilled

    async def expired() -> bool:
        return (await stats(broker.address)).subscriptions_expired == 1

    await until(expired, "the subscription to expire", limit=60)
    async with aio.insecure_channel(broker.address) as channel:
        listed = await broker_pb2_grpc.BrokerAdminStub(channel).ListSubscriptions(
            broker_pb2.ListSubscriptionsRequest(topic="feed"), timeout=10
        )
    assert [s.subscriber_id for s in listed.subscriptions] == []

    async def freed() -> bool:
        return not folder.exists()

    await until(freed, "its segment files to be deleted")
    assert "expired the durable subscription of gone to feed" in broker.log()


async def test_messages_on_disk_older_than_the_maximum_age_go_too(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """The same from disk: a queue over its memory budget spilled them; an age read discards
    them (several read batches), and the subscriber is told of every one."""
    broker = broker_factory(queue_budget="16KiB", batch_messages="50")
    broker.start()
    async with Subscriber(broker.address, "aging", "ticks", durable=True, retention_max_age=0.5) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    total = 400
    async with Publisher(broker.address, "src") as pub:
        for i in range(1, total + 1):
            pub.publish_nowait("ticks", "K", b"x" * 1000 + str(i).encode())
        await pub.flush()
        assert (await subscriber_stats(broker.address, "aging")).spilled_count > 0

        async def aged_out() -> bool:
            s = await subscriber_stats(broker.address, "aging")
            return s.dropped_retention_age == total and s.depth == 0

        await until(aged_out, "the messages on disk to age out", limit=60)
        seqs: list[int] = []
        gaps: list[GapError] = []
        async with Subscriber(broker.address, "aging", "ticks", durable=True, retention_max_age=0.5) as sub:
            await asyncio.wait_for(sub.connected.wait(), 10)
            await pub.publish("ticks", "K", b"last")
            await asyncio.wait_for(_read(sub, 1, seqs, gaps), 30)
    assert seqs == [total + 1]
    assert [(g.first_missing, g.last_missing, g.over_age, g.over_bytes) for g in gaps] == [(1, total, total, 0)]


async def test_a_gap_told_on_a_new_stream_counts_only_what_the_subscriber_lacks(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """Messages the subscriber received and never acknowledged (in flight when its stream ended)
    are discarded by age with the rest. The next stream resumes after what it received: the gap
    carried by the next message starts there and counts only the messages it did not get."""
    broker = broker_factory(retention_max_age="0.5")
    broker.start()
    async with Subscriber(broker.address, "aging", "ticks", durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    async with aio.insecure_channel(broker.address) as channel:
        first = await open_subscribe(channel, "aging", "ticks", credits=10, durable=True)
        pub, _ = await open_publish(channel, "src")
        now = time.time_ns()
        published = [message("src", i) for i in range(1, 31)]
        for m in published:
            m.publish_time_unix_nano = now
        await publish(pub, batch("ticks", published))
        assert await read_seqs(first, 10) == list(range(1, 11))
        first.cancel()  # received 1..10, acknowledged nothing

        async def aged_out() -> bool:
            s = await subscriber_stats(broker.address, "aging")
            return not s.connected and s.dropped_retention_age == 30 and s.depth == 0

        await until(aged_out, "the 30 messages, the 10 received among them, to age out", limit=60)
        again = await open_subscribe(channel, "aging", "ticks", credits=10, durable=True, position={"src": 10})
        last = message("src", 31)
        last.publish_time_unix_nano = time.time_ns()
        await publish(pub, batch("ticks", [last]))
        frame = await again.read()
        assert isinstance(frame, broker_pb2.SubscribeResponse), frame
        (delivered,) = frame.batch.messages
        again.cancel()
        pub.cancel()
    gap = delivered.retention_gap
    assert (delivered.publisher_seq, delivered.previous_seq) == (31, 30)
    assert (gap.first_seq, gap.last_seq, gap.over_age, gap.over_bytes) == (11, 30, 20, 0)

"""Credits, duplicates, limits and flow-to-disk against a real broker process, frame by frame."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import Publisher, Subscriber
from tests.broker.fix_broker import BrokerProcess, stats, subscriber_stats, until
from tests.broker.raw import batch, message, open_publish, open_subscribe, publish, read_seqs

pytestmark = pytest.mark.timeout(120)


async def test_credits_are_never_exceeded(broker: BrokerProcess) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        sub = await open_subscribe(channel, "counter", "ticks", credits=7)
        pub, _ = await open_publish(channel, "feed")
        await publish(pub, batch("ticks", [message("feed", s) for s in range(1, 101)]))

        async def broker_has_sent_all_it_may() -> bool:
            s = await subscriber_stats(broker.address, "counter")
            return s.in_flight == 7 and s.credits == 0 and s.depth == 100

        await until(broker_has_sent_all_it_may, "7 messages in flight")
        received = await read_seqs(sub, 7)
        assert received == list(range(1, 8))
        # Acknowledge 5 without new credit: nothing more may come.
        await sub.write(
            broker_pb2.SubscribeRequest(
                credit=broker_pb2.SubscriberCredit(acked=broker_pb2.Position(last_seq={"feed": 5}))
            )
        )

        async def acked() -> bool:
            return (await subscriber_stats(broker.address, "counter")).in_flight == 2

        await until(acked, "the acknowledgement")
        assert (await subscriber_stats(broker.address, "counter")).credits == 0
        # Grant 10 more: exactly 10 more arrive.
        await sub.write(broker_pb2.SubscribeRequest(credit=broker_pb2.SubscriberCredit(credits=10)))
        received += await read_seqs(sub, 10)
        assert received == list(range(1, 18))

        async def window_full_again() -> bool:
            s = await subscriber_stats(broker.address, "counter")
            return s.in_flight == 12 and s.credits == 0

        await until(window_full_again, "12 in flight")
        sub.cancel()
        pub.cancel()


async def test_duplicates_are_dropped_and_counted(broker: BrokerProcess) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        sub = await open_subscribe(channel, "reader", "dups", credits=1000)
        pub, opened = await open_publish(channel, "retrying")
        assert opened.last_seq == 0
        ack = await publish(pub, batch("dups", [message("retrying", s) for s in range(1, 11)]))
        assert ack.acked_through_seq == 10
        pub.cancel()
        # A reconnecting publisher learns where the broker is and resends an overlap anyway.
        again, opened = await open_publish(channel, "retrying")
        assert opened.last_seq == 10
        ack = await publish(again, batch("dups", [message("retrying", s) for s in range(5, 16)]))
        assert (ack.acked_through_seq, ack.duplicates) == (15, 6)
        seqs = await read_seqs(sub, 15)
        assert seqs == list(range(1, 16))
        assert (await stats(broker.address)).duplicates_total == 6
        again.cancel()
        sub.cancel()


async def test_broker_limit_refuses_persistent_and_drops_non_persistent(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(max_count="50")
    broker.start()
    async with aio.insecure_channel(broker.address) as channel:
        await open_subscribe(channel, "stalled", "orders", credits=1)
        pub, _ = await open_publish(channel, "shop")
        ack = await publish(pub, batch("orders", [message("shop", s) for s in range(1, 61)]))
        assert ack.acked_through_seq == 50
        [refusal] = ack.rejected
        assert (refusal.first_seq, refusal.last_seq) == (51, 60)
        assert refusal.limit == "broker max_count (50 messages)"
        assert "51..60 were not stored" in refusal.message
        # While refusing, later persistent messages are refused too (go-back-N keeps order).
        ack = await publish(pub, batch("orders", [message("shop", s) for s in range(61, 63)]))
        assert ack.acked_through_seq == 50
        assert ack.rejected[0].first_seq == 61
        # Non-persistent messages over the limit are dropped and counted instead.
        ack = await publish(pub, batch("orders", [message("shop", s, persistent=False) for s in range(51, 56)]))
        assert (ack.acked_through_seq, ack.dropped, list(ack.rejected)) == (55, 5, [])
        s = await stats(broker.address)
        assert (s.held_count, s.rejected_total, s.dropped_total) == (50, 12, 5)
        pub.cancel()


async def test_topic_limit_refuses_only_that_topic(broker: BrokerProcess) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        await admin.CreateTopic(
            broker_pb2.CreateTopicRequest(topic=broker_pb2.Topic(name="small", max_bytes=4096)), timeout=10
        )
        await open_subscribe(channel, "slow", "small", credits=1)
        await open_subscribe(channel, "slow", "big", credits=1)
        pub, _ = await open_publish(channel, "p")
        ack = await publish(pub, batch("small", [message("p", s, body=b"x" * 1000) for s in range(1, 11)]))
        assert ack.acked_through_seq < 10
        assert ack.rejected[0].limit == "topic small max_bytes (4096 bytes)"
        other, _ = await open_publish(channel, "q")
        ack = await publish(other, batch("big", [message("q", s, body=b"x" * 1000) for s in range(1, 11)]))
        assert (ack.acked_through_seq, list(ack.rejected)) == (10, [])
        pub.cancel()
        other.cancel()


async def test_flow_to_disk_keeps_memory_within_budget_and_reads_back_in_order(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    budget = 128 * 1024
    broker = broker_factory(queue_budget=str(budget))
    broker.start()
    async with Subscriber(broker.address, "slow", "feed", durable=True) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    peak = 0
    async with Publisher(broker.address, "src", batch_messages=32) as pub:
        for block in range(40):
            for i in range(32):
                pub.publish_nowait("feed", "K", f"{block * 32 + i + 1:08d}".encode() + b"x" * 1016)
            await pub.flush()  # acknowledged = held in memory or fsynced on disk
            peak = max(peak, (await subscriber_stats(broker.address, "slow")).memory_bytes)
    s = await subscriber_stats(broker.address, "slow")
    assert s.depth == 1280
    assert s.spilled_count > 1000, "most of the backlog is on disk"
    assert peak <= budget, f"queue memory {peak} went over its budget {budget}"
    seqs: list[int] = []

    async def read_back() -> None:
        async with Subscriber(broker.address, "slow", "feed", durable=True) as sub:
            async for m in sub:
                assert m.body.startswith(f"{m.publisher_seq:08d}".encode())
                seqs.append(m.publisher_seq)
                if len(seqs) == 1280:
                    break

    try:
        await asyncio.wait_for(read_back(), 60)
    except TimeoutError:
        raise AssertionError(
            f"read-back stalled after {len(seqs)}: {await subscriber_stats(broker.address, 'slow')}\n{broker.log()}"
        ) from None
    assert seqs == list(range(1, 1281))

    async def drained() -> bool:
        s = await subscriber_stats(broker.address, "slow")
        return s.depth == 0 and s.spilled_count == 0

    try:
        await until(drained, "the queue to drain")
    except AssertionError:
        raise AssertionError(f"the queue did not drain: {await subscriber_stats(broker.address, 'slow')}") from None
    segments = list((broker.state_dir / "queues" / "feed" / "slow").glob("*.seg"))
    assert len(segments) <= 1, "fully acknowledged segments are deleted"


async def test_one_slow_subscriber_does_not_hold_back_another(broker: BrokerProcess) -> None:
    async with (
        Subscriber(broker.address, "stalled", "ticks", flow_limit=10) as stalled,
        Subscriber(broker.address, "fast", "ticks") as fast,
        Publisher(broker.address, "feed") as pub,
    ):
        await asyncio.wait_for(stalled.connected.wait(), 10)
        await asyncio.wait_for(fast.connected.wait(), 10)
        for i in range(3000):
            pub.publish_nowait("ticks", "K", str(i).encode())
        await pub.flush()
        got = 0
        async for _ in fast:
            got += 1
            if got == 3000:
                break
        s = await subscriber_stats(broker.address, "stalled")
        assert s.in_flight == 10
        assert s.depth == 3000


async def test_a_reconnecting_subscriber_takes_over_its_old_stream(broker: BrokerProcess) -> None:
    """A new stream for the same subscription ends the old one instead of being refused."""
    async with aio.insecure_channel(broker.address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        sub = broker_pb2.Subscription(subscriber_id="phone", topic="news", durable=True)
        await admin.CreateSubscription(broker_pb2.CreateSubscriptionRequest(subscription=sub), timeout=10)
        old = await open_subscribe(channel, "phone", "news", credits=10, durable=True)
        new = await open_subscribe(channel, "phone", "news", credits=10, durable=True)
        assert await old.read() is aio.EOF
        pub, _ = await open_publish(channel, "wire")
        await publish(pub, batch("news", [message("wire", 1)]))
        frame = await new.read()
        assert isinstance(frame, broker_pb2.SubscribeResponse)
        assert [m.publisher_seq for m in frame.batch.messages] == [1]
        assert (await subscriber_stats(broker.address, "phone")).connected
        for call in (new, pub):
            call.cancel()


async def test_resume_when_everything_redelivered_is_already_held(broker: BrokerProcess) -> None:
    """In-flight messages of a dropped stream that the new position covers are skipped, and what follows comes."""
    async with aio.insecure_channel(broker.address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        sub = broker_pb2.Subscription(subscriber_id="tablet", topic="fx", durable=True)
        await admin.CreateSubscription(broker_pb2.CreateSubscriptionRequest(subscription=sub), timeout=10)
        pub, _ = await open_publish(channel, "bank")
        await publish(pub, batch("fx", [message("bank", s) for s in range(1, 6)]))
        first = await open_subscribe(channel, "tablet", "fx", credits=5, durable=True)
        assert await read_seqs(first, 5) == [1, 2, 3, 4, 5]
        first.cancel()  # gone without acknowledging: 1..5 are owed again, first

        async def detached() -> bool:
            return not (await subscriber_stats(broker.address, "tablet")).connected

        await until(detached, "the first stream to end")
        await publish(pub, batch("fx", [message("bank", s) for s in range(6, 11)]))
        second = await open_subscribe(channel, "tablet", "fx", credits=100, durable=True, position={"bank": 5})
        frame = await asyncio.wait_for(second.read(), 10)
        assert isinstance(frame, broker_pb2.SubscribeResponse)
        assert [m.publisher_seq for m in frame.batch.messages] == [6, 7, 8, 9, 10]
        for call in (second, pub):
            call.cancel()


async def test_streams_cancelled_during_read_back_lose_nothing(broker_factory: Callable[..., BrokerProcess]) -> None:
    """Many short sessions on a queue that is all on disk: every message arrives once, in order."""
    broker = broker_factory(queue_budget="1KiB", batch_messages="5")
    broker.start()
    total = 2000
    async with aio.insecure_channel(broker.address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        sub = broker_pb2.Subscription(subscriber_id="flaky", topic="t", durable=True)
        await admin.CreateSubscription(broker_pb2.CreateSubscriptionRequest(subscription=sub), timeout=10)
        pub, _ = await open_publish(channel, "feed")
        for first in range(1, total + 1, 100):
            await publish(pub, batch("t", [message("feed", s, body=b"x" * 1000) for s in range(first, first + 100)]))
        pub.cancel()
    have = 0
    for session in range(2000):
        async with aio.insecure_channel(broker.address) as channel:
            call = await open_subscribe(channel, "flaky", "t", credits=1000, durable=True, position={"feed": have})
            for _ in range(1 + session % 4):  # leave while reads from disk are under way
                try:
                    frame = await asyncio.wait_for(call.read(), 5)
                except TimeoutError:
                    break
                assert isinstance(frame, broker_pb2.SubscribeResponse)
                for m in frame.batch.messages:
                    if m.publisher_seq > have:
                        assert m.publisher_seq == have + 1, f"lost {have + 1}..{m.publisher_seq - 1}"
                        have = m.publisher_seq
            call.cancel()
        if have == total:
            break
    assert have == total

    async def settled() -> bool:
        s = await subscriber_stats(broker.address, "flaky")
        return s.spilled_count == 0

    await until(settled, "the disk counters to settle")

"""SubscribeMany against a real broker process, frame by frame: many subscriptions on one stream,
each with its own filter, credits and end; a client's mistakes get a clear status."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from tests.broker.fix_broker import BrokerProcess, stats, subscriber_stats, until
from tests.broker.raw import (
    ManyReader,
    batch,
    many_credit,
    many_open,
    message,
    moved_to,
    open_publish,
    publish,
    start_many,
)

pytestmark = pytest.mark.timeout(120)
TOPIC = "quotes"
KEYS = ("A.1", "B.1", "C.1", "D.1")


def _keyed(publisher: str, first: int, last: int) -> broker_pb2.PublishRequest:
    """Messages ``first``..``last``; message ``s`` has key ``KEYS[s % 4]``."""
    return batch(TOPIC, [message(publisher, s, key=KEYS[s % 4]) for s in range(first, last + 1)])


async def _subscribed(reader: ManyReader, *lanes: int) -> None:
    await reader.until(lambda: all("subscribed" in reader.kinds(lane) for lane in lanes))


async def test_one_stream_carries_each_subscription_its_own_messages_in_one_frame(broker: BrokerProcess) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        reader = ManyReader(start_many(channel))
        await reader.send(
            many_open(1, "a-desk", TOPIC, 1000, prefixes=["A."]),
            many_open(2, "b-desk", TOPIC, 1000, prefixes=["B."]),
            many_open(3, "ab-desk", TOPIC, 1000, prefixes=["A.", "B."]),
            many_open(7, "all-desk", TOPIC, 1000),
        )
        await _subscribed(reader, 1, 2, 3, 7)
        pub, _ = await open_publish(channel, "feed")
        await publish(pub, _keyed("feed", 1, 200))
        frames_before = reader.frames
        await reader.until(lambda: len(reader.seqs.get(7, [])) == 200)
        # One publish batch made every queue ready at once: one frame carried all four batches.
        assert reader.frames - frames_before == 1
        assert reader.seqs[1] == [s for s in range(1, 201) if s % 4 == 0]
        assert reader.seqs[2] == [s for s in range(1, 201) if s % 4 == 1]
        assert reader.seqs[3] == [s for s in range(1, 201) if s % 4 in (0, 1)]
        assert reader.seqs[7] == list(range(1, 201))
        assert set(reader.keys[1]) == {"A.1"}
        # Each subscription is a subscriber stream of its own for the broker.
        assert (await stats(broker.address)).subscriber_streams == 4
        reader.call.cancel()
        pub.cancel()

    async def detached() -> bool:
        return (await stats(broker.address)).subscriber_streams == 0

    await until(detached, "every subscription detached when the stream ended")


@pytest.mark.parametrize("delivery_workers", ["0", "1"])
async def test_credits_are_kept_per_subscription(
    broker_factory: Callable[..., BrokerProcess], delivery_workers: str
) -> None:
    """Also with the stream at a delivery worker (docs/broker.md, Delivery workers)."""
    broker = broker_factory(delivery_workers=delivery_workers)
    broker.start()
    at = broker.address if delivery_workers == "0" else await moved_to(broker.address)
    async with aio.insecure_channel(at) as many_channel, aio.insecure_channel(broker.address) as channel:
        reader = ManyReader(start_many(many_channel))
        await reader.send(many_open(1, "narrow", TOPIC, 3), many_open(2, "wide", TOPIC, 1000))
        await _subscribed(reader, 1, 2)
        pub, _ = await open_publish(channel, "feed")
        await publish(pub, _keyed("feed", 1, 50))
        await reader.until(lambda: len(reader.seqs.get(2, [])) == 50)

        async def narrow_window_full() -> bool:
            s = await subscriber_stats(broker.address, "narrow")
            return s.in_flight == 3 and s.credits == 0 and s.depth == 50

        await until(narrow_window_full, "3 messages in flight to the narrow subscription")
        await reader.until(lambda: len(reader.seqs.get(1, [])) == 3)
        assert reader.seqs[1] == [1, 2, 3]
        await reader.send(many_credit(1, 5, acked={"feed": 3}))
        await reader.until(lambda: len(reader.seqs.get(1, [])) == 8)
        assert reader.seqs[1] == list(range(1, 9))

        async def narrow_again() -> bool:
            s = await subscriber_stats(broker.address, "narrow")
            return s.in_flight == 5 and s.credits == 0

        await until(narrow_again, "5 more in flight, no more")
        assert reader.seqs[2] == list(range(1, 51))
        reader.call.cancel()
        pub.cancel()


async def test_a_subscription_ends_alone_and_its_id_is_free_again(broker: BrokerProcess) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        reader = ManyReader(start_many(channel))
        await reader.send(
            many_open(1, "stays", TOPIC, 1000),
            many_open(2, "nobody", TOPIC, 10, durable=True),  # not created: NOT_FOUND
            many_open(3, "zero", TOPIC, 0),  # no credit: INVALID_ARGUMENT
            many_open(4, "leaves", TOPIC, 1000),
        )
        await reader.until(lambda: all(reader.kinds(lane) for lane in (1, 2, 3, 4)))
        ended = {lane: reader.events[lane][0].ended for lane in (2, 3)}
        assert ended[2].code == grpc.StatusCode.NOT_FOUND.value[0]
        assert "no subscription of 'nobody' to topic 'quotes'; create it first" in ended[2].message
        assert ended[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "credits must be at least 1" in ended[3].message
        # A credit frame that grants nothing ends its subscription only; a close ends it cleanly.
        await reader.send(
            many_credit(4, 0),
            broker_pb2.SubscriptionRequest(id=1, close=broker_pb2.SubscriptionClose()),
        )
        await reader.until(lambda: len(reader.kinds(4)) == 2 and len(reader.kinds(1)) == 2)
        assert reader.events[4][1].ended.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "must grant credits (at least 1) or acknowledge" in reader.events[4][1].ended.message
        assert reader.events[1][1].ended.code == grpc.StatusCode.OK.value[0]
        # Frames for an id the broker ended are ignored; the id opens again.
        await reader.send(many_credit(1, 5), many_open(1, "again", TOPIC, 1000))
        await reader.until(lambda: len(reader.kinds(1)) == 3)
        assert reader.kinds(1) == ["subscribed", "ended", "subscribed"]
        pub, _ = await open_publish(channel, "feed")
        await publish(pub, _keyed("feed", 1, 10))
        await reader.until(lambda: len(reader.seqs.get(1, [])) == 10)
        assert reader.seqs[1] == list(range(1, 11))
        assert (await stats(broker.address)).subscriber_streams == 1
        reader.call.cancel()
        pub.cancel()


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ([many_credit(0, 5)], "id must be at least 1"),
        ([many_open(1, "x", TOPIC, 10), many_open(1, "y", TOPIC, 10)], "but 1 is open on this stream"),
        ([many_credit(9, 5)], "credit for a subscription this stream never opened"),
        ([broker_pb2.SubscriptionRequest(id=2)], "holds no open, credit or close"),
    ],
    ids=["id-zero", "duplicate-id", "never-opened", "empty-frame"],
)
async def test_a_stream_level_mistake_ends_the_stream_with_invalid_argument(
    broker: BrokerProcess, frames: list[broker_pb2.SubscriptionRequest], says: str
) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        reader = ManyReader(start_many(channel))
        await reader.send(*frames)
        with pytest.raises(aio.AioRpcError) as raised:
            await reader.until(lambda: False)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in (raised.value.details() or "")

    async def detached() -> bool:
        return (await stats(broker.address)).subscriber_streams == 0

    await until(detached, "the stream's subscriptions detached")


async def test_garbage_ends_the_stream_with_invalid_argument(broker: BrokerProcess) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        call: aio.StreamStreamCall[bytes, bytes] = channel.stream_stream("/sokutatsu.broker.v1.Broker/SubscribeMany")()
        await call.write(b"\xff\xff\xff\xff not a protobuf")
        with pytest.raises(aio.AioRpcError) as raised:
            await call.read()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be decoded as SubscribeManyRequest" in (raised.value.details() or "")


async def test_the_stream_and_each_subscription_count_for_the_limits(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(max_streams_per_client="3")
    broker.start()
    async with aio.insecure_channel(broker.address) as channel:
        reader = ManyReader(start_many(channel))
        await reader.send(
            many_open(1, "one", TOPIC, 10), many_open(2, "two", TOPIC, 10), many_open(3, "three", TOPIC, 10)
        )
        await reader.until(lambda: all(reader.kinds(lane) for lane in (1, 2, 3)))
        assert reader.kinds(1) == reader.kinds(2) == ["subscribed"]
        refused = reader.events[3][0].ended
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "SOKUTATSU_BROKER_MAX_STREAMS_PER_CLIENT" in refused.message
        await reader.send(broker_pb2.SubscriptionRequest(id=2, close=broker_pb2.SubscriptionClose()))
        await reader.send(many_open(3, "three", TOPIC, 10))
        await reader.until(lambda: len(reader.kinds(3)) == 2)
        assert reader.kinds(3) == ["ended", "subscribed"]
        reader.call.cancel()

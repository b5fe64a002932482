"""Raw gRPC streams to the broker, for tests that need to control every frame."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from grpc import aio

from sokutatsu.broker.v1 import broker_pb2


def _serialize_publish(request: broker_pb2.PublishRequest) -> bytes:
    return request.SerializeToString()


def _serialize_subscribe(request: broker_pb2.SubscribeRequest) -> bytes:
    return request.SerializeToString()


PublishCall = aio.StreamStreamCall[broker_pb2.PublishRequest, broker_pb2.PublishResponse]
SubscribeCall = aio.StreamStreamCall[broker_pb2.SubscribeRequest, broker_pb2.SubscribeResponse]


def message(
    publisher: str, seq: int, key: str = "K", body: bytes = b"x", *, persistent: bool = True
) -> broker_pb2.Message:
    return broker_pb2.Message(publisher_id=publisher, publisher_seq=seq, key=key, body=body, persistent=persistent)


def batch(topic: str, messages: Sequence[broker_pb2.Message]) -> broker_pb2.PublishRequest:
    return broker_pb2.PublishRequest(batch=broker_pb2.PublishBatch(topic=topic, messages=messages))


async def open_publish(channel: aio.Channel, publisher: str) -> tuple[PublishCall, broker_pb2.PublishOpened]:
    call: PublishCall = channel.stream_stream(
        "/sokutatsu.broker.v1.Broker/Publish",
        request_serializer=_serialize_publish,
        response_deserializer=broker_pb2.PublishResponse.FromString,
    )()
    await call.write(broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id=publisher)))
    opened = await call.read()
    assert isinstance(opened, broker_pb2.PublishResponse)
    return call, opened.opened


async def publish(call: PublishCall, request: broker_pb2.PublishRequest) -> broker_pb2.PublishAck:
    await call.write(request)
    response = await call.read()
    assert isinstance(response, broker_pb2.PublishResponse), response
    return response.ack


async def start_subscribe(
    channel: aio.Channel, opening: broker_pb2.SubscribeOpen
) -> tuple[SubscribeCall, broker_pb2.SubscribeResponse]:
    """A Subscribe stream opened with ``opening``, and the broker's first frame on it."""
    call: SubscribeCall = channel.stream_stream(
        "/sokutatsu.broker.v1.Broker/Subscribe",
        request_serializer=_serialize_subscribe,
        response_deserializer=broker_pb2.SubscribeResponse.FromString,
    )()
    await call.write(broker_pb2.SubscribeRequest(open=opening))
    first = await call.read()
    assert isinstance(first, broker_pb2.SubscribeResponse), first
    return call, first


async def open_subscribe(
    channel: aio.Channel,
    subscriber: str,
    topic: str,
    credits: int,
    *,
    durable: bool = False,
    position: dict[str, int] | None = None,
) -> SubscribeCall:
    call, first = await start_subscribe(
        channel,
        broker_pb2.SubscribeOpen(
            subscription=broker_pb2.Subscription(subscriber_id=subscriber, topic=topic, durable=durable),
            position=broker_pb2.Position(last_seq=position or {}),
            credits=credits,
        ),
    )
    assert first.HasField("subscribed"), first
    return call


async def read_seqs(call: SubscribeCall, count: int) -> list[int]:
    """Read delivery frames until at least ``count`` sequence numbers arrived; return them in order."""
    seqs: list[int] = []
    while len(seqs) < count:
        frame = await call.read()
        assert isinstance(frame, broker_pb2.SubscribeResponse), frame
        seqs += [m.publisher_seq for m in frame.batch.messages]
    return seqs


# ------------------------------------------------------------ SubscribeMany --
ManyCall = aio.StreamStreamCall[broker_pb2.SubscribeManyRequest, broker_pb2.SubscribeManyResponse]


def _serialize_many(request: broker_pb2.SubscribeManyRequest) -> bytes:
    return request.SerializeToString()


def start_many(channel: aio.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> ManyCall:
    """A SubscribeMany stream (nothing sent yet), with this call metadata (a bearer token)."""
    call: ManyCall = channel.stream_stream(
        "/sokutatsu.broker.v1.Broker/SubscribeMany",
        request_serializer=_serialize_many,
        response_deserializer=broker_pb2.SubscribeManyResponse.FromString,
    )(metadata=metadata)
    return call


async def moved_to(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> str:
    """What a broker with delivery workers answers a new SubscribeMany stream with, as an address."""
    async with aio.insecure_channel(address) as channel:
        call = start_many(channel, metadata)
        first = await call.read()
        assert isinstance(first, broker_pb2.SubscribeManyResponse)
        assert not first.frames
        assert await call.read() is aio.EOF  # the broker ended it, having opened nothing
    moved = first.moved_to
    return address.rpartition(":")[0] + moved if moved.startswith(":") else moved


def many_open(
    lane: int,
    subscriber: str,
    topic: str,
    credits: int,
    *,
    prefixes: Sequence[str] = (),
    durable: bool = False,
    position: dict[str, int] | None = None,
) -> broker_pb2.SubscriptionRequest:
    return broker_pb2.SubscriptionRequest(
        id=lane,
        open=broker_pb2.SubscribeOpen(
            subscription=broker_pb2.Subscription(
                subscriber_id=subscriber,
                topic=topic,
                durable=durable,
                filter=broker_pb2.KeyFilter(prefixes=list(prefixes)),
            ),
            position=broker_pb2.Position(last_seq=position or {}),
            credits=credits,
        ),
    )


def many_credit(lane: int, credits: int = 0, acked: dict[str, int] | None = None) -> broker_pb2.SubscriptionRequest:
    credit = broker_pb2.SubscriberCredit(credits=credits)
    if acked is not None:
        credit.acked.CopyFrom(broker_pb2.Position(last_seq=acked))
    return broker_pb2.SubscriptionRequest(id=lane, credit=credit)


class ManyReader:
    """Reads a SubscribeMany stream, sorting what arrives by subscription id."""

    def __init__(self, call: ManyCall) -> None:
        self.call = call
        self.frames = 0
        self.seqs: dict[int, list[int]] = {}
        self.keys: dict[int, list[str]] = {}
        self.events: dict[int, list[broker_pb2.SubscriptionResponse]] = {}

    async def send(self, *frames: broker_pb2.SubscriptionRequest) -> None:
        await self.call.write(broker_pb2.SubscribeManyRequest(frames=frames))

    async def read(self) -> None:
        response = await self.call.read()
        assert isinstance(response, broker_pb2.SubscribeManyResponse), response
        self.frames += 1
        for frame in response.frames:
            if frame.WhichOneof("frame") == "batch":
                self.seqs.setdefault(frame.id, []).extend(m.publisher_seq for m in frame.batch.messages)
                self.keys.setdefault(frame.id, []).extend(m.key for m in frame.batch.messages)
            else:
                self.events.setdefault(frame.id, []).append(frame)

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            await self.read()

    def kinds(self, lane: int) -> list[str]:
        return [str(e.WhichOneof("frame")) for e in self.events.get(lane, [])]

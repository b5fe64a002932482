"""Raw gRPC streams to the broker, for tests that need to control every frame."""

from __future__ import annotations

from collections.abc import Sequence

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

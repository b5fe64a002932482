"""The three systems of ``sokutatsu bench peers``, each driven the way its own users drive it.

* **sokutatsu**: the broker pair with the monitor; the SDK's ``Publisher`` sends every batch to
  both brokers and counts a message once both acknowledged it; durable ``Subscriber`` in
  ``migrate`` mode (credits: 1,000).
* **rabbitmq**: aio-pika; a durable fanout exchange with one durable classic queue per consumer,
  persistent messages, publisher confirms; consumers with prefetch 1,000 and batched
  manual acks (``multiple=True`` every 100 messages or 5 ms).
* **nats**: nats-py; a JetStream stream with file storage, acknowledged publishes
  (``publish_async``), one durable pull consumer per consumer (explicit ack, at most 1,000
  unacknowledged), fetched in batches of up to 100.

Two references, for the latency scenario only: **sokutatsu-single** (one broker, no standby,
no monitor: what the pair's second copy costs) and **grpc-floor** (the bare relay of
:mod:`sokutatsu.bench.floor`: what two Python gRPC hops cost before any broker work).

Every publisher keeps at most ``WINDOW`` messages unacknowledged (NATS's default for
``publish_async``). Bodies start with the message's sequence number and publish time (one
clock for publisher and consumers: they run on one machine), padded to the size.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from grpc import aio

if TYPE_CHECKING:
    from sokutatsu.client import Publisher

WINDOW = 4000
PREFETCH = 1000
ACK_BATCH = 100  # RabbitMQ consumers acknowledge this many deliveries at once ...
ACK_INTERVAL = 0.005  # ... or what they processed this long ago, whichever comes first
HEADER = struct.Struct("<QQ")  # sequence number, publish time (ns since the epoch)
EXCHANGE = "sokutatsu-bench"
STREAM = "SOKUTATSU_BENCH"
SUBJECT = "sokutatsu-bench.ticks"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"
NATS_URL = "nats://127.0.0.1:4222"


def make_body(seq: int, size: int) -> bytes:
    head = HEADER.pack(seq, time.time_ns())
    return head + b"x" * max(0, size - len(head))


def read_body(body: bytes) -> tuple[int, int]:
    """``(sequence number, publish time ns)`` of a body made by :func:`make_body`."""
    seq, published = HEADER.unpack_from(body)
    return seq, published


class Sender(Protocol):
    async def send(self, body: bytes) -> None:
        """Hand one message over; waits only while ``WINDOW`` messages are unacknowledged."""

    async def flush(self) -> None:
        """Wait until every message handed over is acknowledged (raise if one was refused)."""


class Peer(Protocol):
    name: str

    async def prepare(self, consumers: Sequence[str]) -> None:
        """Fresh, empty destinations for these consumers (run before they start)."""

    async def cleanup(self) -> None:
        """Remove what :meth:`prepare` made."""

    def sender(self) -> contextlib.AbstractAsyncContextManager[Sender]: ...

    def consume(self, consumer: str) -> contextlib.AbstractAsyncContextManager[AsyncIterator[bytes]]:
        """Bodies for ``consumer`` in delivery order; each is acknowledged when the next is asked for."""
        ...


# ------------------------------------------------------------------ Sokutatsu --
@dataclass
class SokutatsuPeer:
    addresses: list[str]
    # The slow consumer's queue budget: over it the monitor moves the consumer to the standby.
    budget: int = 0
    name: str = "sokutatsu"
    topic: str = "bench-ticks"

    async def prepare(self, consumers: Sequence[str]) -> None:
        """Nothing: each run gets a fresh pair, and durable subscriptions are made when they connect."""

    async def cleanup(self) -> None:
        """Nothing: the pair is stopped after the run."""

    @contextlib.asynccontextmanager
    async def sender(self) -> AsyncIterator[Sender]:
        from sokutatsu.client import Publisher  # noqa: PLC0415 - each peer imports only its own client
        from sokutatsu.core.tls import client_config  # noqa: PLC0415

        async with Publisher(
            self.addresses, "bench-peers", max_pending=WINDOW, ack_timeout=120, config=client_config()
        ) as pub:
            yield _SokutatsuSender(pub, self.topic)

    @contextlib.asynccontextmanager
    async def consume(self, consumer: str) -> AsyncIterator[AsyncIterator[bytes]]:
        from sokutatsu.client import Subscriber  # noqa: PLC0415
        from sokutatsu.core.tls import client_config  # noqa: PLC0415

        async with Subscriber(
            self.addresses,
            consumer,
            self.topic,
            durable=True,
            mode="migrate",
            memory_budget=self.budget,
            config=client_config(),
        ) as sub:
            await asyncio.wait_for(sub.connected.wait(), 30)

            async def bodies() -> AsyncIterator[bytes]:
                async for message in sub:
                    yield message.body

            yield bodies()


async def publish_with_room(pub: Any, topic: str, key: str, body: bytes) -> None:
    """``pub.publish_nowait`` (a ``sokutatsu.client.Publisher``), waiting for room in its window."""
    from sokutatsu.client import BufferFull  # noqa: PLC0415 - each system imports only its own client

    while True:
        try:
            pub.publish_nowait(topic, key, body)
        except BufferFull:
            await pub.wait_for_room()
        else:
            return


@dataclass
class _SokutatsuSender:
    pub: Publisher
    topic: str

    async def send(self, body: bytes) -> None:
        await publish_with_room(self.pub, self.topic, "7203.T", body)

    async def flush(self) -> None:
        await self.pub.flush()


# ------------------------------------------------------------------- RabbitMQ --
@dataclass
class RabbitPeer:
    url: str = RABBITMQ_URL
    name: str = "rabbitmq"
    queues: list[str] = field(default_factory=list)

    def queue_name(self, consumer: str) -> str:
        return f"{EXCHANGE}-{consumer}"

    async def prepare(self, consumers: Sequence[str]) -> None:
        import aio_pika  # noqa: PLC0415

        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.declare_exchange(EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
            for consumer in consumers:
                name = self.queue_name(consumer)
                await channel.queue_delete(name)
                queue = await channel.declare_queue(name, durable=True)
                await queue.bind(exchange)
                self.queues.append(name)

    async def cleanup(self) -> None:
        import aio_pika  # noqa: PLC0415

        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            for name in self.queues:
                await channel.queue_delete(name)
            await channel.exchange_delete(EXCHANGE)
        self.queues.clear()

    @contextlib.asynccontextmanager
    async def sender(self) -> AsyncIterator[Sender]:
        import aio_pika  # noqa: PLC0415

        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(EXCHANGE)
            yield _RabbitSender(exchange, aio_pika)

    @contextlib.asynccontextmanager
    async def consume(self, consumer: str) -> AsyncIterator[AsyncIterator[bytes]]:
        import aio_pika  # noqa: PLC0415

        connection = await aio_pika.connect(self.url)
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=PREFETCH)
            queue = await channel.get_queue(self.queue_name(consumer))
            async with queue.iterator() as messages, _BatchedAcks() as acks:

                async def bodies() -> AsyncIterator[bytes]:
                    async for message in messages:
                        yield message.body
                        await acks.processed(message)

                yield bodies()


class _BatchedAcks:
    """Acknowledge RabbitMQ deliveries ``multiple=True``: every ``ACK_BATCH`` messages and
    at most ``ACK_INTERVAL`` seconds after one was processed, as a tuned consumer would."""

    def __init__(self) -> None:
        self.last: Any = None
        self.count = 0
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _BatchedAcks:
        self.task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.flush()

    async def processed(self, message: Any) -> None:
        self.last = message
        self.count += 1
        if self.count >= ACK_BATCH:
            await self.flush()

    async def flush(self) -> None:
        message, self.last, self.count = self.last, None, 0
        if message is not None:
            await message.ack(multiple=True)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(ACK_INTERVAL)
            await self.flush()


class _RabbitSender:
    """Publisher confirms with up to ``WINDOW`` unconfirmed publishes in flight."""

    def __init__(self, exchange: Any, aio_pika: Any) -> None:
        self.exchange = exchange
        self.aio_pika = aio_pika
        self.room = asyncio.Semaphore(WINDOW)
        self.inflight: set[asyncio.Task[Any]] = set()
        self.failure: BaseException | None = None

    async def send(self, body: bytes) -> None:
        if self.failure is not None:
            raise self.failure
        await self.room.acquire()
        message = self.aio_pika.Message(body, delivery_mode=self.aio_pika.DeliveryMode.PERSISTENT)
        task = asyncio.create_task(self.exchange.publish(message, routing_key=""))
        self.inflight.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.inflight.discard(task)
        self.room.release()
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()

    async def flush(self) -> None:
        if self.inflight:
            await asyncio.gather(*list(self.inflight), return_exceptions=True)
        if self.failure is not None:
            raise self.failure


# ----------------------------------------------------------------------- NATS --
@dataclass
class NatsPeer:
    url: str = NATS_URL
    name: str = "nats"

    async def prepare(self, consumers: Sequence[str]) -> None:
        import nats  # noqa: PLC0415
        from nats.js import api  # noqa: PLC0415
        from nats.js.errors import NotFoundError  # noqa: PLC0415

        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(STREAM)
            await js.add_stream(name=STREAM, subjects=[SUBJECT], storage=api.StorageType.FILE)
            for consumer in consumers:
                await js.add_consumer(
                    STREAM,
                    api.ConsumerConfig(
                        durable_name=consumer,
                        ack_policy=api.AckPolicy.EXPLICIT,
                        deliver_policy=api.DeliverPolicy.ALL,
                        max_ack_pending=PREFETCH,
                    ),
                )
        finally:
            await nc.close()

    async def cleanup(self) -> None:
        import nats  # noqa: PLC0415
        from nats.js.errors import NotFoundError  # noqa: PLC0415

        nc = await nats.connect(self.url)
        try:
            with contextlib.suppress(NotFoundError):
                await nc.jetstream().delete_stream(STREAM)
        finally:
            await nc.close()

    @contextlib.asynccontextmanager
    async def sender(self) -> AsyncIterator[Sender]:
        import nats  # noqa: PLC0415

        nc = await nats.connect(self.url)
        try:
            yield _NatsSender(nc.jetstream(publish_async_max_pending=WINDOW))
        finally:
            await nc.close()

    @contextlib.asynccontextmanager
    async def consume(self, consumer: str) -> AsyncIterator[AsyncIterator[bytes]]:
        import nats  # noqa: PLC0415
        from nats.errors import TimeoutError as NatsTimeout  # noqa: PLC0415

        nc = await nats.connect(self.url)
        try:
            sub = await nc.jetstream().pull_subscribe(SUBJECT, durable=consumer, stream=STREAM)

            async def bodies() -> AsyncIterator[bytes]:
                while True:
                    try:
                        batch = await sub.fetch(batch=100, timeout=1.0)
                    except NatsTimeout:
                        continue
                    for message in batch:
                        yield message.data
                        await message.ack()

            yield bodies()
        finally:
            await nc.close()


class _NatsSender:
    def __init__(self, js: Any) -> None:
        self.js = js
        self.failure: BaseException | None = None

    async def send(self, body: bytes) -> None:
        if self.failure is not None:
            raise self.failure
        # Waits on the client's own semaphore once WINDOW publishes are unacknowledged.
        future = await self.js.publish_async(SUBJECT, body)
        future.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None and self.failure is None:
            self.failure = future.exception()  # JetStream refused it

    async def flush(self) -> None:
        await self.js.publish_async_completed()
        if self.failure is not None:
            raise self.failure


# ----------------------------------------------------------------- references --
@dataclass
class FloorPeer:
    """The bare gRPC relay of :mod:`sokutatsu.bench.floor`: latency only (nothing is stored
    or acknowledged per message), the floor under any Python gRPC broker's."""

    address: str
    name: str = "grpc-floor"

    async def prepare(self, consumers: Sequence[str]) -> None:
        """Nothing: the relay keeps nothing."""

    async def cleanup(self) -> None:
        """Nothing: the relay is stopped after the run."""

    @contextlib.asynccontextmanager
    async def sender(self) -> AsyncIterator[Sender]:
        from sokutatsu.bench.floor import SEND  # noqa: PLC0415 - the relay's own names

        async with aio.insecure_channel(self.address) as channel:
            call: aio.StreamUnaryCall[bytes, bytes] = channel.stream_unary(SEND)()
            yield _FloorSender(call)

    @contextlib.asynccontextmanager
    async def consume(self, consumer: str) -> AsyncIterator[AsyncIterator[bytes]]:
        from sokutatsu.bench.floor import RECEIVE  # noqa: PLC0415

        async with aio.insecure_channel(self.address) as channel:
            receive: aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(RECEIVE)
            call = receive(b"")
            await call.wait_for_connection()  # registered before the publisher starts

            async def bodies() -> AsyncIterator[bytes]:
                async for body in call:
                    yield body

            yield bodies()


@dataclass
class _FloorSender:
    call: aio.StreamUnaryCall[bytes, bytes]
    sent: int = 0

    async def send(self, body: bytes) -> None:
        await self.call.write(body)
        self.sent += 1

    async def flush(self) -> None:
        await self.call.done_writing()
        relayed = int(await self.call)
        if relayed != self.sent:
            raise RuntimeError(f"the relay took {relayed} of {self.sent} bodies")


def peer_named(name: str, addresses: Sequence[str] = (), budget: int = 0) -> Peer:
    if name in ("sokutatsu", "sokutatsu-single"):
        return SokutatsuPeer(list(addresses), budget)
    if name == "grpc-floor":
        return FloorPeer(addresses[0])
    if name == "rabbitmq":
        return RabbitPeer()
    if name == "nats":
        return NatsPeer()
    raise ValueError(f"unknown system {name!r}: sokutatsu, rabbitmq, nats, sokutatsu-single or grpc-floor")

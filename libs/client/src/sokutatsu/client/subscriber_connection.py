"""``SubscriberConnection``: the subscribers of a process share one stream per broker.

    async with SubscriberConnection() as connection:
        subs = [Subscriber(brokers, f"desk-{i}", "prices", durable=True, connection=connection) for i in range(32)]
        ...

Without it every :class:`~sokutatsu.client.Subscriber` opens a ``Subscribe`` stream (and a
connection) of its own. With it, the subscribers given ``connection=`` open their subscriptions on
one ``SubscribeMany`` stream per broker address (docs/broker.md, One stream for many
subscriptions): the broker sends, in one frame, what every one of them has ready, and one task per
stream reads the frames and hands each subscriber its batch (no task per subscription for receiving
or for granting credit). Each subscription keeps its own credits, acknowledgements, position, gaps
and redirects: a subscriber redirected to the other broker moves alone, onto the connection's
stream to that broker.

Each ``_ManyLink`` is one stream to one broker; a link whose stream broke is replaced by a new one
when the next subscriber opens on that address (each subscriber reconnects with its own backoff,
as without a connection). Subscription ids are the link's, increasing, never reused.

A broker with delivery workers answers a new stream with ``moved_to`` (one of its workers) and ends
it, having opened nothing: the link then reopens its stream at the worker and sends it every frame
it had sent the broker, in order (so every lane opens there). The link still belongs to the broker
(``address``): redirects and reconnects name brokers, and when the worker's stream breaks the next
link opens at the broker again, which moves it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import grpc
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client._link import CHANNEL_OPTIONS
from sokutatsu.client._retry import StreamEnded, raise_status, write_frame
from sokutatsu.client.config import ClientConfig
from sokutatsu.client.errors import Closed

log = logging.getLogger(__name__)

SUBSCRIBE_MANY_METHOD = "/sokutatsu.broker.v1.Broker/SubscribeMany"
# How long close() waits for each stream to end after half-closing it.
CLOSE_SECONDS = 2.0
_ManyCall = aio.StreamStreamCall[broker_pb2.SubscribeManyRequest, broker_pb2.SubscribeManyResponse]


def _serialize_request(request: broker_pb2.SubscribeManyRequest) -> bytes:
    return request.SerializeToString()


class Redirected(Exception):
    """The broker sent a subscription elsewhere (``Redirect``); the subscriber opens it there."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.target = target


class Lane:
    """One subscription on a link. ``ended`` completes with what ended it (an exception to raise:
    :class:`Redirected`, :class:`StreamEnded`, an :class:`aio.AioRpcError`)."""

    def __init__(
        self,
        link: ManyLink,
        lane_id: int,
        accept: Callable[[Sequence[broker_pb2.Message]], None],
        subscribed: Callable[[broker_pb2.Subscribed], None],
        flush: Callable[[], None],
    ) -> None:
        self.link = link
        self.id = lane_id
        self.accept = accept
        self.subscribed = subscribed
        # Queues the subscriber's pending acknowledgement (called by the link's timer).
        self.flush = flush
        self.ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def credit(self, credits: int, acked: Mapping[str, int]) -> None:
        """Grant ``credits`` more and acknowledge ``acked`` (sent with the link's next write)."""
        if not self.ended.done():
            position = broker_pb2.Position(last_seq=acked)
            self.link.send(
                broker_pb2.SubscriptionRequest(
                    id=self.id, credit=broker_pb2.SubscriberCredit(credits=credits, acked=position)
                )
            )

    def close(self) -> None:
        """Ask the broker to end the subscription; ``ended`` completes when it has (after the credits before)."""
        if not self.ended.done():
            self.link.send(broker_pb2.SubscriptionRequest(id=self.id, close=broker_pb2.SubscriptionClose()))

    def finish(self, reason: BaseException) -> None:
        if not self.ended.done():
            self.ended.set_result(reason)


class ManyLink:
    """One SubscribeMany stream to one broker: a writer that sends what the lanes queued, in one
    frame per write, and a reader that dispatches each frame's parts to their lanes."""

    def __init__(self, address: str, config: ClientConfig, ack_interval: float) -> None:
        self.address = address
        # Where the stream is open: the broker's address, or the delivery worker it moved the link to.
        self.target = address
        # Frames written on a stream to the broker until its first response: replayed at the worker
        # when that response is ``moved_to`` (None once the stream is known to stay where it is).
        self._written: list[broker_pb2.SubscriptionRequest] | None = None
        self.config = config
        self.ack_interval = ack_interval
        self.lanes: dict[int, Lane] = {}
        self._last_id = 0
        self._pending: list[broker_pb2.SubscriptionRequest] = []
        self._wake = asyncio.Event()
        self._closing = False
        # Set once the stream has ended: the link takes no more subscriptions.
        self.broken = False
        self._task = asyncio.create_task(self._run(), name=f"subscribe-many-{address}")

    def open(
        self,
        opening: broker_pb2.SubscribeOpen,
        accept: Callable[[Sequence[broker_pb2.Message]], None],
        subscribed: Callable[[broker_pb2.Subscribed], None],
        flush: Callable[[], None],
    ) -> Lane:
        self._last_id += 1
        lane = Lane(self, self._last_id, accept, subscribed, flush)
        self.lanes[lane.id] = lane
        self.send(broker_pb2.SubscriptionRequest(id=lane.id, open=opening))
        return lane

    def send(self, frame: broker_pb2.SubscriptionRequest) -> None:
        self._pending.append(frame)
        self._wake.set()

    async def close(self) -> None:
        """Half-close after what is queued; wait (at most ``CLOSE_SECONDS``) for the broker to end the stream."""
        self._closing = True
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_SECONDS):  # not wait_for: see Accumulator.wait_acked
                await asyncio.shield(self._task)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        reason: BaseException = StreamEnded()
        try:
            moved = await self._stream(self.address)
            if moved is not None:
                # Everything sent to the broker, then what is queued, in order: the broker opened nothing.
                written, self._written = self._written or [], None
                self._pending = written + self._pending
                self._wake.set()
                self.target = moved
                await self._stream(moved)
        except (aio.AioRpcError, StreamEnded) as exc:
            reason = exc
        finally:
            self.broken = True
            lanes = list(self.lanes.values())
            self.lanes.clear()
            for lane in lanes:
                lane.finish(reason)

    async def _stream(self, target: str) -> str | None:
        """One stream at ``target`` until it ends (raises why); the worker's address when the broker
        moved the stream (only a stream at the broker may be moved, once)."""
        self._written = [] if target == self.address else None
        async with self.config.channel(target, options=CHANNEL_OPTIONS) as channel:
            call: _ManyCall = channel.stream_stream(
                SUBSCRIBE_MANY_METHOD,
                request_serializer=_serialize_request,
                response_deserializer=broker_pb2.SubscribeManyResponse.FromString,
            )()
            writer = asyncio.create_task(self._write(call), name=f"subscribe-many-writer-{target}")
            ticker = asyncio.create_task(self._tick(), name=f"subscribe-many-acks-{target}")
            try:
                return await self._read(call)
            finally:
                writer.cancel()
                ticker.cancel()
                await asyncio.gather(writer, ticker, return_exceptions=True)

    async def _tick(self) -> None:
        """Every ``ack_interval``, every lane's pending acknowledgement, in one frame (one timer per
        stream, not one per subscriber)."""
        while True:
            await asyncio.sleep(self.ack_interval)
            for lane in list(self.lanes.values()):
                lane.flush()

    async def _write(self, call: _ManyCall) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            frames, self._pending = self._pending, []
            if frames:
                if self._written is not None:
                    self._written += frames  # before the write: a write the moved stream refuses is replayed too
                await write_frame(call, broker_pb2.SubscribeManyRequest(frames=frames))
            if self._closing and not self._pending:
                with contextlib.suppress(aio.AioRpcError, aio.UsageError, asyncio.InvalidStateError):
                    await call.done_writing()
                return

    async def _read(self, call: _ManyCall) -> str | None:
        lanes = self.lanes
        while True:
            response = await call.read()
            if response is aio.EOF:
                await raise_status(call)
                raise StreamEnded
            if not isinstance(response, broker_pb2.SubscribeManyResponse):  # pragma: no cover - typed by the stub
                continue
            if self._written is not None:
                if response.moved_to:
                    return _resolve(response.moved_to, self.address)
                self._written = None  # served where it is
            for frame in response.frames:
                lane = lanes.get(frame.id)
                if lane is None:
                    continue  # closed by its subscriber; the broker had sent this before it read the close
                kind = frame.WhichOneof("frame")
                if kind == "batch":
                    lane.accept(frame.batch.messages)
                elif kind == "subscribed":
                    lane.subscribed(frame.subscribed)
                elif kind == "redirect":
                    del lanes[frame.id]
                    lane.finish(Redirected(frame.redirect.target))
                elif kind == "ended":
                    del lanes[frame.id]
                    lane.finish(_ended(frame.ended))


def _resolve(moved_to: str, broker: str) -> str:
    """``moved_to`` as an address: ":port" is that port on the host the broker was reached at."""
    if moved_to.startswith(":"):
        return broker.rpartition(":")[0] + moved_to
    return moved_to


def _ended(ended: broker_pb2.SubscriptionEnded) -> BaseException:
    """What a subscription's end means to its subscriber: as its own Subscribe stream's status would."""
    if ended.code == 0:
        return StreamEnded()
    code = next((c for c in grpc.StatusCode if c.value[0] == ended.code), grpc.StatusCode.UNKNOWN)
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), ended.message)


class SubscriberConnection:
    """One ``SubscribeMany`` stream per broker address, shared by the subscribers given it
    (``Subscriber(..., connection=connection)``). ``config``: TLS and token of its streams (default:
    plaintext, none); the subscribers' own ``config`` is used for creating their subscriptions.
    ``ack_interval``: how often the acknowledgements of all its subscribers on a stream go out
    together (and whenever a subscriber has processed its ``flow_threshold``); it stands for each
    subscriber's own ``ack_interval``.

    Close it after its subscribers (``async with``, or :meth:`close`); a subscriber whose
    connection is closed raises :class:`~sokutatsu.client.errors.Closed`.
    """

    def __init__(self, *, config: ClientConfig | None = None, ack_interval: float = 0.05) -> None:
        if ack_interval <= 0:
            raise ValueError("ack_interval must be above 0 seconds")
        self.config = config or ClientConfig()
        self.ack_interval = ack_interval
        self._links: dict[str, ManyLink] = {}
        self._closed = False

    async def __aenter__(self) -> SubscriberConnection:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def link(self, address: str) -> ManyLink:
        """The stream to ``address``, opened if there is none or it ended."""
        if self._closed:
            raise Closed("the SubscriberConnection is closed")
        link = self._links.get(address)
        if link is None or link.broken:
            link = self._links[address] = ManyLink(address, self.config, self.ack_interval)
        return link

    @property
    def streams(self) -> int:
        """How many streams are open (one per broker address in use)."""
        return sum(1 for link in self._links.values() if not link.broken)

    async def close(self) -> None:
        """End every stream (callable many times). Close the subscribers first: they acknowledge on close."""
        self._closed = True
        links = list(self._links.values())
        self._links.clear()
        await asyncio.gather(*(link.close() for link in links))

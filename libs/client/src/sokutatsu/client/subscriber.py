"""``Subscriber``: receive a topic's messages exactly once, in per-publisher order.

    async with Subscriber("127.0.0.1:7201", "desk-1", "prices", prefixes=["72"], durable=True) as sub:
        async for message in sub:          # a sokutatsu.client.Message
            handle(message)

* Flow control (seed 003): the broker sends at most ``flow_limit`` messages
  beyond what the application has consumed; once ``flow_threshold`` of them
  are consumed (or ``ack_interval`` has passed) the SDK acknowledges them and
  grants as many again.
* A message counts as processed when the application asks for the next one;
  :attr:`position` (per publisher, the last processed number) is what to store
  to resume a durable subscription in a later process.
* On reconnect (jittered backoff, or at once after a redirect) the SDK sends
  the position the application has processed (the broker takes it as
  acknowledged); the broker resumes after it, so what waited in the buffer is
  sent again and dropped here: it stays owed until processed. Duplicates are
  dropped; a message whose ``previous_seq`` is above what was received
  reveals lost messages: :class:`GapError` is raised (``on_gap="raise"``) or
  the gap is recorded in :attr:`gaps` (``on_gap="report"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Literal

import grpc
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client._link import CHANNEL_OPTIONS
from sokutatsu.client._retry import (
    RECONNECT_CODES,
    Backoff,
    StreamEnded,
    raise_status,
    reconnectable,
    write_frame,
    write_or_cancel,
)
from sokutatsu.client._subscription import Mode, Policy, find_gaps, subscription_message, to_message
from sokutatsu.client._tracing import tracing_on
from sokutatsu.client.config import ClientConfig
from sokutatsu.client.errors import BrokerError, GapError, Unreachable
from sokutatsu.client.structs import Message
from sokutatsu.client.subscriber_connection import Lane, Redirected, SubscriberConnection

if TYPE_CHECKING:
    from sokutatsu.client._spans import ProcessSpans

log = logging.getLogger(__name__)

SUBSCRIBE_METHOD = "/sokutatsu.broker.v1.Broker/Subscribe"
# How long close() waits to deliver its final acknowledgement.
FINAL_ACK_SECONDS = 2.0
# A durable subscription this SDK created on one broker only (the other did not answer)
# reaches the other through the pair's own link within milliseconds; until then that
# broker answers NOT_FOUND, which is retried this long before it is final.
MISSING_GRACE_SECONDS = 5.0
_SubscribeCall = aio.StreamStreamCall[broker_pb2.SubscribeRequest, broker_pb2.SubscribeResponse]


def _serialize_request(request: broker_pb2.SubscribeRequest) -> bytes:
    return request.SerializeToString()


class Subscriber:
    """Receive ``topic`` from the broker pair ``brokers`` as ``subscriber_id``; iterate for :class:`Message`.

    ``keys``/``prefixes`` filter by key (none: every message); ``durable`` keeps the subscription
    (and what it has not received) across disconnects; ``config``: TLS and token (default:
    plaintext, none). ``connection``: receive on the :class:`SubscriberConnection`'s stream to
    each broker, shared with its other subscribers, instead of a stream of its own (its
    ``ack_interval`` then stands for this one's).
    """

    def __init__(
        self,
        brokers: str | Sequence[str],
        subscriber_id: str,
        topic: str,
        *,
        keys: Sequence[str] = (),
        prefixes: Sequence[str] = (),
        durable: bool = False,
        mode: Mode | None = None,
        memory_budget: int = 0,
        retention_max_bytes: int = 0,
        retention_max_age: float = 0.0,
        retention_policy: Policy | None = None,
        flow_limit: int = 1000,
        flow_threshold: float = 0.5,
        ack_interval: float = 0.05,
        position: Mapping[str, int] | None = None,
        on_gap: Literal["raise", "report"] = "raise",
        config: ClientConfig | None = None,
        connection: SubscriberConnection | None = None,
    ) -> None:
        addresses = [brokers] if isinstance(brokers, str) else list(brokers)
        if not addresses:
            raise ValueError("give at least one broker address (host:port)")
        if flow_limit < 1:
            raise ValueError("flow_limit must be at least 1")
        if not 0 < flow_threshold <= 1:
            raise ValueError("flow_threshold must be in (0, 1]")
        self.addresses = addresses
        self.config = config or ClientConfig()
        self._subscription = subscription_message(
            subscriber_id,
            topic,
            keys=keys,
            prefixes=prefixes,
            durable=durable,
            mode=mode,
            memory_budget=memory_budget,
            retention_max_bytes=retention_max_bytes,
            retention_max_age=retention_max_age,
            retention_policy=retention_policy,
        )
        self.flow_limit = flow_limit
        self._grant_at = max(1, int(flow_limit * flow_threshold))
        self.ack_interval = ack_interval
        self.on_gap = on_gap
        # Processed by the application / received from the broker, per publisher.
        self._processed: dict[str, int] = dict(position or {})
        self._received: dict[str, int] = dict(position or {})
        # Per publisher, what the broker sends again after the last reconnect: (processed, received].
        self._again: dict[str, tuple[int, int]] = {}
        self._buffer: deque[broker_pb2.Message | GapError] = deque()
        self._arrived = asyncio.Event()
        self._last: broker_pb2.Message | None = None
        self._unacked = 0
        self._call: _SubscribeCall | None = None
        self._connection = connection
        # The subscription on the connection's stream, while a session on it lasts.
        self._lane: Lane | None = None
        self._failure: Exception | None = None
        # When the brokers started answering NOT_FOUND for the durable subscription (None: they do not).
        self._missing_since: float | None = None
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._address_index = 0
        # The next open comes straight from a broker's redirect (SubscribeOpen.redirected).
        self._redirected = False
        self.duplicates = 0
        self.gaps: list[GapError] = []
        self.connected = asyncio.Event()
        self.broker_id = ""
        self._spans: ProcessSpans | None = None  # set by start() when tracing is on

    # ------------------------------------------------------------- lifecycle --
    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the durable subscription (:class:`Unreachable` when no broker answers) and start receiving."""
        if tracing_on():
            from sokutatsu.client._spans import ProcessSpans  # noqa: PLC0415 - OpenTelemetry only when tracing

            self._spans = ProcessSpans(self._subscription.subscriber_id, self._subscription.topic)
        if self._subscription.durable:
            await self._create_subscription()
        self._task = asyncio.create_task(self._run(), name=f"subscribe-{self._subscription.subscriber_id}")
        if self._connection is None:  # the connection's streams have one timer each for their subscribers
            self._flusher = asyncio.create_task(self._flush_acks(), name="subscribe-acks")

    async def _create_subscription(self) -> None:
        """Create the durable subscription on every broker that answers (the pair holds it on both)."""
        created = 0
        last: Exception | None = None
        for address in self.addresses:
            async with self.config.channel(address, options=CHANNEL_OPTIONS) as channel:
                stub = broker_pb2_grpc.BrokerAdminStub(channel)
                try:
                    await stub.CreateSubscription(
                        broker_pb2.CreateSubscriptionRequest(subscription=self._subscription), timeout=10
                    )
                except aio.AioRpcError as exc:
                    if exc.code() not in RECONNECT_CODES:
                        raise BrokerError(exc.code(), exc.details() or "") from None
                    last = exc
                else:
                    created += 1
        if not created:
            raise Unreachable(f"no broker answered CreateSubscription: {last}")

    async def close(self) -> None:
        """Stop receiving. The last message handed out counts as processed and is acknowledged."""
        # The timer stops first: a credit write it started now would be cancelled below,
        # taking the final acknowledgement with it.
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        self._mark_processed()
        call = self._call
        self._closed = True  # no reconnecting from here on
        if call is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FINAL_ACK_SECONDS):  # not wait_for: see Accumulator.wait_acked
                    await self._final_ack(call)
        lane = self._lane
        if lane is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FINAL_ACK_SECONDS):  # not wait_for: see Accumulator.wait_acked
                    await self._final_ack_lane(lane)
        tasks = [t for t in (self._task, self._flusher, self._writer) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._spans is not None:
            self._spans.flush()
        self._arrived.set()

    async def _final_ack(self, call: _SubscribeCall) -> None:
        """Let a running credit write finish, then acknowledge what is left."""
        writer = self._writer
        if writer is not None and not writer.done():
            await asyncio.gather(asyncio.shield(writer), return_exceptions=True)
        if self._unacked:
            self._unacked = 0
            frame = broker_pb2.SubscribeRequest(
                credit=broker_pb2.SubscriberCredit(acked=broker_pb2.Position(last_seq=self._processed))
            )
            await _write_quietly(call, frame)
        # Half-close and let the broker end the stream: it reads every frame before that, so
        # the acknowledgement is not lost with a connection torn down under it.
        with contextlib.suppress(aio.AioRpcError, aio.UsageError, asyncio.InvalidStateError):
            await call.done_writing()
            await call.code()

    async def _final_ack_lane(self, lane: Lane) -> None:
        """Acknowledge what is left and close the subscription on the shared stream; the broker
        applies the acknowledgement before it ends the subscription."""
        if self._unacked:
            self._unacked = 0
            lane.credit(0, self._processed)
        lane.close()
        await asyncio.shield(lane.ended)

    @property
    def subscriber_id(self) -> str:
        return self._subscription.subscriber_id

    @property
    def topic(self) -> str:
        return self._subscription.topic

    @property
    def position(self) -> dict[str, int]:
        """Per publisher, the last sequence number the application has processed."""
        return dict(self._processed)

    # -------------------------------------------------------------- iterating --
    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> Message:
        return to_message(await self._next_raw(), self._subscription.topic)

    async def _next_raw(self) -> broker_pb2.Message:
        """The next message as the broker sent it (the ordered subscriber reads its stamp)."""
        self._mark_processed()
        while not self._buffer:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise StopAsyncIteration
            self._arrived.clear()
            await self._arrived.wait()
        item = self._buffer.popleft()
        if isinstance(item, GapError):
            raise item
        self._last = item
        return item

    def _mark_processed(self) -> None:
        last = self._last
        if last is None:
            return
        self._last = None
        self._processed[last.publisher_id] = last.publisher_seq
        self._unacked += 1
        if self._unacked >= self._grant_at:
            self._send_credit()

    def _send_credit(self) -> None:
        lane = self._lane
        if lane is not None:
            if self._unacked:
                lane.credit(self._unacked, self._processed)  # queued on the shared stream's next write
                self._unacked = 0
            return
        call = self._call
        if call is None or not self._unacked or (self._writer is not None and not self._writer.done()):
            return
        frame = broker_pb2.SubscribeRequest(
            credit=broker_pb2.SubscriberCredit(
                credits=self._unacked, acked=broker_pb2.Position(last_seq=self._processed)
            )
        )
        self._unacked = 0
        # One write at a time on a stream; iteration does not wait for it. If one is still
        # running, the credit stays counted in _unacked and the next trigger or the timer sends it.
        self._writer = asyncio.create_task(_write_quietly(call, frame))

    async def _flush_acks(self) -> None:
        while True:
            await asyncio.sleep(self.ack_interval)
            self._send_credit()

    # -------------------------------------------------------------- receiving --
    async def _run(self) -> None:
        backoff = Backoff()
        while not self._closed:
            address = self.addresses[self._address_index % len(self.addresses)]
            try:
                if self._connection is not None:
                    await self._shared_session(self._connection, address, backoff)
                else:
                    await self._session(address, backoff)
            except StreamEnded:
                log.info("broker %s ended the subscribe stream; reconnecting", address)
            except Redirected as redirect:
                if redirect.target not in self.addresses:
                    self.addresses.append(redirect.target)
                self._address_index = self.addresses.index(redirect.target)
                self._redirected = True  # said in the next open (SubscribeOpen.redirected)
                continue
            except aio.AioRpcError as exc:
                if not reconnectable(exc) and not self._created_elsewhere(exc):
                    self._failure = BrokerError(exc.code(), exc.details() or "")
                    self._arrived.set()
                    return
                log.info("subscribe stream to %s broke (%s); reconnecting", address, exc.code().name)
            except Exception as exc:  # noqa: BLE001 - surfaces to the application instead of dying silently
                self._failure = exc
                self._arrived.set()
                return
            finally:
                self._call = None
                self._lane = None
                self.connected.clear()
            self._address_index += 1
            await asyncio.sleep(backoff.next_delay())

    def _created_elsewhere(self, error: aio.AioRpcError) -> bool:
        """Whether ``error`` is a NOT_FOUND for the durable subscription this SDK created,
        within the grace its pair needs to copy it from the broker that has it."""
        if error.code() != grpc.StatusCode.NOT_FOUND or not self._subscription.durable:
            return False
        now = asyncio.get_running_loop().time()
        if self._missing_since is None:
            self._missing_since = now
        return now - self._missing_since < MISSING_GRACE_SECONDS

    def _opening(self) -> broker_pb2.SubscribeOpen:
        """The open frame of a new session."""
        # Only the first attempt after a redirect says so, whatever becomes of it.
        redirected, self._redirected = self._redirected, False
        # It resumes after what the application processed, not after what was received: the broker
        # takes an open's position as acknowledged and releases what it covers, and what waits in
        # the buffer unprocessed must stay owed until it is processed (an application that closed
        # or crashed after a reconnect lost it before: its stored position was below it, and the
        # broker no longer held it). The broker sends what it holds of it again; _accept drops
        # those (at or below what was received) and gives their credits back, so the buffer stays
        # within flow_limit whatever the broker still holds.
        credits = max(1, self.flow_limit - len(self._buffer) - self._unacked)
        self._unacked = 0
        self._again = {
            p: (self._processed.get(p, 0), n) for p, n in self._received.items() if n > self._processed.get(p, 0)
        }
        return broker_pb2.SubscribeOpen(
            subscription=self._subscription,
            position=broker_pb2.Position(last_seq=self._processed),
            credits=credits,
            redirected=redirected,
            received=broker_pb2.Position(last_seq={p: n for p, (_, n) in self._again.items()}),
        )

    def _subscribed(self, subscribed: broker_pb2.Subscribed, backoff: Backoff) -> None:
        self.broker_id = subscribed.broker_id
        self._missing_since = None
        self.connected.set()
        backoff.reset()

    async def _shared_session(self, connection: SubscriberConnection, address: str, backoff: Backoff) -> None:
        """A session on the connection's stream to ``address``: its reader hands this subscriber
        its batches (``_accept``); this waits for the subscription's end and raises what ended it."""
        lane = connection.link(address).open(
            self._opening(), self._accept, lambda subscribed: self._subscribed(subscribed, backoff), self._send_credit
        )
        self._lane = lane
        try:
            reason = await asyncio.shield(lane.ended)
        finally:
            if not lane.ended.done():
                lane.close()  # cancelled: the subscription must not stay open on the shared stream
        raise reason

    async def _session(self, address: str, backoff: Backoff) -> None:
        async with self.config.channel(address, options=CHANNEL_OPTIONS) as channel:
            call: _SubscribeCall = channel.stream_stream(
                SUBSCRIBE_METHOD,
                request_serializer=_serialize_request,
                response_deserializer=broker_pb2.SubscribeResponse.FromString,
            )()
            await write_frame(call, broker_pb2.SubscribeRequest(open=self._opening()))
            self._call = call
            while True:
                response = await call.read()
                if response is aio.EOF:
                    await raise_status(call)
                    raise StreamEnded  # the broker ended the stream (e.g. a newer one took over)
                if not isinstance(response, broker_pb2.SubscribeResponse):  # pragma: no cover - typed by the stub
                    continue
                kind = response.WhichOneof("frame")
                if kind == "batch":
                    self._accept(response.batch.messages)
                elif kind == "subscribed":
                    self._subscribed(response.subscribed, backoff)
                elif kind == "redirect":
                    raise Redirected(response.redirect.target)

    def _accept(self, messages: Sequence[broker_pb2.Message]) -> None:
        received = self._received
        buffer = self._buffer
        spans = self._spans
        accepted: list[broker_pb2.Message] | None = [] if spans is not None else None
        dropped = 0
        for message in messages:
            publisher = message.publisher_id
            seq = message.publisher_seq
            have = received.get(publisher, 0)
            if seq <= have:
                dropped += 1
                low, high = self._again.get(publisher, (0, 0))
                if not low < seq <= high:  # not one sent again after a reconnect
                    self.duplicates += 1
                continue
            if accepted is not None:
                accepted.append(message)
            if (have and message.previous_seq > have) or message.HasField("retention_gap"):
                for gap in find_gaps(message, have):
                    self.gaps.append(gap)
                    log.warning("%s", gap)
                    if self.on_gap == "raise":
                        buffer.append(gap)
            received[publisher] = seq
            buffer.append(message)
        if dropped:
            # Each dropped message took a credit: give it back, or a stream whose broker sends again
            # what the SDK has (after a reconnect, or a copy holding what was skipped as a gap) stops.
            self._unacked += dropped
            if self._unacked >= self._grant_at:
                self._send_credit()
        if spans is not None and accepted is not None:
            spans.accepted(accepted)
        self._arrived.set()


async def _write_quietly(call: _SubscribeCall, frame: broker_pb2.SubscribeRequest) -> None:
    # If the stream is gone, the next one starts from the processed position.
    with contextlib.suppress(aio.AioRpcError, aio.UsageError, asyncio.InvalidStateError):
        await write_or_cancel(call, frame)

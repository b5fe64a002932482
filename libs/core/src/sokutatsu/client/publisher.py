"""``Publisher``: publish to the broker pair with acknowledgements, batching and retries.

Every message gets the next number of this publisher's sequence. Messages are
batched on the wire (a frame is sent when ``batch_messages`` or
``batch_bytes`` are ready; a link that sent a frame less than ``linger``
seconds ago waits up to that long for a fuller one, an idle link sends at once) and every batch goes to
every broker address given (the active/standby pair). A message is
acknowledged once every broker holds it; acknowledging with one broker of
the pair down ("single copy") comes with the pair, issue #4.

* A stream that breaks is opened again with jittered exponential backoff; the
  broker says which number it last holds and the rest is sent again, so
  retries never duplicate (the broker drops numbers it already has).
* A persistent message refused at a broker limit is sent again, with backoff,
  with everything after it (go-back-N), so the order is kept; ``publish``
  raises :class:`PublishTimeout` naming the limit if that takes longer than
  ``ack_timeout``.
* A refusal for bad input (e.g. a body over the broker's maximum) is final:
  waiting calls and later publishes raise :class:`BrokerError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client._retry import Backoff, StreamEnded, raise_status, reconnectable, write_frame
from sokutatsu.client._tracing import TRACEPARENT, SendSpans, tracing_on
from sokutatsu.client._wire import batch_frame, encode_message, message_element, publisher_field
from sokutatsu.client.errors import BrokerError, BufferFull, Closed, PublishTimeout
from sokutatsu.core.tls import ChannelTls, open_channel

log = logging.getLogger(__name__)

PUBLISH_METHOD = "/sokutatsu.broker.v1.Broker/Publish"
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 16 * 2**20),
    ("grpc.max_receive_message_length", 16 * 2**20),
    # Every stream opens a channel of its own; with gRPC's process-wide subchannel pool it would
    # inherit the reconnect backoff of the last channel to that address (seconds after a broker
    # restart: a restarted broker served for 0.9-2.8 s before a publish reached it). A local pool
    # makes each attempt a real connection attempt.
    ("grpc.use_local_subchannel_pool", 1),
]
# A broken publish link is opened again after a jittered delay growing to this: short, because
# while one broker of a pair is back and heard by its peer, acknowledgements wait for this link.
RECONNECT_MAX_SECONDS = 0.25


def default_publisher_id() -> str:
    """Unique per process: host, pid and a random part."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}".replace(".", "-")


def _frame_bytes(frame: bytes | broker_pb2.PublishRequest) -> bytes:
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


@dataclass(slots=True)
class _Pending:
    seq: int
    topic: str
    element: bytes
    size: int


@dataclass
class _Link:
    address: str
    sent_through: int = 0
    acked_through: int = 0
    connected: bool = False
    resume_at: float = 0.0
    # Incremented each time a refusal sends the link back (go-back-N).
    rewinds: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    broker_last_seq: int = 0
    # The broker's last ack said its peer is down (it alone holds what it acknowledged).
    single_copy: bool = False
    # Loop time of the last frame written (adaptive batching).
    last_send: float = float("-inf")
    # The broker's most messages per batch (PublishOpened.max_batch_messages; 0 = no limit).
    max_batch: int = 0
    # Why the last attempt to open the stream failed (for the error when none opened).
    last_error: str = ""
    # Set to cut a reconnect delay short: the other broker said its peer is back.
    reconnect_now: asyncio.Event = field(default_factory=asyncio.Event)
    # While the stream is being opened: the first number it may need (PublishOpen.first_unacked_seq).
    opening_from: int = 0


_PublishCall = aio.StreamStreamCall[bytes | broker_pb2.PublishRequest, broker_pb2.PublishResponse]


class Publisher:
    def __init__(
        self,
        brokers: str | Sequence[str],
        publisher_id: str | None = None,
        *,
        batch_messages: int = 500,
        batch_bytes: int = 1 * 2**20,
        linger: float = 0.001,
        max_pending: int = 100_000,
        ack_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        tls: ChannelTls | None = None,
        token: str | None = None,
    ) -> None:
        addresses = [brokers] if isinstance(brokers, str) else list(brokers)
        if not addresses:
            raise ValueError("give at least one broker address (host:port)")
        self.publisher_id = publisher_id or default_publisher_id()
        self._publisher_field = publisher_field(self.publisher_id)
        self.batch_messages = batch_messages
        self.batch_bytes = batch_bytes
        self.linger = linger
        self.max_pending = max_pending
        self.ack_timeout = ack_timeout
        self.connect_timeout = connect_timeout
        # None: the environment's SOKUTATSU_TLS_* settings (plaintext when they are unset).
        self.tls = tls
        # None: the environment's SOKUTATSU_AUTH_TOKEN (no token when it is unset).
        self.token = token
        self._links = [_Link(a) for a in addresses]
        # Messages kept for sending, numbers dense from _pending[0]; _pending_start is the first
        # one not acknowledged. Acknowledged ones stay while a connected or opening link still
        # has to send them (at most max_pending of them).
        self._pending: list[_Pending] = []
        self._pending_start = 0
        self._next_seq = 1
        self._acked = 0
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._acked_event = asyncio.Event()
        self._failure: Exception | None = None
        self._last_refusal = ""
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []
        self._spans: SendSpans | None = None  # set by start() when tracing is on
        # Counters from the brokers' acknowledgements.
        self.dropped = 0
        self.duplicates = 0
        self.refused = 0

    # ------------------------------------------------------------- lifecycle --
    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None and self._failure is None:
                await self.flush()
        finally:
            await self.close()

    async def start(self) -> None:
        """Connect to the brokers and learn where this publisher's sequence continues."""
        if tracing_on():
            self._spans = SendSpans(self.publisher_id)
        self._tasks = [
            asyncio.create_task(self._run_link(link), name=f"publish-{link.address}") for link in self._links
        ]
        waits = [asyncio.ensure_future(link.opened.wait()) for link in self._links]
        done, pending = await asyncio.wait(waits, timeout=self.connect_timeout, return_when=asyncio.ALL_COMPLETED)
        for waiter in pending:
            waiter.cancel()
        if self._failure is not None:
            await self.close()
            raise self._failure
        if not done:
            await self.close()
            why = "; ".join(f"{link.address}: {link.last_error}" for link in self._links if link.last_error)
            raise ConnectionError(
                f"no broker answered within {self.connect_timeout:g}s: {self.addresses}" + (f" ({why})" if why else "")
            )
        last = max(link.broker_last_seq for link in self._links)
        self._next_seq = last + 1
        self._acked = last
        for link in self._links:
            if link.connected and link.broker_last_seq < last:
                # Its stream opened before the larger number was known (first_unacked_seq 1), and this
                # process does not hold what lies between: left where its broker is, its next send
                # finds that gone (_unsent_index) and opens the stream again from last + 1, so the
                # broker records the hole instead of refusing last + 1 as a gap (chaos seed 508077).
                continue
            link.sent_through = max(link.sent_through, last)
            link.acked_through = max(link.acked_through, last)

    async def close(self) -> None:
        """Stop without waiting for acknowledgements (``async with`` flushes first)."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._spans is not None:
            self._spans.close()
        self._fail_waiters(Closed("publisher closed"))

    @property
    def addresses(self) -> list[str]:
        return [link.address for link in self._links]

    @property
    def acked_seq(self) -> int:
        """Every message up to this number is acknowledged."""
        return self._acked

    @property
    def last_seq(self) -> int:
        """The number of the last message handed to this publisher."""
        return self._next_seq - 1

    # ------------------------------------------------------------ publishing --
    def publish_nowait(
        self,
        topic: str,
        key: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        persistent: bool = True,
        *,
        stamp: bytes = b"",
    ) -> int:
        """Queue one message for sending; return its sequence number. Raises :class:`BufferFull`.

        ``stamp`` is a serialised sequencer ``Stamp``, required on total-order topics
        (:class:`~sokutatsu.client.OrderedPublisher` sets it).
        """
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise Closed("publisher closed")
        if len(self._pending) - self._pending_start >= self.max_pending:
            raise BufferFull(f"{self.max_pending} messages are waiting for acknowledgement; await flush()")
        seq = self._next_seq
        self._next_seq += 1
        fields = dict(headers) if headers else None
        now = time.time_ns()
        trace_field = b""
        if self._spans is not None:
            if fields:
                fields.pop(TRACEPARENT, None)  # the SDK's send span is the message's creation context
            trace_field = self._spans.traceparent(topic, seq, len(body), now)
        payload = encode_message(self._publisher_field, seq, key, body, fields, persistent, now, stamp, trace_field)
        element = message_element(payload)
        self._pending.append(_Pending(seq, topic, element, len(element)))
        for link in self._links:
            link.wake.set()
        return seq

    async def publish(
        self,
        topic: str,
        key: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        persistent: bool = True,
        *,
        stamp: bytes = b"",
    ) -> int:
        """Publish one message and wait until the brokers hold it; return its sequence number."""
        await self.wait_for_room()
        seq = self.publish_nowait(topic, key, body, headers, persistent, stamp=stamp)
        await self.wait_acked(seq)
        return seq

    @property
    def room(self) -> int:
        """How many more messages :meth:`publish_nowait` takes before it raises :class:`BufferFull`."""
        return self.max_pending - (len(self._pending) - self._pending_start)

    async def wait_for_room(self) -> None:
        """Wait until fewer than ``max_pending`` messages wait for acknowledgement, so that
        :meth:`publish_nowait` will not raise :class:`BufferFull` (back-pressure without a drain)."""
        while self.room <= 0:
            await self.wait_acked(self._pending[self._pending_start].seq)

    async def flush(self) -> None:
        """Wait until every message handed over so far is acknowledged."""
        await self.wait_acked(self.last_seq)

    async def wait_acked(self, seq: int) -> None:
        """Wait until message ``seq`` (a number :meth:`publish_nowait` returned) is acknowledged."""
        if self._failure is not None:
            raise self._failure
        if seq <= self._acked:
            return
        waiter = self._waiters.get(seq)
        if waiter is None:
            waiter = self._waiters[seq] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.ack_timeout)
        except TimeoutError:
            why = f": {self._last_refusal}" if self._last_refusal else ""
            raise PublishTimeout(f"message {seq} not acknowledged within {self.ack_timeout:g}s{why}") from None

    def _advance(self) -> None:
        """Acknowledge what every broker holds; with a broker down or stalled, what the brokers
        that say (``single_copy``) they do not hear their peer hold.

        A broker says ``single_copy`` only while its peer is silent to it for the peer timeout,
        not merely away from this client; its copy is then all the pair has, and waiting for the
        silent one (dead, or paused with its connection still open) would stop publishing. When
        the brokers cannot hear each other but both are up, both say so and both are counted.
        """
        links = self._links
        alone = [link for link in links if link.connected and link.single_copy]
        if alone:
            links = alone
        acked = min(link.acked_through for link in links)
        if acked <= self._acked:
            return
        self._acked = acked
        pending = self._pending
        start = self._pending_start
        while start < len(pending) and pending[start].seq <= acked:
            start += 1
        # Keep what a connected or opening link has not had acknowledged yet (a broker that came
        # back is sent everything after the number it holds), but no more than max_pending: a link
        # further behind is opened again (_send_loop) and its broker records the hole.
        keep = min(
            [acked]
            + [link.acked_through for link in self._links if link.connected]
            + [link.opening_from - 1 for link in self._links if link.opening_from]
        )
        keep = max(keep, acked - self.max_pending)
        drop = start - (acked - keep)
        if drop > 4096 and drop * 2 > len(pending):
            del pending[:drop]
            start -= drop
        self._pending_start = start
        for seq in [s for s in self._waiters if s <= acked]:
            waiter = self._waiters.pop(seq)
            if not waiter.done():
                waiter.set_result(None)

    def _fail_waiters(self, error: Exception) -> None:
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
                waiter.exception()  # retrieved here so an unawaited one does not warn
        self._waiters.clear()

    def _fail(self, error: Exception) -> None:
        if self._failure is None:
            self._failure = error
            self._fail_waiters(error)
            for link in self._links:
                link.opened.set()

    # ----------------------------------------------------------------- links --
    async def _run_link(self, link: _Link) -> None:
        backoff = Backoff(maximum=RECONNECT_MAX_SECONDS)
        while not self._closed and self._failure is None:
            try:
                await self._session(link, backoff)
            except* aio.AioRpcError as group:
                error = group.exceptions[0]
                if not isinstance(error, aio.AioRpcError):  # pragma: no cover - the group holds only these
                    raise
                if reconnectable(error):
                    link.last_error = f"{error.code().name}: {error.details()}"
                    log.info("publish stream to %s broke (%s); reconnecting", link.address, error.code().name)
                else:
                    self._fail(BrokerError(error.code(), error.details() or ""))
            except* StreamEnded:
                log.info("broker %s closed the publish stream; reconnecting", link.address)
            except* Exception as group:  # noqa: BLE001 - surfaces to the application instead of dying silently
                self._fail(group.exceptions[0] if isinstance(group.exceptions[0], Exception) else group)
            link.connected = False
            self._advance()
            if self._failure is None:
                link.reconnect_now.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(link.reconnect_now.wait(), backoff.next_delay())

    async def _session(self, link: _Link, backoff: Backoff) -> None:
        async with open_channel(link.address, tls=self.tls, options=CHANNEL_OPTIONS, token=self.token) as channel:
            call = channel.stream_stream(
                PUBLISH_METHOD,
                request_serializer=_frame_bytes,
                response_deserializer=broker_pb2.PublishResponse.FromString,
            )()
            # Messages up to _acked may be gone from _pending (the survivor acknowledged them
            # alone while this broker was away): it continues after them and marks the hole.
            # Those acknowledged from here on stay in _pending until this link is open.
            first_unacked = self._acked + 1
            link.opening_from = first_unacked
            try:
                await write_frame(
                    call,
                    broker_pb2.PublishRequest(
                        open=broker_pb2.PublishOpen(publisher_id=self.publisher_id, first_unacked_seq=first_unacked)
                    ),
                )
                first = await call.read()
                if (
                    first is aio.EOF
                    or not isinstance(first, broker_pb2.PublishResponse)
                    or not first.HasField("opened")
                ):
                    await raise_status(call)
                    raise StreamEnded
                last = first.opened.last_seq
                link.max_batch = first.opened.max_batch_messages
                link.last_error = ""
                link.broker_last_seq = last
                # The broker's number is what it holds (at least first_unacked - 1: it records the
                # hole below that); everything after it is sent again, in order.
                link.acked_through = last
                link.sent_through = last
                link.connected = True
            finally:
                link.opening_from = 0
            link.opened.set()
            backoff.reset()
            self._advance()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._send_loop(link, call))
                group.create_task(self._receive_loop(link, call))

    def _unsent_index(self, link: _Link) -> int:
        """Index in ``_pending`` of the first message not yet sent on ``link`` (may be past the end).

        Raises :class:`StreamEnded` when that message is no longer kept (the link fell more than
        ``max_pending`` behind): the stream is opened again and continues after what is acknowledged.
        """
        pending = self._pending
        first_seq = pending[0].seq if pending else self._next_seq
        index = link.sent_through + 1 - first_seq
        if index < 0:
            raise StreamEnded
        return index

    async def _send_loop(self, link: _Link, call: _PublishCall) -> None:
        loop = asyncio.get_running_loop()
        lingered = False
        while True:
            link.wake.clear()
            wait = link.resume_at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            pending = self._pending
            index = self._unsent_index(link)
            ready = len(pending) - index
            if ready <= 0:
                lingered = False
                await link.wake.wait()
                continue
            # Within the broker's limit (SOKUTATSU_BROKER_MAX_BATCH_MESSAGES) whatever batch_messages says.
            batch_messages = min(self.batch_messages, link.max_batch) if link.max_batch else self.batch_messages
            if (
                ready < batch_messages
                and self.linger > 0
                and not lingered
                and loop.time() - link.last_send < self.linger
            ):
                # Adaptive batching: a link that wrote a frame less than `linger` ago is
                # busy, so give the application a moment to fill this one; an idle link
                # sends at once (lowest latency). Indexes are recomputed afterwards:
                # acknowledgements may have compacted the list.
                lingered = True
                await asyncio.sleep(self.linger)
                continue
            lingered = False
            spans = self._spans
            topic = pending[index].topic
            elements: list[bytes] = []
            size = 0
            end = min(len(pending), index + batch_messages)
            i = index
            while i < end and size < self.batch_bytes:
                item = pending[i]
                if item.topic != topic:
                    break
                elements.append(item.element)
                size += item.size
                i += 1
            last_seq = pending[i - 1].seq
            rewinds = link.rewinds
            link.last_send = loop.time()
            await write_frame(call, batch_frame(topic, elements))
            if spans is not None:
                spans.written(last_seq)
            if link.rewinds == rewinds:  # no refusal sent us back meanwhile
                link.sent_through = last_seq

    async def _receive_loop(self, link: _Link, call: _PublishCall) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial=0.02, maximum=1.0)
        while True:
            response = await call.read()
            if response is aio.EOF:
                await raise_status(call)
                raise StreamEnded
            if not isinstance(response, broker_pb2.PublishResponse):  # pragma: no cover - typed by the stub
                raise StreamEnded
            ack = response.ack
            self.dropped += ack.dropped
            self.duplicates += ack.duplicates
            link.acked_through = max(link.acked_through, ack.acked_through_seq)
            if link.single_copy and not ack.single_copy:
                # Its peer is back: acknowledgements now wait for that broker's copy too, so a
                # link to it waiting out a reconnect delay tries at once.
                for other in self._links:
                    if not other.connected:
                        other.reconnect_now.set()
            link.single_copy = ack.single_copy
            if ack.rejected and ack.rejected[0].first_seq > link.acked_through:
                rejection = ack.rejected[0]
                self.refused += rejection.last_seq - rejection.first_seq + 1
                self._last_refusal = rejection.message
                # Go back to the first refused message and try again after a pause.
                link.sent_through = max(link.acked_through, min(link.sent_through, rejection.first_seq - 1))
                link.rewinds += 1
                link.resume_at = loop.time() + backoff.next_delay()
                link.wake.set()
            else:
                backoff.reset()
            self._advance()

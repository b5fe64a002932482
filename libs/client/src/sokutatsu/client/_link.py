"""One publish stream per broker of the pair: batching, acknowledgements and go-back-N.

A :class:`BrokerLink` sends the accumulator's messages to its broker in frames and reports what
the broker acknowledges. A full frame leaves at once (below); one that is not full waits:

* a link that sent a frame less than ``linger`` seconds ago waits up to that long for a fuller
  one (an idle link sends at once);
* a link with ``max_in_flight`` frames its broker has not acknowledged waits for an
  acknowledgement, at most ``max_hold`` seconds (``max_in_flight`` 0: no such wait). The broker's
  own pace sets the frames: while it keeps up, its acknowledgement is back within the linger and
  nothing changes; while it is busy, the messages that arrive meanwhile go in one frame, and each
  frame's fixed cost (a gRPC read, an acknowledgement, the delivery frames it wakes) is paid once
  for all of them. ``max_hold`` bounds what a message waits when acknowledgements are slow for
  another reason (a broker that acknowledges once a spilled queue's write is on disk, one that is
  stopped).

A frame is full when it ends at ``batch_messages``, ``batch_bytes`` or a change of topic: such a
frame leaves at once, since waiting cannot make it fuller.

* A stream that breaks is opened again with jittered exponential backoff; the broker says
  which number it last holds and the rest is sent again, so retries never duplicate (the
  broker drops numbers it already has).
* A message refused at a broker limit is sent again, with backoff, with everything after it
  (go-back-N), so the order is kept.
* A refusal for bad input (e.g. a body over the broker's maximum) is final: the publisher fails
  with :class:`~sokutatsu.client.errors.BrokerError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client._accumulator import Accumulator, Pending
from sokutatsu.client._retry import Backoff, StreamEnded, raise_status, reconnectable, write_frame
from sokutatsu.client._wire import batch_frame
from sokutatsu.client.config import ClientConfig
from sokutatsu.client.errors import BrokerError

if TYPE_CHECKING:
    from sokutatsu.client._spans import SendSpans

log = logging.getLogger("sokutatsu.client.publisher")

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

_PublishCall = aio.StreamStreamCall[bytes | broker_pb2.PublishRequest, broker_pb2.PublishResponse]


def _frame_bytes(frame: bytes | broker_pb2.PublishRequest) -> bytes:
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


@dataclass(frozen=True)
class Batching:
    batch_messages: int
    batch_bytes: int
    linger: float
    max_in_flight: int
    max_hold: float


@dataclass
class Counters:
    """From the brokers' acknowledgements."""

    dropped: int = 0
    duplicates: int = 0
    refused: int = 0
    # Publish frames written, over every link (not from the brokers).
    frames: int = 0


class BrokerLink:
    def __init__(  # noqa: PLR0917 - built in one place (Publisher.__init__)
        self,
        address: str,
        publisher_id: str,
        config: ClientConfig,
        batching: Batching,
        accumulator: Accumulator,
        counters: Counters,
    ) -> None:
        self.address = address
        self.publisher_id = publisher_id
        self.config = config
        self.batching = batching
        self.accumulator = accumulator
        self.counters = counters
        # Every link of the publisher, this one included (set by the publisher).
        self.links: Sequence[BrokerLink] = (self,)
        self.spans: SendSpans | None = None
        self.sent_through = 0
        self.acked_through = 0
        self.connected = False
        self.resume_at = 0.0
        # Incremented each time a refusal sends the link back (go-back-N).
        self.rewinds = 0
        self.wake = asyncio.Event()
        self.opened = asyncio.Event()
        self.broker_last_seq = 0
        # The broker's last ack said its peer is down (it alone holds what it acknowledged).
        self.single_copy = False
        # Loop time of the last frame written (adaptive batching).
        self.last_send = float("-inf")
        # The broker's most messages per batch (PublishOpened.max_batch_messages; 0 = no limit).
        self.max_batch = 0
        # Why the last attempt to open the stream failed (for the error when none opened).
        self.last_error = ""
        # Set to cut a reconnect delay short: the other broker said its peer is back.
        self.reconnect_now = asyncio.Event()
        # While the stream is being opened: the first number it may need (PublishOpen.first_unacked_seq).
        self.opening_from = 0
        # The last number of each frame written on this stream and not yet acknowledged, in order.
        self.in_flight: collections.deque[int] = collections.deque()
        # While a frame that is not full waits for an acknowledgement: the timer ending the wait.
        self._hold_timer: asyncio.TimerHandle | None = None
        self._hold_expired = False
        # The last look at the next frame (:meth:`_frame_end`): its first and last number and bytes, so
        # that each publish that wakes a waiting link looks only at what came since (numbers are dense).
        self._scan = (0, 0, 0)

    def fail(self, error: Exception) -> None:
        """The publisher fails for good; ``start()`` stops waiting for the links."""
        self.accumulator.fail(error)
        for link in self.links:
            link.opened.set()

    def advance(self) -> None:
        self.accumulator.advance(self.links)

    async def run(self) -> None:
        """Keep a stream open to the broker until the publisher closes (cancels this) or fails."""
        backoff = Backoff(maximum=RECONNECT_MAX_SECONDS)
        while not self.accumulator.closed and self.accumulator.failure is None:
            try:
                await self._session(backoff)
            except* aio.AioRpcError as group:
                error = group.exceptions[0]
                if not isinstance(error, aio.AioRpcError):  # pragma: no cover - the group holds only these
                    raise
                if reconnectable(error):
                    self.last_error = f"{error.code().name}: {error.details()}"
                    log.info("publish stream to %s broke (%s); reconnecting", self.address, error.code().name)
                else:
                    self.fail(BrokerError(error.code(), error.details() or ""))
            except* StreamEnded:
                log.info("broker %s closed the publish stream; reconnecting", self.address)
            except* Exception as group:  # noqa: BLE001 - surfaces to the application instead of dying silently
                self.fail(group.exceptions[0] if isinstance(group.exceptions[0], Exception) else group)
            self.connected = False
            self.advance()
            if self.accumulator.failure is None:
                self.reconnect_now.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(backoff.next_delay()):  # not wait_for: see Accumulator.wait_acked
                        await self.reconnect_now.wait()

    async def _session(self, backoff: Backoff) -> None:
        accumulator = self.accumulator
        async with self.config.channel(self.address, options=CHANNEL_OPTIONS) as channel:
            call = channel.stream_stream(
                PUBLISH_METHOD,
                request_serializer=_frame_bytes,
                response_deserializer=broker_pb2.PublishResponse.FromString,
            )()
            # Messages up to acked may be gone from pending (the survivor acknowledged them
            # alone while this broker was away): it continues after them and marks the hole.
            # Those acknowledged from here on stay in pending until this link is open.
            first_unacked = accumulator.acked + 1
            self.opening_from = first_unacked
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
                self.max_batch = first.opened.max_batch_messages
                self.last_error = ""
                self.broker_last_seq = last
                # The broker's number is what it holds (at least first_unacked - 1: it records the
                # hole below that); everything after it is sent again, in order.
                self.acked_through = last
                self.sent_through = last
                self.connected = True
            finally:
                self.opening_from = 0
            self.in_flight.clear()
            self.opened.set()
            backoff.reset()
            self.advance()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._send_loop(call))
                group.create_task(self._receive_loop(call))

    async def _send_loop(self, call: _PublishCall) -> None:
        loop = asyncio.get_running_loop()
        accumulator = self.accumulator
        batching = self.batching
        lingered = False
        try:
            while True:
                self.wake.clear()
                wait = self.resume_at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                pending = accumulator.pending
                index = accumulator.unsent_index(self.sent_through)
                if index is None:
                    # Fell more than max_pending behind: the stream is opened again and continues
                    # after what is acknowledged.
                    raise StreamEnded
                if index >= len(pending):
                    lingered = False
                    await self.wake.wait()
                    continue
                # Within the broker's limit (SOKUTATSU_BROKER_MAX_BATCH_MESSAGES) whatever batch_messages says.
                most = min(batching.batch_messages, self.max_batch) if self.max_batch else batching.batch_messages
                end, full = self._frame_end(index, most)
                if not full and not lingered and loop.time() - self.last_send < batching.linger:
                    # Adaptive batching: a link that wrote a frame less than `linger` ago is
                    # busy, so give the application a moment to fill this one; an idle link
                    # sends at once (lowest latency). Indexes are recomputed afterwards:
                    # acknowledgements may have compacted the list.
                    lingered = True
                    await asyncio.sleep(batching.linger)
                    continue
                if not full and self._hold(loop):
                    await self.wake.wait()
                    continue
                self._end_hold()
                lingered = False
                await self._write(call, pending[index:end])
        finally:
            self._end_hold()

    def _hold(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a frame that is not full waits: ``max_in_flight`` frames are unacknowledged and
        it has not waited ``max_hold`` yet (an acknowledgement, a publish or the timer wakes it)."""
        limit = self.batching.max_in_flight
        if not 0 < limit <= len(self.in_flight):
            return False
        if self._hold_timer is None:
            self._hold_expired = False
            self._hold_timer = loop.call_later(self.batching.max_hold, self._hold_over)
        return not self._hold_expired

    def _hold_over(self) -> None:
        self._hold_expired = True
        self.wake.set()

    def _end_hold(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None

    def _frame_end(self, index: int, most: int) -> tuple[int, bool]:
        """Where the frame from ``pending[index]`` ends (one topic, at most ``most`` messages,
        ``batch_bytes`` passed by at most one message), and whether it is full: ended by one of
        those rather than by the last message ready, so that waiting cannot make it fuller."""
        pending = self.accumulator.pending
        first = pending[index].seq
        topic = pending[index].topic
        batch_bytes = self.batching.batch_bytes
        stop = min(len(pending), index + most)
        scanned_from, scanned_to, size = self._scan
        i = index + scanned_to - first + 1 if scanned_from == first else index
        if i > stop:  # the broker's limit fell below what was scanned (a new stream)
            i, size = index, 0
        elif i == index:
            size = 0
        while i < stop and size < batch_bytes:
            item = pending[i]
            if item.topic != topic:
                return i, True
            size += item.size
            i += 1
        self._scan = (first, pending[i - 1].seq, size)
        return i, i < len(pending) or i - index >= most or size >= batch_bytes

    async def _write(self, call: _PublishCall, frame: list[Pending]) -> None:
        last_seq = frame[-1].seq
        rewinds = self.rewinds
        self.last_send = asyncio.get_running_loop().time()
        # Counted before the write: its acknowledgement may arrive before the write returns.
        self.in_flight.append(last_seq)
        self.counters.frames += 1
        await write_frame(call, batch_frame(frame[0].topic, [item.element for item in frame]))
        if self.spans is not None:
            self.spans.written(last_seq)
        if self.rewinds == rewinds:  # no refusal sent us back meanwhile
            self.sent_through = last_seq

    async def _receive_loop(self, call: _PublishCall) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial=0.02, maximum=1.0)
        counters = self.counters
        while True:
            response = await call.read()
            if response is aio.EOF:
                await raise_status(call)
                raise StreamEnded
            if not isinstance(response, broker_pb2.PublishResponse):  # pragma: no cover - typed by the stub
                raise StreamEnded
            ack = response.ack
            counters.dropped += ack.dropped
            counters.duplicates += ack.duplicates
            self.acked_through = max(self.acked_through, ack.acked_through_seq)
            in_flight = self.in_flight
            while in_flight and in_flight[0] <= self.acked_through:
                in_flight.popleft()
            if len(in_flight) < self.batching.max_in_flight:
                self.wake.set()
            if self.single_copy and not ack.single_copy:
                # Its peer is back: acknowledgements now wait for that broker's copy too, so a
                # link to it waiting out a reconnect delay tries at once.
                for other in self.links:
                    if not other.connected:
                        other.reconnect_now.set()
            self.single_copy = ack.single_copy
            if ack.single_copy_refused:
                # It does not hear its peer but may not be counted alone (a monitored active without
                # the monitor's lease): said if the wait for the other broker's copy times out.
                self.accumulator.last_refusal = f"{self.address}: {ack.single_copy_refused}"
            if ack.rejected and ack.rejected[0].first_seq > self.acked_through:
                rejection = ack.rejected[0]
                counters.refused += rejection.last_seq - rejection.first_seq + 1
                self.accumulator.last_refusal = rejection.message
                # Go back to the first refused message and try again after a pause.
                self.sent_through = max(self.acked_through, min(self.sent_through, rejection.first_seq - 1))
                self.rewinds += 1
                self.in_flight.clear()  # what was out after the refusal is sent again
                self.resume_at = loop.time() + backoff.next_delay()
                self.wake.set()
            else:
                backoff.reset()
            self.advance()

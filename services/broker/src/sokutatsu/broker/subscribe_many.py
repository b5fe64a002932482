"""``SubscribeMany``: one stream carrying many subscriptions of one client (docs/broker.md,
One stream for many subscriptions).

Per subscription it is a ``Subscribe`` stream (``service.py``): the same attach, credit, detach
and redirect (``broker.py``, ``subscription_queue.py``), the same limits per client. What differs
is the waking and the framing:

* no task per subscription: each attached queue calls its *listener* (the lane's), which puts
  the lane in the stream's ready set and sets the stream's one event. The writer, woken once,
  takes from every ready queue what it has within its credit (``SubscriptionQueue.poll``) and
  writes it all as one frame, at once (no linger: a frame carries what became ready while the
  previous one was written, which is how frames fill under load without waiting at low load);
* a frame holds about ``BATCH_BYTES`` at most (plus one batch); ready lanes left over go into
  the next frame at once.

A *lane* is one subscription of the stream, named by the client's id. Invariants, kept by this
module alone (``_open``, ``_attached`` and ``_end`` are the only places that change a lane):

1. a lane is in ``lanes`` from its open frame until its one terminal frame (``Redirect`` or
   ``SubscriptionEnded``) is queued; its id is free from then on;
2. a lane with a queue is attached to it with the lane's listener, and is detached from it and
   released from the limits exactly once (``_end``), also when the stream ends by an error or a
   cancellation (then without a terminal frame);
3. a lane's frames go out in order: ``Subscribed``, batches, the terminal frame.

Memory: batches are taken only within each lane's credits; the other frames (``Subscribed``, terminal
frames, refused opens) answer the client's own frames, so the reader applies no more of those while
``frame_bytes`` of them wait to be written (``pending``): a client that sends and never reads is held
back by gRPC flow control instead of filling the broker with answers it does not take.

A client's mistake that concerns the stream (an undecodable frame, id 0, an open for an id that is
open, a frame for an id never opened) ends the stream with ``INVALID_ARGUMENT``; one that concerns
one subscription (an open the broker refuses, a credit over the maximum) ends that subscription
with the status a Subscribe stream would have ended with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc
from grpc import aio

from sokutatsu.broker.broker import Broker, PeerServes
from sokutatsu.broker.messages import subscription_batch, subscription_tag
from sokutatsu.broker.subscription_queue import SubscriptionQueue
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.errors import InvalidArgument, SokutatsuError

log = logging.getLogger(__name__)

# Counts a subscription for the client's limits (``DataPlane.hold``); returns its release.
Hold = Callable[[broker_pb2.Subscription], Callable[[], None]]


class Lane:
    """One subscription open on a SubscribeMany stream."""

    __slots__ = ("credits", "id", "opening", "queue", "release", "tag")

    def __init__(self, lane_id: int, release: Callable[[], None]) -> None:
        self.id = lane_id
        self.tag = subscription_tag(lane_id)
        self.release = release
        self.queue: SubscriptionQueue | None = None
        # The attach under way (None once attached or ended).
        self.opening: asyncio.Task[None] | None = None
        # Credit frames that came before the attach finished, applied once it has.
        self.credits: list[broker_pb2.SubscriberCredit] = []


def _response(lane_id: int, **frame: object) -> bytes:
    """One serialised ``SubscribeManyResponse`` of one frame; such frames concatenate into one."""
    return broker_pb2.SubscribeManyResponse(
        frames=[broker_pb2.SubscriptionResponse(id=lane_id, **frame)]  # type: ignore[arg-type]
    ).SerializeToString()


def _ended(lane_id: int, code: grpc.StatusCode, message: str) -> bytes:
    return _response(lane_id, ended=broker_pb2.SubscriptionEnded(code=code.value[0], message=message))


class ManyStream:
    """The broker's side of one SubscribeMany stream."""

    def __init__(self, broker: Broker, hold: Hold, frame_bytes: int) -> None:
        self.broker = broker
        self.hold = hold
        self.frame_bytes = frame_bytes
        self.lanes: dict[int, Lane] = {}
        # Lanes whose queue may have something to send or wants to stop, in the order they became so.
        self.ready: dict[int, Lane] = {}
        # Frames other than batches waiting to go out (Subscribed, terminal frames), and their bytes.
        self.out: list[bytes] = []
        self.pending = 0
        # Set each time the writer has written what it drained: the reader may apply more frames.
        self.taken = asyncio.Event()
        self.wake = asyncio.Event()
        # The highest id ever opened: a frame for a higher one names a subscription never opened.
        self.highest = 0
        self.reading = True
        self.failure: BaseException | None = None
        # Attaches cancelled by a close, awaited when the stream ends.
        self.cancelled: set[asyncio.Task[None]] = set()

    async def run(self, requests: AsyncIterator[broker_pb2.SubscribeManyRequest]) -> AsyncGenerator[bytes, None]:
        """The serialised response frames, until the client half-closes or a stream-level error."""
        reader = asyncio.create_task(self._read(requests), name="subscribe-many-requests")
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                if self.failure is not None:
                    raise self.failure
                frame = self._drain()
                if frame:
                    yield frame
                self.taken.set()
                if not self.reading:
                    break
        finally:
            # Synchronous up to the await: a second cancellation must not leave a queue attached.
            reader.cancel()
            for lane in list(self.lanes.values()):
                self._end(lane, None)
            await asyncio.gather(reader, *self.cancelled, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[broker_pb2.SubscribeManyRequest]) -> None:
        try:
            async for request in requests:
                for frame in request.frames:
                    self._apply(frame)
                    while self.pending >= self.frame_bytes:
                        # The client has not taken our answers so far: read no more until it has.
                        self.taken.clear()
                        await self.taken.wait()
        except (SokutatsuError, aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self.failure = exc
        finally:
            self.reading = False
            self.wake.set()

    # ------------------------------------------------------------ requests --
    def _apply(self, frame: broker_pb2.SubscriptionRequest) -> None:
        lane_id = frame.id
        kind = frame.WhichOneof("frame")
        if lane_id == 0:
            raise InvalidArgument("SubscriptionRequest.id must be at least 1 (your number for the subscription)")
        lane = self.lanes.get(lane_id)
        if kind == "open":
            if lane is not None:
                raise InvalidArgument(
                    f"SubscriptionRequest {lane_id} opens a subscription, but {lane_id} is open on this stream: "
                    "use another id, or wait for its Redirect or SubscriptionEnded"
                )
            self._open(lane_id, frame.open)
            return
        if kind is None:
            raise InvalidArgument(f"SubscriptionRequest {lane_id} holds no open, credit or close")
        if lane is None:
            if lane_id > self.highest:
                raise InvalidArgument(
                    f"SubscriptionRequest {lane_id} sends a {kind} for a subscription this stream never opened"
                )
            return  # the broker ended it; the client had not read that yet
        if kind == "close":
            self._end(lane, _ended(lane_id, grpc.StatusCode.OK, "closed"))
        elif lane.queue is None:
            lane.credits.append(frame.credit)
        else:
            self._credit(lane, lane.queue, frame.credit)

    def _credit(self, lane: Lane, queue: SubscriptionQueue, credit: broker_pb2.SubscriberCredit) -> None:
        try:
            self.broker.credit(queue, credit)
        except InvalidArgument as exc:
            self._end(lane, _ended(lane.id, exc.code, str(exc)))

    def _open(self, lane_id: int, opening: broker_pb2.SubscribeOpen) -> None:
        self.highest = max(self.highest, lane_id)
        try:
            release = self.hold(opening.subscription)
        except SokutatsuError as exc:
            self._queue(_ended(lane_id, exc.code, str(exc)))
            return
        lane = Lane(lane_id, release)
        self.lanes[lane_id] = lane
        lane.opening = asyncio.create_task(self._attach(lane, opening), name=f"subscribe-many-open-{lane_id}")

    async def _attach(self, lane: Lane, opening: broker_pb2.SubscribeOpen) -> None:
        try:
            queue, _ = await self.broker.attach(opening, lambda: self._ready(lane))
        except PeerServes as serves:
            lane.opening = None
            self._end(lane, _response(lane.id, redirect=serves.redirect))
            return
        except SokutatsuError as exc:
            lane.opening = None
            self._end(lane, _ended(lane.id, exc.code, str(exc)))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A fault of this broker's, not the client's: the stream ends with it (INTERNAL).
            log.exception("SubscribeMany: attaching %s failed", opening.subscription.subscriber_id)
            self.failure = exc
            self.wake.set()
            raise
        lane.opening = None
        lane.queue = queue
        self._queue(
            _response(
                lane.id,
                subscribed=broker_pb2.Subscribed(
                    broker_id=self.broker.settings.instance, role=self.broker.role, position=opening.position
                ),
            )
        )
        credits, lane.credits = lane.credits, []
        for credit in credits:
            if self.lanes.get(lane.id) is lane:
                self._credit(lane, queue, credit)
        self._ready(lane)

    # ------------------------------------------------------------- delivery --
    def _ready(self, lane: Lane) -> None:
        """The lane's listener: its queue may have something for the stream, or wants it to stop."""
        self.ready[lane.id] = lane
        self.wake.set()

    def _drain(self) -> bytes:
        """One response frame: the waiting frames, then what every ready lane has now."""
        parts = self.out
        size = self.pending
        self.out, self.pending = [], 0
        lanes = list(self.ready.values())
        self.ready.clear()
        for lane in lanes:
            queue = lane.queue
            if queue is None or self.lanes.get(lane.id) is not lane:
                continue  # still attaching (it is marked ready once attached), or ended
            if size >= self.frame_bytes:
                self._ready(lane)  # the next frame, at once
                continue
            if queue.stopping:
                self._stopped(lane, queue)
                continue
            body = queue.poll()
            if body is not None:
                part = subscription_batch(lane.tag, body)
                parts.append(part)
                size += len(part)
                if queue.has_more:
                    self._ready(lane)
        parts += self.out
        self.out, self.pending = [], 0
        return b"".join(parts)

    def _stopped(self, lane: Lane, queue: SubscriptionQueue) -> None:
        """The queue ended the lane's stream: redirected, taken over by a newer stream, or closed."""
        if queue.redirect is not None:
            self._end(lane, _response(lane.id, redirect=queue.redirect))
        elif queue.closed:
            self._end(lane, _ended(lane.id, grpc.StatusCode.OK, "the subscription was deleted, or the broker stops"))
        else:
            self._end(lane, _ended(lane.id, grpc.StatusCode.OK, "a newer stream of this subscriber took it over"))

    def _end(self, lane: Lane, terminal: bytes | None) -> None:
        """End ``lane`` (invariant 2), queueing its ``terminal`` frame (None: the stream ends)."""
        if self.lanes.get(lane.id) is not lane:
            return
        del self.lanes[lane.id]
        self.ready.pop(lane.id, None)
        if lane.opening is not None:
            lane.opening.cancel()  # Broker.attach attaches nothing when cancelled
            self.cancelled.add(lane.opening)
            lane.opening.add_done_callback(self.cancelled.discard)
            lane.opening = None
        queue, lane.queue = lane.queue, None
        if queue is not None:
            self.broker.detach(queue)
        lane.release()
        if terminal is not None:
            self._queue(terminal)

    def _queue(self, frame: bytes) -> None:
        """A frame other than a batch, to go out with the next response."""
        self.out.append(frame)
        self.pending += len(frame)
        self.wake.set()

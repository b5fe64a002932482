"""The queue of one subscription: what the broker still owes that subscriber.

Order of delivery, oldest first::

    front        items that were in flight when the last stream ended (redelivered first)
    readback     items read back from disk, not yet sent    }
    disk         spilled items, read back in order          } flow-to-disk only
    spill buffer items waiting for the disk thread to write }
    memory       items in memory, newest last

Items sent and not yet acknowledged sit in ``in_flight``; at most ``credits``
more are sent. Acknowledged items are released (their shared message may then
leave memory; their segment may then be deleted).

Flow-to-disk: when the queue's memory would exceed its budget, every item in
``memory`` moves to the spill buffer and the queue enters disk mode: new items
go to the spill buffer too, the disk thread appends them to the segment log
(fsync per batch) and drops them from memory, and delivery reads them back in
order. Disk mode ends when the log and the buffer are empty. The queue's
memory is then its in-flight window, one read batch and what arrives during
one write.

In a pair (see ``pair.py``) the queue has a state: ``SERVING`` (delivered from
here), ``SHADOW`` (the peer delivers it; this copy holds what the subscriber has
not acknowledged, trimmed by the peer's watermarks: :meth:`trim`), ``AWAY``
(the peer, the standby, delivers it; this copy keeps only the newest
``away_tail`` bytes, also trimmed by the peer's watermarks, dropping the oldest
and raising its floor, so a subscriber that caught up can come back at once, and
one whose standby dies loses nothing if it was within the tail) or ``LEAVING``
(redirected, waiting for switchover step 4).

Ownership: ``state`` changes only through :meth:`serve`, :meth:`leave`,
:meth:`hand_over` and :meth:`shadow`; the broker (``broker.py``) picks which
from its role and the switchover steps. What holds for one copy:

* it is delivered from (a stream may attach) only while ``SERVING``;
* it leaves ``SERVING``/``LEAVING`` for ``SHADOW`` or ``AWAY`` only with no
  stream attached or with the attached stream redirected to the peer;
* it holds every matching message after ``floor``; whatever it may lack past
  the subscriber's acknowledged position is in ``lacks`` (a hole left while
  its broker was away, an away copy trimmed to its tail), so the broker can
  say whether it is caught up, and a switchover onto it waits (its floor)
  until the subscriber is past what it lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from sokutatsu.broker.disk_worker import DiskWorker
from sokutatsu.broker.messages import StoredMessage, batch_response, delivery_body, delivery_element
from sokutatsu.broker.retention import AGE, BYTES, RetentionGaps
from sokutatsu.broker.segment_log import HEADER_BYTES, SegmentLog, SegmentLogError
from sokutatsu.broker.subscription import DROP_OLDEST, Retention, SubscriptionSpec
from sokutatsu.broker.v1 import broker_pb2

_PREV = struct.Struct("<Q")
SERVING = broker_pb2.QUEUE_STATE_SERVING
SHADOW = broker_pb2.QUEUE_STATE_SHADOW
AWAY = broker_pb2.QUEUE_STATE_AWAY
LEAVING = broker_pb2.QUEUE_STATE_LEAVING
log = logging.getLogger(__name__)


class Item:
    """One message queued for this subscriber."""

    __slots__ = ("msg", "payload", "prev", "publisher_id", "segment", "seq", "size")

    def __init__(  # noqa: PLR0917 - built per message on the hot path; positional is cheaper
        self, publisher_id: str, seq: int, prev: int, payload: bytes, msg: StoredMessage | None, segment: int
    ) -> None:
        self.publisher_id = publisher_id
        self.seq = seq
        self.prev = prev
        self.payload = payload
        self.size = len(payload)
        # The shared message while it is held in memory for this queue (None once spilled or read back).
        self.msg = msg
        # The segment it was read back from (-1 when it never went to disk).
        self.segment = segment


def _segment_bytes(retention: Retention) -> int:
    """Segment files of a queue with a maximum on disk are small beside it (a sixteenth), so
    discarding whole segments keeps it within its maximum; 16 MiB otherwise."""
    if not retention.max_bytes:
        return 16 * 2**20
    return min(16 * 2**20, max(64 * 1024, retention.max_bytes // 16))


def publish_time(item: Item) -> int:
    """When ``item`` was published (Message.publish_time_unix_nano; 0 = not said)."""
    return broker_pb2.Message.FromString(item.payload).publish_time_unix_nano


def _parse_record(segment: int, record: bytes) -> Item:
    from sokutatsu.broker.v1 import broker_pb2  # noqa: PLC0415 - parsing read-backs only

    (prev,) = _PREV.unpack_from(record)
    payload = record[_PREV.size :]
    header = broker_pb2.Message.FromString(payload)
    return Item(header.publisher_id, header.publisher_seq, prev, payload, None, segment)


class HeldBack:
    """What a queue holds back (:meth:`SubscriptionQueue.hold_back`)."""

    def __init__(self, holds: dict[str, int], lacks: dict[str, int]) -> None:
        # Per publisher, the last number the copy holds (its disk) when it began holding back: a
        # publisher that comes back meanwhile raises ``last_enqueued`` past what the peer fills in.
        self.holds = holds
        # What the copy lacked then (before its log's first record, or a hole inside it): a fill,
        # which brings what the peer holds after ``holds``, does not bring that.
        self.lacks = lacks
        # In arrival order, each with its publisher's ``last_enqueued`` as it arrived: what a
        # resume after a hole (``Broker.resume_publisher``) or a message not kept raised it to, so
        # the message names that as its predecessor where nothing fills in between.
        self.messages: list[tuple[StoredMessage, int]] = []
        # Publishes waiting for their messages to be written (``SubscriptionQueue.written``).
        self.waiters: list[asyncio.Future[None]] = []


class SubscriptionQueue:
    # The attached stream's wake-up when it is a SubscribeMany stream (subscribe_many.py): called,
    # instead of a task waiting on `ready`, whenever `ready` is set. Set by attach, cleared by detach.
    listener: Callable[[], None] | None = None
    # Per publisher, up to where a peer's fill completed this copy (a restart's claim, :meth:`_filled`:
    # what the peer held up to there is here or told as a gap): a hole below it is not lacked again.
    filled_through: Mapping[str, int] = MappingProxyType({})
    # Per publisher, what the attached stream's subscriber holds (its open's position, or beyond it:
    # SubscribeOpen.received): a retention gap it is told counts from after it.
    _told_from: Mapping[str, int] = MappingProxyType({})
    # Called when the queue starts or stops being served here (the broker records it: pair_state.py,
    # invariant 7).
    on_serving: Callable[[], None] | None = None

    def __init__(
        self,
        *,
        spec: SubscriptionSpec,
        folder: Path,
        disk: DiskWorker,
        batch_messages: int,
        batch_bytes: int,
        linger_seconds: float,
        state: broker_pb2.QueueState.ValueType = SERVING,
        floor: dict[str, int] | None = None,
        away_tail: int = 0,
        retention: Retention | None = None,
    ) -> None:
        self.spec = spec
        # The retention limits in force (resolved against the broker's), and what they discarded.
        self.retention = retention or Retention()
        self.kept = RetentionGaps()
        # When the last stream ended, or the queue was made (monotonic): for SUBSCRIPTION_EXPIRY.
        self.idle_since = time.monotonic()
        self.state = state
        self.away_tail = away_tail
        # Per publisher: this copy holds every matching message after this number (it may lack
        # earlier ones: it was created, or its broker joined, later). See AcceptSubscriber.
        self.floor: dict[str, int] = dict(floor or {})
        # Per publisher: this copy may lack messages up to this number that the subscriber has not
        # acknowledged (a hole left while its broker was away, or an away copy trimmed to its tail);
        # an entry goes once `acked` reaches it. Empty: this copy holds all the subscriber still needs.
        self.lacks: dict[str, int] = {}
        # Taken at switchover step 2 and no stream attached since: the source still serves the
        # subscriber until its redirect (Broker.attach sends one from before the floor there).
        self.taken_pending = False
        # Per publisher, the last number the subscriber acknowledged (or had when it connected).
        self.acked: dict[str, int] = {}
        # Set when `acked` moved since the last watermark frame was sent to the peer.
        self.acked_dirty = False
        # Counts empty_out() calls: a spill job that overlapped one drops what it wrote.
        self._emptied = 0
        # Where a redirected stream is sent (switchover step 3, or a peer that serves it).
        self.redirect: broker_pb2.Redirect | None = None
        self.folder = folder
        self._disk = disk
        self._batch_messages = batch_messages
        self._batch_bytes = batch_bytes
        self._linger = linger_seconds
        self.memory: deque[Item] = deque()
        self.front: deque[Item] = deque()
        # Read back from disk, not yet sent (between `front` and what is still on disk).
        self.readback: deque[Item] = deque()
        self._reading = False
        self._aging = False
        self._spill_retry_delay = 0.0
        self.in_flight: deque[Item] = deque()
        self.spill_buffer: list[Item] = []
        self.spilling = 0
        self._spill_scheduled = False
        self.disk_count = self.disk_bytes = self.memory_bytes = 0
        # While this broker, restarted, settles with its peer whether it serves the subscriber again
        # (pair_state.py, invariant 7): what arrives meanwhile, and the publishes waiting for it to be
        # written. None otherwise. (An attribute of the instance: enqueue reads it per message.)
        self.held_back: HeldBack | None = None
        self.log: SegmentLog | None = None
        self.last_enqueued: dict[str, int] = {}
        # Per publisher that resumed after a hole (Broker.resume_publisher): the last number this copy
        # holds of it (or that a message not kept took), and the number ``last_enqueued`` was raised to
        # so the next message's previous_seq tells the hole. While ``last_enqueued`` is that number, the
        # copy does not hold it: its holdings say the held one (Broker.holdings). A message put here
        # inside the hole (a peer's fill) raises the held number; one at or past the raised number ends
        # the mark (:meth:`enqueue`).
        self.hole_marks: dict[str, tuple[int, int]] = {}
        self.delivered: dict[str, int] = {}
        self.credits = 0
        self.attached = False
        self._last_send = 0.0
        self._skip: dict[str, int] = {}
        self._detaching = False
        self.closed = False
        self.recovered = False
        # Which stream is attached; stop_stream ignores requests about an earlier one.
        self.generation = 0
        self.ready = asyncio.Event()
        # Set while no stream is attached.
        self.idle = asyncio.Event()
        self.idle.set()
        self.enqueued_total = 0
        self.sent_total = 0
        self.spilled_total = 0
        # Items put in the spill buffer, and written to disk, since start; waiters for the latter.
        self.spill_appended = 0
        self._spill_waiters: list[tuple[int, asyncio.Future[None]]] = []

    # ------------------------------------------------------------ recovery --
    async def recover(self) -> None:
        """Open the segment log left by an earlier run, if any; its items are owed again.

        Messages that were only in memory when the broker stopped are gone; so that the
        SDK reports them, the first message of each publisher after a restart claims the
        number just before it as its predecessor (a filtered subscription may therefore
        report a possible gap once per publisher after a restart).
        """
        self.recovered = True
        if not self.folder.exists():
            return
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        holes: dict[str, int] = {}

        def numbers(record: memoryview) -> None:
            header = broker_pb2.Message.FromString(bytes(record[_PREV.size :]))
            publisher, seq = header.publisher_id, header.publisher_seq
            if publisher in last:
                (prev,) = _PREV.unpack_from(record)
                if prev > last[publisher]:
                    holes[publisher] = prev  # a hole the publisher resumed after (Broker.resume_publisher)
            else:
                first[publisher] = seq
            last[publisher] = seq

        self.log = await self._disk.call(SegmentLog, self.folder, _segment_bytes(self.retention), numbers)
        self.disk_count = self.log.unread_count
        self.disk_bytes = self.log.unread_bytes
        # What the log holds, per publisher, is every message of this queue from its first to its last
        # there (a spill keeps the queue's order, and a record leaves only once acknowledged), except
        # where a record names a predecessor past the publisher's record before it: a hole the copy was
        # told of while it ran (its floor and ``lacks``, in memory only), which it still lacks. Before,
        # recovery forgot it: the copy counted itself caught up and a subscriber moved here was told as
        # a gap what the peer held (chaos seed 223254). What came before its first may be missing too
        # (it was in memory).
        self.last_enqueued.update(last)
        for publisher, seq in first.items():
            self.may_lack(publisher, seq - 1)
        for publisher, prev in holes.items():
            self.may_lack(publisher, prev)

    # ------------------------------------------------------------- enqueue --
    @property
    def disk_mode(self) -> bool:
        return bool(self.disk_count or self.spill_buffer or self.spilling)

    @property
    def depth(self) -> int:
        return (
            len(self.memory)
            + len(self.front)
            + len(self.readback)
            + len(self.in_flight)
            + len(self.spill_buffer)
            + self.spilling
            + self.disk_count
        )

    def enqueue(self, msg: StoredMessage, prev: int = -1) -> bool:
        """Queue ``msg`` (already held once for this queue by the caller); True if it goes to disk
        (or is held back: :meth:`written` then waits for its turn). ``prev``: its predecessor when
        known (a peer's fill), else the last one queued here."""
        if self.held_back is not None:
            self.held_back.messages.append((msg, self.last_enqueued.get(msg.publisher_id, 0)))
            return True
        publisher = msg.publisher_id
        seq = msg.seq
        last = self.last_enqueued.get(publisher, -1)
        if seq <= last:
            # Held already: a peer's fill (pair_state.py, invariant 7) or a restart's disk, and now a
            # publisher sending it again.
            msg.release()
            return False
        if prev < 0:
            prev = last if last >= 0 else seq - 1 if self.recovered else 0
        item = Item(publisher, seq, prev, msg.payload, msg, -1)
        self.last_enqueued[publisher] = seq
        if self.hole_marks:
            self._into_hole(publisher, seq)
        self.memory_bytes += item.size
        to_disk = True
        if self.state == AWAY:
            self.memory.append(item)
            to_disk = False
            while self.memory_bytes > self.away_tail and self.memory:
                oldest = self.memory.popleft()
                self.may_lack(oldest.publisher_id, oldest.seq)
                self._release([oldest])
        elif self.disk_mode:
            self.spill_buffer.append(item)
            self.spill_appended += 1
        elif self.memory_bytes > self.spec.budget:
            self.spill_appended += len(self.memory) + 1
            self.spill_buffer.extend(self.memory)
            self.memory.clear()
            self.spill_buffer.append(item)
        else:
            self.memory.append(item)
            to_disk = False
        if to_disk:
            self._schedule_spill()
        self.enqueued_total += 1
        if self.attached:
            self._wake()
        return to_disk

    def _into_hole(self, publisher: str, seq: int) -> None:
        """``publisher``'s ``seq`` was put here: a mark it reaches ends (the copy holds the number
        ``last_enqueued`` says), one it is inside of holds up to it (a peer's fill into the hole)."""
        mark = self.hole_marks.get(publisher)
        if mark is None:
            return
        if seq >= mark[1]:
            del self.hole_marks[publisher]
        elif seq > mark[0]:
            self.hole_marks[publisher] = (seq, mark[1])

    @property
    def file_bytes(self) -> int:
        """Bytes of this queue's segment files on disk."""
        log_ = self.log
        return log_.disk_bytes if log_ is not None else 0

    def full(self) -> bool:
        """Whether a ``refuse_publish`` queue is at its maximum bytes (segment files and what waits
        to be written): its topic's persistent publishes are refused until it has room."""
        if not self.retention.refuses or not self.disk_mode:
            return False
        pending = sum(_PREV.size + HEADER_BYTES + i.size for i in self.spill_buffer)
        return self.file_bytes + pending >= self.retention.max_bytes

    def not_kept(self, publisher: str, seq: int) -> None:
        """A non-persistent message was not kept because this ``refuse_publish`` queue is full;
        the next one kept names it as its predecessor and carries the gap."""
        prev = self.last_enqueued.get(publisher, seq - 1 if self.recovered else 0)
        self.last_enqueued[publisher] = seq
        self.kept.note(publisher, seq, prev, BYTES)
        self.acked_dirty = True

    def written(self, appended: int) -> asyncio.Future[None]:
        """Completes when the first ``appended`` spilled items are on disk (fsynced)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.held_back is not None:
            self.held_back.waiters.append(done)  # settled in end_hold_back, once its turn is written
        elif self.spilled_total >= appended or self.closed:
            done.set_result(None)
        else:
            self._spill_waiters.append((appended, done))
        return done

    def _wake_spill_waiters(self, everyone: bool = False) -> None:
        if everyone and self.held_back is not None:
            for waiter in self.held_back.waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self.held_back.waiters = []
        keep = []
        for target, waiter in self._spill_waiters:
            if everyone or self.spilled_total >= target:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                keep.append((target, waiter))
        self._spill_waiters = keep

    def _schedule_spill(self) -> None:
        if not self._spill_scheduled:
            self._spill_scheduled = True
            self._disk.submit(self._spill)

    async def _spill(self) -> None:
        """Write one batch of the spill buffer (a disk job; it resubmits itself while more waits,
        so reads and other queues' jobs take turns with it)."""
        retry = False
        batch: list[Item] = []
        try:
            if self.closed or not self.spill_buffer:
                return
            batch = self.spill_buffer
            self.spill_buffer = []
            self.spilling = len(batch)
            emptied = self._emptied
            try:
                await self._write(batch)
            except (OSError, SegmentLogError) as exc:
                # Nothing of the batch counts as written: put it back, in order, and retry.
                self.spill_buffer = batch + self.spill_buffer
                self._spill_retry_delay = min(max(self._spill_retry_delay * 2, 0.05), 5.0)
                log.error(  # noqa: TRY400 - an expected I/O failure: one line, no traceback
                    "spilling %d messages of %s on %s failed: %s; retrying in %.2fs",
                    len(batch),
                    self.spec.subscriber_id,
                    self.spec.topic,
                    exc,
                    self._spill_retry_delay,
                )
                retry = True
                return
            self._spill_retry_delay = 0.0
            for item in batch:
                self.memory_bytes -= item.size
                self.disk_bytes += item.size
                if item.msg is not None:
                    item.msg.release()
                    item.msg = None
            if emptied != self._emptied:
                # The queue was emptied while this batch was written: the removal job queued
                # behind this one deletes the folder; nothing of it is owed.
                self.disk_bytes = 0
                self.spilled_total += len(batch)
                self._wake_spill_waiters()
                stale, self.log = self.log, None
                if stale is not None:
                    with contextlib.suppress(SegmentLogError):
                        await self._disk.run_blocking(stale.destroy)
                return
            self.disk_count += len(batch)
            self.spilled_total += len(batch)
            self._wake_spill_waiters()
        finally:
            self.spilling = 0
            self._spill_scheduled = False
            if self.closed:
                self._wake_spill_waiters(everyone=True)
            elif retry:
                asyncio.get_running_loop().call_later(self._spill_retry_delay, self._schedule_spill)
            elif self.spill_buffer:
                self._schedule_spill()
            self._wake()

    async def _write(self, batch: list[Item]) -> None:
        """Append ``batch`` to the log (opened on first use), after ``drop_oldest`` made room (it
        takes what it discards out of ``batch``, so a failed append puts back only the rest)."""
        if self.log is None:
            self.log = await self._disk.run_blocking(SegmentLog, self.folder, _segment_bytes(self.retention))
        if self.retention.max_bytes and self.retention.policy == DROP_OLDEST:
            await self._make_room(self.log, batch)
            self.spilling = len(batch)
        records = [_PREV.pack(item.prev) + item.payload for item in batch]
        if records:
            await self._disk.run_blocking(self.log.append, records)

    async def _make_room(self, log_: SegmentLog, batch: list[Item]) -> None:
        """``drop_oldest`` (a disk job, before ``batch`` is written): discard the oldest messages on
        disk until the segment files and ``batch`` fit in ``max_bytes``, then, should that not be
        enough, the oldest of ``batch`` (taken out of it)."""
        limit = self.retention.max_bytes
        incoming = sum(_PREV.size + HEADER_BYTES + item.size for item in batch)
        if log_.disk_bytes + incoming > limit and log_.unread_count:
            emptied = self._emptied
            records = await self._disk.run_blocking(log_.discard_oldest, limit - incoming)
            if emptied == self._emptied:
                for record in records:
                    item = _parse_record(-1, record)
                    self.disk_count -= 1
                    self.disk_bytes -= item.size
                    self.kept.note(item.publisher_id, item.seq, item.prev, BYTES)
                self.acked_dirty = bool(records) or self.acked_dirty
        dropped = 0
        while batch[dropped:] and log_.disk_bytes + incoming > limit:
            item = batch[dropped]
            dropped += 1
            incoming -= _PREV.size + HEADER_BYTES + item.size
            self.memory_bytes -= item.size
            self.spilled_total += 1  # never written: no longer awaited (written())
            if item.msg is not None:
                item.msg.release()
                item.msg = None
            self.kept.note(item.publisher_id, item.seq, item.prev, BYTES)
            self.acked_dirty = True
        del batch[:dropped]

    def expire(self, now_ns: int) -> int:
        """Discard the owed messages older than ``max_age_ms`` from the oldest on (the oldest in
        memory here; those on disk through a disk job, one by one). Returns how many went here."""
        max_age = self.retention.max_age_ms
        if not max_age or self.closed:
            return 0
        cutoff = now_ns - max_age * 1_000_000
        dropped = 0
        for source in (self.front, self.readback):
            while source and 0 < publish_time(source[0]) < cutoff:
                dropped += self._discard_old(source.popleft())
            if source:
                return dropped
        if self.disk_count:
            if not self._aging:
                self._aging = True
                self._disk.submit(lambda: self._age_disk(cutoff))
            return dropped
        if not (self.spill_buffer or self.spilling):
            while self.memory and 0 < publish_time(self.memory[0]) < cutoff:
                dropped += self._discard_old(self.memory.popleft())
        return dropped

    async def _age_disk(self, cutoff: int) -> None:
        """A disk job: discard the oldest records on disk while they are past the age (looked at
        one by one, so a younger one is never taken off the disk)."""
        try:
            log_ = self.log
            emptied = self._emptied
            if log_ is None or self.closed or self.front or self.readback or self._reading:
                return

            def old(record: bytes) -> bool:
                return 0 < publish_time(_parse_record(-1, record)) < cutoff

            records = await self._disk.run_blocking(log_.discard_while, old, 10_000)
            if self.closed or emptied != self._emptied:
                return
            for record in records:
                item = _parse_record(-1, record)
                self.disk_count -= 1
                self.disk_bytes -= item.size
                self.kept.note(item.publisher_id, item.seq, item.prev, AGE)
            if records:
                self.acked_dirty = True
                self._wake()
        finally:
            self._aging = False

    def _discard_old(self, item: Item) -> int:
        self.kept.note(item.publisher_id, item.seq, item.prev, AGE)
        self.acked_dirty = True
        self._release([item])
        return 1

    def oldest_age_ms(self, now_ns: int) -> int:
        """Age of the oldest message owed and not in flight, when it is in memory (0 otherwise)."""
        for source in (self.front, self.readback):
            if source:
                return max(0, now_ns - publish_time(source[0])) // 1_000_000 if publish_time(source[0]) else 0
        if self.disk_count or self.spill_buffer or self.spilling or not self.memory:
            return 0
        published = publish_time(self.memory[0])
        return max(0, now_ns - published) // 1_000_000 if published else 0

    # ------------------------------------------------------------ delivery --
    def _wake(self) -> None:
        """Something changed that may let the attached stream send, or make it stop."""
        self.ready.set()
        listener = self.listener
        if listener is not None:
            listener()

    def attach(
        self,
        position: dict[str, int],
        credits: int,
        listener: Callable[[], None] | None = None,
        received: dict[str, int] | None = None,
    ) -> int:
        """Attach a stream; return its generation (for :meth:`stop_stream`).

        A Subscribe stream awaits :meth:`next_batch`; a SubscribeMany stream passes ``listener``
        (called whenever the queue may have something for it, or wants it to stop) and takes
        batches with :meth:`poll`. ``position`` is acknowledged; ``received`` (``SubscribeOpen.
        received``) is what the subscriber holds beyond it, sent again all the same: a retention
        gap is counted from after it.
        """
        self.generation += 1
        self.listener = listener
        self.attached = True
        self.kept.acked(position)
        self.idle.clear()
        self._detaching = False
        self.credits = credits
        self._skip = dict(position)
        self._told_from = {**position, **{p: n for p, n in (received or {}).items() if n > position.get(p, 0)}}
        self.redirect = None
        for publisher, seq in position.items():
            if seq > self.delivered.get(publisher, 0):
                self.delivered[publisher] = seq
        self._raise_acked(position)
        self._wake()
        return self.generation

    def detach(self) -> None:
        """The stream ended: what was in flight is owed again, first."""
        self.front = deque([*self.in_flight, *self.front])
        self.in_flight.clear()
        self.attached = False
        self.listener = None
        self.credits = 0
        self._skip = {}
        self._told_from = MappingProxyType({})
        self.idle.set()
        self.idle_since = time.monotonic()

    def redirect_stream(self, redirect: broker_pb2.Redirect) -> None:
        """End the attached stream with a Redirect frame (after what it was already sent)."""
        self.redirect = redirect
        if self.attached:
            self._detaching = True
            self._wake()

    def stop_stream(self, generation: int) -> None:
        """Make :meth:`next_batch` of stream ``generation`` return None (its client went away).

        A request about an earlier stream (one that was already replaced) is ignored.
        """
        if generation == self.generation and self.attached:
            self._detaching = True
            self._wake()

    def grant(self, credits: int) -> None:
        self.credits += credits
        if credits:
            self._wake()

    async def next_batch(self) -> bytes | None:
        """The next serialised ``SubscribeResponse`` batch, waiting for messages and credit; None to stop."""
        while True:
            self.ready.clear()
            if self.stopping:
                return None
            if self.credits > 0:
                items = await self._take(min(self.credits, self._batch_messages))
                if items:
                    return batch_response(self._send(items))
                if self.stopping:
                    return None
                if items is None:
                    continue
            await self.ready.wait()

    @property
    def stopping(self) -> bool:
        """Whether the attached stream must end (redirected, replaced, its client gone, or the queue closed)."""
        return self._detaching or self.closed

    def poll(self) -> bytes | None:
        """A SubscribeMany stream's :meth:`next_batch`: the serialised ``DeliveryBatch`` of what is ready
        now within the credit, or None (the listener is called when that changes). No linger: the
        stream's frame carries what every one of its subscriptions has ready."""
        while self.credits > 0 and not self.stopping:
            items = self._take_now(min(self.credits, self._batch_messages))
            if items:
                return self._send(items)
            if items is not None:
                return None
        return None

    @property
    def has_more(self) -> bool:
        """Whether :meth:`poll` would return a batch at once (credit left and items waiting in memory)."""
        return self.credits > 0 and bool(self.front or self.readback or self.memory) and not self.stopping

    async def _take(self, limit: int) -> list[Item] | None:
        """:meth:`_take_now`, after the adaptive batching's wait.

        Adaptive batching: a stream that sent a frame less than `linger` ago is busy, so wait
        that long for a fuller frame of what is in memory; an idle stream sends at once (lowest latency).
        """
        if (
            self._linger
            and self.memory
            and len(self.memory) < limit
            and not (self.front or self.readback or self.disk_mode)
            and time.monotonic() - self._last_send < self._linger
        ):
            await asyncio.sleep(self._linger)
        return self._take_now(limit)

    def _take_now(self, limit: int) -> list[Item] | None:
        """Up to ``limit`` items from the oldest source; None means: look again at once.

        A source can yield nothing although it was not empty (every item was already
        covered by the subscriber's position); then the next source must be looked at
        at once, not after the next wake-up.
        """
        if self.front:
            return self._pop(self.front, limit) or None
        if self.readback:
            return self._pop(self.readback, limit) or None
        if self.disk_count:
            self._request_read(limit)
            return []  # the read job sets `ready`
        if self.spill_buffer or self.spilling:
            return []  # the spill job sets `ready` when the items are on disk
        if not self.memory:
            return []
        return self._pop(self.memory, limit) or None

    def _pop(self, source: deque[Item], limit: int) -> list[Item]:
        items: list[Item] = []
        size = 0
        skip = self._skip
        while source and len(items) < limit and size < self._batch_bytes:
            item = source.popleft()
            if skip and item.seq <= skip.get(item.publisher_id, 0):
                self._release([item])
                continue
            items.append(item)
            size += item.size
        return items

    def _request_read(self, limit: int) -> None:
        """Have the disk thread read the next records into ``readback``.

        The job, not the stream, takes the records: a stream cancelled while the read
        runs loses nothing, and the counters always match the log.
        """
        if self._reading or self.log is None:
            return
        self._reading = True
        log_ = self.log
        emptied = self._emptied

        async def read() -> None:
            try:
                if self.closed or emptied != self._emptied:
                    return
                try:
                    records = await self._disk.run_blocking(log_.read, limit, self._batch_bytes)
                except SegmentLogError as exc:
                    # An unreadable record cannot be delivered; the SDK sees the loss as a gap.
                    log.error(  # noqa: TRY400 - a corrupt record: one line, no traceback
                        "cannot read back %s on %s: %s", self.spec.subscriber_id, self.spec.topic, exc
                    )
                    records = []
                    self.disk_count = 0
                    self.disk_bytes = 0
                if self.closed or emptied != self._emptied:
                    # Emptied while the read ran (switchover step 4): its log is gone, and
                    # these records are no longer owed; the counters were reset then.
                    return
                if not records:
                    self.disk_count = min(self.disk_count, log_.unread_count)
                    self.disk_bytes = log_.unread_bytes if self.disk_count else 0
                    return
                items = [_parse_record(segment, record) for segment, record in records]
                self.disk_count -= len(items)
                for item in items:
                    self.disk_bytes -= item.size
                    self.memory_bytes += item.size
                self.readback.extend(items)
            finally:
                self._reading = False
                self._wake()
                if self.state == SHADOW and not self.closed:
                    self._trim_heads()

        self._disk.submit(read)

    def _send(self, items: list[Item]) -> bytes:
        """Count ``items`` as sent; the serialised ``DeliveryBatch`` carrying them."""
        self._last_send = time.monotonic()
        self.in_flight.extend(items)
        self.credits -= len(items)
        self.sent_total += len(items)
        delivered = self.delivered
        for item in items:
            delivered[item.publisher_id] = item.seq
        gaps = self.kept
        if gaps.gaps:
            # A gap is told from after what this stream's subscriber received (its open position,
            # or beyond it: SubscribeOpen.received).
            received = self._told_from
            return delivery_body(
                [
                    delivery_element(
                        item.payload,
                        item.prev,
                        gaps.element_tail(item.publisher_id, item.prev, received.get(item.publisher_id, 0)),
                    )
                    for item in items
                ]
            )
        return delivery_body([delivery_element(item.payload, item.prev) for item in items])

    # ---------------------------------------------------------------- acks --
    def ack(self, position: dict[str, int]) -> int:
        """Release the in-flight items the subscriber has processed; return how many."""
        self._raise_acked(position)
        done: list[Item] = []
        in_flight = self.in_flight
        while in_flight and in_flight[0].seq <= position.get(in_flight[0].publisher_id, 0):
            done.append(in_flight.popleft())
        self._release(done)
        return len(done)

    def _raise_acked(self, position: dict[str, int]) -> None:
        acked = self.acked
        for publisher, seq in position.items():
            if seq > acked.get(publisher, 0):
                acked[publisher] = seq
                self.acked_dirty = True
        if self.kept.gaps:
            self.kept.acked(acked)

    # ----------------------------------------------------------- ownership --
    def serve(self) -> None:
        """Deliver from this copy (the peer is gone, this broker was promoted, or switchover step 2)."""
        if self.state != SERVING and not self.attached:
            # SUBSCRIPTION_EXPIRY counts from when this broker began to serve it: a copy that was
            # a shadow for weeks is not expired the moment its broker takes it over.
            self.idle_since = time.monotonic()
        was = self.state
        self.state = SERVING
        self.redirect = None
        if was not in (SERVING, LEAVING):
            self._serving_changed()

    def _serving_changed(self) -> None:
        if self.on_serving is not None:
            self.on_serving()

    # ------------------------------------------------------- restart claim --
    def hold_back(self) -> None:
        """Hold what arrives until :meth:`end_hold_back` (pair_state.py, invariant 7)."""
        if self.held_back is None:
            self.held_back = HeldBack(dict(self.last_enqueued), dict(self.lacks))

    def end_hold_back(self, fill: Sequence[tuple[int, StoredMessage]] | None = None) -> int:
        """Queue ``fill`` (``(previous number, message)`` from the peer, oldest first: all its copy
        holds after this copy's numbers; None: no fill came) and what was held back, in each
        publisher's order, each message once (what this copy holds already is skipped); and let the
        publishes that waited go on once their messages are where they wait otherwise. Returns how
        many of ``fill`` were queued.

        A held-back message numbered before a filled one of its publisher goes in before it: the
        peer's away copy keeps only a tail, so its fill may begin after messages both brokers took
        while the claim waited. Before, the fill went in first and those, held here, were skipped as
        held already: acknowledged by both, kept by neither (a review's schedule)."""
        held = self.held_back
        if held is None:
            return 0
        self.held_back = None
        # A publisher that came back meanwhile said where it continues (``Broker.resume_publisher``
        # raised ``last_enqueued``); what the peer fills in below that is what this copy lacks.
        told = self.last_enqueued
        self.last_enqueued = last = dict(held.holds)
        waiting: dict[str, deque[tuple[StoredMessage, int]]] = {}
        for entry in held.messages:
            waiting.setdefault(entry[0].publisher_id, deque()).append(entry)

        def put_held(msg: StoredMessage, hole: int) -> None:
            # ``hole``: where its publisher resumed before it came (a hole neither filled nor held
            # then: this message tells it). Not where the publisher resumed last: a second hole
            # during the claim would hide the first (a review's schedule).
            if msg.seq > hole > last.get(msg.publisher_id, 0):
                last[msg.publisher_id] = hole
            self.enqueue(msg)

        filled = 0
        for prev, msg in fill or ():
            before = waiting.get(msg.publisher_id)
            while before and before[0][0].seq < msg.seq:
                put_held(*before.popleft())
            queued = self.enqueued_total
            self.enqueue(msg, prev)  # what the copy holds already is skipped
            filled += self.enqueued_total - queued
        if fill is not None:
            self._filled(held.lacks)
        for entry in held.messages:
            rest = waiting[entry[0].publisher_id]
            if rest and rest[0] is entry:
                put_held(*rest.popleft())
        for publisher, seq in told.items():
            if seq > last.get(publisher, 0):
                last[publisher] = seq  # the same for the next message of a publisher held none after it
        waiters = held.waiters
        if waiters:

            def settle(_: asyncio.Future[None]) -> None:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)

            self.written(self.spill_appended).add_done_callback(settle)
        return filled

    def fill_after(self, position: dict[str, int]) -> list[tuple[int, bytes]]:
        """What this (away) copy holds after ``position``, oldest first: ``(previous number, message)``."""
        return [(item.prev, item.payload) for item in self.memory if item.seq > position.get(item.publisher_id, 0)]

    def leave(self, redirect: broker_pb2.Redirect) -> bool:
        """Switchover step 3: end the stream with ``redirect``; True if one was attached."""
        self.taken_pending = False
        if self.state not in (SERVING, LEAVING):  # pragma: no cover - the broker checks first
            raise ValueError(f"leave() on a {self.state} copy")
        self.state = LEAVING
        connected = self.attached
        self.redirect_stream(redirect)
        return connected

    def hand_over(self, *, keep_tail: bool) -> int:
        """Switchover step 4 (no stream attached): the peer serves the subscriber now.

        The active keeps a tail (``AWAY``): the newest ``away_tail`` bytes of what it held (in
        memory; what is older, or on disk, is cleared and recorded as what it may lack), so a
        subscriber moved with a backlog that fits the tail loses nothing if the standby dies
        right after. The standby keeps a ``SHADOW``. Returns how many were cleared.
        """
        if self.attached:  # pragma: no cover - the broker checks first
            raise ValueError("hand_over() with a stream attached")
        self.taken_pending = False
        cleared = 0
        if keep_tail:
            kept = self._take_newest(self.away_tail)
            first: dict[str, int] = {}
            for item in kept:
                first.setdefault(item.publisher_id, item.seq)
            cleared = self.empty_out()
            for publisher, seq in self.last_enqueued.items():
                self.may_lack(publisher, first[publisher] - 1 if publisher in first else seq)
            self.memory.extend(kept)
            self.state = AWAY
        else:
            self.state = SHADOW
        self.redirect = None
        self._serving_changed()
        return cleared

    def _take_newest(self, limit: int) -> list[Item]:
        """Take out of the queue the newest items held in memory, oldest first, at most ``limit``
        bytes, with nothing left after them (per publisher, they are its last ones here). Their
        bytes stay counted in ``memory_bytes``; nothing past the disk is taken."""
        taken: list[Item] = []
        size = 0
        newest_first: list[list[Item] | deque[Item]] = [self.memory, self.spill_buffer]
        if not (self.disk_count or self.spilling or self._reading):
            newest_first += [self.readback, self.front]
        for source in newest_first:
            while source and size + source[-1].size <= limit:
                item = source.pop()
                size += item.size
                item.segment = -1  # its segment goes with the log
                taken.append(item)
                if source is self.spill_buffer:
                    self.spilled_total += 1  # never written: no longer awaited (written())
            if source:
                break
        taken.reverse()
        return taken

    def shadow(self, peer: str) -> bool:
        """This broker became standby: a copy it served or kept away becomes a shadow, and an
        attached stream is redirected to ``peer``. True when the state changed."""
        self.taken_pending = False
        if self.state == SERVING:
            self.state = SHADOW
            if self.attached and peer:
                self.redirect_stream(broker_pb2.Redirect(target=peer, reason="broker demoted"))
            self._serving_changed()
            return True
        if self.state == AWAY:
            self.state = SHADOW
            return True
        return False

    def acknowledged(self, position: dict[str, int]) -> None:
        """What the subscriber acknowledged, as the peer knew it (a restart's fill): owed no more, so
        what this copy lacked up to it is not counted as lacking (:attr:`behind`)."""
        self._raise_acked(position)

    def _filled(self, lacked_before: dict[str, int]) -> None:
        """The peer's fill is in. What this copy lacked up to a number it now holds, it holds or tells
        (each filled message names its true predecessor: what neither copy holds is a gap the
        subscriber is told), so it lacks no more of it than it did before the claim: what was missing
        before its log's first record or inside it (``lacked_before``), which the fill does not bring.
        A lack past what the fill brought stays. Before, every lack stayed until the subscriber
        acknowledged past it: an idle subscriber's copy stayed behind for good after a reclaim. The
        broker does not mark a hole below ``filled_through`` in this copy again (``Broker._mark_holes``,
        with each later holdings: a review found the lack coming back)."""
        last = self.last_enqueued
        self.filled_through = MappingProxyType(dict(last))
        for publisher, seq in list(self.lacks.items()):
            if seq <= last.get(publisher, 0):
                before = lacked_before.get(publisher)
                if before is None:
                    del self.lacks[publisher]
                else:
                    self.lacks[publisher] = before

    # -------------------------------------------------------------- shadow --
    def may_lack(self, publisher: str, seq: int) -> bool:
        """This copy may not hold ``publisher``'s messages up to ``seq``: raise the floor (a
        switchover here waits until the subscriber is past it) and, when the subscriber has not
        acknowledged that far, count it as behind. True when the floor rose."""
        raised = seq > self.floor.get(publisher, 0)
        if raised:
            self.floor[publisher] = seq
        if seq > self.acked.get(publisher, 0) and seq > self.lacks.get(publisher, 0):
            self.lacks[publisher] = seq
        return raised

    def lacks_after(self, position: dict[str, int]) -> bool:
        """Whether this copy may lack a message after ``position`` (the peer's holdings said it has
        messages this copy was away for)."""
        return any(seq > position.get(publisher, 0) for publisher, seq in self.lacks.items())

    @property
    def behind(self) -> bool:
        """Whether this copy may lack a message its subscriber has not acknowledged."""
        lacks = self.lacks
        if lacks:
            acked = self.acked
            told = self.kept.told_through
            for publisher in [p for p, seq in lacks.items() if seq <= max(acked.get(p, 0), told(p))]:
                del lacks[publisher]
        return bool(lacks)

    def trim(self, position: dict[str, int], gaps: Sequence[broker_pb2.PublisherRetentionGap] = ()) -> int:
        """Drop what the subscriber has acknowledged at the peer (a shadow copy); return how many.

        Each source is trimmed from its oldest item and stops at the first one not covered
        (several publishers interleave, so a covered item may wait behind another's for
        the next watermark). Spilled items are read back by the disk thread to be trimmed.
        """
        self._raise_acked(position)
        if gaps:
            self.kept.merge(gaps, self.acked)
        self.acked_dirty = False
        return self._trim_heads()

    def _trim_heads(self) -> int:
        acked = self.acked
        dropped: list[Item] = []
        covers = self.kept.covers
        for source in (self.front, self.readback, self.memory):
            while source and (
                source[0].seq <= acked.get(source[0].publisher_id, 0) or covers(source[0].publisher_id, source[0].seq)
            ):
                dropped.append(source.popleft())
        if dropped:
            self._release(dropped)
        if self.disk_count and not self.readback and not self.attached:
            self._request_read(self._batch_messages)
        return len(dropped)

    def _release(self, items: list[Item]) -> None:
        segments: dict[int, int] = {}
        for item in items:
            self.memory_bytes -= item.size
            if item.msg is not None:
                item.msg.release()
                item.msg = None
            if item.segment >= 0:
                segments[item.segment] = segments.get(item.segment, 0) + 1
        if segments and self.log is not None:
            log = self.log

            async def ack_segments() -> None:
                if not self.closed:
                    await self._disk.run_blocking(_ack_all, log, segments)

            self._disk.submit(ack_segments)

    # --------------------------------------------------------------- close --
    def clear(self) -> int:
        """Drop everything owed (switchover step 4, or a deleted subscription); return how many."""
        items = [*self.front, *self.readback, *self.in_flight, *self.memory, *self.spill_buffer]
        dropped = len(items) + self.disk_count + self.spilling
        for item in items:
            self.memory_bytes -= item.size
            if item.msg is not None:
                item.msg.release()
                item.msg = None
        self.front.clear()
        self.readback.clear()
        self.in_flight.clear()
        self.memory.clear()
        self.spill_buffer = []
        return dropped

    def empty_out(self) -> int:
        """Drop everything owed, on disk too, and keep the queue (switchover step 4); return how many."""
        # Spill-buffer items dropped here are never written: no longer awaited (written()).
        self.spilled_total += len(self.spill_buffer)
        dropped = self.clear()
        self._emptied += 1
        self._wake_spill_waiters(everyone=True)
        log_ = self.log
        self.log = None
        self.disk_count = 0
        self.disk_bytes = 0
        if log_ is not None:

            async def remove() -> None:
                await self._disk.run_blocking(log_.destroy)

            self._disk.submit(remove)
        return dropped

    def discard(self) -> None:
        """Drop the queue and its segments (the subscription is gone).

        Synchronous, so it also runs in a handler being cancelled; the disk thread deletes
        the segments, in order with the jobs already queued.
        """
        self.closed = True
        self._wake_spill_waiters(everyone=True)
        if self.held_back is not None:
            for msg, _ in self.held_back.messages:
                msg.release()
            self.held_back = None
        self.clear()
        self._wake()
        log = self.log
        self.log = None
        self.disk_count = 0
        self.disk_bytes = 0
        if log is not None:

            async def remove() -> None:
                await self._disk.run_blocking(log.destroy)

            self._disk.submit(remove)

    async def close(self) -> None:
        """Broker shutdown (after the disk task has stopped): keep a durable queue's backlog on disk.

        What is only in memory is appended to the segment log where that keeps the order:
        all of it when nothing is on disk, otherwise the part newer than what is on disk
        (older in-memory items, sent before the queue went to disk, are then lost, and the
        SDK reports them as a gap after the restart).
        """
        self.closed = True
        self._wake_spill_waiters(everyone=True)
        self._wake()
        if self.spec.durable:
            older = [i for i in (*self.in_flight, *self.front, *self.readback) if i.segment < 0]
            on_disk = bool(self.disk_count or self.spilling) or any(
                i.segment >= 0 for i in (*self.in_flight, *self.front, *self.readback)
            )
            keep = ([] if on_disk else older) + [*self.spill_buffer, *self.memory]
            if keep:
                try:
                    if self.log is None:
                        self.log = await self._disk.run_blocking(
                            SegmentLog, self.folder, _segment_bytes(self.retention)
                        )
                    await self._disk.run_blocking(self.log.append, [_PREV.pack(i.prev) + i.payload for i in keep])
                    log.info(
                        "kept %d messages of %s on %s for the restart",
                        len(keep),
                        self.spec.subscriber_id,
                        self.spec.topic,
                    )
                except (OSError, SegmentLogError) as exc:
                    log.error(  # noqa: TRY400 - an I/O failure at shutdown: one line, no traceback
                        "could not keep %d messages of %s on %s: %s",
                        len(keep),
                        self.spec.subscriber_id,
                        self.spec.topic,
                        exc,
                    )
        if self.log is not None:
            await self._disk.run_blocking(self.log.close)

    def rates_sample(self) -> tuple[float, int, int]:
        return time.monotonic(), self.enqueued_total, self.sent_total


def _ack_all(log: SegmentLog, segments: dict[int, int]) -> None:
    for segment, count in segments.items():
        log.ack(segment, count)

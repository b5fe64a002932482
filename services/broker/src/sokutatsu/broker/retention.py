"""What a subscription's retention discarded, and what its subscriber must be told.

A queue (``subscription_queue.py``) discards messages for two reasons: it holds more bytes of
segment files than its ``max_bytes`` (``drop_oldest``: the oldest on disk go; ``refuse_publish``:
non-persistent messages are not kept while it is full), or a message is older than its
``max_age_ms``. Per publisher this records a *gap*: the range the discarded messages lay in and
how many went for each reason. Invariants:

* per publisher, a *range* is a run of discarded messages that followed one another in this
  queue: a discarded message whose predecessor (``previous_seq``) ends a range extends it, any
  other starts a new one. So a range holds no message the queue kept, and a copy holding a
  message inside a range may drop it (``covers``);
* per publisher, the ranges are disjoint and sorted, and each discarded message is counted once:
  a message discarded again (a copy's own discard of one a merged range already covers) is not
  counted again, and ranges that come to overlap (a merge) become one;
* the message delivered right after a range (its ``previous_seq`` is the range's ``last_seq``)
  carries it (``Message.retention_gap``), on every delivery until the subscriber acknowledged
  past it, so a resend after a broken stream does too;
* what a subscriber is told counts only what it lacks: a stream counts from what its subscriber
  received (``SubscribeOpen.received``, or its position), and a message it received may have been
  discarded since (it was in
  flight and never acknowledged, or the peer delivered it while this copy discarded it), so the
  range a delivery carries starts after that position and counts only the messages after it
  (:meth:`element_tail`). That count is exact when every number of the range was discarded (a
  publisher whose messages all match, the usual case); otherwise (numbers between that never
  matched) it cannot be split and the whole range's count is told;
* the serving copy sends its ranges to the peer with its watermarks; the peer merges them
  (:meth:`merge`), drops what they cover from its copy and tells the subscriber if it comes to
  serve it, so a subscriber moved between the brokers is neither re-sent what it was told it
  lost nor left untold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client._wire import varint

BYTES = "bytes"
AGE = "age"
_TAG_RETENTION_GAP = b"\x52"  # Message.retention_gap = 10, length-delimited


class RetentionGaps:
    """Per publisher, the pending ranges of one queue (oldest first), and the totals since start."""

    __slots__ = ("dirty", "dropped_age", "dropped_bytes", "gaps", "refused_publishes")

    def __init__(self) -> None:
        self.gaps: dict[str, list[broker_pb2.RetentionGap]] = {}
        self.dropped_bytes = 0
        self.dropped_age = 0
        self.refused_publishes = 0
        # Set when a range changed since the last watermark frame (the peer must hear of it).
        self.dirty = False

    def note(self, publisher: str, seq: int, prev: int, reason: str) -> None:
        """``publisher``'s message ``seq`` (queued after ``prev``) was discarded for ``reason``."""
        if reason == BYTES:
            self.dropped_bytes += 1
        else:
            self.dropped_age += 1
        ranges = self.gaps.setdefault(publisher, [])
        if self.covers(publisher, seq):
            return  # already counted (a merged range of the peer's holds it)
        gap = next((r for r in reversed(ranges) if r.last_seq == prev), None) if prev else None
        if gap is None:
            gap = broker_pb2.RetentionGap(first_seq=seq, last_seq=seq)
            ranges.append(gap)
            ranges.sort(key=lambda r: r.first_seq)
        else:
            gap.last_seq = seq
        if reason == BYTES:
            gap.over_bytes += 1
        else:
            gap.over_age += 1
        _coalesce(ranges)
        self.dirty = True

    def covers(self, publisher: str, seq: int) -> bool:
        """Whether ``publisher``'s ``seq`` lies in a discarded range (a copy may drop it)."""
        return any(gap.first_seq <= seq <= gap.last_seq for gap in self.gaps.get(publisher, ()))

    def told_through(self, publisher: str) -> int:
        """The last number of ``publisher`` this queue discarded and has yet to tell (0 = none)."""
        ranges = self.gaps.get(publisher)
        return ranges[-1].last_seq if ranges else 0

    def element_tail(self, publisher: str, prev: int, received: int = 0) -> bytes:
        """The serialised ``Message.retention_gap`` for a delivery of ``publisher``'s message queued
        after ``prev`` (b"" when ``prev`` ends no range), on a stream whose subscriber received up
        to ``received``: what it already has is not told as lost."""
        for gap in self.gaps.get(publisher, ()):
            if gap.last_seq == prev:
                told = _after(gap, received)
                body = told.SerializeToString()
                return _TAG_RETENTION_GAP + varint(len(body)) + body
        return b""

    def acked(self, position: Mapping[str, int]) -> None:
        """The subscriber acknowledged ``position``: ranges it is past were told."""
        for publisher in [p for p in self.gaps if p in position]:
            kept = [gap for gap in self.gaps[publisher] if gap.last_seq > position[publisher]]
            if kept:
                self.gaps[publisher] = kept
            else:
                del self.gaps[publisher]

    def to_proto(self) -> list[broker_pb2.PublisherRetentionGap]:
        return [
            broker_pb2.PublisherRetentionGap(publisher_id=publisher, gap=gap)
            for publisher, ranges in self.gaps.items()
            for gap in ranges
        ]

    def merge(self, gaps: Iterable[broker_pb2.PublisherRetentionGap], acked: Mapping[str, int]) -> None:
        """The peer's ranges (its watermark frame): what it discarded is discarded here too."""
        for theirs in gaps:
            publisher, gap = theirs.publisher_id, theirs.gap
            if acked.get(publisher, 0) >= gap.last_seq:
                continue
            ranges = self.gaps.setdefault(publisher, [])
            ranges.append(broker_pb2.RetentionGap())
            ranges[-1].CopyFrom(gap)
            ranges.sort(key=lambda r: r.first_seq)
            _coalesce(ranges)


def _full(gap: broker_pb2.RetentionGap) -> bool:
    """Whether every number from ``first_seq`` to ``last_seq`` was discarded (counted once each)."""
    return gap.over_bytes + gap.over_age == gap.last_seq - gap.first_seq + 1


def _coalesce(ranges: list[broker_pb2.RetentionGap]) -> None:
    """Make overlapping ranges of one publisher (sorted by ``first_seq``) one, in place, and full
    ranges that meet.

    Two that overlap saw the same run: the union, counted once. When each was full (every number
    discarded), so is the union, and its count is its width (by reason: exact when both have one
    reason, the same); otherwise the numbers between are unknown and it takes the larger count of
    each reason (both copies saw the same run), never more than its width.
    """
    i = 1
    while i < len(ranges):
        before, gap = ranges[i - 1], ranges[i]
        both_full = _full(before) and _full(gap)
        # Full ranges that meet (every number between them discarded) are one run too.
        if gap.first_seq > before.last_seq + (1 if both_full else 0):
            i += 1
            continue
        before.first_seq = min(before.first_seq, gap.first_seq)
        before.last_seq = max(before.last_seq, gap.last_seq)
        width = before.last_seq - before.first_seq + 1
        if both_full:
            over_bytes = min(width, before.over_bytes + gap.over_bytes) if before.over_bytes or gap.over_bytes else 0
            before.over_bytes, before.over_age = over_bytes, width - over_bytes
        else:
            before.over_bytes = min(width, max(before.over_bytes, gap.over_bytes))
            before.over_age = min(width - before.over_bytes, max(before.over_age, gap.over_age))
        del ranges[i]


def _after(gap: broker_pb2.RetentionGap, received: int) -> broker_pb2.RetentionGap:
    """``gap`` as told to a subscriber that received up to ``received``: from the number after it,
    counting only the messages after it, when the range is full (otherwise as it is)."""
    if not gap.first_seq <= received < gap.last_seq or not _full(gap):
        return gap
    lacks = gap.last_seq - received
    # Exact by reason when the range has one; with both, the total is exact, not the split.
    over_age = min(gap.over_age, lacks)
    return broker_pb2.RetentionGap(
        first_seq=received + 1, last_seq=gap.last_seq, over_bytes=lacks - over_age, over_age=over_age
    )

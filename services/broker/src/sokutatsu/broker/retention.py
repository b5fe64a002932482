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
* the message delivered right after a range (its ``previous_seq`` is the range's ``last_seq``)
  carries it (``Message.retention_gap``), on every delivery until the subscriber acknowledged
  past it, so a resend after a broken stream does too;
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
        ranges = self.gaps.setdefault(publisher, [])
        if ranges and ranges[-1].last_seq == prev:
            gap = ranges[-1]
            gap.last_seq = seq
        else:
            gap = broker_pb2.RetentionGap(first_seq=seq, last_seq=seq)
            ranges.append(gap)
        if reason == BYTES:
            gap.over_bytes += 1
            self.dropped_bytes += 1
        else:
            gap.over_age += 1
            self.dropped_age += 1
        self.dirty = True

    def covers(self, publisher: str, seq: int) -> bool:
        """Whether ``publisher``'s ``seq`` lies in a discarded range (a copy may drop it)."""
        return any(gap.first_seq <= seq <= gap.last_seq for gap in self.gaps.get(publisher, ()))

    def told_through(self, publisher: str) -> int:
        """The last number of ``publisher`` this queue discarded and has yet to tell (0 = none)."""
        ranges = self.gaps.get(publisher)
        return ranges[-1].last_seq if ranges else 0

    def element_tail(self, publisher: str, prev: int) -> bytes:
        """The serialised ``Message.retention_gap`` for a delivery of ``publisher``'s message queued
        after ``prev`` (b"" when ``prev`` ends no range)."""
        for gap in self.gaps.get(publisher, ()):
            if gap.last_seq == prev:
                body = gap.SerializeToString()
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
            mine = next((r for r in ranges if r.first_seq <= gap.last_seq and gap.first_seq <= r.last_seq), None)
            if mine is None:
                ranges.append(broker_pb2.RetentionGap())
                ranges[-1].CopyFrom(gap)
                ranges.sort(key=lambda r: r.first_seq)
                continue
            # The same run seen by both: the wider range, and the larger count of each reason.
            mine.first_seq = min(mine.first_seq, gap.first_seq)
            mine.last_seq = max(mine.last_seq, gap.last_seq)
            mine.over_bytes = max(mine.over_bytes, gap.over_bytes)
            mine.over_age = max(mine.over_age, gap.over_age)

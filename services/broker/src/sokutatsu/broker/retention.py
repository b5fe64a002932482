"""What a subscription's retention discarded, and what its subscriber must be told.

A queue (``subscription_queue.py``) discards messages for two reasons: it holds more bytes of
segment files than its ``max_bytes`` (``drop_oldest``: the oldest on disk go; ``refuse_publish``:
non-persistent messages are not kept while it is full), or a message is older than its
``max_age_ms``. Per publisher this records a *gap*: the range the discarded messages lay in and
how many went for each reason. Invariants:

* discards are taken from the oldest owed messages (or, for ``refuse_publish``, are the newest
  ones while nothing newer is kept), so per publisher the discarded messages are every message
  this queue owed in ``first_seq..last_seq`` that was not already in flight: a copy holding such
  a message may drop it (``covers``);
* a gap lasts until the subscriber acknowledged ``last_seq`` or beyond (it then received the
  message after it, which carried the gap): every delivery of a later message of that publisher
  before then carries it (``Message.retention_gap``), so a resend after a broken stream does too;
* the serving copy sends its gaps to the peer with its watermarks; the peer merges them
  (:meth:`merge`), drops what they cover from its copy and tells the subscriber if it comes to
  serve it, so a subscriber moved between the brokers is neither re-sent what it was told it
  lost nor left untold.
"""

from __future__ import annotations

from collections.abc import Mapping

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.wire import varint

BYTES = "bytes"
AGE = "age"
_TAG_RETENTION_GAP = b"\x52"  # Message.retention_gap = 10, length-delimited


class RetentionGaps:
    """Per publisher, the pending gap of one queue, and the totals discarded since start."""

    __slots__ = ("dirty", "dropped_age", "dropped_bytes", "gaps", "refused_publishes")

    def __init__(self) -> None:
        self.gaps: dict[str, broker_pb2.RetentionGap] = {}
        self.dropped_bytes = 0
        self.dropped_age = 0
        self.refused_publishes = 0
        # Set when a gap changed since the last watermark frame (the peer must hear of it).
        self.dirty = False

    def note(self, publisher: str, seq: int, reason: str) -> None:
        """``publisher``'s message ``seq`` was discarded for ``reason`` (BYTES or AGE)."""
        gap = self.gaps.get(publisher)
        if gap is None:
            gap = self.gaps[publisher] = broker_pb2.RetentionGap(first_seq=seq, last_seq=seq)
        else:
            gap.first_seq = min(gap.first_seq, seq)
            gap.last_seq = max(gap.last_seq, seq)
        if reason == BYTES:
            gap.over_bytes += 1
            self.dropped_bytes += 1
        else:
            gap.over_age += 1
            self.dropped_age += 1
        self.dirty = True

    def covers(self, publisher: str, seq: int) -> bool:
        """Whether ``publisher``'s ``seq`` lies in a discarded range (a copy may drop it)."""
        gap = self.gaps.get(publisher)
        return gap is not None and gap.first_seq <= seq <= gap.last_seq

    def told_through(self, publisher: str) -> int:
        """The last number of ``publisher`` this queue discarded and has yet to tell (0 = none)."""
        gap = self.gaps.get(publisher)
        return gap.last_seq if gap is not None else 0

    def element_tail(self, publisher: str, seq: int) -> bytes:
        """The serialised ``Message.retention_gap`` a delivery of ``publisher``'s ``seq`` carries (or b"")."""
        gap = self.gaps.get(publisher)
        if gap is None or seq <= gap.last_seq:
            return b""
        body = gap.SerializeToString()
        return _TAG_RETENTION_GAP + varint(len(body)) + body

    def acked(self, position: Mapping[str, int]) -> None:
        """The subscriber acknowledged ``position``: gaps it is past were told."""
        gaps = self.gaps
        for publisher in [p for p, gap in gaps.items() if position.get(p, 0) >= gap.last_seq]:
            del gaps[publisher]

    def merge(self, gaps: Mapping[str, broker_pb2.RetentionGap], acked: Mapping[str, int]) -> None:
        """The peer's gaps (its watermark frame): what it discarded is discarded here too."""
        for publisher, theirs in gaps.items():
            if acked.get(publisher, 0) >= theirs.last_seq:
                continue
            mine = self.gaps.get(publisher)
            if mine is None:
                self.gaps[publisher] = broker_pb2.RetentionGap(
                    first_seq=theirs.first_seq,
                    last_seq=theirs.last_seq,
                    over_bytes=theirs.over_bytes,
                    over_age=theirs.over_age,
                )
                continue
            mine.first_seq = min(mine.first_seq, theirs.first_seq)
            mine.last_seq = max(mine.last_seq, theirs.last_seq)
            # The same discards counted on both sides: keep the larger count of each reason.
            mine.over_bytes = max(mine.over_bytes, theirs.over_bytes)
            mine.over_age = max(mine.over_age, theirs.over_age)

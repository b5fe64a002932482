"""RetentionGaps (retention.py) and the segment log's discards, as units: ranges hold only
discarded messages, the message right after a range carries it, the peer's ranges merge."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from sokutatsu.broker.retention import AGE, BYTES, RetentionGaps
from sokutatsu.broker.segment_log import SegmentLog
from sokutatsu.broker.v1 import broker_pb2


def test_a_kept_message_between_discards_splits_the_ranges() -> None:
    """Messages 1..10 queued in order; 4-5 are kept (read back for delivery) while 1-3 and 6-8
    were discarded: two ranges, neither covering a kept one, each told by the message after it."""
    gaps = RetentionGaps()
    for seq in (1, 2, 3):
        gaps.note("p", seq, seq - 1, BYTES)
    for seq in (6, 7, 8):
        gaps.note("p", seq, seq - 1, AGE)
    assert [(g.first_seq, g.last_seq, g.over_bytes, g.over_age) for g in gaps.gaps["p"]] == [(1, 3, 3, 0), (6, 8, 0, 3)]
    assert [gaps.covers("p", seq) for seq in (3, 4, 5, 6)] == [True, False, False, True]
    assert [gaps.element_tail("p", prev) != b"" for prev in (3, 4, 8)] == [True, False, True]
    told = broker_pb2.Message.FromString(b"\x08\x01" + gaps.element_tail("p", 8)).retention_gap
    assert (told.first_seq, told.last_seq, told.over_age) == (6, 8, 3)
    gaps.acked({"p": 5})
    assert [(g.first_seq, g.last_seq) for g in gaps.gaps["p"]] == [(6, 8)]
    gaps.acked({"p": 9})
    assert gaps.gaps == {}
    assert (gaps.dropped_bytes, gaps.dropped_age) == (3, 3)


@given(st.lists(st.booleans(), min_size=1, max_size=200))
def test_ranges_cover_exactly_the_discarded_messages(discarded: list[bool]) -> None:
    """Any pattern of discards over a run of messages: covers() is true of exactly the discarded
    ones, and the tail goes exactly on each kept message that follows a discarded one."""
    gaps = RetentionGaps()
    for index, dropped in enumerate(discarded):
        if dropped:
            gaps.note("p", index + 1, index, BYTES)
    for index, dropped in enumerate(discarded):
        assert gaps.covers("p", index + 1) == dropped
        if not dropped:
            assert (gaps.element_tail("p", index) != b"") == (index > 0 and discarded[index - 1])
    peer = RetentionGaps()
    peer.merge(gaps.to_proto(), {})
    assert [(g.first_seq, g.last_seq) for g in peer.gaps.get("p", [])] == [
        (g.first_seq, g.last_seq) for g in gaps.gaps.get("p", [])
    ]


def _told(gaps: RetentionGaps, prev: int, received: int) -> tuple[int, int, int, int]:
    told = broker_pb2.Message.FromString(b"\x08\x01" + gaps.element_tail("p", prev, received)).retention_gap
    return told.first_seq, told.last_seq, told.over_bytes, told.over_age


def _peer(first: int, last: int, over_bytes: int) -> list[broker_pb2.PublisherRetentionGap]:
    gap = broker_pb2.RetentionGap(first_seq=first, last_seq=last, over_bytes=over_bytes)
    return [broker_pb2.PublisherRetentionGap(publisher_id="p", gap=gap)]


def test_a_copys_own_discards_and_its_peers_are_one_range_counted_once() -> None:
    """A shadow copy holding the subscriber's unacknowledged window (1..10, delivered by the peer)
    discards the oldest on its disk while the peer's ranges (from 11: the peer had sent 1..10)
    arrive (the sequence a pair test logged): one range, each message counted once, told from
    after what the moved subscriber received. It was two overlapping ranges, the later one told
    alone (a gap without a reason before it) or a count over messages the subscriber had."""
    gaps = RetentionGaps()
    for seq in range(1, 249):
        gaps.note("p", seq, seq - 1, BYTES)
    gaps.merge(_peer(11, 310, 300), {})
    for seq in range(301, 373):  # read back from disk after the merge: mostly covered already
        gaps.note("p", seq, seq - 1, BYTES)
    gaps.merge(_peer(11, 868, 858), {})
    for seq in range(751, 882):
        gaps.note("p", seq, seq - 1, BYTES)
    assert [(g.first_seq, g.last_seq, g.over_bytes, g.over_age) for g in gaps.gaps["p"]] == [(1, 881, 881, 0)]
    assert _told(gaps, 881, 10) == (11, 881, 871, 0)
    assert _told(gaps, 881, 0) == (1, 881, 881, 0)


def test_a_gap_counts_only_what_the_stream_lacks() -> None:
    """Told to a stream that received up to a number inside the range: from the next number, and
    only those after it; a range with numbers never discarded between (a filtered subscription)
    cannot be split and is told whole."""
    gaps = RetentionGaps()
    for seq in range(1, 21):
        gaps.note("p", seq, seq - 1, AGE)
    assert _told(gaps, 20, 10) == (11, 20, 0, 10)
    assert _told(gaps, 20, 20) == (1, 20, 0, 20)  # nothing after it: the subscriber drops it
    sparse = RetentionGaps()
    for seq, prev in ((2, 0), (4, 2), (6, 4)):
        sparse.note("p", seq, prev, BYTES)
    assert _told(sparse, 6, 3) == (2, 6, 3, 0)


def _record(seq: int, published_ns: int) -> bytes:
    return broker_pb2.Message(
        publisher_id="p", publisher_seq=seq, publish_time_unix_nano=published_ns
    ).SerializeToString()


def test_discard_while_leaves_the_first_young_record_unread(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path / "q", segment_bytes=64)
    log.append([_record(seq, seq) for seq in range(1, 11)])
    gone = log.discard_while(lambda r: broker_pb2.Message.FromString(r).publish_time_unix_nano < 6, 100)
    assert [broker_pb2.Message.FromString(r).publisher_seq for r in gone] == [1, 2, 3, 4, 5]
    assert log.unread_count == 5
    assert [broker_pb2.Message.FromString(r).publisher_seq for _, r in log.read(10, 1 << 20)] == [6, 7, 8, 9, 10]
    log.close()


def test_discard_oldest_frees_whole_segments_down_to_the_target(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path / "q", segment_bytes=256)
    log.append([_record(seq, 0) for seq in range(1, 101)])
    before = log.disk_bytes
    gone = log.discard_oldest(before // 2)
    assert log.disk_bytes <= before // 2
    assert [broker_pb2.Message.FromString(r).publisher_seq for r in gone] == list(range(1, len(gone) + 1))
    rest = [broker_pb2.Message.FromString(r).publisher_seq for _, r in log.read(1000, 1 << 20)]
    assert rest == list(range(len(gone) + 1, 101))
    log.close()

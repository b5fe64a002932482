"""SegmentLog: the Flow-to-Disk spill log, on real files (no mocks)."""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sokutatsu.broker.segment_log import SegmentLog, SegmentLogError

ROOT = Path(__file__).resolve().parents[2]

RECORD = 28  # bytes on disk of a 20-byte payload: 4 length + 4 CRC + 20
SMALL_SEGMENT = 100  # holds 3 records of RECORD bytes


def rec(i: int, size: int = 20) -> bytes:
    """A recognisable payload of `size` bytes (size >= 9)."""
    return f"{i:08d}:".encode().ljust(size, b"x")


def name(segment_id: int) -> str:
    return f"{segment_id:020d}.seg"


def seg_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.glob("*.seg"))}


def read_all(log: SegmentLog) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    while batch := log.read(1000, 1 << 30):
        out.extend(batch)
    return out


def encoded(payload: bytes) -> bytes:
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


OpenLog = Callable[..., SegmentLog]


@pytest.fixture
def open_log() -> Iterator[OpenLog]:
    """SegmentLog(...), closed at teardown."""
    opened: list[SegmentLog] = []

    def open_(folder: Path, segment_bytes: int = SMALL_SEGMENT) -> SegmentLog:
        log = SegmentLog(folder, segment_bytes)
        opened.append(log)
        return log

    yield open_
    for log in opened:
        log.close()


def filled(open_log: OpenLog, folder: Path, count: int) -> SegmentLog:
    """An open log holding rec(0) .. rec(count - 1), three records per segment."""
    log = open_log(folder)
    log.append([rec(i) for i in range(count)])
    return log


# ----------------------------------------------------------------- round trip --


def test_round_trip_in_order_across_segment_rolls(tmp_path: Path, open_log: OpenLog) -> None:
    folder = tmp_path / "nested" / "log"
    log = open_log(folder)
    assert folder.is_dir()
    assert seg_files(folder) == {}
    assert (log.unread_count, log.unread_bytes, log.disk_bytes) == (0, 0, 0)

    n = 0
    for size in (1, 7, 2, 5, 3, 3, 1, 6, 4, 8, 10):  # 50 records, batches crossing segment ends
        log.append([rec(i) for i in range(n, n + size)])
        n += size
    assert n == 50
    assert log.unread_count == 50
    assert log.unread_bytes == 50 * 20
    assert log.disk_bytes == 50 * RECORD

    files = seg_files(folder)
    assert list(files) == [name(i) for i in range(1, 18)]  # 3 records per segment, 17 segments
    assert set(files.values()) == {3 * RECORD, 2 * RECORD}
    assert files[name(17)] == 2 * RECORD
    assert sum(files.values()) == log.disk_bytes

    got: list[tuple[int, bytes]] = []
    while batch := log.read(4, 1 << 20):
        assert len(batch) <= 4
        got.extend(batch)
        assert log.unread_count == 50 - len(got)
        assert log.unread_bytes == 20 * (50 - len(got))
    assert got == [(i // 3 + 1, rec(i)) for i in range(50)]
    assert log.read(10, 1000) == []

    # Appends after everything was read are read next.
    log.append([rec(50)])
    assert log.read(10, 1000) == [(17, rec(50))]


def test_oversized_record_goes_alone_in_its_segment(tmp_path: Path, open_log: OpenLog) -> None:
    log = open_log(tmp_path)
    big = rec(1, 500)
    log.append([rec(0), big, rec(2)])
    assert seg_files(tmp_path) == {name(1): RECORD, name(2): 508, name(3): RECORD}
    log.append([rec(3, 1000)])
    assert seg_files(tmp_path)[name(4)] == 1008
    assert read_all(log) == [(1, rec(0)), (2, big), (3, rec(2)), (4, rec(3, 1000))]


def test_record_exactly_filling_a_segment_stays_in_it(tmp_path: Path, open_log: OpenLog) -> None:
    log = open_log(tmp_path, segment_bytes=2 * RECORD)
    log.append([rec(0), rec(1), rec(2)])
    assert seg_files(tmp_path) == {name(1): 2 * RECORD, name(2): RECORD}


def test_append_validates_the_whole_batch_before_writing(tmp_path: Path, open_log: OpenLog) -> None:
    log = open_log(tmp_path)
    log.append([])
    assert seg_files(tmp_path) == {}
    with pytest.raises(ValueError, match="non-empty"):
        log.append([rec(0), b"", rec(1)])
    assert seg_files(tmp_path) == {}
    assert log.unread_count == 0
    log.append([rec(0)])
    assert read_all(log) == [(1, rec(0))]


# ---------------------------------------------------------------- read limits --


def test_read_limits(tmp_path: Path, open_log: OpenLog) -> None:
    log = open_log(tmp_path, segment_bytes=1 << 20)
    assert log.read(10, 1000) == []
    payloads = [rec(0, 10), rec(1, 10), rec(2, 10), rec(3, 300), rec(4, 10), rec(5, 10)]
    log.append(payloads)

    assert log.read(0, 1000) == []
    assert log.read(2, 1000) == [(1, payloads[0]), (1, payloads[1])]  # max_records
    # max_bytes: 10 fits, 10 + 300 does not.
    assert log.read(10, 305) == [(1, payloads[2])]
    # A record alone over max_bytes still comes, alone.
    assert log.read(10, 5) == [(1, payloads[3])]
    # Exactly max_bytes is allowed.
    assert log.read(10, 20) == [(1, payloads[4]), (1, payloads[5])]
    assert log.read(10, 1000) == []
    assert (log.unread_count, log.unread_bytes) == (0, 0)


def test_read_crosses_into_the_next_segment(tmp_path: Path, open_log: OpenLog) -> None:
    log = filled(open_log, tmp_path, 7)
    assert log.read(5, 1000) == [(1, rec(0)), (1, rec(1)), (1, rec(2)), (2, rec(3)), (2, rec(4))]
    assert log.read(5, 1000) == [(2, rec(5)), (3, rec(6))]


# ------------------------------------------------------------------------ ack --


def test_ack_deletes_only_fully_read_fully_acked_non_current_segments(tmp_path: Path, open_log: OpenLog) -> None:
    log = filled(open_log, tmp_path, 8)  # segments 1: 0-2, 2: 3-5, 3: 6-7 (current)
    assert list(seg_files(tmp_path)) == [name(1), name(2), name(3)]

    assert [s for s, _ in log.read(4, 1000)] == [1, 1, 1, 2]
    log.ack(1, 2)
    assert name(1) in seg_files(tmp_path)  # one record of segment 1 not acked yet
    log.ack(2, 1)
    assert name(2) in seg_files(tmp_path)  # segment 2 not fully read
    log.ack(1, 1)
    assert list(seg_files(tmp_path)) == [name(2), name(3)]
    assert log.disk_bytes == 5 * RECORD

    assert [s for s, _ in log.read(10, 1000)] == [2, 2, 3, 3]
    log.ack(3, 2)  # fully read and acked, but current: kept
    assert list(seg_files(tmp_path)) == [name(2), name(3)]
    log.ack(2, 2)
    assert list(seg_files(tmp_path)) == [name(3)]

    log.append([rec(8)])  # fits in segment 3: still current
    assert list(seg_files(tmp_path)) == [name(3)]
    assert log.read(10, 1000) == [(3, rec(8))]
    log.ack(3, 1)
    log.append([rec(9)])  # rolls: segment 3 is no longer current and goes
    assert seg_files(tmp_path) == {name(4): RECORD}
    assert log.disk_bytes == RECORD
    assert log.read(10, 1000) == [(4, rec(9))]


def test_acks_may_come_out_of_segment_order(tmp_path: Path, open_log: OpenLog) -> None:
    log = filled(open_log, tmp_path, 9)
    read_all(log)
    log.ack(2, 3)
    assert list(seg_files(tmp_path)) == [name(1), name(3)]
    log.ack(1, 3)
    assert list(seg_files(tmp_path)) == [name(3)]


def test_ack_rejects_unknown_segments_and_more_than_was_read(tmp_path: Path, open_log: OpenLog) -> None:
    log = filled(open_log, tmp_path, 6)
    log.read(2, 1000)
    with pytest.raises(ValueError, match="cannot ack 3 more"):
        log.ack(1, 3)
    with pytest.raises(ValueError, match="cannot ack 1 more"):
        log.ack(2, 1)
    with pytest.raises(ValueError, match="cannot ack -1 more"):
        log.ack(1, -1)
    with pytest.raises(ValueError, match="no segment 9"):
        log.ack(9, 1)
    log.ack(1, 0)
    log.ack(1, 2)
    log.read(1, 1000)
    log.ack(1, 1)
    with pytest.raises(ValueError, match="no segment 1"):
        log.ack(1, 1)


# --------------------------------------------------------------------- reopen --


def test_reopen_returns_every_record_not_in_a_deleted_segment(tmp_path: Path, open_log: OpenLog) -> None:
    log = filled(open_log, tmp_path, 10)  # segments 1: 0-2, 2: 3-5, 3: 6-8, 4: 9
    log.read(7, 1000)
    log.ack(1, 3)  # segment 1 deleted
    log.ack(2, 2)  # acked but segment 2 survives: they come back
    log.close()
    log.close()  # idempotent

    log = open_log(tmp_path)
    assert log.unread_count == 7
    assert log.unread_bytes == 7 * 20
    assert log.disk_bytes == 7 * RECORD
    expected = [(2, rec(3)), (2, rec(4)), (2, rec(5)), (3, rec(6)), (3, rec(7)), (3, rec(8)), (4, rec(9))]
    assert read_all(log) == expected
    # Acks are about what this instance read.
    log.ack(2, 3)
    assert name(2) not in seg_files(tmp_path)
    # The last segment stays current: new records continue it.
    log.append([rec(10), rec(11)])
    assert list(seg_files(tmp_path)) == [name(3), name(4)]
    log.close()

    log = open_log(tmp_path)
    assert read_all(log) == [*expected[3:], (4, rec(10)), (4, rec(11))]


def test_reopen_of_a_log_never_written(tmp_path: Path, open_log: OpenLog) -> None:
    open_log(tmp_path).close()
    log = open_log(tmp_path)
    assert (log.unread_count, log.disk_bytes) == (0, 0)
    log.append([rec(0)])
    assert read_all(log) == [(1, rec(0))]


def test_reopen_ignores_other_files(tmp_path: Path, open_log: OpenLog) -> None:
    filled(open_log, tmp_path, 2).close()
    (tmp_path / "notes.txt").write_text("not a segment")
    (tmp_path / "1.seg").write_bytes(b"garbage")
    log = open_log(tmp_path)
    assert read_all(log) == [(1, rec(0)), (1, rec(1))]


def test_reopen_deletes_empty_segments_before_the_last(tmp_path: Path, open_log: OpenLog) -> None:
    filled(open_log, tmp_path, 4).close()
    (tmp_path / name(1)).write_bytes(b"")
    log = open_log(tmp_path)
    assert list(seg_files(tmp_path)) == [name(2)]
    assert read_all(log) == [(2, rec(3))]


def test_an_empty_last_segment_is_current(tmp_path: Path, open_log: OpenLog) -> None:
    filled(open_log, tmp_path, 3).close()
    (tmp_path / name(2)).write_bytes(b"")  # crash right after a roll created the file
    log = open_log(tmp_path)
    assert log.unread_count == 3
    log.append([rec(3)])
    assert seg_files(tmp_path) == {name(1): 3 * RECORD, name(2): RECORD}
    assert [s for s, _ in read_all(log)] == [1, 1, 1, 2]


# ------------------------------------------------------------------ torn tails --


@pytest.mark.parametrize("cut", [1, 5, RECORD - 9, RECORD - 1], ids=["header", "crc", "payload", "last-byte"])
def test_torn_last_record_is_truncated(
    tmp_path: Path, open_log: OpenLog, cut: int, caplog: pytest.LogCaptureFixture
) -> None:
    filled(open_log, tmp_path, 8).close()  # segment 3 holds 6, 7
    last = tmp_path / name(3)
    os.truncate(last, RECORD + cut)

    with caplog.at_level(logging.WARNING):
        log = open_log(tmp_path)
    assert "torn tail" in caplog.text
    assert last.stat().st_size == RECORD
    assert log.disk_bytes == 7 * RECORD
    assert log.unread_count == 7
    assert read_all(log) == [(i // 3 + 1, rec(i)) for i in range(7)]
    log.append([rec(100), rec(101)])
    log.close()

    log = open_log(tmp_path)
    assert [p for _, p in read_all(log)] == [*(rec(i) for i in range(7)), rec(100), rec(101)]


def test_recovery_shows_each_surviving_record_once_in_order(tmp_path: Path) -> None:
    """``on_record`` (how a restarted broker learns which numbers its queue holds, pair_state.py
    invariant 7) sees the records recovery keeps, oldest first, and not the torn one."""
    log = SegmentLog(tmp_path, SMALL_SEGMENT)
    log.append([rec(i) for i in range(8)])
    log.close()
    os.truncate(tmp_path / name(3), RECORD + 5)  # segment 3 held 6, 7: 7 is torn
    seen: list[bytes] = []
    log = SegmentLog(tmp_path, SMALL_SEGMENT, lambda payload: seen.append(bytes(payload)))
    try:
        assert seen == [rec(i) for i in range(7)]
        assert [p for _, p in read_all(log)] == seen
    finally:
        log.close()


GARBAGE = {
    "random": bytes(range(7, 200, 3)),
    "zeroes": bytes(64),
    "huge-length": struct.pack("<II", 0xFFFFFFFF, 0) + b"abc",
    "bad-crc": struct.pack("<II", 5, zlib.crc32(b"hello") ^ 1) + b"hello",
    "short-header": b"\x05\x00",
}


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_after_the_last_record_is_truncated(tmp_path: Path, open_log: OpenLog, garbage: bytes) -> None:
    filled(open_log, tmp_path, 8).close()
    last = tmp_path / name(3)
    with last.open("ab") as f:
        f.write(garbage)
    log = open_log(tmp_path)
    assert last.stat().st_size == 2 * RECORD
    assert read_all(log) == [(i // 3 + 1, rec(i)) for i in range(8)]
    log.append([rec(8)])
    log.close()
    assert [p for _, p in read_all(open_log(tmp_path))] == [rec(i) for i in range(9)]


def test_corrupt_record_in_the_last_segment_cuts_it_there(tmp_path: Path, open_log: OpenLog) -> None:
    filled(open_log, tmp_path, 9).close()  # segment 3: 6, 7, 8
    last = tmp_path / name(3)
    data = bytearray(last.read_bytes())
    data[RECORD + 12] ^= 0xFF  # inside the payload of 7
    last.write_bytes(bytes(data))
    log = open_log(tmp_path)
    assert last.stat().st_size == RECORD
    assert [p for _, p in read_all(log)] == [rec(i) for i in range(7)]


def test_valid_records_after_a_torn_one_are_dropped(tmp_path: Path, open_log: OpenLog) -> None:
    """A valid-looking record after a torn one is still dropped: the cut is at the first bad record."""
    filled(open_log, tmp_path, 2).close()
    seg = tmp_path / name(1)
    with seg.open("ab") as f:
        f.write(encoded(rec(2))[:-3] + encoded(rec(3)))
    log = open_log(tmp_path)
    assert seg.stat().st_size == 2 * RECORD
    assert [p for _, p in read_all(log)] == [rec(0), rec(1)]


# ------------------------------------------------------ corruption before the tail --


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[RECORD + 10] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate_mid_record(path: Path) -> None:
    os.truncate(path, RECORD + 5)


def _append_garbage(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\x00\x00\x00\x00junk")


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate_mid_record, _append_garbage])
@pytest.mark.parametrize("segment_id", [1, 2])
def test_corruption_in_an_earlier_segment_raises(
    tmp_path: Path, open_log: OpenLog, damage: Callable[[Path], None], segment_id: int
) -> None:
    filled(open_log, tmp_path, 8).close()
    damage(tmp_path / name(segment_id))
    before = seg_files(tmp_path)
    with pytest.raises(SegmentLogError) as caught:
        SegmentLog(tmp_path, SMALL_SEGMENT)
    message = str(caught.value)
    assert name(segment_id) in message
    assert "corrupt record" in message
    assert "\n" not in message
    assert seg_files(tmp_path) == before  # nothing repaired or deleted
    # The failed open released the folder: a repaired folder opens.
    (tmp_path / name(segment_id)).unlink()
    open_log(tmp_path).close()


def test_corruption_after_open_is_caught_by_read(tmp_path: Path, open_log: OpenLog) -> None:
    log = filled(open_log, tmp_path, 6)
    _flip_payload_byte(tmp_path / name(2))
    assert [p for _, p in log.read(4, 1000)] == [rec(i) for i in range(4)]
    with pytest.raises(SegmentLogError, match=name(2)):
        log.read(4, 1000)


# ------------------------------------------------------------------ lifecycle --


def test_second_open_of_a_folder_is_refused(tmp_path: Path, open_log: OpenLog) -> None:
    log = open_log(tmp_path)
    with pytest.raises(SegmentLogError, match="already open"):
        SegmentLog(tmp_path)
    log.close()
    open_log(tmp_path)


def test_closed_log_refuses_calls(tmp_path: Path, open_log: OpenLog) -> None:
    log = filled(open_log, tmp_path, 2)
    log.close()
    log.close()
    for call in (lambda: log.append([b"x"]), lambda: log.read(1, 1), lambda: log.ack(1, 0)):
        with pytest.raises(SegmentLogError, match="closed"):
            call()
    assert log.unread_count == 2


def test_destroy_deletes_the_folder(tmp_path: Path, open_log: OpenLog) -> None:
    folder = tmp_path / "log"
    log = filled(open_log, folder, 5)
    (folder / "other").write_text("x")
    log.destroy()
    assert not folder.exists()
    assert (log.unread_count, log.disk_bytes) == (0, 0)
    log.destroy()  # nothing left: no error
    log.close()
    with pytest.raises(SegmentLogError, match="closed"):
        log.read(1, 1)


def test_folder_that_is_a_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(SegmentLogError, match="file"):
        SegmentLog(path)


def test_segment_bytes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="segment_bytes"):
        SegmentLog(tmp_path, 0)


# ------------------------------------------------------------- failed appends --

FAILING_APPENDS = """
import os, resource, signal, sys
from pathlib import Path
from sokutatsu.broker.segment_log import SegmentLog, SegmentLogError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # writes past 1000 bytes fail with EFBIG
folder = Path(sys.argv[1])
r = b"r" * 100  # 108 bytes on disk

def files():
    return {p.name[-5:]: p.stat().st_size for p in sorted(folder.glob("*.seg"))}

def failing(records):
    try:
        log.append(records)
    except SegmentLogError as error:
        assert "append failed" in str(error), error
    else:
        raise AssertionError("append did not fail")

# A write cut short in the current segment.
log = SegmentLog(folder, segment_bytes=10_000)
log.append([r] * 9)
failing([r, r])
assert files() == {"1.seg": 972}, files()
assert (log.unread_count, log.disk_bytes) == (9, 972)
log.append([b"y" * 10])
assert [p for _, p in log.read(100, 1 << 20)] == [r] * 9 + [b"y" * 10]
log.close()

# A batch that rolls into a new segment and fails there: its part in the old segment goes too.
log = SegmentLog(folder, segment_bytes=1000)
failing([b"z", b"b" * 1200])
assert files() == {"1.seg": 990}, files()
assert (log.unread_count, log.disk_bytes) == (10, 990)
log.append([b"s" * 900])  # rolls into segment 2
assert files() == {"1.seg": 990, "2.seg": 908}, files()
assert [p for _, p in log.read(100, 1 << 20)] == [r] * 9 + [b"y" * 10, b"s" * 900]
log.close()
print("ok")
"""


def test_failed_append_is_undone_and_the_log_stays_usable(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", FAILING_APPENDS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


# ---------------------------------------------------------------------- crash --


def crash_record(i: int) -> bytes:
    """Record i of the crash test (shared with the child through inspect.getsource)."""
    return b"%d:" % i + bytes([i % 251]) * (i * 37 % 3000)


def crash_batch(n: int) -> int:
    """Size of the batch that starts at record n."""
    return 1 + n % 13


CRASH_CHILD = "\n".join(
    [
        "import sys",
        "from pathlib import Path",
        "from sokutatsu.broker.segment_log import SegmentLog",
        inspect.getsource(crash_record),
        inspect.getsource(crash_batch),
        textwrap.dedent(
            """
            log = SegmentLog(Path(sys.argv[1]), segment_bytes=int(sys.argv[2]))
            n = 0
            while True:
                size = crash_batch(n)
                log.append([crash_record(i) for i in range(n, n + size)])
                n += size
                print(n, flush=True)
            """
        ),
    ]
)


@pytest.mark.parametrize(("lines", "segment_bytes"), [(30, 64 * 1024), (150, 16 * 1024), (400, 256 * 1024)])
def test_kill_9_loses_no_appended_record(tmp_path: Path, open_log: OpenLog, lines: int, segment_bytes: int) -> None:
    folder = tmp_path / "log"
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, str(folder), str(segment_bytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert child.stdout is not None
    assert child.stderr is not None
    seen: list[str] = []
    try:
        for _ in range(lines):
            seen.append(child.stdout.readline())
            assert seen[-1], f"child stopped early: {child.stderr.read()}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    seen.append(child.stdout.read())  # printed before the kill but not read yet
    child.stdout.close()
    child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    complete_lines = "".join(seen).split("\n")[:-1]  # what follows the last newline may be cut short
    reported = int(complete_lines[-1])
    assert reported >= lines

    log = open_log(folder, segment_bytes)
    got = [payload for _, payload in read_all(log)]
    assert len(got) >= reported
    assert got[:reported] == [crash_record(i) for i in range(reported)]
    extra = got[reported:]  # from the append that was running when the kill came, never reported
    assert len(extra) <= crash_batch(reported)
    assert extra == [crash_record(i) for i in range(reported, reported + len(extra))]
    assert log.disk_bytes == sum(seg_files(folder).values())

    # The recovered log takes new records after the survivors.
    log.append([b"after"])
    log.close()
    assert [p for _, p in read_all(open_log(folder, segment_bytes))][-2:] == [got[-1], b"after"]


# ---------------------------------------------------------- property: model --


@dataclass
class ModelSegment:
    id: int
    records: list[bytes] = field(default_factory=list)
    size: int = 0
    read: int = 0
    acked: int = 0


@settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
class SegmentLogMachine(RuleBasedStateMachine):
    """Random append / read / ack / reopen against a list-of-segments model."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="segment-log-"))
        self.folder = self.tmp / "log"
        self.segment_bytes = SMALL_SEGMENT
        self.log: SegmentLog | None = None
        self.model: list[ModelSegment] = []

    def teardown(self) -> None:
        if self.log is not None:
            self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def opened(self) -> SegmentLog:
        assert self.log is not None
        return self.log

    @initialize(segment_bytes=st.sampled_from([1, 30, 64, 200, 1 << 20]))
    def open_log(self, segment_bytes: int) -> None:
        self.segment_bytes = segment_bytes
        self.log = SegmentLog(self.folder, segment_bytes)

    def _delete_if_done(self, segment: ModelSegment) -> None:
        if segment is not self.model[-1] and segment.read == segment.acked == len(segment.records):
            self.model.remove(segment)

    @rule(batch=st.lists(st.binary(min_size=1, max_size=70), max_size=6))
    def append(self, batch: list[bytes]) -> None:
        self.opened.append(batch)
        for payload in batch:
            need = 8 + len(payload)
            current = self.model[-1] if self.model else None
            if current is None or (current.size > 0 and current.size + need > self.segment_bytes):
                new = ModelSegment(current.id + 1 if current else 1)
                self.model.append(new)
                if current is not None:
                    self._delete_if_done(current)
                current = new
            current.records.append(payload)
            current.size += need

    @rule(max_records=st.integers(0, 8), max_bytes=st.integers(0, 150))
    def read(self, max_records: int, max_bytes: int) -> None:
        expected: list[tuple[int, bytes]] = []
        total = 0
        unread = [(s, s.records[i]) for s in self.model for i in range(s.read, len(s.records))]
        for segment, payload in unread:
            if len(expected) == max_records or (expected and total + len(payload) > max_bytes):
                break
            expected.append((segment.id, payload))
            total += len(payload)
            segment.read += 1
        assert self.opened.read(max_records, max_bytes) == expected

    @precondition(lambda self: any(s.read > s.acked for s in self.model))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        segment = data.draw(st.sampled_from([s for s in self.model if s.read > s.acked]))
        count = data.draw(st.integers(1, segment.read - segment.acked))
        self.opened.ack(segment.id, count)
        segment.acked += count
        self._delete_if_done(segment)

    @rule()
    def reopen(self) -> None:
        self.opened.close()
        self.log = SegmentLog(self.folder, self.segment_bytes)
        for segment in self.model:
            segment.read = segment.acked = 0

    @invariant()
    def matches_model(self) -> None:
        if self.log is None:
            return
        assert self.log.unread_count == sum(len(s.records) - s.read for s in self.model)
        assert self.log.unread_bytes == sum(sum(map(len, s.records[s.read :])) for s in self.model)
        assert self.log.disk_bytes == sum(s.size for s in self.model)
        assert seg_files(self.folder) == {name(s.id): s.size for s in self.model}


test_segment_log_against_model = SegmentLogMachine.TestCase

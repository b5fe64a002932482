"""Flow-to-Disk spill log: an append-only, crash-safe log of opaque records in segment files.

A subscriber queue that outgrows its memory budget appends its oldest messages here and reads them
back, in order, when it has room again. Every method is called from one worker thread (never from the
asyncio event loop): the class holds no locks and does blocking file I/O.

On-disk format
==============

The log is one folder. Its records live in *segment files* named after a 20-digit, zero-padded,
increasing id (``00000000000000000001.seg``, ``00000000000000000002.seg``, ...); a segment with a
higher id holds later records. Other names in the folder are ignored. A segment file is a plain
concatenation of records, with no file header::

    +-----------------------+-------------------------------+--------------------+
    | length: u32 LE (4 B)  | crc32(payload): u32 LE (4 B)  | payload (length B) |
    +-----------------------+-------------------------------+--------------------+

``length`` is never 0 (payloads are non-empty) and the checksum is :func:`zlib.crc32` of the payload.
New records go to the last segment (the *current* one). When a record would take it past
``segment_bytes`` (headers included), the log *rolls*: it creates the segment with the next id and
writes there instead; a record bigger than ``segment_bytes`` therefore sits alone in its segment.
Nothing else is stored: which records were read or acknowledged is kept in memory only.

Crash safety
============

``append`` writes its records with ``pwrite`` at the known end of the current segment and calls
``fdatasync`` before returning. When the batch rolls into a new segment, the part written to the old
segment is synced *before* the new file is created, and the folder is fsynced after each creation, so
at any instant every segment but the last is complete and durable. Therefore, after ``kill -9`` (or a
power cut, given a file system that honours fsync):

* every record of every ``append`` that returned is on disk, in order;
* only the last segment can end in a torn write: a record cut short, or garbage such as zeroes from
  a half-extended file. Every record carries its length and checksum, and a zero length is never
  valid, so recovery scans the last segment and truncates it at the first record that is incomplete
  or fails its checksum. Everything before that point was written by completed ``pwrite`` calls;
* a bad record in any *earlier* segment cannot come from a crash, so it is reported as
  :class:`SegmentLogError` instead of being silently dropped.

An ``append`` that did not return may have left a prefix of its batch on disk: those records survive
recovery like any other. The same holds for an ``append`` that raised, if the process dies before the
next ``append`` (its rollback truncation is not synced on its own).

Deleting a fully acknowledged segment does not fsync the folder: after a power cut (never after
``kill -9``) a deleted segment may come back, and its records are delivered again. Delivery is thus
at-least-once across a reopen: recovery makes every surviving record unread again, including records
that were read, and even acknowledged, in a segment that had not been deleted yet.

While open, the folder is locked with ``flock`` so a second :class:`SegmentLog` (in this process or
another) cannot write into it; the kernel drops the lock when the process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import struct
import sys
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SegmentLog", "SegmentLogError"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
HEADER_BYTES = _HEADER.size
"""Bytes before each payload: 4 of length, 4 of CRC32."""
MAX_PAYLOAD = 2**32 - 1
"""Largest payload the 4-byte length can describe."""
_NAME = re.compile(r"(\d{20})\.seg")
_READ_CHUNK = 1 << 20  # bytes fetched per pread when reading or recovering

if sys.platform == "linux":
    _datasync = os.fdatasync
else:  # pragma: no cover - the broker runs on Linux
    _datasync = os.fsync


class SegmentLogError(Exception):
    """The log cannot be used: corruption beyond a torn tail, an unreadable folder, a failed write, ...

    The message is one line and names the file or folder concerned.
    """


def segment_name(segment_id: int) -> str:
    """File name of a segment: the id zero-padded to 20 digits, then ``.seg``."""
    return f"{segment_id:020d}.seg"


@dataclass(eq=False)
class _Segment:
    id: int
    path: Path
    size: int = 0  # bytes of whole, valid records (the file may be longer only during an append)
    records: int = 0
    payload_bytes: int = 0
    read: int = 0  # records handed out by read()
    acked: int = 0  # of those, how many were acknowledged


@dataclass(eq=False)
class _Part:
    """Records of one append that go to one segment."""

    segment: _Segment
    new: bool
    records: list[bytes] = field(default_factory=list)
    data: bytes = b""


class _BadRecord(Exception):
    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            raise _BadRecord(offset + got, "file ends early")
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _encode(records: Sequence[bytes]) -> bytes:
    pieces: list[bytes] = []
    for payload in records:
        pieces.append(_HEADER.pack(len(payload), zlib.crc32(payload)))
        pieces.append(payload)
    return b"".join(pieces)


def _error_text(error: OSError) -> str:
    return error.strerror or str(error)


class _RecordReader:
    """Sequential reader of one segment file through a buffer refilled with ``pread``.

    It never reads past the ``end`` it is given (the log's own idea of where valid records stop), so
    a buffer can never hold bytes that a later write replaces.
    """

    def __init__(self, fd: int, segment: _Segment | None = None) -> None:
        self.fd = fd
        self.segment = segment
        self.offset = 0  # file offset of the next record
        self._buffer = b""
        self._buffer_offset = 0  # file offset of self._buffer[0]

    def _window(self, size: int, end: int) -> int:
        """Make ``size`` bytes from ``offset`` available in the buffer; return their index in it."""
        index = self.offset - self._buffer_offset
        if index >= 0 and index + size <= len(self._buffer):
            return index
        available = end - self.offset
        if size > available:
            raise _BadRecord(self.offset, f"record needs {size} bytes, only {available} follow")
        self._buffer = _pread_exact(self.fd, min(max(size, _READ_CHUNK), available), self.offset)
        self._buffer_offset = self.offset
        return 0

    def peek_length(self, end: int) -> int:
        """Payload length of the next record (checked to be non-zero and to fit before ``end``)."""
        index = self._window(HEADER_BYTES, end)
        length: int = _HEADER.unpack_from(self._buffer, index)[0]
        if length == 0:
            raise _BadRecord(self.offset, "zero length")
        if self.offset + HEADER_BYTES + length > end:
            raise _BadRecord(self.offset, f"length {length} runs past the end ({end})")
        return length

    def next(self, end: int) -> memoryview:
        """Payload of the next record, checksum verified; advances past it."""
        length = self.peek_length(end)
        index = self._window(HEADER_BYTES + length, end)
        crc: int = _HEADER.unpack_from(self._buffer, index)[1]
        payload = memoryview(self._buffer)[index + HEADER_BYTES : index + HEADER_BYTES + length]
        if zlib.crc32(payload) != crc:
            raise _BadRecord(self.offset, "checksum mismatch")
        self.offset += HEADER_BYTES + length
        return payload

    def close(self) -> None:
        self._buffer = b""
        with contextlib.suppress(OSError):
            os.close(self.fd)


class SegmentLog:
    """The spill log of one subscriber queue, in one folder (see the module docstring for the format).

    Records come back from :meth:`read` in append order as ``(segment_id, payload)``; the owner
    acknowledges them per segment with :meth:`ack`, and a segment file is deleted once it is not the
    one being written, has been read to its end and has all its records acknowledged. Read and
    acknowledgement state lives in memory only: after a reopen every surviving record is unread again
    and acknowledgements use the segment ids that the new :meth:`read` calls return.

    Not thread-safe: call it from one thread (never the asyncio loop, it blocks on disk I/O).
    """

    def __init__(
        self,
        folder: Path,
        segment_bytes: int = 16 * 1024 * 1024,
        on_record: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Open (creating the folder if needed) and recover.

        Existing segments are kept; a torn or corrupt tail in the LAST segment (crash mid-write) is
        truncated at the last valid record; corruption in an earlier segment raises SegmentLogError.
        After recovery every surviving record is unread (the read cursor is at the start of the oldest
        segment). New records continue the last segment. Empty segments other than the last are
        deleted. Raises SegmentLogError if the folder cannot be created or read, or is already open.
        ``on_record`` sees each surviving record's payload during recovery, oldest first (it reads
        them anyway to check them); the view is valid only during the call.
        """
        self._on_record = on_record
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be at least 1, not {segment_bytes}")
        self._folder = Path(folder)
        self._segment_bytes = segment_bytes
        self._segments: dict[int, _Segment] = {}  # every live segment, oldest first
        # Segments with unread records, oldest first, plus always the current one (last) if any.
        self._queue: deque[_Segment] = deque()
        self._current: _Segment | None = None
        self._current_fd = -1
        self._reader: _RecordReader | None = None
        self._dir_fd = -1
        self._next_id = 1
        self._unread_count = 0
        self._unread_bytes = 0
        self._disk_bytes = 0
        self._broken: str | None = None  # set when a failed append could not be undone
        self._closed = False
        try:
            self._open()
        except BaseException:
            self._closed = True
            self._release()
            raise
        finally:
            self._on_record = None

    # ------------------------------------------------------------------ properties --

    @property
    def unread_count(self) -> int:
        """Records not yet returned by :meth:`read`."""
        return self._unread_count

    @property
    def unread_bytes(self) -> int:
        """Payload bytes (headers excluded) of the records not yet returned by :meth:`read`."""
        return self._unread_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of all segment files on disk (headers included)."""
        return self._disk_bytes

    # --------------------------------------------------------------------- public --

    def append(self, records: Sequence[bytes]) -> None:
        """Append records (each an opaque non-empty bytes payload) and fsync once before returning.

        Rolls to a new segment file when the current one would exceed segment_bytes (a single record
        larger than segment_bytes still goes in, alone in its segment). A batch that rolls syncs each
        segment it touches (and the folder once per new segment).

        All or nothing while the process lives: if it raises (ValueError for an empty or too large
        payload, before anything is written; SegmentLogError for a failed write or sync), none of the
        batch is readable and the files are cut back, so the log stays usable. Should that cutting
        back fail, further appends raise SegmentLogError until the log is reopened.
        """
        self._check_open()
        if self._broken is not None:
            raise SegmentLogError(f"{self._folder}: appends disabled since a failed append ({self._broken}); reopen")
        for payload in records:
            if not payload:
                raise ValueError("records must be non-empty")
            if len(payload) > MAX_PAYLOAD:
                raise ValueError(f"a record of {len(payload)} bytes is over the limit of {MAX_PAYLOAD}")
        if not records:
            return
        parts = self._plan(records)
        created: list[tuple[_Segment, int]] = []
        try:
            for part in parts:
                if part.new:
                    fd = os.open(part.segment.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    created.append((part.segment, fd))
                    _pwrite_all(fd, part.data, 0)
                    _datasync(fd)
                    os.fsync(self._dir_fd)
                else:
                    _pwrite_all(self._current_fd, part.data, part.segment.size)
                    _datasync(self._current_fd)
        except OSError as error:
            path = created[-1][0].path if created else parts[0].segment.path
            self._undo(created)
            raise SegmentLogError(f"{path}: append failed: {_error_text(error)}") from error
        except BaseException:
            self._undo(created)
            raise
        fds = iter(fd for _, fd in created)
        for part in parts:
            segment = part.segment
            segment.size += len(part.data)
            segment.records += len(part.records)
            added = sum(len(payload) for payload in part.records)
            segment.payload_bytes += added
            self._unread_count += len(part.records)
            self._unread_bytes += added
            self._disk_bytes += len(part.data)
            if part.new:
                self._become_current(segment, next(fds))

    def read(self, max_records: int, max_bytes: int) -> list[tuple[int, bytes]]:
        """Up to max_records unread records, oldest first, as (segment_id, payload).

        Returns at least one record if any is unread (even if it alone exceeds max_bytes), then more
        while their payloads stay within max_bytes in total; advances the read cursor. Returns an
        empty list when nothing is unread or max_records < 1. Checksums are verified again: a record
        that changed on disk since it was written raises SegmentLogError.
        """
        self._check_open()
        out: list[tuple[int, bytes]] = []
        total = 0
        while len(out) < max_records and self._unread_count > 0:
            segment = self._queue[0]
            reader = self._reader
            try:
                if reader is None or reader.segment is not segment:
                    self._close_reader()
                    reader = self._reader = _RecordReader(os.open(segment.path, os.O_RDONLY), segment)
                length = reader.peek_length(segment.size)
                if out and total + length > max_bytes:
                    break
                payload = bytes(reader.next(segment.size))
            except _BadRecord as bad:
                raise SegmentLogError(f"{segment.path}: corrupt record at offset {bad.offset}: {bad.reason}") from None
            except OSError as error:
                raise SegmentLogError(f"{segment.path}: cannot read: {_error_text(error)}") from error
            total += length
            segment.read += 1
            self._unread_count -= 1
            self._unread_bytes -= length
            out.append((segment.id, payload))
            if segment.read == segment.records and segment is not self._current:
                self._queue.popleft()
                self._close_reader()
        return out

    def ack(self, segment_id: int, count: int) -> None:
        """count records read from segment_id are delivered and acknowledged.

        A segment file is deleted once it is no longer the segment being written, has been fully
        read, and all its records are acked (the current segment is deleted when a later append
        rolls past it). Raises ValueError for an unknown (or already deleted) segment, or when
        count is negative or would acknowledge more records than were read from that segment.
        """
        self._check_open()
        segment = self._segments.get(segment_id)
        if segment is None:
            raise ValueError(f"{self._folder}: no segment {segment_id} (never existed or already deleted)")
        if count < 0 or segment.acked + count > segment.read:
            raise ValueError(
                f"{segment.path}: cannot ack {count} more records: {segment.read} read, {segment.acked} acked"
            )
        segment.acked += count
        self._delete_if_done(segment)

    def discard_oldest(self, target_bytes: int) -> list[bytes]:
        """Retention (drop the oldest): read and acknowledge the oldest unread records, a segment's
        worth at a time, until the segment files take at most ``target_bytes`` or nothing is unread.

        Returns their payloads, oldest first, so the owner can tell whom they were for. A segment
        goes once every record in it was read and acknowledged (as :meth:`ack` says), so records
        that were read earlier and are not acknowledged yet (in flight) keep theirs, and the one
        being written stays until the next append rolls past it.
        """
        self._check_open()
        out: list[bytes] = []
        while self._disk_bytes > target_bytes and self._unread_count > 0:
            segment = self._queue[0]
            records = self.read(max(1, segment.records - segment.read), MAX_PAYLOAD)
            counts: dict[int, int] = {}
            for segment_id, payload in records:
                counts[segment_id] = counts.get(segment_id, 0) + 1
                out.append(payload)
            for segment_id, count in counts.items():
                self.ack(segment_id, count)
        return out

    def discard_while(self, old: Callable[[bytes], bool], max_records: int) -> list[bytes]:
        """Retention by age: read and acknowledge the oldest unread records while ``old`` says so of
        each (looked at before it is taken: the first one it refuses stays unread), at most
        ``max_records``. Returns their payloads, oldest first."""
        self._check_open()
        out: list[bytes] = []
        while len(out) < max_records and self._unread_count > 0:
            segment = self._queue[0]
            reader = self._reader
            try:
                if reader is None or reader.segment is not segment:
                    self._close_reader()
                    reader = self._reader = _RecordReader(os.open(segment.path, os.O_RDONLY), segment)
                at = reader.offset
                payload = bytes(reader.next(segment.size))
            except _BadRecord as bad:
                raise SegmentLogError(f"{segment.path}: corrupt record at offset {bad.offset}: {bad.reason}") from None
            except OSError as error:
                raise SegmentLogError(f"{segment.path}: cannot read: {_error_text(error)}") from error
            reader.offset = at
            if not old(payload):
                break
            [(segment_id, taken)] = self.read(1, MAX_PAYLOAD)
            self.ack(segment_id, 1)
            out.append(taken)
        return out

    def close(self) -> None:
        """Close the file handles and release the folder lock; idempotent. Other calls then raise."""
        if not self._closed:
            self._closed = True
            self._release()

    def destroy(self) -> None:
        """Close and delete the folder and everything in it."""
        try:
            shutil.rmtree(self._folder)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise SegmentLogError(f"{self._folder}: cannot delete: {_error_text(error)}") from error
        finally:
            self.close()
            self._segments.clear()
            self._queue.clear()
            self._current = None
            self._unread_count = self._unread_bytes = self._disk_bytes = 0

    # ------------------------------------------------------------------- recovery --

    def _open(self) -> None:
        try:
            self._folder.mkdir(parents=True, exist_ok=True)
            self._dir_fd = os.open(self._folder, os.O_RDONLY | os.O_DIRECTORY)
            names = os.listdir(self._dir_fd)
        except OSError as error:
            raise SegmentLogError(f"{self._folder}: cannot open folder: {_error_text(error)}") from error
        try:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SegmentLogError(f"{self._folder}: already open by another SegmentLog") from None
        except OSError as error:
            raise SegmentLogError(f"{self._folder}: cannot lock folder: {_error_text(error)}") from error
        ids = sorted(int(match[1]) for name in names if (match := _NAME.fullmatch(name)))
        for index, segment_id in enumerate(ids):
            segment = self._recover(segment_id, last=index == len(ids) - 1)
            self._segments[segment_id] = segment
            self._disk_bytes += segment.size
            self._unread_count += segment.records
            self._unread_bytes += segment.payload_bytes
            if segment.records or segment is self._current:
                self._queue.append(segment)
        if ids:
            self._next_id = ids[-1] + 1
        for segment in list(self._segments.values()):
            self._delete_if_done(segment)  # empty segments before the last one

    def _recover(self, segment_id: int, *, last: bool) -> _Segment:
        segment = _Segment(segment_id, self._folder / segment_name(segment_id))
        fd = -1
        try:
            fd = os.open(segment.path, os.O_RDWR if last else os.O_RDONLY)
            file_size = os.fstat(fd).st_size
            reader = _RecordReader(fd)
            problem: _BadRecord | None = None
            while reader.offset < file_size:
                try:
                    payload = reader.next(file_size)
                except _BadRecord as bad:
                    problem = bad
                    break
                if self._on_record is not None:
                    self._on_record(payload)
                segment.records += 1
                segment.payload_bytes += len(payload)
            segment.size = reader.offset
            if problem is not None:
                if not last:
                    raise SegmentLogError(
                        f"{segment.path}: corrupt record at offset {problem.offset} in a segment before the "
                        f"last: {problem.reason}"
                    )
                log.warning(
                    "%s: torn tail (%s): truncated from %d to %d bytes",
                    segment.path,
                    problem.reason,
                    file_size,
                    segment.size,
                )
                os.ftruncate(fd, segment.size)
                _datasync(fd)
            if last:
                self._current, self._current_fd, fd = segment, fd, -1
        except OSError as error:
            raise SegmentLogError(f"{segment.path}: cannot recover: {_error_text(error)}") from error
        finally:
            if fd >= 0:
                os.close(fd)
        return segment

    # ------------------------------------------------------------------- internals --

    def _check_open(self) -> None:
        if self._closed:
            raise SegmentLogError(f"{self._folder}: segment log is closed")

    def _plan(self, records: Sequence[bytes]) -> list[_Part]:
        """Split a batch by destination segment (without touching anything) and encode each part."""
        parts: list[_Part] = []
        target = self._current
        used = target.size if target is not None else 0
        next_id = self._next_id
        part: _Part | None = None
        for payload in records:
            need = HEADER_BYTES + len(payload)
            if target is None or (used > 0 and used + need > self._segment_bytes):
                target = _Segment(next_id, self._folder / segment_name(next_id))
                next_id += 1
                used = 0
                part = None
            if part is None:
                part = _Part(target, new=target is not self._current)
                parts.append(part)
            part.records.append(payload)
            used += need
        for part in parts:
            part.data = _encode(part.records)
        return parts

    def _undo(self, created: list[tuple[_Segment, int]]) -> None:
        """Take back the effects of a failed append: new files go, the current one is cut back."""
        problems: list[str] = []
        for segment, fd in created:
            with contextlib.suppress(OSError):
                os.close(fd)
            try:
                segment.path.unlink(missing_ok=True)
            except OSError as error:
                problems.append(f"{segment.path.name}: {_error_text(error)}")
        if self._current is not None:
            try:
                os.ftruncate(self._current_fd, self._current.size)
            except OSError as error:
                problems.append(f"{self._current.path.name}: {_error_text(error)}")
        if problems:
            self._broken = "could not undo it: " + "; ".join(problems)

    def _become_current(self, segment: _Segment, fd: int) -> None:
        previous = self._current
        self._segments[segment.id] = segment
        self._queue.append(segment)
        self._current, self._next_id = segment, segment.id + 1
        if self._current_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._current_fd)
        self._current_fd = fd
        if previous is not None:
            if self._queue[0] is previous and previous.read == previous.records:
                self._queue.popleft()
                self._close_reader()
            self._delete_if_done(previous)

    def _delete_if_done(self, segment: _Segment) -> None:
        if segment is self._current or segment.acked < segment.records or segment.read < segment.records:
            return
        if self._reader is not None and self._reader.segment is segment:
            self._close_reader()
        with contextlib.suppress(ValueError):
            self._queue.remove(segment)
        del self._segments[segment.id]
        self._disk_bytes -= segment.size
        try:
            segment.path.unlink(missing_ok=True)
        except OSError as error:
            # Its records are all acknowledged: failing to delete only costs disk space until the
            # next reopen, which delivers them again (at-least-once).
            log.warning("%s: cannot delete acknowledged segment: %s", segment.path, _error_text(error))

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _release(self) -> None:
        self._close_reader()
        for fd in (self._current_fd, self._dir_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._current_fd = self._dir_fd = -1

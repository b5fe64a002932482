"""The sequencer's journal: which numbers were handed out, and which ranges are settled.

One append-only file of fixed 29-byte records, written (``os.write``, so it survives the
process being killed) before the stamp answer leaves:

* ``E epoch last_seq``: an epoch starts after ``last_seq``;
* ``H first count distribution_id epoch``: a range was handed out;
* ``S first``: that range is settled (its client published it, or a fill replaced it).

On start the journal is read back (a torn last record is ignored), compacted to one
``E`` record plus the unsettled ``H`` records, and a new epoch begins after the highest
number ever handed out. The installed distribution lives beside it in
``distribution.bin``, replaced atomically.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

_RECORD = struct.Struct("<cQIQQ")  # kind, then up to four numbers (0 where unused)
RECORD_SIZE = _RECORD.size
_COMPACT_AFTER = 1_000_000  # records appended before the file is rewritten


@dataclass(slots=True)
class HandedRange:
    first: int
    count: int
    distribution_id: int
    epoch: int

    @property
    def last(self) -> int:
        return self.first + self.count - 1


@dataclass
class Recovered:
    epoch: int  # the epoch that ended (0 for a fresh journal)
    last_seq: int
    unsettled: dict[int, HandedRange]


class Journal:
    def __init__(self, folder: Path, *, fsync: bool = False) -> None:
        self.folder = folder
        self.path = folder / "journal.bin"
        self.distribution_path = folder / "distribution.bin"
        self.fsync = fsync
        self._fd = -1
        self._appended = 0

    def open(self) -> Recovered:
        """Read what an earlier run left, compact it, and keep the file open for appends."""
        self.folder.mkdir(parents=True, exist_ok=True)
        recovered = self._read()
        self.rewrite(recovered.epoch, recovered.last_seq, recovered.unsettled)
        return recovered

    def _read(self) -> Recovered:
        epoch = 0
        last_seq = 0
        unsettled: dict[int, HandedRange] = {}
        with contextlib.suppress(FileNotFoundError):
            data = self.path.read_bytes()
            usable = len(data) - len(data) % RECORD_SIZE
            for kind, a, b, c, d in _RECORD.iter_unpack(data[:usable]):
                if kind == b"E":
                    epoch, last_seq = max(epoch, a), max(last_seq, b)
                elif kind == b"H":
                    unsettled[a] = HandedRange(a, b, c, d)
                    last_seq = max(last_seq, a + b - 1)
                    epoch = max(epoch, d)
                elif kind == b"S":
                    unsettled.pop(a, None)
        return Recovered(epoch, last_seq, unsettled)

    def rewrite(self, epoch: int, last_seq: int, unsettled: dict[int, HandedRange]) -> None:
        """Replace the file with one ``E`` record and the unsettled ranges."""
        tmp = self.path.with_suffix(".tmp")
        records = [_RECORD.pack(b"E", epoch, last_seq, 0, 0)]
        records += [_RECORD.pack(b"H", r.first, r.count, r.distribution_id, r.epoch) for r in unsettled.values()]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"".join(records))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._appended = 0

    def begin_epoch(self, epoch: int, last_seq: int) -> None:
        self._append(_RECORD.pack(b"E", epoch, last_seq, 0, 0))
        os.fsync(self._fd)  # rare: always durable

    def handed(self, handed: HandedRange) -> None:
        self._append(_RECORD.pack(b"H", handed.first, handed.count, handed.distribution_id, handed.epoch))
        if self.fsync:
            os.fdatasync(self._fd)

    def settled(self, firsts: list[int]) -> None:
        if firsts:
            self._append(b"".join(_RECORD.pack(b"S", first, 0, 0, 0) for first in firsts))

    @property
    def needs_compaction(self) -> bool:
        return self._appended >= _COMPACT_AFTER

    def _append(self, record: bytes) -> None:
        os.write(self._fd, record)
        self._appended += len(record) // RECORD_SIZE

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ----------------------------------------------------------- distribution --
    def load_distribution(self) -> bytes | None:
        try:
            return self.distribution_path.read_bytes()
        except FileNotFoundError:
            return None

    def save_distribution(self, data: bytes) -> None:
        tmp = self.distribution_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.distribution_path)

"""A consumer process of ``sokutatsu bench fanout``: many subscribers of one system.

    python -m sokutatsu.bench.fanout_consumer SYSTEM ADDRESSES TOTAL FILTERED FIRST COUNT

It connects subscribers ``FIRST`` .. ``FIRST + COUNT - 1`` (``FILTERED`` 1: each on its key
group, 0: every key), prints ``ready``, and receives until every subscriber has all it must
(``TOTAL`` messages are to be published; ``total N`` on its standard input says the publisher
stopped after N of them) or it is told ``stop``. Every delivery is checked as it arrives:
against the subscriber's filter, against what it already had (duplicates) and against the
highest sequence number so far (reordered; a skipped wanted message is a hole: lost unless it
arrives later). At the end it prints one JSON line: per subscriber its counts, and for the
whole process a histogram of latency (receive time minus publish time, one clock) in buckets of
``1 %`` width, and the largest latency.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sokutatsu.bench.fanout_clients import Wanted, expected, group_of, subscribed, subscriber_group, subscriber_name
from sokutatsu.bench.peers_clients import HEADER
from sokutatsu.cli.children import stdin_words

READY = "ready"
BUCKET = 1.01  # latency histogram: bucket b holds latencies in [BUCKET**b, BUCKET**(b+1)) microseconds
_LOG_BUCKET = math.log(BUCKET)


def bucket_of(latency_ns: int) -> int:
    return int(math.log(max(latency_ns, 1000) / 1000) / _LOG_BUCKET)


def bucket_ms(bucket: int) -> float:
    """The middle of a bucket, in milliseconds."""
    return float(BUCKET ** (bucket + 0.5) / 1000)


@dataclass
class Latencies:
    histogram: Counter[int] = field(default_factory=Counter)
    max_ns: int = 0


@dataclass
class Track:
    """What one subscriber received, checked as it arrived."""

    name: str
    group: int | None
    total: int
    latencies: Latencies
    all_done: asyncio.Event
    remaining: list[int]  # [subscribers of the process not yet complete], shared
    wanted: int = 0
    seen: bytearray = field(default_factory=bytearray)
    last: int = 0
    distinct: int = 0
    holes: int = 0
    duplicates: int = 0
    reordered: int = 0
    unexpected: int = 0
    first_ns: int = 0
    done_ns: int = 0

    def __post_init__(self) -> None:
        self.wanted = expected(self.total, self.group)
        self.seen = bytearray(self.total + 2)
        if self.wanted == 0:
            self._complete()

    def take(self, body: bytes) -> None:
        now = time.time_ns()
        seq, published = HEADER.unpack_from(body)
        if not 0 < seq <= self.total or (self.group is not None and group_of(seq) != self.group):
            self.unexpected += 1
            return
        if self.seen[seq]:
            self.duplicates += 1
            return
        self.seen[seq] = 1
        if seq < self.last:
            self.reordered += 1
            self.holes -= 1  # it was counted as a hole when a later one came first
        elif seq > self.last + 1:
            self.holes += self._wanted_between(self.last, seq)
        self.last = max(self.last, seq)
        self.distinct += 1
        latency = now - published
        self.latencies.histogram[bucket_of(latency)] += 1
        self.latencies.max_ns = max(self.latencies.max_ns, latency)
        self.first_ns = self.first_ns or now
        self.done_ns = now
        if self.distinct == self.wanted:
            self._complete()

    def published(self, total: int) -> None:
        """The publisher stopped after ``total`` messages: only those are wanted."""
        if total >= self.total:
            return
        complete = self.distinct >= self.wanted
        self.total = total
        self.wanted = expected(total, self.group)
        if not complete and self.distinct >= self.wanted:
            self._complete()

    def _wanted_between(self, low: int, high: int) -> int:
        if self.group is None:
            return high - low - 1
        return sum(1 for s in range(low + 1, high) if group_of(s) == self.group)

    def _complete(self) -> None:
        self.remaining[0] -= 1
        if self.remaining[0] == 0:
            self.all_done.set()

    def figures(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "wanted": self.wanted,
            "received": self.distinct,
            "lost": self.holes,  # skipped and never delivered
            "undelivered": self.wanted - self.distinct - self.holes,  # not yet delivered when told to stop
            "duplicates": self.duplicates,
            "reordered": self.reordered,
            "unexpected": self.unexpected,
            "first_ns": self.first_ns,
            "done_ns": self.done_ns,
        }


async def _steer(stop: asyncio.Event, tracks: list[Track]) -> None:
    async for word in stdin_words():
        if word == "stop":
            break
        if word.startswith("total "):
            for track in tracks:
                track.published(int(word.split()[1]))
    stop.set()


async def main(argv: list[str]) -> dict[str, Any]:
    system, addresses, total, filtered, first, count = argv
    latencies = Latencies()
    all_done = asyncio.Event()
    remaining = [int(count)]
    tracks = [
        Track(subscriber_name(i), subscriber_group(i, filtered == "1"), int(total), latencies, all_done, remaining)
        for i in range(int(first), int(first) + int(count))
    ]
    stop = asyncio.Event()
    steering = asyncio.create_task(_steer(stop, tracks))
    wanted = [Wanted(t.name, t.group, t.take) for t in tracks]
    async with subscribed(system, [a for a in addresses.split(",") if a], wanted):
        print(READY, flush=True)  # noqa: T201 - protocol with the parent process
        waits = {asyncio.create_task(all_done.wait()), asyncio.create_task(stop.wait())}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        stopped_ns = time.time_ns()
    steering.cancel()
    return {
        "subscribers": [t.figures() for t in tracks],
        "histogram": {str(b): n for b, n in sorted(latencies.histogram.items())},
        "max_latency_ns": latencies.max_ns,
        "stopped_ns": stopped_ns,
        "told_to_stop": stop.is_set(),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))))  # noqa: T201

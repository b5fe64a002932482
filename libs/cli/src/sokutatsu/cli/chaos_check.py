"""The checker of ``sokutatsu chaos``: pure functions over the recorded histories.

For every acknowledged message (``publish()`` returned) and every subscriber whose filter
matches its key: delivered exactly once (``lost``, ``duplicates``), in per-publisher order
(``reordered``), no gap reported for it (``gaps``). Also the publish stalls (per publisher,
for each acknowledged message: its acknowledgement time minus the later of its publish time
and the previous message's acknowledgement, i.e. how long the publisher waited with that
message pending) and how many brokers answered ``ACTIVE`` at once. The histories are read
from the JSON lines the client processes and the harness write (docs/chaos.md).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sokutatsu.cli.measure import percentile


# ------------------------------------------------------------------ histories --
@dataclass(frozen=True)
class Ack:
    key: str
    published: float
    acked: float


@dataclass
class PublisherHistory:
    publisher_id: str
    acks: dict[int, Ack] = field(default_factory=dict)
    starts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ended: bool = False


@dataclass(frozen=True)
class Gap:
    publisher_id: str
    first: int
    last: int
    at: float


@dataclass
class SubscriberHistory:
    subscriber_id: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    delivered: list[tuple[str, int]] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    brokers: list[tuple[float, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def read_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON records of a file, and how many lines were torn (a process killed mid-write)."""
    records, torn = [], 0
    if not path.exists():
        return [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    return records, torn


def publisher_history(publisher_id: str, records: Iterable[dict[str, Any]]) -> PublisherHistory:
    history = PublisherHistory(publisher_id)
    for r in records:
        kind = r.get("e")
        if kind == "ack":
            history.acks[int(r["s"])] = Ack(str(r["k"]), float(r["pt"]), float(r["t"]))
        elif kind == "start":
            history.starts.append(float(r["t"]))
        elif kind == "error":
            history.errors.append(str(r["error"]))
        elif kind == "end":
            history.ended = True
    return history


def subscriber_history(
    subscriber_id: str, records: Iterable[dict[str, Any]], keys: Sequence[str] = (), prefixes: Sequence[str] = ()
) -> SubscriberHistory:
    history = SubscriberHistory(subscriber_id, tuple(keys), tuple(prefixes))
    for r in records:
        kind = r.get("e")
        if kind == "msg":
            history.delivered.append((str(r["p"]), int(r["s"])))
        elif kind == "gap":
            history.gaps.append(Gap(str(r["p"]), int(r["first"]), int(r["last"]), float(r["t"])))
        elif kind == "broker":
            history.brokers.append((float(r["t"]), str(r["b"])))
        elif kind == "error":
            history.errors.append(str(r["error"]))
    return history


# -------------------------------------------------------------------- checker --
def matches(key: str, keys: Sequence[str], prefixes: Sequence[str]) -> bool:
    """The broker's key filter: exact keys and/or prefixes; none = every key."""
    if not keys and not prefixes:
        return True
    return key in keys or any(key.startswith(p) for p in prefixes)


def ranges(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted numbers as runs of consecutive ones: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    out: list[tuple[int, int]] = []
    for s in sorted(seqs):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


@dataclass
class Verdict:
    """What one subscriber got wrong, with the evidence (publisher -> runs of numbers)."""

    subscriber_id: str
    expected: int = 0
    delivered: int = 0
    lost: int = 0
    duplicates: int = 0
    reordered: int = 0
    gaps: int = 0
    # Delivered, yet acknowledged with a key this subscriber's filter does not take (another
    # subscription's message: on a shared SubscribeMany stream, a frame handed to the wrong lane).
    unexpected: int = 0
    unexpected_examples: list[tuple[str, int, str]] = field(default_factory=list)
    lost_ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    duplicate_ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    reordered_examples: list[tuple[str, int, int]] = field(default_factory=list)
    gap_reports: list[tuple[str, int, int, int]] = field(default_factory=list)

    @property
    def violations(self) -> int:
        return self.lost + self.duplicates + self.reordered + self.gaps + self.unexpected

    def as_dict(self) -> dict[str, Any]:
        return {
            "subscriber": self.subscriber_id,
            "expected": self.expected,
            "delivered": self.delivered,
            "lost": self.lost,
            "duplicates": self.duplicates,
            "reordered": self.reordered,
            "gaps": self.gaps,
            "unexpected": self.unexpected,
            "unexpected_examples": self.unexpected_examples[:20],
            "lost_ranges": {p: r[:20] for p, r in self.lost_ranges.items()},
            "duplicate_ranges": {p: r[:20] for p, r in self.duplicate_ranges.items()},
            "reordered_examples": self.reordered_examples[:20],
            # (publisher, first, last, acknowledged messages in it)
            "gap_reports": self.gap_reports[:20],
        }


def check_subscriber(publishers: Sequence[PublisherHistory], sub: SubscriberHistory) -> Verdict:
    verdict = Verdict(sub.subscriber_id, delivered=len(sub.delivered))
    expected: dict[str, set[int]] = {
        p.publisher_id: {s for s, a in p.acks.items() if matches(a.key, sub.keys, sub.prefixes)} for p in publishers
    }
    verdict.expected = sum(len(v) for v in expected.values())
    acks = {p.publisher_id: p.acks for p in publishers}
    counts = Counter(sub.delivered)
    highest: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    duplicated: dict[str, list[int]] = {}
    for publisher, seq in sub.delivered:
        if (publisher, seq) in seen:
            verdict.duplicates += 1
            duplicated.setdefault(publisher, []).append(seq)
            continue
        seen.add((publisher, seq))
        ack = acks[publisher].get(seq) if publisher in acks else None
        if ack is not None and seq not in expected[publisher]:  # acknowledged, outside the filter
            verdict.unexpected += 1
            verdict.unexpected_examples.append((publisher, seq, ack.key))
        top = highest.get(publisher, 0)
        if seq < top:
            verdict.reordered += 1
            verdict.reordered_examples.append((publisher, top, seq))
        else:
            highest[publisher] = seq
    for publisher, seqs in expected.items():
        missing = {s for s in seqs if counts[(publisher, s)] == 0}
        if missing:
            verdict.lost += len(missing)
            verdict.lost_ranges[publisher] = ranges(missing)
    verdict.duplicate_ranges = {p: ranges(set(s)) for p, s in duplicated.items()}
    for gap in sub.gaps:
        acked = sum(1 for s in expected.get(gap.publisher_id, ()) if gap.first <= s <= gap.last)
        if acked:
            verdict.gaps += acked
            verdict.gap_reports.append((gap.publisher_id, gap.first, gap.last, acked))
    return verdict


# --------------------------------------------------------------------- stalls --
@dataclass(frozen=True)
class Stall:
    publisher_id: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def stalls(history: PublisherHistory) -> list[Stall]:
    """Per acknowledged message, how long the publisher waited for it with it pending."""
    out: list[Stall] = []
    previous = float("-inf")
    for seq in sorted(history.acks):
        ack = history.acks[seq]
        start = max(previous, ack.published)
        out.append(Stall(history.publisher_id, start, max(start, ack.acked)))
        previous = max(previous, ack.acked)
    return out


# A stall that began this long before a fault was recorded is that fault's (a message was
# pending when it hit).
CHARGE_MARGIN_SECONDS = 0.1


def charge(all_stalls: Sequence[Stall], fault_times: Sequence[float]) -> list[float]:
    """Per fault (times in any order, answered in that order): the longest stall charged to it, each
    stall charged to the latest fault at or before its start (plus CHARGE_MARGIN_SECONDS)."""
    order = sorted(range(len(fault_times)), key=lambda i: fault_times[i])
    longest = [0.0] * len(fault_times)
    for stall in all_stalls:
        owner = None
        for i in order:
            if fault_times[i] <= stall.start + CHARGE_MARGIN_SECONDS:
                owner = i
            else:
                break
        if owner is not None:
            longest[owner] = max(longest[owner], stall.seconds)
    return longest


@dataclass
class StallSummary:
    max_s: float
    p99_s: float
    # Per fault (in the order given): the longest stall charged to it (see :func:`charge`).
    per_fault_s: list[float]
    longest: Stall | None


def summarize_stalls(all_stalls: Sequence[Stall], fault_times: Sequence[float]) -> StallSummary:
    values = sorted(s.seconds for s in all_stalls)
    return StallSummary(
        max_s=values[-1] if values else 0.0,
        p99_s=percentile(values, 0.99) if values else 0.0,
        per_fault_s=charge(all_stalls, fault_times),
        longest=max(all_stalls, key=lambda s: s.seconds, default=None),
    )


# -------------------------------------------------------------------- actives --
@dataclass(frozen=True)
class RoleSample:
    """One poll of GetRole on every broker: broker -> (role name or "" when it did not answer, epoch)."""

    at: float
    roles: dict[str, tuple[str, int]]

    @property
    def actives(self) -> list[str]:
        return sorted(b for b, (role, _) in self.roles.items() if role == "ACTIVE")


def max_actives(samples: Sequence[RoleSample]) -> int:
    return max((len(s.actives) for s in samples), default=0)


def two_active_windows(samples: Sequence[RoleSample]) -> list[dict[str, Any]]:
    """Runs of polls in which more than one broker answered ACTIVE, with their epochs."""
    out: list[dict[str, Any]] = []
    for s in samples:
        if len(s.actives) < 2:
            continue
        epochs = {b: s.roles[b][1] for b in s.actives}
        if out and out[-1]["epochs"] == epochs and s.at - out[-1]["end"] < 0.5:
            out[-1]["end"] = s.at
            out[-1]["polls"] += 1
        else:
            out.append({"start": s.at, "end": s.at, "polls": 1, "epochs": epochs})
    return out

"""The adaptive slow-subscriber threshold (beyond seed 000, whose threshold is fixed).

A subscriber in overflow mode ``migrate`` is moved to the standby once its queue depth
passes its threshold. The move must finish before the queue reaches its memory budget, so
the threshold leaves room for what arrives meanwhile::

    budget messages = memory budget bytes / mean message bytes
    headroom        = inflow (msgs/s) x (switch time + one stats interval) x safety factor
    threshold       = budget messages - headroom, within [lower bound, min(budget messages, upper bound)]

* the mean message size is measured on the subscriber's queue (memory bytes / messages in
  memory), else on the broker as a whole, else assumed to be 1 KiB;
* the inflow is the highest rate seen in the last few seconds (bursts count): the broker's
  inflow rate, or the queue's growth between two statistics frames when that is higher (the
  broker's rates are per second; growth shows a burst one frame later);
* the switch time is a high percentile (p90) of the last switchovers' totals; until five are
  measured, at least the configured estimate;
* the stats interval counts because the depth is seen that much later;
* the lower bound keeps the SDK's credit window (a healthy subscriber's in-flight messages)
  from looking slow; the budget wins over it when it holds fewer messages.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_MESSAGE_BYTES = 1024
# Switch totals kept for the percentile, the percentile, and how many make it trusted alone.
SWITCH_SAMPLES_KEPT = 50
SWITCH_PERCENTILE = 0.9
SWITCH_SAMPLES_TRUSTED = 5


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 1]) of a non-empty collection."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of nothing")
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class SwitchTimes:
    """Recent switchover totals and the switch time the thresholds assume."""

    def __init__(self, assumed_seconds: float, kept: int = SWITCH_SAMPLES_KEPT) -> None:
        self.assumed = assumed_seconds
        self._samples: deque[float] = deque(maxlen=kept)

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)

    def __len__(self) -> int:
        return len(self._samples)

    def estimate(self) -> float:
        if not self._samples:
            return self.assumed
        measured = percentile(self._samples, SWITCH_PERCENTILE)
        if len(self._samples) < SWITCH_SAMPLES_TRUSTED:
            return max(self.assumed, measured)
        return measured

    def basis(self) -> str:
        n = len(self._samples)
        if not n:
            return f"switch time {_ms(self.assumed)} assumed (none measured yet)"
        measured = percentile(self._samples, SWITCH_PERCENTILE)
        if n < SWITCH_SAMPLES_TRUSTED and measured < self.assumed:
            return (
                f"switch time {_ms(self.assumed)} assumed (p90 of {n} measured is {_ms(measured)}; "
                f"trusted from {SWITCH_SAMPLES_TRUSTED})"
            )
        return f"switch time {_ms(measured)} (p90 of the last {n})"


class RecentPeak:
    """The highest of the last ``kept`` samples (e.g. inflow rates, one per stats interval)."""

    def __init__(self, kept: int) -> None:
        self._samples: deque[float] = deque(maxlen=max(1, kept))

    def add(self, value: float) -> float:
        self._samples.append(value)
        return self.peak

    @property
    def peak(self) -> float:
        return max(self._samples, default=0.0)


class MeanSize:
    """Mean message size of one queue, smoothed (exponential moving average)."""

    ALPHA = 0.2

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, memory_bytes: int, messages_in_memory: int) -> float | None:
        if messages_in_memory > 0 and memory_bytes > 0:
            sample = memory_bytes / messages_in_memory
            self.value = sample if self.value is None else self.value + self.ALPHA * (sample - self.value)
        return self.value


@dataclass(frozen=True)
class ThresholdInputs:
    budget_bytes: int  # 0 = not known
    mean_message_bytes: float
    size_source: str  # "measured", "broker-wide" or "assumed"
    inflow_per_second: float
    switch_seconds: float
    detect_seconds: float  # one stats interval
    safety: float
    lower: int
    upper: int  # 0 = no bound but the budget


@dataclass(frozen=True)
class Threshold:
    messages: int
    basis: str


def derive_threshold(i: ThresholdInputs) -> Threshold:
    """The threshold in messages and what it came from, in words."""
    mean = max(1.0, i.mean_message_bytes)
    lower = max(1, i.lower)
    window = i.switch_seconds + i.detect_seconds
    headroom = math.ceil(max(0.0, i.inflow_per_second) * window * i.safety)
    room = (
        f"inflow {i.inflow_per_second:.0f}/s x (switch {_ms(i.switch_seconds)} + stats {_ms(i.detect_seconds)})"
        f" x safety {i.safety:g} = {headroom} msgs"
    )
    if not i.budget_bytes:
        if i.upper:
            value = max(1, i.upper)
            return Threshold(value, f"no memory budget known: the upper bound {value}")
        return Threshold(lower, f"no memory budget known: the lower bound {lower}")
    budget_msgs = max(1, int(i.budget_bytes // mean))
    cap = min(budget_msgs, i.upper) if i.upper else budget_msgs
    start = (
        f"budget {_size(i.budget_bytes)} / {_size(mean)} per message ({i.size_source}) = {budget_msgs} msgs; "
        f"minus {room}"
    )
    raw = budget_msgs - headroom
    if cap < lower:
        why = "the budget" if cap == budget_msgs else "the upper bound"
        return Threshold(cap, f"{start} -> {raw}; {why} ({cap}) is under the lower bound {lower}: {cap}")
    if raw < lower:
        return Threshold(lower, f"{start} -> {raw}, raised to the lower bound {lower}")
    if raw > cap:
        return Threshold(cap, f"{start} -> {raw}, capped at the upper bound {cap}")
    return Threshold(raw, f"{start} -> {raw} (bounds {lower}..{cap})")


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


def _size(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"

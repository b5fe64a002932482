"""What the monitor measures and decides per subscriber between statistics frames."""

from __future__ import annotations

from dataclasses import dataclass, field

from sokutatsu.monitor.hysteresis import MoveGuard
from sokutatsu.monitor.threshold import MeanSize, RecentPeak, Threshold


@dataclass
class Measures:
    """What the monitor measures and decides per subscriber between statistics frames."""

    size: MeanSize
    inflow: RecentPeak
    guard: MoveGuard
    threshold: Threshold = field(default_factory=lambda: Threshold(0, "not measured yet"))
    # After a switchover of this subscriber: no decision until both brokers report again.
    settled_after: float = 0.0
    # The last depth seen (serving broker, depth, when): its growth counts as inflow too,
    # as it shows a burst before the broker's per-second rates do.
    last_depth: tuple[str, int, float] | None = None

    def growth(self, broker_id: str, depth: int, now: float) -> float:
        """Messages per second the queue grew by since the last sample on the same broker."""
        last, self.last_depth = self.last_depth, (broker_id, depth, now)
        if last is None or last[0] != broker_id or now - last[2] <= 0:
            return 0.0
        return max(0.0, (depth - last[1]) / (now - last[2]))

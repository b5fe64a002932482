"""When to move a subscriber: to the standby when slow, back to the active when recovered.

One :class:`MoveGuard` per subscriber, fed one :class:`Observation` per stats interval
(time is passed in, so the rules are pure and testable):

* **To the standby** (reason SLOW): served by the active, overflow mode ``migrate``, depth
  over the threshold, the standby answering. Never delayed by hysteresis (the threshold is
  what keeps memory from overflowing); only a failed attempt waits a moment before retrying.
* **Back to the active** (reason RECOVERED): served by the standby, connected, depth at or
  under the low mark (far under the threshold) continuously for the dwell time, at least the
  minimum move interval since its last move, the active answering.
* **No flapping**: a subscriber that turns slow again soon after it returned (within the
  dwell plus the minimum interval) needs twice the dwell next time (up to 16 times); a later,
  unhurried slow move halves the penalty again.

A monitor that starts (or restarts) counts every subscriber as moved at its first sight, so
it never moves one back before the minimum interval.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# After a failed move to the standby, try again this much later (the depth still grows).
FAILED_RETRY_SECONDS = 1.0
MAX_PENALTY = 4


class Move(enum.Enum):
    NONE = "none"
    TO_STANDBY = "to standby"
    TO_ACTIVE = "to active"


@dataclass(frozen=True)
class Observation:
    now: float  # monotonic seconds
    served: bool  # some broker serves it
    migrated: bool  # served by the standby
    migrate_mode: bool  # overflow mode migrate
    connected: bool
    depth: int
    threshold: int
    low_mark: int
    standby_up: bool
    active_up: bool


class MoveGuard:
    """The move decision and its hysteresis state for one subscriber."""

    def __init__(self, now: float, dwell: float, min_interval: float) -> None:
        self.dwell = dwell
        self.min_interval = min_interval
        self.last_move_at = now
        self.last_move = Move.NONE
        self.low_since: float | None = None
        self.retry_at = 0.0
        self.penalty = 0

    @property
    def required_dwell(self) -> float:
        return self.dwell * float(2**self.penalty)

    def decide(self, obs: Observation) -> Move:
        if not obs.migrate_mode or not obs.served:
            self.low_since = None
            return Move.NONE
        if not obs.migrated:
            self.low_since = None
            if obs.depth > obs.threshold and obs.standby_up and obs.now >= self.retry_at:
                return Move.TO_STANDBY
            return Move.NONE
        if obs.depth > obs.low_mark or not obs.connected:
            self.low_since = None
            return Move.NONE
        if self.low_since is None:
            self.low_since = obs.now
        ready = (
            obs.now - self.low_since >= self.required_dwell
            and obs.now - self.last_move_at >= self.min_interval
            and obs.now >= self.retry_at
            and obs.active_up
        )
        return Move.TO_ACTIVE if ready else Move.NONE

    def record(self, now: float, move: Move, ok: bool) -> None:
        """A move of this subscriber (automatic or asked for) finished, successfully or not."""
        if move is Move.NONE:
            return
        if not ok:
            self.retry_at = now + (FAILED_RETRY_SECONDS if move is Move.TO_STANDBY else self.min_interval)
            self.low_since = None
            return
        if move is Move.TO_STANDBY and self.last_move is Move.TO_ACTIVE:
            if now - self.last_move_at < self.required_dwell + self.min_interval:
                self.penalty = min(MAX_PENALTY, self.penalty + 1)
            else:
                self.penalty = max(0, self.penalty - 1)
        self.last_move_at = now
        self.last_move = move
        self.low_since = None
        self.retry_at = 0.0

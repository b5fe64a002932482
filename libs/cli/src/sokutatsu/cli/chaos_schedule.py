"""The nemesis' schedule: a list of fault steps drawn from a seed (``random.Random(seed)``).

A schedule is a sequence of :class:`Step`, each taken ``delay`` seconds after the previous one
was taken (a broker fault is *taken* once the broker is back; the other faults run in the
background, see docs/chaos.md). Every schedule holds at least two broker kills, one broker
pause, one link cut, a slow subscriber that turns slow shortly before one of those broker
faults (so the monitor has migrated it when the fault hits) and recovers later, a subscriber
reopening with its position and a publisher restarting with its id. Extra steps (more of
those, monitor kills and pauses, stream floods) fill the schedule up to its length. Faults on
the monitor's own link to a broker (one per :data:`MONITOR_LINK_EVERY` seconds of length) are
drawn from a random stream of their own and inserted between the other steps, so a seed's
other steps are the ones it drew before those faults existed (the fixed schedules of the
tests keep their meaning). The subscription churn (:func:`churn_calls`, one call per
:data:`CHURN_EVERY` seconds of length) is a timeline of its own, from its own random stream,
run beside the steps so that its calls land during broker kills, pauses and cuts: a client
creates or deletes one of :data:`CHURN_NAMES` (durable, nobody attached) on one broker or both,
and at the end both brokers must hold the same ones (invariant 8 of the broker's lists).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

# Kinds of step.
KILL = "kill"  # kill -9 a broker, restart it on the same port and state after `duration`
PAUSE = "pause"  # SIGSTOP a broker for `duration`, then SIGCONT
KILL_MONITOR = "kill-monitor"
PAUSE_MONITOR = "pause-monitor"
CUT = "cut"  # cut the pair's link (`target`: both, to-a, to-b) for `duration`
FLOOD = "flood"  # FLOOD_STREAMS Subscribe streams from one client on the active, held `duration`
SLOW = "slow"  # the slow subscriber turns slow (the monitor migrates it)
RECOVER = "recover"  # the slow subscriber reads as fast as it can again
REOPEN = "reopen"  # a subscriber closes, waits `duration`, reopens with its stored position
RESTART_PUBLISHER = "restart-publisher"  # kill -9 a publisher, restart it with its id after `duration`
# The monitor's link to a broker (`target`: active or standby, resolved when taken), for `duration`:
CUT_MONITOR = "cut-monitor"  # closed and refused: the broker runs on, out of the monitor's reach
MUTE_MONITOR = "mute-monitor"  # calls arrive, answers are dropped: the broker acts, the monitor never hears
MONITOR_LINK_FAULTS = (CUT_MONITOR, MUTE_MONITOR)
# CreateSubscription or DeleteSubscription (`detail`: "create NAME" or "delete NAME") sent to `target`:
# broker-a, broker-b or both (by name, not role: a call that reaches one broker only is the point).
CHURN = "churn"
CHURN_NAMES = ("churn-0", "churn-1", "churn-2")
# One churn step per this many seconds of schedule length.
CHURN_EVERY = 3.0
# One monitor-link fault per this many seconds of schedule length.
MONITOR_LINK_EVERY = 20.0

BROKER_FAULTS = (KILL, PAUSE)
# The other extra steps: kind -> (target, shortest and longest duration).
_EXTRAS = {
    KILL_MONITOR: ("monitor", 0.2, 3.0),
    PAUSE_MONITOR: ("monitor", 1.0, 5.0),
    FLOOD: ("active", 1.0, 4.0),
    REOPEN: ("reopen", 0.2, 2.0),
    RESTART_PUBLISHER: ("pub-2", 0.1, 1.5),
}
# Rough seconds a step occupies the schedule beyond its delay (to fill the length).
_OCCUPIES = {KILL: 4.0, PAUSE: 3.0}


@dataclass(frozen=True)
class Step:
    kind: str
    # "active" or "standby" for broker faults (resolved when the step is taken), the link's
    # direction for a cut, the process for the others.
    target: str
    delay: float
    duration: float = 0.0
    # The broker fault that the slow subscriber's migration overlaps.
    during_migration: bool = False
    # What a churn step does ("create churn-1").
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _broker_fault(rng: random.Random, kind: str, delay: float, during_migration: bool = False) -> Step:
    target = rng.choice(("active", "standby"))
    duration = round(rng.uniform(0.2, 2.0), 2) if kind == KILL else round(rng.uniform(1.0, 5.0), 2)
    return Step(kind, target, delay, duration, during_migration)


def _extra(rng: random.Random) -> Step:
    delay = round(rng.uniform(0.5, 3.0), 2)
    kind = rng.choices(
        (KILL, PAUSE, KILL_MONITOR, PAUSE_MONITOR, CUT, FLOOD, REOPEN, RESTART_PUBLISHER),
        weights=(2, 2, 1, 1, 2, 1, 2, 1),
    )[0]
    if kind in BROKER_FAULTS:
        return _broker_fault(rng, kind, delay)
    if kind == CUT:
        return Step(CUT, rng.choice(("both", "to-a", "to-b")), delay, round(rng.uniform(1.0, 5.0), 2))
    target, low, high = _EXTRAS[kind]
    return Step(kind, target, delay, round(rng.uniform(low, high), 2))


def occupies(step: Step) -> float:
    return step.delay + _OCCUPIES.get(step.kind, 0.0) + (step.duration if step.kind in BROKER_FAULTS else 0.0)


def draw(seed: int, seconds: float, *, monitor_links: bool = True) -> list[Step]:
    """The schedule of ``seed``, about ``seconds`` long (never shorter than its required steps);
    without the monitor-link faults when ``monitor_links`` is false."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible schedule, not security
    # The migration group: slow, a broker fault once the monitor has moved the subscriber, recover.
    overlap_kind = rng.choice(BROKER_FAULTS)
    group = [
        Step(SLOW, "slow", round(rng.uniform(0.5, 2.0), 2)),
        _broker_fault(rng, overlap_kind, round(rng.uniform(2.0, 3.5), 2), during_migration=True),
        Step(RECOVER, "slow", round(rng.uniform(1.0, 4.0), 2)),
    ]
    required: list[Step | list[Step]] = [
        _broker_fault(rng, KILL, round(rng.uniform(1.0, 3.0), 2)),
        Step(CUT, rng.choice(("both", "to-a", "to-b")), round(rng.uniform(0.5, 3.0), 2), round(rng.uniform(1, 5), 2)),
        group,
    ]
    # At least two kills and one pause among the broker faults, whatever the group holds.
    required.append(_broker_fault(rng, PAUSE if overlap_kind == KILL else KILL, round(rng.uniform(1.0, 3.0), 2)))
    # A subscriber reopening with its position and a publisher restarting with its id (both cheap).
    for kind in (REOPEN, RESTART_PUBLISHER):
        target, low, high = _EXTRAS[kind]
        required.append(Step(kind, target, round(rng.uniform(0.5, 2.0), 2), round(rng.uniform(low, high), 2)))
    units: list[Step | list[Step]] = list(required)
    length = sum(occupies(s) for u in units for s in (u if isinstance(u, list) else [u]))
    while length < seconds:
        extra = _extra(rng)
        units.append(extra)
        length += occupies(extra)
    rng.shuffle(units)
    steps: list[Step] = []
    for unit in units:
        steps.extend(unit if isinstance(unit, list) else [unit])
    return _with_monitor_link_faults(steps, seed, seconds) if monitor_links else steps


def _outside_migration(steps: list[Step]) -> list[int]:
    """The places a step may be inserted at: not inside the migration group (slow, its fault, recover)."""
    inside, allowed = False, []
    for i, s in enumerate(steps):
        if not inside:
            allowed.append(i)
        inside = (inside or s.kind == SLOW) and s.kind != RECOVER
    allowed.append(len(steps))
    return allowed


def churn_calls(seed: int, seconds: float) -> list[Step]:
    """The subscription churn of ``seed``: about one call per :data:`CHURN_EVERY` seconds, each taken
    its ``delay`` after the previous one, beside the schedule's steps."""
    rng = random.Random(f"churn-{seed}")  # noqa: S311 - a reproducible schedule, not security
    calls = []
    for _ in range(int(seconds // CHURN_EVERY)):
        operation = rng.choices(("create", "delete"), weights=(3, 2))[0]
        calls.append(
            Step(
                CHURN,
                rng.choice(("broker-a", "broker-b", "both")),
                round(rng.uniform(0.2, 2 * CHURN_EVERY - 0.2), 2),
                detail=f"{operation} {rng.choice(CHURN_NAMES)}",
            )
        )
    return calls


def _with_monitor_link_faults(steps: list[Step], seed: int, seconds: float) -> list[Step]:
    """``steps`` with the monitor-link faults of ``seed`` inserted (never inside the migration group)."""
    rng = random.Random(f"monitor-links-{seed}")  # noqa: S311 - a reproducible schedule, not security
    steps = list(steps)
    for _ in range(int(seconds // MONITOR_LINK_EVERY)):
        step = Step(
            rng.choice(MONITOR_LINK_FAULTS),
            rng.choice(("active", "standby")),
            round(rng.uniform(0.5, 3.0), 2),
            round(rng.uniform(1.0, 5.0), 2),
        )
        steps.insert(rng.choice(_outside_migration(steps)), step)
    return steps


def meets_minimum(steps: list[Step]) -> bool:
    """At least two broker kills, one broker pause, one link cut and a broker fault during a migration."""
    kinds = [s.kind for s in steps]
    return (
        kinds.count(KILL) >= 2
        and kinds.count(PAUSE) >= 1
        and kinds.count(CUT) >= 1
        and any(s.during_migration and s.kind in BROKER_FAULTS for s in steps)
    )

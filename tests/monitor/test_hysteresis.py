"""Move decisions: slow -> standby at once; recovered -> back after the dwell; never flapping."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from sokutatsu.monitor.hysteresis import FAILED_RETRY_SECONDS, Move, MoveGuard, Observation

DWELL = 5.0
MIN_INTERVAL = 10.0


def _obs(now: float, **changes: object) -> Observation:
    base = Observation(
        now=now,
        served=True,
        migrated=False,
        migrate_mode=True,
        connected=True,
        depth=0,
        threshold=4000,
        low_mark=500,
        standby_up=True,
        active_up=True,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_over_the_threshold_moves_to_the_standby_at_once() -> None:
    guard = MoveGuard(0.0, DWELL, MIN_INTERVAL)
    assert guard.decide(_obs(0.1, depth=4000)) is Move.NONE  # at the threshold is not over it
    assert guard.decide(_obs(0.2, depth=4001)) is Move.TO_STANDBY


def test_only_migrate_mode_subscribers_move() -> None:
    guard = MoveGuard(0.0, DWELL, MIN_INTERVAL)
    assert guard.decide(_obs(1.0, depth=10**6, migrate_mode=False)) is Move.NONE
    assert guard.decide(_obs(1.0, depth=10**6, served=False)) is Move.NONE


def test_no_move_without_a_standby() -> None:
    guard = MoveGuard(0.0, DWELL, MIN_INTERVAL)
    assert guard.decide(_obs(1.0, depth=10**6, standby_up=False)) is Move.NONE


def test_failed_move_to_the_standby_retries_after_a_moment() -> None:
    guard = MoveGuard(0.0, DWELL, MIN_INTERVAL)
    guard.record(1.0, Move.TO_STANDBY, ok=False)
    assert guard.decide(_obs(1.0 + FAILED_RETRY_SECONDS / 2, depth=9000)) is Move.NONE
    assert guard.decide(_obs(1.0 + FAILED_RETRY_SECONDS, depth=9000)) is Move.TO_STANDBY


def test_back_to_the_active_after_the_dwell_and_the_minimum_interval() -> None:
    guard = MoveGuard(0.0, DWELL, MIN_INTERVAL)
    guard.record(0.0, Move.TO_STANDBY, ok=True)
    migrated = {"migrated": True}
    # Low from t=1: the dwell ends at t=6, but the last move was at t=0: not before t=10.
    assert guard.decide(_obs(1.0, depth=10, **migrated)) is Move.NONE
    assert guard.decide(_obs(6.0, depth=10, **migrated)) is Move.NONE
    assert guard.decide(_obs(9.9, depth=10, **migrated)) is Move.NONE
    assert guard.decide(_obs(10.0, depth=10, **migrated)) is Move.TO_ACTIVE


def test_one_sample_above_the_low_mark_restarts_the_dwell() -> None:
    guard = MoveGuard(-100.0, DWELL, MIN_INTERVAL)
    migrated = {"migrated": True}
    assert guard.decide(_obs(0.0, depth=10, **migrated)) is Move.NONE
    assert guard.decide(_obs(4.0, depth=501, **migrated)) is Move.NONE  # above the low mark
    assert guard.decide(_obs(5.0, depth=10, **migrated)) is Move.NONE
    assert guard.decide(_obs(9.9, depth=10, **migrated)) is Move.NONE
    assert guard.decide(_obs(10.0, depth=10, **migrated)) is Move.TO_ACTIVE


def test_a_disconnected_subscriber_is_not_moved_back() -> None:
    guard = MoveGuard(-100.0, DWELL, MIN_INTERVAL)
    for t in range(0, 30):
        assert guard.decide(_obs(float(t), depth=0, migrated=True, connected=False)) is Move.NONE


def test_not_moved_back_while_the_active_is_down() -> None:
    guard = MoveGuard(-100.0, DWELL, MIN_INTERVAL)
    guard.decide(_obs(0.0, depth=0, migrated=True))
    assert guard.decide(_obs(20.0, depth=0, migrated=True, active_up=False)) is Move.NONE
    assert guard.decide(_obs(20.1, depth=0, migrated=True)) is Move.TO_ACTIVE


def test_a_failed_move_back_waits_the_minimum_interval() -> None:
    guard = MoveGuard(-100.0, DWELL, MIN_INTERVAL)
    guard.record(0.0, Move.TO_ACTIVE, ok=False)
    guard.decide(_obs(0.0, depth=0, migrated=True))
    assert guard.decide(_obs(9.0, depth=0, migrated=True)) is Move.NONE
    assert guard.decide(_obs(10.0, depth=0, migrated=True)) is Move.TO_ACTIVE


def test_a_fresh_guard_counts_as_just_moved() -> None:
    """A (re)started monitor never moves a subscriber back before the minimum interval."""
    guard = MoveGuard(50.0, DWELL, MIN_INTERVAL)
    guard.decide(_obs(50.0, depth=0, migrated=True))
    assert guard.decide(_obs(59.0, depth=0, migrated=True)) is Move.NONE
    assert guard.decide(_obs(60.0, depth=0, migrated=True)) is Move.TO_ACTIVE


def test_turning_slow_soon_after_returning_doubles_the_dwell() -> None:
    guard = MoveGuard(0.0, DWELL, MIN_INTERVAL)
    guard.record(0.0, Move.TO_STANDBY, ok=True)
    guard.record(20.0, Move.TO_ACTIVE, ok=True)
    guard.record(22.0, Move.TO_STANDBY, ok=True)  # slow again 2 s after returning: a flap
    assert guard.required_dwell == 2 * DWELL
    guard.decide(_obs(25.0, depth=0, migrated=True))  # low from t=25
    # Without the penalty it would return at t=32 (25 + 5, and 10 s after the move at 22).
    assert guard.decide(_obs(33.0, depth=0, migrated=True)) is Move.NONE
    assert guard.decide(_obs(35.0, depth=0, migrated=True)) is Move.TO_ACTIVE
    for _ in range(10):
        guard.record(100.0, Move.TO_ACTIVE, ok=True)
        guard.record(100.5, Move.TO_STANDBY, ok=True)
    assert guard.required_dwell == 16 * DWELL  # capped
    guard.record(1000.0, Move.TO_ACTIVE, ok=True)
    guard.record(5000.0, Move.TO_STANDBY, ok=True)  # a long while later: the penalty shrinks
    assert guard.required_dwell == 8 * DWELL


@settings(max_examples=200)
@given(
    samples=st.lists(
        st.tuples(
            st.floats(min_value=0.05, max_value=3.0),  # time to the next sample
            st.integers(min_value=0, max_value=20_000),  # depth
            st.booleans(),  # connected
            st.booleans(),  # move succeeds
        ),
        min_size=1,
        max_size=300,
    )
)
def test_moves_back_are_never_closer_than_the_minimum_interval(
    samples: list[tuple[float, int, bool, bool]],
) -> None:
    """Whatever the depths, a move back to the active follows the previous move by at least the
    minimum interval and a dwell of low samples; a move to the standby needs depth over the threshold."""
    guard = MoveGuard(0.0, DWELL, MIN_INTERVAL)
    now = 0.0
    migrated = False
    last_move = 0.0
    low_since: float | None = None
    for step, depth, connected, ok in samples:
        now += step
        obs = _obs(now, depth=depth, connected=connected, migrated=migrated)
        if migrated and depth <= obs.low_mark and connected:
            low_since = now if low_since is None else low_since
        else:
            low_since = None
        move = guard.decide(obs)
        if move is Move.TO_STANDBY:
            assert not migrated
            assert depth > obs.threshold
        elif move is Move.TO_ACTIVE:
            assert migrated
            assert now - last_move >= MIN_INTERVAL
            assert low_since is not None
            assert now - low_since >= DWELL
        if move is not Move.NONE:
            guard.record(now, move, ok)
            if ok:
                migrated = move is Move.TO_STANDBY
                last_move = now
                low_since = None

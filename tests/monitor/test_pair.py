"""Role decisions of the pair: failover after the active is silent; one active only."""

from __future__ import annotations

from dataclasses import replace

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.monitor.pair import Member, decide_roles

ACTIVE = broker_pb2.BROKER_ROLE_ACTIVE
STANDBY = broker_pb2.BROKER_ROLE_STANDBY
A = Member("broker-a", "a:7201", True, ACTIVE, 1, up_since=0.0, last_ok=10.0)
B = Member("broker-b", "b:7202", True, STANDBY, 1, up_since=0.0, last_ok=10.0)


def test_a_healthy_pair_needs_nothing() -> None:
    assert decide_roles([A, B], now=10.0, no_active_since=None, failover_after=1.0, highest_epoch=1) is None


def test_failover_only_after_the_active_was_silent_long_enough() -> None:
    dead = replace(A, reachable=False)
    assert decide_roles([dead, B], now=10.5, no_active_since=10.0, failover_after=1.0, highest_epoch=1) is None
    change = decide_roles([dead, B], now=11.0, no_active_since=10.0, failover_after=1.0, highest_epoch=1)
    assert change is not None
    assert (change.broker_id, change.role, change.epoch, change.peer, change.failover) == (
        "broker-b",
        ACTIVE,
        2,
        "a:7201",
        True,
    )
    assert "broker-a has not answered as active" in change.why


def test_the_new_epoch_is_above_every_epoch_seen() -> None:
    dead = replace(A, reachable=False, epoch=7)
    change = decide_roles([dead, B], now=20.0, no_active_since=10.0, failover_after=1.0, highest_epoch=9)
    assert change is not None
    assert change.epoch == 10


def test_nothing_to_promote_when_neither_answers() -> None:
    down = [replace(A, reachable=False), replace(B, reachable=False)]
    assert decide_roles(down, now=99.0, no_active_since=0.0, failover_after=1.0, highest_epoch=1) is None


def test_two_standbys_promote_the_higher_epoch_then_the_first() -> None:
    a, b = replace(A, role=STANDBY, epoch=4), replace(B, epoch=5)
    change = decide_roles([a, b], now=5.0, no_active_since=0.0, failover_after=1.0, highest_epoch=5)
    assert change is not None
    assert change.broker_id == "broker-b"
    change = decide_roles([replace(a, epoch=5), b], now=5.0, no_active_since=0.0, failover_after=1.0, highest_epoch=5)
    assert change is not None
    assert change.broker_id == "broker-a"


def test_two_actives_demote_the_older_epoch() -> None:
    promoted = replace(B, role=ACTIVE, epoch=2)
    change = decide_roles([A, promoted], now=30.0, no_active_since=None, failover_after=1.0, highest_epoch=2)
    assert change is not None
    assert (change.broker_id, change.role, change.epoch, change.peer, change.failover) == (
        "broker-a",
        STANDBY,
        3,
        "b:7202",
        False,
    )


def test_two_actives_on_one_epoch_demote_the_one_that_came_back() -> None:
    back = replace(A, up_since=29.0)
    stayed = replace(B, role=ACTIVE, up_since=1.0)
    change = decide_roles([back, stayed], now=30.0, no_active_since=None, failover_after=1.0, highest_epoch=1)
    assert change is not None
    assert change.broker_id == "broker-a"
    assert "came back last" in change.why

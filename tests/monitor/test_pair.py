"""Role decisions of the pair: failover after the active is silent; one active only."""

from __future__ import annotations

from dataclasses import replace

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.monitor.pair import MAX_EPOCH, Held, Member, RoleChange, decide_roles

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
    assert isinstance(change, RoleChange)
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
    assert isinstance(change, RoleChange)
    assert change.epoch == 10


def test_nothing_to_promote_when_neither_answers() -> None:
    down = [replace(A, reachable=False), replace(B, reachable=False)]
    assert decide_roles(down, now=99.0, no_active_since=0.0, failover_after=1.0, highest_epoch=1) is None


def test_two_standbys_promote_the_higher_epoch_then_the_first() -> None:
    a, b = replace(A, role=STANDBY, epoch=4), replace(B, epoch=5)
    change = decide_roles([a, b], now=5.0, no_active_since=0.0, failover_after=1.0, highest_epoch=5)
    assert isinstance(change, RoleChange)
    assert change.broker_id == "broker-b"
    change = decide_roles([replace(a, epoch=5), b], now=5.0, no_active_since=0.0, failover_after=1.0, highest_epoch=5)
    assert isinstance(change, RoleChange)
    assert change.broker_id == "broker-a"


def test_two_actives_demote_the_older_epoch() -> None:
    promoted = replace(B, role=ACTIVE, epoch=2)
    change = decide_roles([A, promoted], now=30.0, no_active_since=None, failover_after=1.0, highest_epoch=2)
    assert isinstance(change, RoleChange)
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
    assert isinstance(change, RoleChange)
    assert change.broker_id == "broker-a"
    assert "came back last" in change.why


# ------------------------------------------------ failover needs the standby's word too --
def test_no_failover_while_the_standby_still_hears_the_active() -> None:
    """A busy active misses the monitor's statistics but still sends pair frames: not dead."""
    silent, hearing = replace(A, reachable=False), replace(B, peer_up=True)
    held = decide_roles([silent, hearing], now=20.0, no_active_since=10.0, failover_after=1.0, highest_epoch=1)
    assert isinstance(held, Held)
    assert (held.kind, held.broker_id) == ("peer-heard", "broker-b")
    assert "broker-b still hears it" in held.why


def test_failover_once_the_standby_stops_hearing_the_active() -> None:
    silent = replace(A, reachable=False)
    change = decide_roles([silent, B], now=20.0, no_active_since=10.0, failover_after=1.0, highest_epoch=1)
    assert isinstance(change, RoleChange)
    assert (change.broker_id, change.role, change.failover) == ("broker-b", ACTIVE, True)
    assert "broker-b does not hear it either" in change.why


def test_failover_without_waiting_for_the_standby_when_the_active_is_shutting_down() -> None:
    stopping, hearing = replace(A, reachable=False, stopping=True), replace(B, peer_up=True)
    change = decide_roles([stopping, hearing], now=20.0, no_active_since=10.0, failover_after=1.0, highest_epoch=1)
    assert isinstance(change, RoleChange)
    assert change.broker_id == "broker-b"
    assert "shutting down" in change.why


def test_two_standbys_that_hear_each_other_still_get_an_active() -> None:
    """The monitor sees the other broker is not active: hearing it says nothing about an active."""
    a, b = replace(A, role=STANDBY, peer_up=True), replace(B, peer_up=True)
    change = decide_roles([a, b], now=5.0, no_active_since=0.0, failover_after=1.0, highest_epoch=1)
    assert isinstance(change, RoleChange)
    assert (change.broker_id, change.role) == ("broker-a", ACTIVE)


def test_the_standby_hearing_the_active_does_not_hurry_the_failover() -> None:
    silent = replace(A, reachable=False)
    assert decide_roles([silent, B], now=10.5, no_active_since=10.0, failover_after=1.0, highest_epoch=1) is None


# ------------------------------------------------------------------------ epochs --
def test_an_epoch_at_the_ceiling_holds_the_failover_instead_of_overflowing() -> None:
    silent, top = replace(A, reachable=False), replace(B, epoch=MAX_EPOCH)
    held = decide_roles([silent, top], now=20.0, no_active_since=10.0, failover_after=1.0, highest_epoch=1)
    assert isinstance(held, Held)
    assert (held.kind, held.broker_id) == ("epoch-exhausted", "broker-b")
    assert f"broker-b reports epoch {MAX_EPOCH}" in held.why
    assert "epoch is exhausted" in held.why


def test_an_epoch_uint64_cannot_exceed_holds_the_demotion_too() -> None:
    hostile = replace(B, role=ACTIVE, epoch=2**64 - 1)
    held = decide_roles([A, hostile], now=30.0, no_active_since=None, failover_after=1.0, highest_epoch=1)
    assert isinstance(held, Held)
    assert (held.kind, held.broker_id) == ("epoch-exhausted", "broker-a")
    assert str(2**64 - 1) in held.why


def test_the_last_epoch_under_the_ceiling_is_still_proposed() -> None:
    silent, near = replace(A, reachable=False), replace(B, epoch=MAX_EPOCH - 1)
    change = decide_roles([silent, near], now=20.0, no_active_since=10.0, failover_after=1.0, highest_epoch=1)
    assert isinstance(change, RoleChange)
    assert change.epoch == MAX_EPOCH


def test_a_standby_that_is_not_caught_up_waits_longer_for_an_active_that_may_only_be_slow() -> None:
    """Chaos seed 1964 under load: the active (broker-b here, epoch 1) had acknowledged alone while
    broker-a was killed; broker-a came back as standby without those messages, broker-b starved
    for 1.1 s, and the monitor promoted broker-a at once: 2,111 acknowledged messages reached the
    subscriber as a gap. A standby that is not caught up waits FAILOVER_BEHIND_AFTER_SECONDS."""
    slow = replace(A, reachable=False)
    behind = replace(B, caught_up=False)
    kwargs = {"no_active_since": 10.0, "failover_after": 1.0, "highest_epoch": 1, "failover_behind_after": 10.0}
    held = decide_roles([slow, behind], now=11.2, **kwargs)  # type: ignore[arg-type]
    assert isinstance(held, Held)
    assert (held.kind, held.broker_id) == ("behind", "broker-b")
    assert "not caught up" in held.why
    assert "FAILOVER_BEHIND_AFTER_SECONDS" in held.why
    # The active answers again within it: nothing changes, nothing lost.
    assert decide_roles([A, behind], now=12.0, **kwargs) is None  # type: ignore[arg-type]
    # Dead after all: promoted once the longer wait is over.
    change = decide_roles([slow, behind], now=20.0, **kwargs)  # type: ignore[arg-type]
    assert isinstance(change, RoleChange)
    assert (change.broker_id, change.role) == ("broker-b", ACTIVE)
    # A caught-up standby is promoted after FAILOVER_AFTER_SECONDS, as before.
    change = decide_roles([slow, B], now=11.2, **kwargs)  # type: ignore[arg-type]
    assert isinstance(change, RoleChange)
    assert change.broker_id == "broker-b"


def test_of_two_standbys_the_one_that_holds_what_was_acknowledged_is_promoted_over_a_higher_epoch() -> None:
    """Chaos seed 4242: broker-a, active at epoch 2, was killed; broker-b (epoch 1: a standby's
    epoch follows no frame) held everything acknowledged. broker-a came back, standby at its
    recorded epoch 2 with nothing in memory (not caught up: it has not had its peer's holdings),
    and the monitor promoted it for its higher epoch: pub-2's message 4290, acknowledged on both,
    reached the subscriber as a gap. The caught-up standby goes first; the epoch only breaks ties."""
    restarted = replace(A, role=STANDBY, epoch=2, caught_up=False, up_since=9.0)
    holds = replace(B, epoch=1, caught_up=True)
    kwargs = {"no_active_since": 4.0, "failover_after": 1.0, "highest_epoch": 2, "failover_behind_after": 10.0}
    change = decide_roles([restarted, holds], now=5.0, **kwargs)  # type: ignore[arg-type]
    assert isinstance(change, RoleChange)
    assert (change.broker_id, change.role, change.epoch) == ("broker-b", ACTIVE, 3)


def test_two_standbys_neither_caught_up_wait_for_their_holdings_before_one_is_promoted() -> None:
    """Both answer and neither is caught up (they have not yet exchanged their holdings): the
    promotion waits FAILOVER_BEHIND_AFTER_SECONDS for one to be, as when the active is silent."""
    a, b = replace(A, role=STANDBY, epoch=2, caught_up=False), replace(B, caught_up=False)
    kwargs = {"no_active_since": 4.0, "failover_after": 1.0, "highest_epoch": 2, "failover_behind_after": 10.0}
    held = decide_roles([a, b], now=5.0, **kwargs)  # type: ignore[arg-type]
    assert isinstance(held, Held)
    assert (held.kind, held.broker_id) == ("behind", "broker-a")
    change = decide_roles([a, replace(b, caught_up=True)], now=5.0, **kwargs)  # type: ignore[arg-type]
    assert isinstance(change, RoleChange)
    assert change.broker_id == "broker-b"
    change = decide_roles([a, b], now=14.5, **kwargs)  # type: ignore[arg-type]
    assert isinstance(change, RoleChange)
    assert change.broker_id == "broker-a"  # the wait is over: the higher epoch

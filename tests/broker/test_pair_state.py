"""Hypothesis drives the pair's role state machine (pair_state.py) with any order of monitor
decisions, peer frames (hostile epochs included), self-promotions, restarts and the passing of
time; the invariants written at the top of pair_state.py are checked after every step."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sokutatsu.broker.pair_state import ACTIVE, MAX_EPOCH, PAIR_FILE, STANDBY, PairState, Role
from sokutatsu.core.errors import FailedPrecondition, InvalidArgument

PEER_TIMEOUT = 1.0
EPOCHS = st.one_of(
    st.integers(0, 8), st.integers(0, 2**64 - 1), st.sampled_from([MAX_EPOCH - 1, MAX_EPOCH, MAX_EPOCH + 1])
)
ROLES = st.sampled_from([ACTIVE, STANDBY])


class PairRoles(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="pair-state-"))
        self.now = 100.0
        self.configured_role = "active"
        self.state = self._load()
        self.epoch_before = self.state.epoch
        # The peer session whose holdings arrived, and the last peer session seen.
        self.holdings_for = -1
        self.peer_session = 0
        self.last_heard = self.now

    # Whether the pair is monitored (invariant 6); the subclass below sets it.
    monitored = False

    def _load(self) -> PairState:
        return PairState.load(
            instance="broker-a",
            role=self.configured_role,
            peer="127.0.0.1:7202",
            peer_link="",
            peer_timeout=PEER_TIMEOUT,
            state_dir=self.folder,
            monitored=self.monitored,
            clock=lambda: self.now,
        )

    @rule(role=ROLES, epoch=EPOCHS)
    def monitor_sets_role(self, role: int, epoch: int) -> None:
        before = (self.state.role, self.state.epoch)
        try:
            self.state.set_by_monitor(role, epoch)  # type: ignore[arg-type]
        except InvalidArgument:
            assert epoch > MAX_EPOCH
            assert (self.state.role, self.state.epoch) == before
        except FailedPrecondition:
            assert epoch < before[1] or (epoch == before[1] and role != before[0])
            assert (self.state.role, self.state.epoch) == before
        else:
            assert (self.state.role, self.state.epoch) == (role, epoch)

    @rule(role=ROLES, epoch=EPOCHS, peer_id=st.sampled_from(["broker-b", "broker-0"]))
    def both_active_frame(self, role: int, epoch: int, peer_id: str) -> None:
        """A peer's frame: when both are active, the older epoch (then the higher id) steps down."""
        was = (self.state.role, self.state.epoch)
        stepped = self.state.step_down_for(peer_id, role, epoch)  # type: ignore[arg-type]
        if stepped:
            assert was[0] == ACTIVE
            assert role == ACTIVE
            assert epoch <= MAX_EPOCH
            assert (was[1], peer_id) < (epoch, "broker-a")
            assert self.state.role == STANDBY

    @rule()
    def promote_alone(self) -> None:
        was = (self.state.role, self.state.epoch)
        if self.state.promote_alone("a subscriber came while the peer is not heard from"):
            assert was[0] == STANDBY
            assert self.state.epoch == was[1] + 1

    @rule(seconds=st.sampled_from([0.1, 0.5, 0.99, 1.0, 3.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @rule(answer=st.one_of(st.none(), st.tuples(ROLES, EPOCHS)))
    def tick(self, answer: tuple[int, int] | None) -> None:
        """The broker runs its checks: an active that did not run for a peer timeout is in doubt
        until its peer answers (or does not); it steps down only for a newer active peer."""
        was = (self.state.role, self.state.epoch, self.state.in_doubt)
        still = self.now - self.state.ticked_at
        doubt = self.state.tick()
        assert doubt == (was[2] or (was[0] == ACTIVE and still > PEER_TIMEOUT))
        assert (self.state.role, self.state.epoch) == was[:2]
        if doubt:
            role, epoch = answer if answer is not None else (None, 0)
            stepped = self.state.settle_doubt("broker-b", role, epoch)  # type: ignore[arg-type]
            assert not self.state.in_doubt
            newer = (was[1], "broker-b") < (epoch, "broker-a")
            assert stepped == (was[0] == ACTIVE and role == ACTIVE and epoch <= MAX_EPOCH and newer)

    @rule(new_peer_session=st.booleans(), holdings=st.booleans())
    def peer_frame(self, new_peer_session: bool, holdings: bool) -> None:
        """The peer's frame; a new session of the peer's always carries its holdings (pair.py)."""
        if new_peer_session:
            self.peer_session += 1
            holdings = True
        self.state.heard(self.peer_session, holdings)
        if holdings:
            self.holdings_for = self.peer_session
        self.last_heard = self.now

    @rule(configured=st.sampled_from(["active", "standby"]))
    def restart(self, configured: str) -> None:
        """kill -9 and start again on the same state folder (whatever ROLE says)."""
        epoch = self.state.epoch
        self.configured_role = configured
        self.state = self._load()
        assert self.state.role == STANDBY
        assert self.state.epoch == epoch
        assert not self.state.synced
        assert not self.state.has_holdings  # a restarted broker is not caught up (chaos seed 4242)
        self.holdings_for = -1
        self.peer_session = 0
        self.epoch_before = epoch

    @precondition(lambda self: self.state.role == ACTIVE and self.state.epoch < MAX_EPOCH)
    @rule()
    def frame_from_an_active_peer_at_the_highest_epoch(self) -> None:
        """The peer is active at the highest epoch: this one steps down and can never promote itself."""
        self.state.step_down_for("broker-b", ACTIVE, MAX_EPOCH)
        assert self.state.role == STANDBY
        assert not self.state.promote_alone("cannot: the epoch is at the highest")

    @invariant()
    def epochs_only_grow_and_stay_within_their_type(self) -> None:
        assert self.epoch_before <= self.state.epoch <= MAX_EPOCH
        self.epoch_before = self.state.epoch

    @invariant()
    def the_recorded_epoch_is_the_current_one(self) -> None:
        recorded = (self.folder / PAIR_FILE).read_text()
        assert f'"epoch": {self.state.epoch}' in recorded

    @invariant()
    def single_copy_exactly_while_the_peer_is_silent(self) -> None:
        assert self.state.peer_up == (self.now - self.state.heard_at < PEER_TIMEOUT)

    @invariant()
    def synced_only_with_the_holdings_of_the_peers_current_session(self) -> None:
        if self.state.synced:
            assert self.state.peer_up
            assert self.holdings_for == self.peer_session > 0

    @invariant()
    def the_peers_last_holdings_count_also_once_it_is_silent(self) -> None:
        """What ``caught_up`` rests on: the holdings of the peer's last session, heard now or not
        (a standby whose active died is caught up; the monitor promotes it at once)."""
        assert self.state.has_holdings == (self.holdings_for == self.peer_session > 0)


TestPairRoles = PairRoles.TestCase
TestPairRoles.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)

LEASE = 1.0


class MonitoredPairRoles(PairRoles):
    """The same machine in a monitored pair (invariant 6), with the monitor's side of the lease
    modelled: a token's answer reaches the monitor some time after the broker made it; the
    monitor grants a token it received, recording the lease's end from its receipt first."""

    def __init__(self) -> None:
        # token -> (when the monitor received it, the epoch the broker answered with)
        self.received: dict[int, tuple[float, int]] = {}
        # The monitor's end of every lease it granted (nothing before the first grant).
        self.monitor_until = 0.0
        super().__init__()

    monitored = True

    def _load(self) -> PairState:
        self.received = {}
        return super()._load()

    @rule(delay=st.sampled_from([0.0, 0.05, 0.4, 1.5]))
    def monitor_takes_a_token(self, delay: float) -> None:
        token, _ = self.state.take_token()
        self.now += delay  # the answer travels
        self.received[token] = (self.now, self.state.epoch)

    @precondition(lambda self: bool(self.received))
    @rule(pick=st.integers(0, 10), other_epoch=st.booleans(), delay=st.sampled_from([0.0, 0.3, 2.0]))
    def monitor_grants(self, pick: int, other_epoch: bool, delay: float) -> None:
        token = sorted(self.received)[pick % len(self.received)]
        at, epoch = self.received[token]
        self.monitor_until = max(self.monitor_until, at + LEASE)  # recorded before it goes out
        self.now += delay  # the grant travels (or is held, and arrives late)
        self.state.grant(token, epoch + 1 if other_epoch else epoch, LEASE)

    @rule()
    def broker_checks_its_lease(self) -> None:
        was = self.state.role
        stepped = self.state.check_lease()
        if stepped:
            assert was == ACTIVE
            assert not self.state.peer_up
            assert self.state.role == STANDBY

    @rule(epoch=EPOCHS, role=st.sampled_from([ACTIVE, STANDBY]))
    def frame_from_the_peer(self, epoch: int, role: Role) -> None:
        """A peer's frame only ever makes it step down: never active again on the peer's word
        (the monitor may be promoting that peer as the frame travels)."""
        was = self.state.role
        self.state.peer_frame("broker-b", role, epoch)
        if was != ACTIVE:
            assert self.state.role != ACTIVE

    @invariant()
    def it_acknowledges_alone_only_within_a_lease_the_monitor_granted(self) -> None:
        alone, why = self.state.acks_alone()
        if self.state.peer_up:
            assert (alone, why) == (False, "")
            return
        assert alone == (self.state.role == ACTIVE and self.now < self.state.alone_until)
        if alone:
            assert self.now < self.monitor_until
        else:
            assert why.startswith("UNAVAILABLE: ")


TestMonitoredPairRoles = MonitoredPairRoles.TestCase
TestMonitoredPairRoles.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_a_first_start_takes_the_configured_role(tmp_path: Path) -> None:
    state = PairState.load(
        instance="broker-a", role="active", peer="", peer_link="", peer_timeout=1.0, state_dir=tmp_path
    )
    assert state.role == ACTIVE
    assert not (tmp_path / PAIR_FILE).exists()


def test_an_unreadable_pair_file_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / PAIR_FILE).write_text("{not json")
    state = PairState.load(
        instance="broker-a", role="active", peer="", peer_link="", peer_timeout=1.0, state_dir=tmp_path
    )
    assert state.role == ACTIVE
    assert "ignoring" in caplog.text


def _monitored_standby(tmp_path: Path, now: list[float]) -> PairState:
    """broker-b, standby in a monitored pair, on the clock ``now[0]``."""
    return PairState.load(
        instance="broker-b",
        role="standby",
        peer="127.0.0.1:7201",
        peer_link="",
        peer_timeout=PEER_TIMEOUT,
        state_dir=tmp_path,
        monitored=True,
        clock=lambda: now[0],
    )


def test_a_broker_that_stepped_down_for_its_lease_is_made_active_again_only_by_the_monitor(tmp_path: Path) -> None:
    """Chaos seed 2630 (loaded machine): broker-b, active at epoch 1, paused past its lease, stepped
    down; broker-a's next frame (standby, epoch 1) made it active again while the monitor was
    promoting broker-a at epoch 2: both answered ACTIVE for 0.1 s. A frame must not do that."""
    now = [0.0]
    state = _monitored_standby(tmp_path, now)
    state.set_by_monitor(ACTIVE, 1)  # promoted; then no lease and no peer
    state.heard(1, False)
    now[0] += 10 * PEER_TIMEOUT
    assert state.check_lease()
    assert state.role == STANDBY
    state.heard(2, False)  # the peer is heard again: its frame says standby at epoch 1
    assert not state.peer_frame("broker-a", STANDBY, 1)
    assert state.role == STANDBY
    assert state.set_by_monitor(ACTIVE, 2)  # only the monitor makes it active again
    assert state.role == ACTIVE


@pytest.mark.parametrize("grace", [0.0, 3.0])
def test_a_broker_promoted_by_the_monitor_steps_down_after_the_grace_the_call_carried(
    tmp_path: Path, grace: float
) -> None:
    """SetRole(ACTIVE) carries the monitor's lease as ``lease_ms``: the monitor counts the broker
    as active until the call's deadline plus it, also when the answer is lost, then may promote
    the other broker. So a promoted broker that hears neither its peer nor a grant within it
    steps down (0: within its peer timeout), never later than the monitor counts."""
    now = [0.0]
    state = _monitored_standby(tmp_path, now)
    now[0] += 10 * PEER_TIMEOUT  # the peer is gone
    assert state.set_by_monitor(ACTIVE, 2, grace)
    end = grace or PEER_TIMEOUT
    now[0] += end * 0.99
    assert not state.check_lease()
    assert state.role == ACTIVE
    now[0] += end * 0.02
    assert state.check_lease()
    assert (state.role, state.epoch) == (STANDBY, 2)


def test_an_active_its_peer_does_not_hear_steps_down_when_its_lease_lapsed(tmp_path: Path) -> None:
    """Chaos seed 7102: the pair's link cut towards broker-b only and the monitor's answers from
    broker-a lost. broker-a still heard broker-b, so it kept its role after its lease lapsed, and
    answered ACTIVE for 0.1 s beside broker-b, promoted, until broker-b's first frame. broker-b's
    frames say it does not hear broker-a: broker-a steps down on them once its lease lapsed, as
    when it does not hear its peer; while they say it is heard, it keeps its role without a lease
    (a healthy pair with its monitor down)."""
    now = [0.0]
    state = _monitored_standby(tmp_path, now)
    state.heard(1, True)
    state.set_by_monitor(ACTIVE, 1, 1.0)
    token, _ = state.take_token()
    assert state.grant(token, 1, 1.0)
    for _ in range(5):  # the lease lapses; the peer's frames go on, saying they hear it
        now[0] += 0.5
        state.heard(1, False, hears_me=True)
        assert not state.check_lease()
    assert state.role == ACTIVE
    now[0] += 0.05
    state.heard(1, False, hears_me=False)
    assert state.check_lease()
    assert (state.role, state.epoch) == (STANDBY, 1)

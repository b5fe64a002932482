"""This broker's place in the pair: role, epoch, peer, and what it may do alone.

Every change of role, epoch or peer goes through :class:`PairState`; the invariants
below are enforced here and nowhere else.

1. **Epochs only grow and stay within their type.** A role change carries an epoch at
   least the current one; an epoch above :data:`MAX_EPOCH` (2^62, far below uint64's
   end, so ``epoch + 1`` always encodes) is refused (``SetRole``) or ignored (a peer's
   frame): no caller can exhaust the pair's epochs. ``SetRole`` with an older epoch is
   refused (FAILED_PRECONDITION); at the current epoch it is a command the monitor sent
   again after losing the answer: OK when it asks for the role held (nothing changes),
   FAILED_PRECONDITION when it asks for another (a role change needs a newer epoch). A
   role is ACTIVE or STANDBY: any other number (``SetRole``, a peer's frame) is
   INVALID_ARGUMENT (:func:`check_role`).
2. **A restarted broker comes back as standby.** Once a broker has known a peer, it
   records the peer and its epoch in ``<STATE_DIR>/pair.json``; a start that finds the
   file is a restart and begins as ``STANDBY`` at the recorded epoch, whatever
   ``SOKUTATSU_BROKER_ROLE`` says. Only the monitor (``SetRole``), a subscriber that
   finds the peer gone, or, in a pair without a monitor, a peer heard as standby too makes
   it active again, with a newer epoch. So a broker killed while active never answers
   ``ACTIVE`` at an old epoch beside its promoted peer. Of two standbys of a pair without a
   monitor that hear each other (the active came back before a subscriber came to its
   standby, which promotes itself only then), the caught-up one takes the active role at the
   epoch after both (of two caught up, the lower broker id; of two behind, the lower id once
   both were so for :data:`BOTH_BEHIND_SECONDS`, as a monitor promotes a standby that is
   behind): :meth:`PairState.lead_both_standby`. Before, both stayed standby for good, each
   redirecting every subscriber to the other (an attacker's review).
3. **Never acknowledge alone while the peer is heard.** A publish acknowledgement says
   ``single_copy`` only while no frame came from the peer for ``PEER_TIMEOUT_MS``
   (:attr:`PairState.peer_up`); in a monitored pair only an active says it, under
   invariant 6 (:meth:`PairState.acks_alone`, asked just before each acknowledgement goes out).
4. **Take a subscriber over only with the peer's holdings.** Each time a broker starts
   hearing its peer (again), it opens a new *session* and sends the peer, in its next
   frame, its *holdings*: per durable queue, the last number of each publisher it put
   there. They are taken after it heard the peer, so they cover everything it
   acknowledged alone. The receiver raises its queues' floors to them (it may lack
   those messages: it was away), and those of queues it makes later as it makes them, and
   is :attr:`synced` only while it holds the holdings
   of the peer's current session. ``AcceptSubscriber`` is refused until then, and its
   floor then says from where this broker holds the subscriber's messages, including
   publishers it has not heard from since it came back. A standby that serves a queue it may
   lack messages of (from switchover step 2 until the subscriber is past its floor) sends a
   subscriber that comes from further back, on its own, to the peer (``Broker.attach``); one
   the peer redirected here (``SubscribeOpen.redirected``) it serves, telling what it lacks
   as a gap, so a subscriber never bounces between the two.
5. **An active that did not run for a peer timeout checks before it acts.** A broker
   paused (SIGSTOP) or starved for longer than ``PEER_TIMEOUT_MS`` was, to its peer and
   the monitor, gone: its peer may have been promoted meanwhile. When it runs again
   (:meth:`PairState.tick`) it is *in doubt*: before it answers a role or statistics,
   takes a subscriber or sends a frame, it asks the peer's role (``Broker.confirm_role``)
   and steps down when the peer answers as active at a newer epoch. So it never answers
   ``ACTIVE`` beside a newer active, and keeps the role when the peer was not promoted.

6. **In a monitored pair, an active acknowledges alone only under the monitor's lease, and one
   that hears neither its peer nor the monitor steps down.** With ``SOKUTATSU_BROKER_MONITORED``
   (the monitor decides failovers) an active that does not hear its peer says ``single_copy``
   only while it holds a lease the monitor granted for a *token it made while it already did
   not hear its peer*; the lease lasts the granted ``lease_ms`` from when it made that token, on
   its own monotonic clock (:meth:`PairState.take_token`, :meth:`PairState.grant`). The monitor
   counts the same lease from when it *received* the token, which is later, and promotes the
   standby only once that has lapsed (plus a margin) on its clock, or once it saw the broker
   standby. So the old active's last acknowledgement alone comes before the new active's first,
   and an active cut off from the monitor before it stopped hearing its peer never acknowledges
   alone (whatever it acknowledged alone the monitor knew of). Without the lease its
   acknowledgements hold the messages but say ``single_copy_refused`` (UNAVAILABLE and why): the
   publisher counts them only with the other broker's. An active that does not hear its peer
   and whose lease lapsed (or, promoted by ``SetRole``, that got none within the ``lease_ms`` the
   call carried, else a peer timeout: the monitor counts it as active until that call's deadline
   plus ``lease_ms``, also when the answer is lost) steps down to standby at its epoch
   (:meth:`PairState.check_lease`, run with :meth:`tick` before it answers a role or statistics,
   takes a subscriber or acknowledges): it never answers ``ACTIVE``
   beside the standby the monitor promotes. The same holds for an active whose peer's frames say
   the peer does not hear it (a link cut one way, ``not_hearing_you``): before, it stayed
   ``ACTIVE`` until the promoted peer's first frame (chaos seed 7102, 0.1 s with two actives).
   Only the monitor makes it active again (``SetRole``
   at a newer epoch), never its peer's frames: a frame saying the peer is standby may have left
   before the monitor promoted that peer, so a broker that came back active on it answered
   ``ACTIVE`` beside the promoted peer (chaos seed 2630, on a loaded machine). So a monitored pair
   whose link is cut while its monitor is down has no active until the monitor is back: publishes
   are held, never acknowledged alone. A grant applies only while the broker is active at
   the epoch the monitor names; a role change ends the lease. An active that never held one this
   term (configured active at start) does not step down: it acknowledges nothing alone, and the
   monitor grants it a lease once it reaches it. A monitored standby neither acknowledges alone
   (a standby that did, while the active ran on but a publisher could not reach it, left the
   active serving subscribers without what it acknowledged: the SDK reported gaps; chaos seed
   508077) nor promotes itself: only the monitor promotes, and only the lease holder counts
   alone. **Without a monitor** (the setting off, the default for a bare
   pair) none of this applies: an active or standby that does not hear its peer acknowledges
   alone and a standby a subscriber comes to promotes itself, as before; a pair cut in two then
   may have two actives, each acknowledging alone (docs/broker.md, The monitor's lease).
7. **A subscriber the standby served, and the backlog it spilled, survive the standby's crash.**
   The active keeps only a tail (``AWAY_TAIL``) of a subscriber it handed to the standby; the rest
   is on the standby's disk. So (a) each broker records in its catalog which durable subscribers it
   serves, on disk before it answers ``AcceptSubscriber`` (other changes soon after); (b) a
   restarted broker whose catalog says it served a subscriber *reclaims* it: its copy, recovered
   from its segment log (which tells exactly which numbers it holds), holds back what arrives, and
   its holdings say ``reclaims``. When the peer's holdings say the peer's copy is ``away``, the
   peer sends what that copy holds after the reclaimer's numbers (a *fill*: what was acknowledged
   while the reclaimer was down, each message with its true predecessor, so a hole neither holds is
   still told as a gap); the reclaimer queues the fill and what it held back, in each publisher's
   order (what it held back from before the peer's tail begins goes first), and serves the
   subscriber again, lacking only what its log lacked and what came past the fill. The claim
   lapses, and the copy stays a shadow (what was held back queued after what it holds), when the
   peer's holdings say its copy is not away, when the peer's watermarks say it serves the
   subscriber, when the peer does not hold it, when the fill has not come ``RECLAIM_SECONDS`` (at
   least two peer timeouts) after it first heard the peer (a peer silent a moment meanwhile sends
   the fill on its next stream), when it has not heard its peer as long after it recovered its
   queues, when it is promoted (it serves what it holds), or when the subscription is deleted; it
   then sends its holdings again, so the peer acts on them. Until then it refuses the subscriber
   (UNAVAILABLE, retry), the peer does not take it over, and its catalog keeps the claim (a second
   crash meanwhile reclaims again).
   (c) An active whose copy is away refuses (UNAVAILABLE, retry) a subscriber whose position is
   before what its tail holds while it has heard its peer within ``AWAY_WAIT``, and serves it after
   that, telling what it lacks as a gap (the peer's disk may be gone). Before, it served it at once:
   the restarted standby recovered from disk what the subscriber had been told was a gap (chaos
   seed 907126).

The queue side of ownership (which broker serves a subscriber, and from where) is in
``subscription_queue.py``; the broker (``broker.py``) applies both.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

ACTIVE = broker_pb2.BROKER_ROLE_ACTIVE
STANDBY = broker_pb2.BROKER_ROLE_STANDBY
Role: TypeAlias = broker_pb2.BrokerRole.ValueType
# The highest epoch a broker takes (see invariant 1).
MAX_EPOCH = 2**62
PAIR_FILE = "pair.json"
# How many of its latest lease tokens a broker keeps for the monitor to grant (invariant 6).
TOKENS_KEPT = 4
# Two standbys of a pair without a monitor, both behind: the lower id takes the active role after
# this long (invariant 2), as the monitor's FAILOVER_BEHIND_AFTER_SECONDS promotes a standby behind.
BOTH_BEHIND_SECONDS = 10.0


def role_name(role: Role) -> str:
    return broker_pb2.BrokerRole.Name(role).removeprefix("BROKER_ROLE_").lower()


def check_role(role: int, field: str) -> None:
    """``role`` when a broker can hold it (ACTIVE or STANDBY); else ``InvalidArgument`` naming ``field``
    and the allowed values (an unknown number is never read as either)."""
    if role not in (ACTIVE, STANDBY):
        raise InvalidArgument(
            f"{field} {role} is not a role a broker takes: use BROKER_ROLE_ACTIVE = {ACTIVE} or "
            f"BROKER_ROLE_STANDBY = {STANDBY}"
        )


@dataclass
class PairState:
    instance: str
    role: Role
    epoch: int
    # The peer's address for clients (redirects) and for the pair's own stream (default: the same).
    peer: str
    peer_link: str
    # Whether the peer address was configured (a configured one is never replaced by a learned one).
    peer_configured: bool
    peer_timeout: float
    # Monotonic time of the last frame from the peer.
    heard_at: float
    # Sessions (invariant 4): this broker's count of times it started hearing the peer, the
    # peer's count from its last frame, and the peer session whose holdings arrived here.
    session: int = 0
    peer_session: int = 0
    holdings_session: int = -1
    path: Path | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    # When this broker last ran its checks, and whether it has since to ask its peer (invariant 5).
    ticked_at: float = 0.0
    in_doubt: bool = False
    # Invariant 6: whether the monitor decides failovers; the lease (monotonic time it ends, and
    # the end of the part granted for tokens made while the peer was not heard; 0: none this term);
    # the tokens it made lately (number -> (time, peer heard then)).
    monitored: bool = False
    lease_until: float = 0.0
    alone_until: float = 0.0
    tokens: dict[int, tuple[float, bool]] = field(default_factory=dict)
    last_token: int = 0
    # Whether the peer's last frame said it hears this broker (a link cut one way: it does not).
    peer_hears_me: bool = True
    # Since when both brokers of a pair without a monitor are standby, as this one hears it, and in
    # which of this broker's sessions (a silence between restarts the count: invariant 2).
    both_standby_since: float = 0.0
    both_standby_session: int = 0

    @classmethod
    def load(
        cls,
        *,
        instance: str,
        role: str,
        peer: str,
        peer_link: str,
        peer_timeout: float,
        state_dir: Path,
        monitored: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> PairState:
        """The state at start: as configured, or, on a restart (``pair.json``), standby at the recorded epoch."""
        path = state_dir / PAIR_FILE
        recorded = _read(path)
        start_role = ACTIVE if role == "active" else STANDBY
        epoch = 0
        learned = ""
        if recorded is not None:
            recorded_epoch = recorded.get("epoch", 0)
            epoch = min(recorded_epoch if isinstance(recorded_epoch, int) else 0, MAX_EPOCH)
            learned = str(recorded.get("peer", ""))
            if learned or peer:
                if start_role == ACTIVE:
                    log.warning(
                        "%s was in a pair before (%s): restarting as standby at epoch %d; the monitor or a "
                        "subscriber that finds the peer gone makes it active again",
                        instance,
                        path,
                        epoch,
                    )
                start_role = STANDBY
        state = cls(
            instance=instance,
            role=start_role,
            epoch=epoch,
            peer=peer or learned,
            peer_link=peer_link,
            peer_configured=bool(peer),
            peer_timeout=peer_timeout,
            # A known peer counts as up for one timeout after start: a broker that just came
            # back must not take subscribers (or the active role) before the peer could reach it.
            heard_at=clock() if (peer or learned) else -1e18,
            path=path,
            clock=clock,
            ticked_at=clock(),
            monitored=monitored,
        )
        if state.peer:
            state.save()
        return state

    # ------------------------------------------------------------------ peer --
    @property
    def peer_up(self) -> bool:
        """Whether the peer sent a frame within the peer timeout (invariant 3)."""
        return self.silent_for() < self.peer_timeout

    def silent_for(self) -> float:
        """Seconds since the peer's last frame (or since start, for a known peer; huge for none)."""
        return self.clock() - self.heard_at

    @property
    def link_address(self) -> str:
        """Where the pair's own stream goes (``PEER_LINK``, else the peer's address)."""
        return self.peer_link or self.peer

    @property
    def synced(self) -> bool:
        """Whether this broker hears the peer and has its holdings of its current session (invariant 4)."""
        return self.peer_up and self.has_holdings

    @property
    def has_holdings(self) -> bool:
        """Whether this broker got the peer's holdings of the peer's last session, heard now or not:
        it then knows of everything the peer acknowledged alone before it stopped hearing it
        (while the peer hears it, the peer acknowledges nothing alone). A restarted broker has
        none until the peer's first frame."""
        return self.peer_session > 0 and self.holdings_session == self.peer_session

    def learn_peer(self, address: str, why: str) -> None:
        """A peer address from a frame or the monitor; a configured one is kept."""
        if not address or address == self.peer or self.peer_configured:
            return
        log.info("the peer's address is %s (%s)", address, why)
        self.peer = address
        self.save()

    def heard(self, peer_session: int, holdings_included: bool, hears_me: bool = True) -> bool:
        """A frame from the peer arrived (``hears_me``: whether the peer said it hears this one);
        True when it opens a new session of this broker's.

        Call before applying the frame's holdings.
        """
        new_session = not self.peer_up or self.session == 0
        self.heard_at = self.clock()
        self.peer_hears_me = hears_me
        if new_session:
            self.session += 1
        if peer_session != self.peer_session:
            self.peer_session = peer_session
        if holdings_included:
            self.holdings_session = peer_session
        return new_session

    def heard_by_probe(self) -> None:
        """The peer answered ``GetRole`` (at start): it is up, though no session is open yet."""
        self.heard_at = self.clock()

    def tick(self) -> bool:
        """This broker runs: an active that had not run for a peer timeout is in doubt until
        it has asked its peer (invariant 5). Called every few tens of ms and before acting as
        active; True while in doubt."""
        now = self.clock()
        still = now - self.ticked_at
        self.ticked_at = now
        if still > self.peer_timeout and self.role == ACTIVE and self.peer and not self.in_doubt:
            log.warning(
                "%s did not run for %.2fs (paused or starved), longer than the peer timeout: asking the peer "
                "whether it was promoted meanwhile before acting as active",
                self.instance,
                still,
            )
            self.in_doubt = True
        return self.in_doubt

    def settle_doubt(self, peer_id: str, peer_role: Role | None, peer_epoch: int) -> bool:
        """The peer's answer after a doubt (``peer_role`` None: no answer). True when this one stepped down."""
        self.in_doubt = False
        if peer_role is None:
            return False
        return self.step_down_for(peer_id, peer_role, peer_epoch)

    # ----------------------------------------------------------------- lease --
    def take_token(self) -> tuple[int, bool]:
        """A token for the monitor to grant (invariant 6): its number and whether the peer is heard now."""
        self.last_token += 1
        up = self.peer_up
        self.tokens[self.last_token] = (self.clock(), up)
        for old in [t for t in self.tokens if t <= self.last_token - TOKENS_KEPT]:
            del self.tokens[old]
        return self.last_token, up

    def grant(self, token: int, epoch: int, lease: float) -> bool:
        """The monitor grants ``token`` for ``lease`` seconds at ``epoch``; True when applied."""
        made = self.tokens.get(token)
        if made is None or self.role != ACTIVE or epoch != self.epoch:
            return False
        at, peer_was_up = made
        self.lease_until = max(self.lease_until, at + lease)
        if not peer_was_up:
            self.alone_until = max(self.alone_until, at + lease)
        return True

    @property
    def lease_left(self) -> float:
        return max(0.0, self.lease_until - self.clock())

    def acks_alone(self) -> tuple[bool, str]:
        """For an acknowledgement sent now: ``single_copy``, and why not although the peer is not heard."""
        if self.peer_up:
            return False, ""
        now = self.clock()
        if not self.monitored or (self.role == ACTIVE and now < self.alone_until):
            return True, ""
        if self.role != ACTIVE:
            why = "it is standby: in a monitored pair only the active holding the monitor's lease acknowledges alone"
        elif now < self.lease_until:
            why = "the monitor has not yet renewed its lease since it stopped hearing its peer"
        elif self.lease_until:
            why = "its lease from the monitor lapsed"
        else:
            why = "the monitor has granted it no lease"
        return False, (
            f"UNAVAILABLE: {self.instance} does not hear its peer {self.peer or '(unknown)'} and {why}: it holds "
            "these messages but may not acknowledge them alone (SOKUTATSU_BROKER_MONITORED); they count once the "
            "other broker holds them too, or once the monitor renews the lease or promotes a broker"
        )

    def check_lease(self) -> bool:
        """A monitored active that holds no lease and does not hear its peer, or is not heard by it,
        steps down (invariant 6); True when it did."""
        if not self.monitored or self.role != ACTIVE or (self.peer_up and self.peer_hears_me):
            return False
        now = self.clock()
        if not self.lease_until or now < self.lease_until:
            return False
        why = "its lease from the monitor lapsed" if self.lease_until else "the monitor granted it no lease"
        cut = "it does not hear its peer" if not self.peer_up else "its peer does not hear it"
        return self.change(
            STANDBY,
            self.epoch,
            f"{cut} and {why}: the monitor may promote the peer (SOKUTATSU_BROKER_MONITORED)",
        )

    # ----------------------------------------------------------------- roles --
    @staticmethod
    def check_epoch(epoch: int, what: str) -> None:
        if epoch > MAX_EPOCH:
            raise InvalidArgument(f"{what}: epoch {epoch} is over the highest a broker takes ({MAX_EPOCH})")

    def set_by_monitor(self, role: Role, epoch: int, grace: float = 0.0) -> bool:
        """``SetRole``, fenced by epoch (invariant 1); True when the role changed. ``grace``: how long
        a promoted monitored broker stays active without its peer or a lease (0: the peer timeout)."""
        check_role(role, "SetRoleRequest.role")
        self.check_epoch(epoch, "SetRole")
        if epoch < self.epoch:
            raise FailedPrecondition(
                f"epoch {epoch} is older than {self.instance}'s epoch {self.epoch}; a newer decision exists"
            )
        if epoch == self.epoch and role != self.role:
            raise FailedPrecondition(
                f"{self.instance} is already {role_name(self.role)} at epoch {epoch}: a different role needs a "
                "newer epoch"
            )
        # The same role at the same epoch is a re-sent SetRole (its answer was lost): OK, nothing changes.
        changed = self.change(role, epoch, "set by the monitor")
        if changed and role == ACTIVE:
            # Invariant 6: a promoted broker that hears neither its peer nor, within the grace the
            # monitor sent (it counts the broker as active that long), its lease steps down (this
            # is no lease to acknowledge alone).
            self.lease_until = self.clock() + (grace or self.peer_timeout)
        return changed

    def promote_alone(self, why: str) -> bool:
        """Become active at the next epoch (the peer is gone); True when the role changed."""
        if self.role == ACTIVE:
            return False
        if self.epoch >= MAX_EPOCH:
            log.error(
                "%s cannot become active: its epoch %d is at the highest a broker takes", self.instance, self.epoch
            )
            return False
        return self.change(ACTIVE, self.epoch + 1, why)

    def lead_both_standby(
        self, peer_id: str, peer_role: Role, peer_epoch: int, peer_caught_up: bool, caught_up: Callable[[], bool]
    ) -> bool:
        """Invariant 2, a pair without a monitor: once the peer's frame is applied (its subscription
        list too: a subscription this broker lacks must count before it judges itself caught up), take
        the active role when both are standby and this one is the one to lead; True when the role
        changed. Only while the peer hears this broker (a link cut one way would give two actives:
        the peer, not hearing this one, promotes itself when a subscriber comes) and with the peer's
        holdings of its current session."""
        if self.monitored or self.role != STANDBY or peer_role != STANDBY or not self.peer_hears_me or not self.synced:
            self.both_standby_since = 0.0
            return False
        now = self.clock()
        if not self.both_standby_since or self.both_standby_session != self.session:
            self.both_standby_since = now
            self.both_standby_session = self.session
        lower = self.instance < peer_id
        if caught_up():
            leads = lower or not peer_caught_up
        else:
            leads = lower and not peer_caught_up and now - self.both_standby_since >= BOTH_BEHIND_SECONDS
        epoch = max(self.epoch, peer_epoch) + 1
        if not leads or epoch > MAX_EPOCH:
            return False
        self.both_standby_since = 0.0
        return self.change(
            ACTIVE, epoch, f"its peer {peer_id} is standby too, in a pair without a monitor (invariant 2)"
        )

    def peer_frame(self, peer_id: str, peer_role: Role, peer_epoch: int) -> bool:
        """The roles a peer's frame states; True when this broker's role changed. A frame makes a
        broker step down (invariant 1), and never active again in a monitored pair (invariant 6):
        without a monitor, see :meth:`lead_both_standby`."""
        return self.step_down_for(peer_id, peer_role, peer_epoch)

    def step_down_for(self, peer_id: str, peer_role: Role, peer_epoch: int) -> bool:
        """Both active: the older epoch, then the higher broker id, steps down; True when this one did."""
        if peer_epoch > MAX_EPOCH:
            log.warning("ignoring the peer %s's epoch %d: over the highest a broker takes", peer_id, peer_epoch)
            return False
        if peer_role != ACTIVE or self.role != ACTIVE or (self.epoch, peer_id) >= (peer_epoch, self.instance):
            return False
        return self.change(STANDBY, peer_epoch, f"the peer {peer_id} is active with epoch {peer_epoch}")

    def rejoin(self, peer_id: str, peer_epoch: int) -> None:
        """At start, the peer answered as active: this one is standby, at least at the peer's epoch."""
        if self.role != STANDBY:
            log.warning("peer %s (%s) is active; rejoining as standby", self.peer, peer_id)
        self.change(STANDBY, max(self.epoch, min(peer_epoch, MAX_EPOCH)), "the peer is active")

    def change(self, role: Role, epoch: int, why: str) -> bool:
        """Apply a role and epoch (never an older epoch); record them; True when the role changed."""
        if epoch < self.epoch:  # pragma: no cover - every caller checks; kept as the invariant's guard
            raise FailedPrecondition(f"epoch {epoch} is older than {self.instance}'s epoch {self.epoch}")
        changed = role != self.role
        if changed:
            log.warning("role %s -> %s (epoch %d): %s", role_name(self.role), role_name(role), epoch, why)
        if changed or epoch != self.epoch:
            # A lease holds for one role at one epoch (invariant 6).
            self.lease_until = self.alone_until = 0.0
            self.tokens.clear()
        if changed or epoch != self.epoch:
            self.role = role
            self.epoch = epoch
            self.save()
        return changed

    # ----------------------------------------------------------- persistence --
    def save(self) -> None:
        """Record the peer and epoch (small, rare: on the event loop, atomically and durably)."""
        if self.path is None or not self.peer:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        with temporary.open("w") as out:
            json.dump({"peer": self.peer, "epoch": self.epoch}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)


def _read(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    return data if isinstance(data, dict) else None

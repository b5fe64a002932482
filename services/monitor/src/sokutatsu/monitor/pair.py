"""Roles of the broker pair: failover when the active is gone, one active only.

Pure rules over what the monitor sees (time passed in):

* **Failover**: when no reachable broker has reported ``ACTIVE`` for ``failover_after``
  seconds, the reachable standby is promoted (the higher epoch, then the one up longest,
  then the first configured). This covers the active dying and a pair that came up with no
  active at all. The monitor's silence alone is not enough: while the standby to promote
  still hears the other broker (``BrokerStats.peer_up``: a pair frame within the brokers'
  peer timeout) and the monitor cannot see that broker, it is alive but busy or cut off from
  the monitor, and the failover is held. It goes ahead once the standby stops hearing it too,
  at once when the monitor sees the other broker is not active (both standby), and when that
  broker said it is shutting down (health not SERVING). And it waits until the lost active's
  lease has lapsed on the monitor's clock (``lease.py``; in a monitored pair the active may
  acknowledge alone until then, and steps down then if it hears nobody), or the monitor saw it
  standby. Of two standbys the caught-up one (``BrokerStats.caught_up``: it holds every message
  its subscribers have not acknowledged) is promoted, then the higher epoch: a restarted broker
  comes back with nothing in memory at its recorded epoch, and promoting it over the standby
  that held everything lost what was acknowledged (chaos seed 4242). A standby that is not
  caught up (it may lack messages the other holds, which promoting it would lose) is promoted
  only after ``failover_behind_after`` without an active, so an active that is slow, not dead,
  is not replaced by a broker without its messages (chaos seed 1964 under load: 2,111
  acknowledged messages lost to a gap), and two standbys that answer get that long to exchange
  their holdings; a caught-up standby after ``failover_after``.
* **One active**: when both report ``ACTIVE`` (a broker came back as active after the
  standby was promoted), the one with the lower epoch is demoted; on equal epochs, the one
  that came back last.

Every change carries an epoch above every epoch seen, so a broker can fence off commands
from the past (``SetRole`` with an older epoch is refused). Epochs the monitor proposes stay
at or under :data:`MAX_EPOCH`: when a change would need a higher one (a broker reports an
absurd epoch, e.g. one set by hand with ``SetRole``), the change is held and said why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sokutatsu.broker.v1 import broker_pb2

ACTIVE = broker_pb2.BROKER_ROLE_ACTIVE
STANDBY = broker_pb2.BROKER_ROLE_STANDBY
# The highest epoch the monitor proposes (the brokers refuse SetRole above it); far below
# uint64's end, so no increment of an epoch seen can overflow the field.
MAX_EPOCH = 2**62


@dataclass(frozen=True)
class Member:
    broker_id: str
    address: str
    reachable: bool
    role: broker_pb2.BrokerRole.ValueType
    epoch: int
    # Monotonic time it became reachable (last time), and it was last heard from.
    up_since: float
    last_ok: float
    # Its last statistics: it hears its peer (a pair frame within the peer timeout).
    peer_up: bool = False
    # Its health answered other than SERVING: it is shutting down.
    stopping: bool = False
    # Its last statistics: it holds every message its subscribers have not acknowledged.
    caught_up: bool = True


@dataclass(frozen=True)
class RoleChange:
    broker_id: str
    role: broker_pb2.BrokerRole.ValueType
    epoch: int
    peer: str  # host:port of the other broker
    why: str
    failover: bool  # a promotion because the active was lost


@dataclass(frozen=True)
class Held:
    """A change the rules would make but must not (yet): ``kind`` names the reason, ``why`` says it."""

    kind: str  # "peer-heard", "lease", "behind" or "epoch-exhausted"
    broker_id: str  # the broker the change was for
    why: str


def decide_roles(
    members: Sequence[Member],
    now: float,
    no_active_since: float | None,
    failover_after: float,
    highest_epoch: int,
    *,
    lease_over: Mapping[str, float] | None = None,
    failover_behind_after: float | None = None,
) -> RoleChange | Held | None:
    """The one role change to make now, if any (``members`` in configured order); ``lease_over``:
    from when each broker holds no lease of the monitor's (none given: no leases);
    ``failover_behind_after``: how long a standby that is not caught up waits (default
    ``failover_after``)."""
    change = _decide(
        members,
        now,
        no_active_since,
        failover_after,
        highest_epoch,
        lease_over=lease_over or {},
        failover_behind_after=failover_after if failover_behind_after is None else failover_behind_after,
    )
    if isinstance(change, RoleChange) and change.epoch > MAX_EPOCH:
        return _exhausted(change, members, highest_epoch)
    return change


def _decide(
    members: Sequence[Member],
    now: float,
    no_active_since: float | None,
    failover_after: float,
    highest_epoch: int,
    *,
    lease_over: Mapping[str, float],
    failover_behind_after: float,
) -> RoleChange | Held | None:
    epoch = max([highest_epoch, *(m.epoch for m in members)]) + 1
    actives = [m for m in members if m.reachable and m.role == ACTIVE]
    if len(actives) > 1:
        order = {m.broker_id: i for i, m in enumerate(members)}
        # Keep the higher epoch; on a tie, the one up longer; then the first configured.
        keep = max(actives, key=lambda m: (m.epoch, -m.up_since, -order[m.broker_id]))
        demote = next(m for m in actives if m is not keep)
        if demote.epoch < keep.epoch:
            why = f"both brokers are active; {demote.broker_id} has the older epoch ({demote.epoch} < {keep.epoch})"
        else:
            why = f"both brokers are active at epoch {keep.epoch}; {demote.broker_id} came back last"
        return RoleChange(demote.broker_id, STANDBY, epoch, keep.address, why, failover=False)
    if actives or no_active_since is None or now - no_active_since < failover_after:
        return None
    standbys = [m for m in members if m.reachable]
    if not standbys:
        return None
    order = {m.broker_id: i for i, m in enumerate(members)}
    # The caught-up one first (it holds what was acknowledged; a restarted broker has nothing in
    # memory, whatever epoch it recorded: chaos seed 4242), then the higher epoch, the one up
    # longer, the first configured.
    chosen = max(standbys, key=lambda m: (m.caught_up, m.epoch, -m.up_since, -order[m.broker_id]))
    other = next((m for m in members if m is not chosen), None)
    gone = f"{other.broker_id} has not answered as active" if other is not None else "no broker answers as active"
    why = f"{gone} for {now - no_active_since:.2f}s"
    behind_for = failover_behind_after - (now - no_active_since)
    held = _wait(chosen, other, now=now, why=why, lease_over=lease_over, epoch=epoch, behind_for=behind_for)
    if held is not None:
        return held
    if other is not None and not other.reachable:
        why += f" and {chosen.broker_id} does not hear it either" if not other.stopping else " (it is shutting down)"
    return RoleChange(chosen.broker_id, ACTIVE, epoch, other.address if other else "", why, failover=True)


def _wait(
    chosen: Member,
    other: Member | None,
    *,
    now: float,
    why: str,
    lease_over: Mapping[str, float],
    epoch: int,
    behind_for: float,
) -> Held | None:
    """Why the promotion of ``chosen`` over the lost ``other`` must wait, if it must."""
    if other is None:
        return None
    if not other.reachable and not other.stopping and chosen.peer_up:
        return Held(
            "peer-heard",
            chosen.broker_id,
            f"{why}, but {chosen.broker_id} still hears it (peer_up): it is busy or cut off from the monitor, "
            f"not dead; no failover while {chosen.broker_id} hears it",
        )
    over = lease_over.get(other.broker_id, 0.0)
    if now < over and epoch <= MAX_EPOCH:  # an exhausted epoch is said instead
        return Held(
            "lease",
            chosen.broker_id,
            f"{why}, but {other.broker_id} may still hold the monitor's lease for {over - now:.2f}s (it may "
            f"acknowledge publishes alone until then): {chosen.broker_id} is promoted once it lapsed",
        )
    if not chosen.caught_up and behind_for > 0 and epoch <= MAX_EPOCH:
        # Chosen first when caught up, so the other is not caught up either (or does not answer).
        unless = "answers" if not other.reachable else "or it is caught up"
        return Held(
            "behind",
            chosen.broker_id,
            f"{why}, but {chosen.broker_id} is not caught up: it may lack messages {other.broker_id} "
            f"holds, which promoting it would lose (its subscribers told of a gap); promoted in "
            f"{behind_for:.2f}s unless {other.broker_id} {unless} (FAILOVER_BEHIND_AFTER_SECONDS)",
        )
    return None


def _exhausted(change: RoleChange, members: Sequence[Member], highest_epoch: int) -> Held:
    top = max(members, key=lambda m: m.epoch)
    source = (
        f"{top.broker_id} reports epoch {top.epoch}"
        if top.epoch >= highest_epoch
        else (f"epoch {highest_epoch} was seen earlier")
    )
    role = broker_pb2.BrokerRole.Name(change.role).removeprefix("BROKER_ROLE_").lower()
    return Held(
        "epoch-exhausted",
        change.broker_id,
        f"{change.broker_id} should become {role} ({change.why}), but the pair's epoch is exhausted: {source}, "
        f"and a role change needs a higher one, above {MAX_EPOCH} (2^62), the most the monitor proposes; "
        "no role change until the brokers' epochs are back under it (a broker keeps its epoch across "
        "restarts, in <STATE_DIR>/pair.json; only SetRole calls by hand get this high: turn auth on)",
    )

"""Roles of the broker pair: failover when no broker answers as active, one active only.

Pure rules over what the monitor sees (time passed in):

* **Failover**: when no reachable broker has reported ``ACTIVE`` for ``failover_after``
  seconds, the reachable standby is promoted (the higher epoch, then the one up longest,
  then the first configured). This covers the active dying and a pair that came up with no
  active at all.
* **One active**: when both report ``ACTIVE`` (a broker came back as active after the
  standby was promoted), the one with the lower epoch is demoted; on equal epochs, the one
  that came back last.

Every change carries an epoch above every epoch seen, so a broker can fence off commands
from the past (``SetRole`` with an older epoch is refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sokutatsu.broker.v1 import broker_pb2

ACTIVE = broker_pb2.BROKER_ROLE_ACTIVE
STANDBY = broker_pb2.BROKER_ROLE_STANDBY


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


@dataclass(frozen=True)
class RoleChange:
    broker_id: str
    role: broker_pb2.BrokerRole.ValueType
    epoch: int
    peer: str  # host:port of the other broker
    why: str
    failover: bool  # a promotion because the active was lost


def decide_roles(
    members: Sequence[Member], now: float, no_active_since: float | None, failover_after: float, highest_epoch: int
) -> RoleChange | None:
    """The one role change to make now, if any (``members`` in configured order)."""
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
    chosen = max(standbys, key=lambda m: (m.epoch, -m.up_since, -order[m.broker_id]))
    other = next((m for m in members if m is not chosen), None)
    gone = f"{other.broker_id} has not answered as active" if other is not None else "no broker answers as active"
    why = f"{gone} for {now - no_active_since:.2f}s"
    return RoleChange(chosen.broker_id, ACTIVE, epoch, other.address if other else "", why, failover=True)

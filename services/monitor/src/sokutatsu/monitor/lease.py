"""The monitor's lease on the active broker (the broker's side: ``pair_state.py``, invariant 6).

In a monitored pair (``SOKUTATSU_BROKER_MONITORED``) an active that does not hear its peer
acknowledges publishes alone only under this lease, and the monitor promotes the standby only
once the old active's lease has lapsed: so two brokers never acknowledge alone at once, and the
one cut off from both its peer and the monitor steps down before its peer is promoted.

Each round (the stats interval) the monitor calls ``RenewLease`` on every reachable broker that
reports ``ACTIVE``, and on a broker whose own last ``RenewLease`` answer, newer than its
statistics and within a lease, said ``ACTIVE`` (statistics lag under load). The call grants the
token the broker gave in its previous answer and takes a new one. The broker counts the lease
(``LEASE_MS``) from when it made the token; the monitor from when it received the answer that
carried it, which is later. The monitor records that end *before* it sends the grant (a grant
that arrives late, or whose answer is lost, is covered), and counts a lease as over only
:func:`margin` after it (clock-rate differences, an acknowledgement already on its way).

A grant goes only to the broker the monitor holds active (reachable, ``ACTIVE``, the higher
epoch), at the epoch its token was made at, and only while no other broker may hold a lease. A
broker seen answering ``STANDBY`` at (or after) the epoch it was last promoted at holds none (a
role change ends a lease on the broker, and a lease is granted again only at a newer epoch).
Promoting a broker counts as granting it a lease until the ``SetRole`` call's deadline plus the
lease, recorded before the call and kept whatever its answer: the call carries the lease as its
``lease_ms``, and a broker it promoted that hears neither its peer nor a grant within it steps
down. So a promotion whose answer was lost holds the next one back until that broker is standby
again, and the next carries a newer epoch (``roles.py``): never two actives at one epoch. At
start the monitor counts every broker as holding a lease for one ``LEASE_MS``: a monitor before
it may have granted one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.monitor.assignments import BrokerView
from sokutatsu.monitor.broker_link import rpc_error_text
from sokutatsu.monitor.host import KeeperHost

log = logging.getLogger(__name__)

ACTIVE = broker_pb2.BROKER_ROLE_ACTIVE
STANDBY = broker_pb2.BROKER_ROLE_STANDBY


def margin(lease: float) -> float:
    """How long after a lease's end (on the monitor's clock) the monitor counts it as over."""
    return max(0.1, 0.1 * lease)


@dataclass
class Lease:
    """One broker's lease as the monitor knows it (monotonic times of the monitor)."""

    # The latest end of a lease the monitor granted it (or assumed at start).
    until: float
    # The token of its last answer, when it arrived, and the role and epoch it was made at.
    token: int = 0
    token_at: float = 0.0
    token_role: broker_pb2.BrokerRole.ValueType = broker_pb2.BROKER_ROLE_UNSPECIFIED
    token_epoch: int = 0
    calling: bool = False
    told_unmonitored: bool = False
    # Whether its last answer said the grant applied (logged when it changes).
    holds: bool = False
    # The epoch of its last promotion by the monitor: a standby seen at an older epoch may be a
    # view from before that promotion, and does not end the lease.
    promoted_epoch: int = 0


class LeaseKeeper:
    def __init__(self, monitor: KeeperHost, now: float) -> None:
        self.monitor = monitor
        self.lease = monitor.settings.lease
        self.leases = {broker_id: Lease(until=now + self.lease) for broker_id in monitor.links}

    def over_at(self, broker_id: str) -> float:
        """From when the monitor counts ``broker_id`` as holding no lease."""
        return self.leases[broker_id].until + margin(self.lease)

    def tick(self, views: list[BrokerView], active: BrokerView | None, now: float) -> None:
        """Forget the leases of brokers seen standby; renew the active's; take tokens from actives."""
        for view in views:
            lease = self.leases[view.broker_id]
            standby = view.stats is not None and view.reachable and view.role == STANDBY
            if standby and view.stats is not None and view.stats.epoch >= lease.promoted_epoch:
                lease.until = 0.0
        answering = [v.broker_id for v in views if self._answers_active(v.broker_id, now)]
        # The broker held active: by its statistics, else by its own answer (then only if alone).
        held = active.broker_id if active is not None else answering[0] if len(answering) == 1 else None
        for view in views:
            lease = self.leases[view.broker_id]
            by_stats = view.reachable and view.role == ACTIVE
            if not (by_stats or view.broker_id in answering) or lease.calling:
                continue
            lease.calling = True
            try:
                self.monitor.spawn(self._renew(view.broker_id, view.broker_id == held), f"lease-{view.broker_id}")
            except BaseException:
                lease.calling = False
                raise

    def _answers_active(self, broker_id: str, now: float) -> bool:
        """Whether the broker's last RenewLease answer said ACTIVE, came within a lease, and is newer
        than its statistics. Statistics lag on a loaded machine: renewing only the broker they call
        active let a just-promoted broker's lease lapse, and it stepped down, was promoted again,
        and so on for a minute (chaos seed 1964, epochs 12 to 25)."""
        lease = self.leases[broker_id]
        return (
            lease.token_role == ACTIVE
            and now - lease.token_at < self.lease
            and lease.token_at > self.monitor.links[broker_id].stats_at
        )

    def _grant(self, broker_id: str, now: float) -> int:
        """The token to grant ``broker_id`` now (0: none), its lease's end recorded first."""
        lease = self.leases[broker_id]
        if not lease.token or lease.token_role != ACTIVE:
            return 0
        if any(now < self.over_at(other) for other in self.leases if other != broker_id):
            return 0
        # Recorded before the grant goes out: the broker's end is never later than this.
        lease.until = max(lease.until, lease.token_at + self.lease)
        return lease.token

    def promoting(self, broker_id: str, epoch: int, deadline: float) -> int:
        """Before ``SetRole(ACTIVE, epoch)`` to ``broker_id`` with this call deadline: count it as
        active (as holding a lease) until the deadline plus the lease, whatever the answer (the
        broker steps down when it hears neither its peer nor a grant within the lease); the
        ``lease_ms`` the call carries."""
        lease = self.leases[broker_id]
        lease.until = max(lease.until, deadline + self.lease)
        lease.promoted_epoch = max(lease.promoted_epoch, epoch)
        return round(self.lease * 1000)

    async def promoted(self, broker_id: str) -> None:
        """Right after ``SetRole(ACTIVE)``: a token and its grant at once, not a round apart (a promoted
        broker that does not hear its peer acknowledges alone only under the lease)."""
        lease = self.leases[broker_id]
        if lease.calling:
            return
        lease.calling = True
        await self._renew(broker_id, False)
        if not lease.calling:
            lease.calling = True
            await self._renew(broker_id, True)

    async def _renew(self, broker_id: str, may_grant: bool) -> None:
        lease = self.leases[broker_id]
        link = self.monitor.links[broker_id]
        grant = self._grant(broker_id, time.monotonic()) if may_grant else 0
        try:
            reply = await link.renew_lease(grant, lease.token_epoch, round(self.lease * 1000))
        except Exception as exc:  # noqa: BLE001 - the next round tries again
            log.debug("RenewLease on %s: %s", link.broker_id, rpc_error_text(exc))
            lease.token = 0
        else:
            if grant and reply.granted != lease.holds:
                lease.holds = reply.granted
                log.info("%s %s the monitor's lease", link.broker_id, "holds" if reply.granted else "no longer holds")
            lease.token = reply.token
            lease.token_at = time.monotonic()
            lease.token_role = reply.role
            lease.token_epoch = reply.epoch
            if not reply.monitored and not lease.told_unmonitored:
                lease.told_unmonitored = True
                log.warning(
                    "%s does not require the monitor's lease (SOKUTATSU_BROKER_MONITORED is false on it): it "
                    "acknowledges alone whenever it does not hear its peer, and promotes itself, whatever the "
                    "monitor decides; set SOKUTATSU_BROKER_MONITORED=true on both brokers",
                    link.broker_id,
                )
        finally:
            lease.calling = False

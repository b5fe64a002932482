"""Carrying out the pair's role decisions (``pair.py``): failover and demotion.

A failover is recorded among the switchovers (reason FAILOVER, no subscriber: every one
moves) with two steps: DETECT, from the last time the active was heard from until the
monitor gave up on it, and PROMOTE, the ``SetRole`` call. After a role change the keeper
waits until the broker's statistics show the new epoch (or the failover time passed)
before deciding again, so one lost active never causes two promotions. A change the rules
hold (``pair.Held``: the standby still hears the active, or the pair's epoch is exhausted) is
logged once per reason, not every round. Epochs above ``MAX_EPOCH`` reported by a broker are
not remembered (they would hold every later change until the monitor restarts).
"""

from __future__ import annotations

import logging
import time
import uuid

from opentelemetry import trace

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.monitor.assignments import BrokerView
from sokutatsu.monitor.broker_link import CONTROL_TIMEOUT_SECONDS, rpc_error_text
from sokutatsu.monitor.host import KeeperHost
from sokutatsu.monitor.lease import LeaseKeeper
from sokutatsu.monitor.pair import MAX_EPOCH, Held, RoleChange, decide_roles
from sokutatsu.monitor.status import unix_nano_at
from sokutatsu.monitor.switchover import timed_step, tracer
from sokutatsu.monitor.v1 import monitor_pb2

log = logging.getLogger(__name__)

# After a SetRole that failed, wait this long before deciding again.
ROLE_RETRY_SECONDS = 0.5


class RoleKeeper:
    def __init__(self, monitor: KeeperHost, now: float, leases: LeaseKeeper | None = None) -> None:
        self.monitor = monitor
        self.leases = leases
        # Since when no reachable broker reports ACTIVE (the monitor's start counts).
        self.no_active_since: float | None = now
        self.last_active = ""
        self.highest_epoch = 0
        self.busy = False
        self.settle: tuple[str, int] | None = None
        self.settle_until = 0.0
        # The reason of the change held last (logged once until it changes or clears).
        self.held: tuple[str, str] | None = None

    def tick(self, views: list[BrokerView], active: BrokerView | None, now: float) -> None:
        for view in views:
            if view.stats is not None and view.stats.epoch <= MAX_EPOCH:
                self.highest_epoch = max(self.highest_epoch, view.stats.epoch)
        links = self.monitor.links
        if active is not None:
            lost = self.last_active
            ours = self.busy or (self.settle is not None and self.settle[0] == active.broker_id)
            if lost and lost != active.broker_id and not links[lost].reachable(now) and not ours:
                self._observed_failover(lost, active, now)
            self.no_active_since = None
            self.last_active = active.broker_id
        elif self.no_active_since is None:
            # From the last time the active was heard from.
            last = links[self.last_active].last_ok if self.last_active else 0.0
            self.no_active_since = last or now
        if self.busy:
            return
        if self.settle is not None:
            broker_id, epoch = self.settle
            stats = links[broker_id].stats
            confirmed = stats is not None and stats.epoch >= epoch and links[broker_id].reachable(now)
            if not confirmed and now < self.settle_until:
                return
            self.settle = None
        settings = self.monitor.settings
        lease_over = {b: self.leases.over_at(b) for b in links} if self.leases is not None else None
        change = decide_roles(
            self.monitor.members(now),
            now,
            self.no_active_since,
            settings.failover_after,
            self.highest_epoch,
            lease_over=lease_over,
            failover_behind_after=max(settings.failover_behind_after, settings.failover_after),
        )
        if isinstance(change, Held):
            self._hold(change)
            return
        if self.held is not None:
            log.info("role change no longer held (%s)", self.held[0])
            self.held = None
        if change is not None:
            self.busy = True
            try:
                self.monitor.spawn(self._apply(change, now), f"set-role-{change.broker_id}")
            except BaseException:
                self.busy = False
                raise

    def _hold(self, held: Held) -> None:
        """Say once why a change the rules would make is not made."""
        key = (held.kind, held.broker_id)
        if self.held == key:
            return
        self.held = key
        level = logging.ERROR if held.kind == "epoch-exhausted" else logging.WARNING
        log.log(level, "role change held: %s", held.why)

    def _observed_failover(self, lost: str, active: BrokerView, now: float) -> None:
        """The standby became active without the monitor (it promotes itself when its peer is gone)."""
        since = self.monitor.links[lost].last_ok or now
        record = _failover(lost, active.broker_id, active.epoch, since, now)
        record.total_micros = record.steps[0].duration_micros
        record.finished = True
        record.note = (
            f"{active.broker_id} became active by itself (epoch {active.epoch}) after {lost} stopped "
            "answering; DETECT is until the monitor saw it"
        )
        with tracer.start_as_current_span(
            "failover",
            attributes={
                "sokutatsu.from_broker": lost,
                "sokutatsu.to_broker": active.broker_id,
                "sokutatsu.reason": "FAILOVER",
                "sokutatsu.epoch": active.epoch,
                "sokutatsu.why": record.note,
            },
        ):
            log.warning("%s", record.note)
        self.monitor.recent.appendleft(record)

    async def _apply(self, change: RoleChange, decided_at: float) -> None:
        try:
            await self._set_role(change, decided_at)
        finally:
            # Whatever failed, roles are decided again (the task's error is logged by Monitor.spawn).
            self.busy = False

    def _failover_record(self, change: RoleChange, lost: str, decided_at: float) -> monitor_pb2.Switchover:
        """The failover's record, with its DETECT step (from when no active was heard from)."""
        since = self.no_active_since if self.no_active_since is not None else decided_at
        return _failover(lost, change.broker_id, change.epoch, since, decided_at)

    async def _set_role(self, change: RoleChange, decided_at: float) -> None:
        links = self.monitor.links
        link = links[change.broker_id]
        role = broker_pb2.BrokerRole.Name(change.role).removeprefix("BROKER_ROLE_").lower()
        lost = self.last_active if self.last_active and self.last_active != change.broker_id else ""
        lost = lost or next((b for b in links if b != change.broker_id), "")
        record = self._failover_record(change, lost, decided_at) if change.failover else None
        name = "failover" if change.failover else "set_role"
        attributes: dict[str, str | int] = {
            "sokutatsu.broker": change.broker_id,
            "sokutatsu.role": role,
            "sokutatsu.epoch": change.epoch,
            "sokutatsu.why": change.why,
        }
        if change.failover:
            attributes |= {"sokutatsu.from_broker": lost, "sokutatsu.to_broker": change.broker_id}
            attributes["sokutatsu.reason"] = "FAILOVER"
        log.warning("%s becomes %s at epoch %d: %s", change.broker_id, role, change.epoch, change.why)
        # Before the call, whatever its answer: the broker may act on it and the answer be lost.
        # Its epoch is never proposed again (two brokers active at one epoch), and a promoted
        # broker counts as active until the call's deadline plus the grace it carries.
        self.highest_epoch = max(self.highest_epoch, change.epoch)
        lease_ms = 0
        if change.role == broker_pb2.BROKER_ROLE_ACTIVE and self.leases is not None:
            lease_ms = self.leases.promoting(change.broker_id, change.epoch, time.monotonic() + CONTROL_TIMEOUT_SECONDS)
        with tracer.start_as_current_span(name, attributes=attributes) as span:
            try:
                if record is not None:
                    with timed_step(record, monitor_pb2.SWITCHOVER_STEP_PROMOTE):
                        await link.set_role(change.role, change.epoch, change.peer, lease_ms)
                else:
                    await link.set_role(change.role, change.epoch, change.peer, lease_ms)
            except Exception as exc:  # noqa: BLE001 - recorded; decided again after a pause
                text = f"SetRole({role}, epoch {change.epoch}) on {change.broker_id} failed: {rpc_error_text(exc)}"
                log.warning("%s", text)
                span.set_status(trace.Status(trace.StatusCode.ERROR, text))
                if record is not None:
                    record.error = text
                self.settle = (change.broker_id, change.epoch)
                self.settle_until = time.monotonic() + ROLE_RETRY_SECONDS
            else:
                self.settle = (change.broker_id, change.epoch)
                self.settle_until = time.monotonic() + max(
                    self.monitor.settings.failover_after, 5 * self.monitor.settings.stats_interval
                )
                if change.role == broker_pb2.BROKER_ROLE_ACTIVE:
                    self.no_active_since = None
                    self.last_active = change.broker_id
                    if self.leases is not None:
                        await self.leases.promoted(change.broker_id)
            finally:
                self.busy = False
                if record is not None:
                    record.total_micros = sum(s.duration_micros for s in record.steps)
                    record.finished = True
                    self.monitor.recent.appendleft(record)
                self.monitor.tell_watchers()


def _failover(lost: str, to: str, epoch: int, since: float, detected: float) -> monitor_pb2.Switchover:
    """A failover's record from ``lost`` to ``to``: its DETECT step from ``since`` (the last sign
    of the lost active) to ``detected`` (monotonic times)."""
    record = monitor_pb2.Switchover(
        id=f"fo-{uuid.uuid4().hex[:12]}",
        from_broker_id=lost,
        to_broker_id=to,
        reason=monitor_pb2.SWITCHOVER_REASON_FAILOVER,
        epoch=epoch,
        started_unix_nano=unix_nano_at(since),
    )
    record.steps.append(
        monitor_pb2.StepTiming(
            step=monitor_pb2.SWITCHOVER_STEP_DETECT,
            started_unix_nano=record.started_unix_nano,
            duration_micros=round((detected - since) * 1e6),
        )
    )
    return record

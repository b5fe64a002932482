"""The monitor: watches the pair, keeps the assignments, moves subscribers, fails over.

Everything runs on one event loop. Statistics frames refresh the assignment view (derived
from the brokers' statistics alone, see ``assignments.py``) and tell watchers what changed;
a tick every stats interval measures each subscriber (threshold), makes the role decisions
(``pair.py``) and the move decisions (``hysteresis.py``), and finishes releases a broker
refused. Switchovers, role changes and releases run as tasks of the monitor's task group,
one switchover per subscriber at a time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, TypeVar

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable, echo
from sokutatsu.monitor import status
from sokutatsu.monitor.assignments import BrokerView, Served, SubKey, active_broker, by_subscriber, derive_assignments
from sokutatsu.monitor.broker_link import BrokerLink
from sokutatsu.monitor.errors import SwitchoverRunning
from sokutatsu.monitor.hysteresis import Move, MoveGuard, Observation
from sokutatsu.monitor.lease import LeaseKeeper
from sokutatsu.monitor.measures import Measures
from sokutatsu.monitor.pair import Member
from sokutatsu.monitor.releases import ReleaseKeeper
from sokutatsu.monitor.roles import RoleKeeper
from sokutatsu.monitor.settings import MonitorSettings
from sokutatsu.monitor.switchover import Outcome, run_switchover
from sokutatsu.monitor.threshold import (
    DEFAULT_MESSAGE_BYTES,
    MeanSize,
    RecentPeak,
    SwitchTimes,
    ThresholdInputs,
    derive_threshold,
)
from sokutatsu.monitor.v1 import monitor_pb2
from sokutatsu.monitor.watchers import WATCH_BUFFER, Watchers

log = logging.getLogger(__name__)
T = TypeVar("T")

# The inflow peak is taken over this many seconds of samples.
INFLOW_WINDOW_SECONDS = 5.0
MIGRATE = broker_pb2.OVERFLOW_MODE_MIGRATE


async def _guard(task: asyncio.Task[Any]) -> None:
    """Wait for a spawned task; log its failure (a fault in one task must not stop the monitor)."""
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # the monitor stops: the guard is cancelled, and the task with it
        # Only the task was cancelled (by whoever started it): nothing to report.
    except Exception:
        log.exception("task %s failed; the monitor goes on", task.get_name())


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


class Monitor:
    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        interval = settings.stats_interval
        stale = min(max(5 * interval, 0.5), settings.failover_after)
        self.links = {
            e.broker_id: BrokerLink(e, interval, stale, self.tell_watchers, link=settings.link_of(e.broker_id))
            for e in settings.brokers
        }
        self.view: dict[SubKey, Served] = {}
        self.measures: dict[SubKey, Measures] = {}
        self.running: dict[SubKey, monitor_pb2.Switchover] = {}
        self.recent: deque[monitor_pb2.Switchover] = deque(maxlen=settings.recent_switchovers)
        self.switch_times = SwitchTimes(settings.switch_estimate_ms / 1000)
        self.releases = ReleaseKeeper(self)
        self.watchers = Watchers()
        now = time.monotonic()
        self.leases = LeaseKeeper(self, now)
        self.roles = RoleKeeper(self, now, self.leases)
        self._published: dict[SubKey, tuple[str, bool, bool]] = {}
        self._group: asyncio.TaskGroup | None = None

    # ----------------------------------------------------------- lifecycle --
    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            self.use(group)
            for link in self.links.values():
                group.create_task(link.run(), name=f"link-{link.broker_id}")
            group.create_task(self._loop(), name="monitor-tick")

    def use(self, group: asyncio.TaskGroup) -> None:
        """Run switchovers, role changes and releases in ``group``."""
        self._group = group

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run ``coro`` as a task of the monitor; its failure is logged and never stops the monitor.

        The task returned is not in the task group (an exception there would cancel the group
        and end the process): a guard in the group awaits it, logs what it raised, and makes
        the task end with the group. Whoever awaits the task still gets its result or error.
        """
        if self._group is None:
            coro.close()
            raise Unavailable("the monitor is starting; try again")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._group.create_task(_guard(task), name=f"guard-{name}")
        return task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_interval)
            try:
                self.tick(time.monotonic())
            except Exception:
                # A fault in one round must not stop the next (failover depends on it).
                log.exception("monitor round failed")

    # ----------------------------------------------------------------- view --
    def views(self, now: float | None = None) -> list[BrokerView]:
        now = time.monotonic() if now is None else now
        return [link.view(now) for link in self.links.values()]

    def tell_watchers(self) -> None:
        """A statistics frame arrived or a broker was lost: refresh the view, tell the watchers."""
        self.view = derive_assignments(self.views())
        for key, served in self.view.items():
            if key not in self.measures:
                self._measure_one(served, time.monotonic(), self.switch_times.estimate())
            placement = (*served.placement(), key in self.running)
            if self._published.get(key) != placement:
                self._published[key] = placement
                self.watchers.publish(self.assignment_proto(served))
        for key in [k for k in self._published if k not in self.view]:
            del self._published[key]
            self.watchers.publish(status.removed(*key))

    def low_mark(self, threshold: int) -> int:
        return min(self.settings.migrate_back_depth, threshold // 4)

    def assignment_proto(self, served: Served) -> monitor_pb2.Assignment:
        measures = self.measures.get(served.key)
        low = self.low_mark(measures.threshold.messages) if measures else 0
        return status.assignment(served, measures, served.key in self.running, low)

    # ----------------------------------------------------------------- tick --
    def tick(self, now: float) -> None:
        views = self.views(now)
        self.view = derive_assignments(views)
        active = active_broker(views)
        self.leases.tick(views, active, now)
        self.roles.tick(views, active, now)
        self._measure(now)
        if self.settings.auto_switch:
            self._decide(now, views, active)
        self.releases.tick(now)
        self.tell_watchers()

    def _measure(self, now: float) -> None:
        switch_seconds = self.switch_times.estimate()
        for served in self.view.values():
            self._measure_one(served, now, switch_seconds)
        for key in [k for k in self.measures if k not in self.view]:
            del self.measures[key]

    def _measure_one(self, served: Served, now: float, switch_seconds: float) -> Measures:
        """Sample the subscriber's message size and inflow; derive its threshold."""
        s = self.settings
        m = self.measures.get(served.key)
        if m is None:
            kept = math.ceil(INFLOW_WINDOW_SECONDS / s.stats_interval)
            guard = MoveGuard(now, s.migrate_back_after, s.min_move_interval)
            m = self.measures[served.key] = Measures(MeanSize(), RecentPeak(kept), guard)
        sub = served.stats
        broker_stats = self.links[served.broker_id].stats if served.broker_id else None
        sampled_at = broker_stats.time_unix_nano / 1e9 if broker_stats is not None else now
        growth = m.growth(served.broker_id, sub.depth, sampled_at)
        mean = m.size.add(sub.memory_bytes, max(0, sub.depth - sub.spilled_count))
        source = "measured"
        if mean is None:
            if broker_stats is not None and broker_stats.held_count:
                mean, source = broker_stats.held_bytes / broker_stats.held_count, "broker-wide"
            else:
                mean, source = float(DEFAULT_MESSAGE_BYTES), "assumed"
        m.threshold = derive_threshold(
            ThresholdInputs(
                budget_bytes=sub.memory_budget_bytes,
                mean_message_bytes=mean,
                size_source=source,
                inflow_per_second=m.inflow.add(max(sub.inflow_per_second, growth)),
                switch_seconds=switch_seconds,
                detect_seconds=s.stats_interval,
                safety=s.safety_factor,
                lower=s.slow_min,
                upper=s.slow_max,
            )
        )
        return m

    def _decide(self, now: float, views: list[BrokerView], active: BrokerView | None) -> None:
        standby = next(
            (
                v
                for v in views
                if v.reachable
                and active
                and v.broker_id != active.broker_id
                and v.role == broker_pb2.BROKER_ROLE_STANDBY
            ),
            None,
        )
        for key, served in self.view.items():
            if key in self.running or key in self.releases:
                continue
            m = self.measures[key]
            if any(link.stats_at <= m.settled_after for link in self.links.values() if link.reachable(now)):
                continue  # statistics from before its last switchover ended
            sub = served.stats
            threshold = m.threshold.messages
            move = m.guard.decide(
                Observation(
                    now=now,
                    served=bool(served.broker_id) and self.links[served.broker_id].reachable(now),
                    migrated=served.migrated,
                    migrate_mode=sub.overflow_mode == MIGRATE,
                    connected=sub.connected,
                    depth=sub.depth,
                    threshold=threshold,
                    low_mark=self.low_mark(threshold),
                    standby_up=standby is not None,
                    active_up=active is not None,
                )
            )
            if active is None or standby is None:
                continue
            if move is Move.TO_STANDBY and served.broker_id == active.broker_id:
                source, target, reason = active, standby, monitor_pb2.SWITCHOVER_REASON_SLOW
            elif move is Move.TO_ACTIVE and served.broker_id == standby.broker_id:
                source, target, reason = standby, active, monitor_pb2.SWITCHOVER_REASON_RECOVERED
            else:
                continue
            log.info("%s on %s: depth %d, threshold %d: moving it %s", key[0], key[1], sub.depth, threshold, move.value)
            self._start(served, self.links[source.broker_id], self.links[target.broker_id], reason)

    # ----------------------------------------------------------- switchover --
    def _start(
        self, served: Served, source: BrokerLink, target: BrokerLink, reason: monitor_pb2.SwitchoverReason.ValueType
    ) -> asyncio.Task[monitor_pb2.Switchover]:
        key = served.key
        if key in self.running:
            raise SwitchoverRunning(self._running_text(key))
        measures = self.measures.get(key)
        record = monitor_pb2.Switchover(
            id=new_id("sw"),
            subscriber_id=served.subscriber_id,
            topic=served.topic,
            from_broker_id=source.broker_id,
            to_broker_id=target.broker_id,
            reason=reason,
            depth=served.stats.depth,
            threshold=measures.threshold.messages if measures else 0,
            started_unix_nano=time.time_ns(),
        )
        self.running[key] = record
        self.tell_watchers()
        return self.spawn(self._switch(key, record, source, target), f"switchover-{record.id}")

    async def _switch(
        self, key: SubKey, record: monitor_pb2.Switchover, source: BrokerLink, target: BrokerLink
    ) -> monitor_pb2.Switchover:
        standby = target.stats is not None and target.stats.role == broker_pb2.BROKER_ROLE_STANDBY
        move = Move.TO_STANDBY if standby else Move.TO_ACTIVE
        outcome = Outcome(moved=False)
        try:
            outcome = await run_switchover(
                record, source, target, switch_timeout=self.settings.switch_timeout, target_up=target.reachable
            )
        except Exception as exc:
            log.exception("switchover %s failed", record.id)
            record.error = f"internal error in the monitor: {type(exc).__name__}: {exc} (see its log)"
            record.finished = True
        finally:
            self.running.pop(key, None)
            self.recent.appendleft(record)
        measures = self.measures.get(key)
        if measures is not None:
            measures.guard.record(time.monotonic(), move, outcome.moved)
            measures.settled_after = time.monotonic()
        if not record.error:
            self.switch_times.add(record.total_micros / 1e6)
        if outcome.pending is not None:
            self.releases.add(key, outcome.pending)
        steps = ", ".join(
            f"{monitor_pb2.SwitchoverStep.Name(s.step).removeprefix('SWITCHOVER_STEP_').lower()} "
            f"{s.duration_micros / 1000:.1f} ms"
            for s in record.steps
        )
        log_level = logging.WARNING if record.error else logging.INFO
        log.log(
            log_level,
            "switchover %s of %s on %s, %s -> %s: %s in %.1f ms (%s)",
            record.id,
            record.subscriber_id,
            record.topic,
            record.from_broker_id,
            record.to_broker_id,
            record.error or "done",
            record.total_micros / 1000,
            steps,
        )
        self.tell_watchers()
        return record

    def _running_text(self, key: SubKey) -> str:
        record = self.running.get(key)
        if record is None:
            return f"the last switchover of {key[0]} on {key[1]} waits for step 4 (release); ask again later"
        age = (time.time_ns() - record.started_unix_nano) / 1e6
        reason = monitor_pb2.SwitchoverReason.Name(record.reason).removeprefix("SWITCHOVER_REASON_").lower()
        return (
            f"a switchover of {key[0]} on {key[1]} is already running ({record.id}, {record.from_broker_id} -> "
            f"{record.to_broker_id}, {reason}, started {age:.0f} ms ago); ask again once it is finished "
            f"(GetStatus lists it)"
        )

    # ------------------------------------------------------------ requests --
    def lookup(self, subscriber_id: str, topic: str) -> Served:
        if not subscriber_id:
            raise InvalidArgument("subscriber_id is empty: name the subscriber")
        if all(link.stats is None for link in self.links.values()):
            problems = "; ".join(
                f"{link.broker_id} at {link.address}: {link.problem()}" for link in self.links.values()
            )
            raise Unavailable(f"no broker has sent its statistics yet ({problems})")
        pair = " or ".join(self.links)
        if topic:
            served = self.view.get((subscriber_id, topic))
            if served is None:
                raise NotFound(f"no subscription of {echo(subscriber_id)} on topic {echo(topic)} at {pair}")
            return served
        matches = by_subscriber(self.view.values(), subscriber_id)
        if not matches:
            raise NotFound(f"no subscriber {echo(subscriber_id)} at {pair}")
        if len(matches) > 1:
            topics = ", ".join(m.topic for m in matches)
            raise InvalidArgument(f"{echo(subscriber_id)} subscribes to topics {topics}: name the topic")
        return matches[0]

    async def request_switchover(self, subscriber_id: str, topic: str, to_broker_id: str) -> monitor_pb2.Switchover:
        served = self.lookup(subscriber_id, topic)
        key = served.key
        if key in self.running or key in self.releases:
            raise SwitchoverRunning(self._running_text(key))
        if to_broker_id and to_broker_id not in self.links:
            raise NotFound(
                f"no broker {echo(to_broker_id)}; the pair is {' and '.join(self.links)} (SOKUTATSU_MONITOR_BROKERS)"
            )
        what = f"{served.subscriber_id} on {served.topic}"
        if not served.broker_id:
            raise FailedPrecondition(f"no broker serves {what} now (neither reports SERVING or LEAVING for it)")
        source = self.links[served.broker_id]
        target = self.links.get(to_broker_id) or next(lk for lk in self.links.values() if lk is not source)
        if target is source:
            raise FailedPrecondition(f"{what} is already served by {source.broker_id}")
        for link, role in ((source, "which serves it"), (target, "the taking broker")):
            if not link.reachable():
                raise Unavailable(f"{link.broker_id} ({role}) does not answer: {link.problem()}")
        task = self._start(served, source, target, monitor_pb2.SWITCHOVER_REASON_MANUAL)
        # The switchover finishes even if this caller goes away.
        return await asyncio.shield(task)

    def assignment(self, subscriber_id: str, topic: str) -> monitor_pb2.Assignment:
        return self.assignment_proto(self.lookup(subscriber_id, topic))

    async def watch(self, subscriber_id: str) -> AsyncGenerator[monitor_pb2.Assignment, None]:
        with self.watchers.open(subscriber_id) as watch:
            for served in sorted(self.view.values(), key=lambda s: s.key):
                if not subscriber_id or served.subscriber_id == subscriber_id:
                    yield self.assignment_proto(served)
            while True:
                item = await watch.queue.get()
                if item is None:
                    raise ResourceExhausted(
                        f"this watcher fell {WATCH_BUFFER} changes behind; call WatchAssignments again"
                    )
                yield item

    # ---------------------------------------------------------------- status --
    def status(self, recent: int) -> monitor_pb2.MonitorStatus:
        now = time.monotonic()
        active = active_broker(self.views(now))
        out = monitor_pb2.MonitorStatus(
            brokers=[status.broker_state(link, now) for link in self.links.values()],
            assignments=[self.assignment_proto(s) for s in sorted(self.view.values(), key=lambda s: s.key)],
            active_broker_id=active.broker_id if active else "",
            switch_estimate_micros=round(self.switch_times.estimate() * 1e6),
        )
        records = [*self.running.values(), *self.recent]
        out.recent_switchovers.extend(records[: recent or len(records)])
        thresholds = [
            self.measures[k].threshold.messages
            for k, s in self.view.items()
            if s.stats.overflow_mode == MIGRATE and k in self.measures
        ]
        out.slow_threshold = min(thresholds, default=0)
        s = self.settings
        upper = f"min(budget, {s.slow_max})" if s.slow_max else "the budget"
        out.threshold_basis = (
            f"{self.switch_times.basis()} + stats interval {s.stats_interval_ms} ms; safety factor "
            f"{s.safety_factor:g}; bounds {s.slow_min}..{upper} messages; back to the active at depth <= "
            f"min({s.migrate_back_depth}, threshold/4) held {s.migrate_back_after:g}s, at least "
            f"{s.min_move_interval:g}s after a move"
        )
        return out

    def members(self, now: float) -> list[Member]:
        out = []
        for link in self.links.values():
            stats = link.stats
            role = stats.role if stats is not None else broker_pb2.BROKER_ROLE_UNSPECIFIED
            epoch = stats.epoch if stats is not None else 0
            peer_up = stats.peer_up if stats is not None else False
            caught_up = stats.caught_up if stats is not None else False
            out.append(
                Member(
                    link.broker_id,
                    link.address,
                    link.reachable(now),
                    role,
                    epoch,
                    link.up_since,
                    link.last_ok,
                    peer_up=peer_up,
                    stopping=link.draining,
                    caught_up=caught_up,
                )
            )
        return out

"""One schedule of ``sokutatsu chaos``: the processes, the nemesis, the drain, the check.

The broker pair and the monitor are started by the launcher's own :class:`Suite` (the
topology's specs, on ports chosen here so a killed service comes back on the same port and
state folder); the pair's link goes through two :class:`LinkProxy`, and the monitor's calls
to each broker through one more each (``SOKUTATSU_MONITOR_BROKER_LINKS``); publishers and
subscribers are child processes using the SDK only (:mod:`sokutatsu.cli.chaos_client`).
A poller asks both brokers ``GetRole`` every ``ROLE_POLL_SECONDS`` for the whole schedule.
See docs/chaos.md for the failure model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.cli import chaos_check as check
from sokutatsu.cli import chaos_schedule as sched
from sokutatsu.cli.chaos_proxy import LinkProxy
from sokutatsu.cli.children import child_process, tell
from sokutatsu.cli.launcher import Running, Suite
from sokutatsu.cli.topology import SuiteProcess, suite
from sokutatsu.core.embedded_pg import free_port
from sokutatsu.core.settings import describe
from sokutatsu.core.tls import open_channel
from sokutatsu.harness import freeze, thaw
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc

TOPIC = "chaos"
FLOOD_TOPIC = "chaos-flood"
# The subscription churn's topic (chaos_schedule.CHURN): durable subscriptions nobody attaches to.
CHURN_TOPIC = "chaos-churn"
# A churn call's deadline; one that fails otherwise than with a status the broker sent leaves its
# outcome unknown (it may still be applied), and the name out of the last-operation check.
CHURN_RPC_SECONDS = 2.0
# Outcomes of a churn call known for sure: done, or refused by the broker (nothing done).
CHURN_SURE = ("OK", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION")
# How long, after the drain, the two brokers have to come to hold the same churn subscriptions.
CHURN_SETTLE_SECONDS = 20.0
# The brokers' SUBSCRIPTION_EXPIRY: churn subscriptions (nobody attached) expire during a run, amid the
# faults and calls; the harness's own subscribers are never away from their broker for this long.
CHURN_EXPIRY_SECONDS = 20.0
ROLE_POLL_SECONDS = 0.05
ROLE_RPC_SECONDS = 0.2
# How long the fault meant to overlap a migration waits for the monitor to have moved the slow
# subscriber (a link cut or another fault may hold the move back); past it the fault is taken
# anyway and the schedule says whether a migration overlapped a fault.
MIGRATION_WAIT_SECONDS = 15.0
# Channels that notice a restarted broker within about 0.1 s (gRPC's default backoff is 1 s+).
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 100),
]
BROKERS = ("broker-a", "broker-b")
# Subscribers: id -> settings for chaos_client (all durable, created before anything is published).
KEYS = [f"A-{i}" for i in range(10)] + [f"B-{i}" for i in range(10)]
SUBSCRIBERS: dict[str, dict[str, Any]] = {
    "all": {},
    # Lanes of one SubscribeMany stream each, beside companions with other filters (chaos_client.py).
    "prefix-a": {
        "prefixes": ["A-"],
        "connection": True,
        "companions": [{"prefixes": ["B-"]}, {"keys": ["B-2", "B-5"]}],
    },
    "keys-b": {"keys": ["B-1", "B-4", "B-7"], "connection": True, "companions": [{"prefixes": ["A-"]}]},
    "slow": {"mode": "migrate", "budget": 1 * 2**20, "flow_limit": 50, "slow_rate": 10.0},
    "reopen": {"prefixes": ["B-"]},
}
PUBLISHERS = ("pub-1", "pub-2")
BROKER_SETTINGS = {
    # The active keeps the whole backlog of a migrated subscriber (a slow phase of a schedule
    # piles up about 20 MiB at most): with the default 4 MiB tail the active would not be
    # caught_up while the slow subscriber is away, and a broker fault then is outside the
    # failure model (docs/broker.md, known limits), so the migration could never overlap a fault.
    "SOKUTATSU_BROKER_AWAY_TAIL": str(64 * 2**20),
    "SOKUTATSU_BROKER_SUBSCRIPTION_EXPIRY": f"{CHURN_EXPIRY_SECONDS:g}s",
}
MONITOR_SETTINGS = {
    # Migrate within a second or two of turning slow (the budget holds ~150 messages), back soon after.
    "SOKUTATSU_MONITOR_SLOW_THRESHOLD_MIN": "100",
    "SOKUTATSU_MONITOR_MIGRATE_BACK_DEPTH": "50",
    "SOKUTATSU_MONITOR_MIGRATE_BACK_SECONDS": "1",
    "SOKUTATSU_MONITOR_MIN_MOVE_SECONDS": "3",
}


@dataclass(frozen=True)
class ChaosConfig:
    seconds: float = 60.0  # length of each schedule's fault phase
    rate: float = 100.0  # messages per second per publisher
    max_pending: int = 2000
    settle_seconds: float = 60.0  # bound on the wait for a healthy, caught-up pair before a broker fault
    drain_seconds: float = 60.0  # bound on the wait for publishers' acks and subscribers' deliveries
    flood_streams: int = 1500
    delivery_workers: int = 0  # SOKUTATSU_BROKER_DELIVERY_WORKERS of both brokers

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def peer_link_supported() -> bool:
    """Whether this broker build has SOKUTATSU_BROKER_PEER_LINK (else the link faults cut nothing)."""
    return any(k.env == "SOKUTATSU_BROKER_PEER_LINK" for k in describe(BrokerSettings))


def _role_name(role: int) -> str:
    return str(broker_pb2.BrokerRole.Name(role)).removeprefix("BROKER_ROLE_")  # type: ignore[arg-type]


# --------------------------------------------------------------------- cluster --
class Cluster:
    """broker-a, broker-b and the monitor (each a process of the launcher's Suite) and the link proxies."""

    def __init__(self, folder: Path, delivery_workers: int = 0) -> None:
        self.folder = folder
        self.delivery_workers = delivery_workers
        self.ports = {name: free_port() for name in (*BROKERS, "monitor")}
        while len(set(self.ports.values())) < 3:
            self.ports["monitor"] = free_port()
        self.address = {name: f"127.0.0.1:{port}" for name, port in self.ports.items()}
        # to[x]: the proxy that leads to broker x (the other broker's PEER_LINK).
        self.to = {name: LinkProxy(self.address[name]) for name in BROKERS}
        # monitor_to[x]: the proxy the monitor's own calls to broker x go through.
        self.monitor_to = {name: LinkProxy(self.address[name]) for name in BROKERS}
        self.suite = Suite(folder / "suite", pg_dsn="", fixed_ports=True, grace_seconds=2.0)
        self.specs: dict[str, SuiteProcess] = {}
        self.running: dict[str, Running] = {}
        self.paused: set[str] = set()
        self.link_via_proxy = peer_link_supported()
        self._never = asyncio.Event()
        self._channels: dict[str, aio.Channel] = {}

    async def start(self) -> None:
        for proxy in (*self.to.values(), *self.monitor_to.values()):
            await proxy.start()
        base = {s.name: s for s in suite()}
        other = {"broker-a": "broker-b", "broker-b": "broker-a"}
        for name in BROKERS:
            env = dict(base[name].env)
            env["SOKUTATSU_BROKER_PEER"] = self.address[other[name]]
            env.update(BROKER_SETTINGS)
            env["SOKUTATSU_BROKER_DELIVERY_WORKERS"] = str(self.delivery_workers)
            if self.link_via_proxy:
                env["SOKUTATSU_BROKER_PEER_LINK"] = self.to[other[name]].address
            self.specs[name] = replace(base[name], fixed_port=self.ports[name], env=env, links={})
        brokers = ",".join(f"{n}={self.address[n]}" for n in BROKERS)
        links = ",".join(f"{n}={self.monitor_to[n].address}" for n in BROKERS)
        self.specs["monitor"] = replace(
            base["monitor"],
            fixed_port=self.ports["monitor"],
            env={**MONITOR_SETTINGS, "SOKUTATSU_MONITOR_BROKERS": brokers, "SOKUTATSU_MONITOR_BROKER_LINKS": links},
            links={},
        )
        for name in (*BROKERS, "monitor"):
            await self._spawn(name)
        for name in (*BROKERS, "monitor"):
            self._channels[name] = open_channel(self.address[name], options=FAST_RECONNECT, cluster=True)

    async def _spawn(self, name: str) -> None:
        running = self.suite.spawn(self.specs[name])
        self.running[name] = running
        await self.suite.wait_ready(running, self._never)

    def pid(self, name: str) -> int:
        return self.running[name].pid

    async def kill(self, name: str) -> None:
        await self.suite.kill(self.running[name])

    async def restart(self, name: str) -> None:
        """Start ``name`` again: same port, same state folder, same settings (as an operator would)."""
        await self._spawn(name)

    def stop_process(self, name: str) -> None:
        freeze(self.running[name].process)
        self.paused.add(name)

    def continue_process(self, name: str) -> None:
        self.paused.discard(name)
        thaw(self.running[name].process)

    async def role(self, name: str) -> broker_pb2.RoleInfo | None:
        stub = broker_pb2_grpc.BrokerControlStub(self._channels[name])
        try:
            info: broker_pb2.RoleInfo = await stub.GetRole(broker_pb2.GetRoleRequest(), timeout=ROLE_RPC_SECONDS)
        except aio.AioRpcError:
            return None
        return info

    async def stats(self, name: str) -> broker_pb2.BrokerStats | None:
        stub = broker_pb2_grpc.BrokerAdminStub(self._channels[name])
        try:
            reply: broker_pb2.BrokerStats = await stub.GetStats(broker_pb2.GetStatsRequest(), timeout=1.0)
        except aio.AioRpcError:
            return None
        return reply

    async def broker_with_role(self, wanted: str) -> str | None:
        roles = {n: await self.role(n) for n in BROKERS}
        for name, info in roles.items():
            if info is not None and _role_name(info.role) == wanted.upper():
                return name
        return None

    async def pair_state(self) -> tuple[bool, str]:
        """Whether both brokers answer, hear each other and report caught_up (True where the field is
        missing), and what each said."""
        replies = [await self.stats(n) for n in BROKERS]
        healthy = all(s is not None and s.peer_up and getattr(s, "caught_up", True) for s in replies)
        said = "; ".join(
            f"{n}: no answer"
            if s is None
            else f"{n}: {_role_name(s.role)} peer_up={s.peer_up} caught_up={getattr(s, 'caught_up', None)} "
            f"queues_behind={getattr(s, 'queues_behind', None)}"
            + "".join(f" {q.topic}/{q.subscriber_id}" for q in s.subscribers if q.behind)
            for n, s in zip(BROKERS, replies, strict=True)
        )
        return healthy, said

    async def wait_healthy_pair(self, limit: float) -> tuple[float, bool, str]:
        """Wait (bounded) until :meth:`pair_state` is healthy; (seconds waited, whether it timed out, last state)."""
        started = time.monotonic()
        said = ""
        while time.monotonic() - started < limit:
            if not self.paused:
                healthy, said = await self.pair_state()
                if healthy:
                    return time.monotonic() - started, False, said
            await asyncio.sleep(0.1)
        return time.monotonic() - started, True, said

    async def churn_call(self, name: str, operation: str, subscriber_id: str) -> str:
        """CreateSubscription or DeleteSubscription of a churn subscription on broker ``name``: the
        status's name (OK, or the code it failed with)."""
        stub = broker_pb2_grpc.BrokerAdminStub(self._channels[name])
        try:
            if operation == "create":
                subscription = broker_pb2.Subscription(subscriber_id=subscriber_id, topic=CHURN_TOPIC, durable=True)
                await stub.CreateSubscription(
                    broker_pb2.CreateSubscriptionRequest(subscription=subscription), timeout=CHURN_RPC_SECONDS
                )
            else:
                await stub.DeleteSubscription(
                    broker_pb2.DeleteSubscriptionRequest(topic=CHURN_TOPIC, subscriber_id=subscriber_id),
                    timeout=CHURN_RPC_SECONDS,
                )
        except aio.AioRpcError as error:
            # NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION: refused, nothing done (CHURN_SURE); any
            # other code (a deadline, a connection lost) leaves the outcome unknown.
            return str(error.code().name)
        return "OK"

    async def churn_held(self, name: str) -> list[str] | None:
        """The churn subscriptions broker ``name`` holds (None: no answer)."""
        stub = broker_pb2_grpc.BrokerAdminStub(self._channels[name])
        try:
            reply = await stub.ListSubscriptions(broker_pb2.ListSubscriptionsRequest(topic=CHURN_TOPIC), timeout=2.0)
        except aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:  # the topic was never made there
                return []
            return None
        return sorted(s.subscriber_id for s in reply.subscriptions if s.durable)

    async def switchovers(self) -> list[monitor_pb2.Switchover]:
        stub = monitor_pb2_grpc.MonitorStub(self._channels["monitor"])
        try:
            status: monitor_pb2.MonitorStatus = await stub.GetStatus(
                monitor_pb2.GetStatusRequest(recent_switchovers=100), timeout=1.0
            )
        except aio.AioRpcError:
            return []
        return list(status.recent_switchovers)

    async def stop(self) -> list[tuple[str, int]]:
        for name in list(self.paused):
            self.continue_process(name)
        for channel in self._channels.values():
            await channel.close()
        results = await self.suite.stop()
        for proxy in (*self.to.values(), *self.monitor_to.values()):
            await proxy.stop()
        return results

    def logs(self) -> Path:
        return self.folder / "suite" / "logs"


# ------------------------------------------------------------------- clients --
@dataclass
class Client:
    name: str
    cfg: dict[str, Any]
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await self.stack.enter_async_context(
            child_process("sokutatsu.cli.chaos_client", json.dumps(self.cfg), what=f"chaos client {self.name}")
        )

    async def tell(self, word: str) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ConnectionError):
                await tell(self.process, word)

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

    async def finish(self, limit: float) -> bool:
        """Tell it to stop; True if it exited by itself within ``limit``."""
        await self.tell("stop")
        ok = False
        if self.process is not None:
            try:
                await asyncio.wait_for(self.process.wait(), limit)
                ok = self.process.returncode == 0
            except TimeoutError:
                await self.kill()
        await self.stack.aclose()
        return ok


# ------------------------------------------------------------------ schedule --
@dataclass
class ScheduleRun:
    seed: int
    folder: Path
    cfg: ChaosConfig
    cluster: Cluster
    progress: Callable[[str], None]
    publishers: dict[str, Client] = field(default_factory=dict)
    subscribers: dict[str, Client] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    samples: list[check.RoleSample] = field(default_factory=list)
    switchovers: dict[str, dict[str, Any]] = field(default_factory=dict)
    t0: float = 0.0
    background: list[asyncio.Task[None]] = field(default_factory=list)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # The churn calls made, in order: t, target, operation, name, and each broker's outcome.
    churn_log: list[dict[str, Any]] = field(default_factory=list)

    def now(self) -> float:
        return round(time.time() - self.t0, 3)

    def lock(self, what: str) -> asyncio.Lock:
        return self.locks.setdefault(what, asyncio.Lock())

    # ----------------------------------------------------------- processes --
    def _client_cfg(self, name: str, role: str, **extra: Any) -> dict[str, Any]:
        return {
            "role": role,
            "id": name,
            "brokers": [self.cluster.address[b] for b in BROKERS],
            "topic": TOPIC,
            "out": str(self.folder / f"{name}.jsonl"),
            "log": str(self.folder / f"{name}.log"),
            "seed": self.seed,
            **extra,
        }

    async def start_clients(self) -> None:
        for name, settings in SUBSCRIBERS.items():
            self.subscribers[name] = Client(name, self._client_cfg(name, "subscriber", **settings))
        await asyncio.gather(*(c.start() for c in self.subscribers.values()))
        for name in PUBLISHERS:
            self.publishers[name] = Client(
                name,
                self._client_cfg(name, "publisher", keys=KEYS, rate=self.cfg.rate, max_pending=self.cfg.max_pending),
            )
        await asyncio.gather(*(c.start() for c in self.publishers.values()))

    async def poll_roles(self) -> None:
        with (self.folder / "roles.jsonl").open("a") as out:
            while True:
                started = time.monotonic()
                infos = await asyncio.gather(*(self.cluster.role(n) for n in BROKERS))
                roles = {
                    n: ((_role_name(i.role), int(i.epoch)) if i is not None else ("", 0))
                    for n, i in zip(BROKERS, infos, strict=True)
                }
                sample = check.RoleSample(round(time.time(), 3), roles)
                self.samples.append(sample)
                out.write(json.dumps({"t": sample.at, "roles": roles}) + "\n")
                await asyncio.sleep(max(0.0, ROLE_POLL_SECONDS - (time.monotonic() - started)))

    async def poll_switchovers(self) -> None:
        while True:
            for s in await self.cluster.switchovers():
                if s.id and s.finished:
                    self.switchovers[s.id] = {
                        "t": round(s.started_unix_nano / 1e9 - self.t0, 3),
                        "subscriber": s.subscriber_id,
                        "from": s.from_broker_id,
                        "to": s.to_broker_id,
                        "reason": str(monitor_pb2.SwitchoverReason.Name(s.reason)).removeprefix("SWITCHOVER_REASON_"),
                        "total_ms": round(s.total_micros / 1000, 1),
                        "error": s.error,
                        "note": s.note,
                    }
            await asyncio.sleep(0.5)

    # --------------------------------------------------------------- faults --
    def record(self, kind: str, target: str, t: float, **extra: Any) -> dict[str, Any]:
        fault = {"t": t, "kind": kind, "target": target, **extra}
        self.faults.append(fault)
        self.progress(f"  seed {self.seed} t={t:6.1f}s {kind} {target} {_brief(extra)}")
        return fault

    async def take(self, step: sched.Step) -> None:
        kind = step.kind
        if kind in sched.BROKER_FAULTS:
            await self._broker_fault(step)
        elif kind == sched.SLOW:
            await self.subscribers["slow"].tell("slow")
            self.record(kind, "slow", self.now())
        elif kind == sched.RECOVER:
            await self.subscribers["slow"].tell("fast")
            self.record(kind, "slow", self.now())
        elif kind == sched.REOPEN:
            await self.subscribers["reopen"].tell(f"reopen {step.duration}")
            self.record(kind, "reopen", self.now(), duration=step.duration)
        else:
            self.background.append(asyncio.create_task(self._background(step)))

    def slow_is_migrated(self) -> bool:
        """Whether the monitor's last successful move of the slow subscriber sent it to the standby."""
        moves = sorted(
            (s for s in self.switchovers.values() if s["subscriber"] == "slow" and not s["error"]), key=lambda s: s["t"]
        )
        return bool(moves) and moves[-1]["reason"] == "SLOW"

    async def _wait_migrated(self) -> tuple[float, bool]:
        """Before the fault meant to overlap a migration: wait (bounded) until the monitor has moved
        the slow subscriber (a link cut or a fault may have held the move back)."""
        started = time.monotonic()
        while not self.slow_is_migrated():
            if time.monotonic() - started > MIGRATION_WAIT_SECONDS:
                return time.monotonic() - started, True
            await asyncio.sleep(0.1)
        return time.monotonic() - started, False

    async def _broker_fault(self, step: sched.Step) -> None:
        migration_wait, migration_timed_out = await self._wait_migrated() if step.during_migration else (0.0, False)
        async with self.lock("brokers"):
            waited, timed_out, said = await self.cluster.wait_healthy_pair(self.cfg.settle_seconds)
            name = await self.cluster.broker_with_role(step.target)
            if name is None:  # no broker answers in that role: pick one by the seed's step
                name = BROKERS[hash((self.seed, step.delay)) % 2]
            t = self.now()
            started = time.monotonic()
            if step.kind == sched.KILL:
                await self.cluster.kill(name)
                await asyncio.sleep(step.duration)
                await self.cluster.restart(name)
            else:
                self.cluster.stop_process(name)
                try:
                    await asyncio.sleep(step.duration)
                finally:
                    self.cluster.continue_process(name)
            self.record(
                step.kind,
                name,
                t,
                role=step.target,
                duration=round(time.monotonic() - started, 3),
                planned=step.duration,
                during_migration=step.during_migration,
                **(
                    {"migration_wait_s": round(migration_wait, 2), "migration_wait_timed_out": migration_timed_out}
                    if step.during_migration
                    else {}
                ),
                settle_wait_s=round(waited, 2),
                settle_timed_out=timed_out,
                **({"settle_state": said} if timed_out else {}),
            )

    async def _background(self, step: sched.Step) -> None:
        kind = step.kind
        if kind == sched.CUT:
            await self._cut(step)
        elif kind in sched.MONITOR_LINK_FAULTS:
            await self._monitor_link(step)
        elif kind in (sched.KILL_MONITOR, sched.PAUSE_MONITOR):
            await self._monitor_fault(step)
        elif kind == sched.FLOOD:
            await self._flood(step)
        elif kind == sched.RESTART_PUBLISHER:
            await self._restart_publisher(step)

    async def churner(self, calls: list[sched.Step]) -> None:
        """The subscription churn, beside the nemesis (its calls land during any fault)."""
        for call in calls:
            await asyncio.sleep(call.delay)
            await self._churn(call)

    async def _churn(self, step: sched.Step) -> None:
        """A client's CreateSubscription or DeleteSubscription on one broker or both (the churner makes
        one call at a time)."""
        operation, name = step.detail.split()
        targets = list(BROKERS) if step.target == "both" else [step.target]
        t = self.now()
        outcomes = {b: await self.cluster.churn_call(b, operation, name) for b in targets}
        # Not a fault: kept apart from the faults (their stalls, the report's lanes).
        self.churn_log.append({"t": t, "target": step.target, "operation": operation, "name": name, **outcomes})
        self.progress(f"  seed {self.seed} t={t:6.1f}s churn {operation} {name} on {step.target}: {outcomes}")

    async def _cut(self, step: sched.Step) -> None:
        kind = step.kind
        async with self.lock("link"):
            proxies = {"both": list(BROKERS), "to-a": ["broker-a"], "to-b": ["broker-b"]}[step.target]
            t = self.now()
            for p in proxies:
                self.cluster.to[p].cut()
            await asyncio.sleep(step.duration)
            for p in proxies:
                self.cluster.to[p].heal()
            self.record(kind, step.target, t, duration=step.duration, effective=self.cluster.link_via_proxy)

    async def _monitor_link(self, step: sched.Step) -> None:
        kind = step.kind
        async with self.lock("monitor-link"):
            name = await self.cluster.broker_with_role(step.target) or BROKERS[hash((self.seed, step.delay)) % 2]
            proxy = self.cluster.monitor_to[name]
            t = self.now()
            if kind == sched.CUT_MONITOR:
                proxy.cut()
            else:
                proxy.mute()
            try:
                await asyncio.sleep(step.duration)
            finally:
                proxy.heal()
            self.record(kind, name, t, role=step.target, duration=step.duration)

    async def _monitor_fault(self, step: sched.Step) -> None:
        kind = step.kind
        async with self.lock("monitor"):
            t = self.now()
            started = time.monotonic()
            if kind == sched.KILL_MONITOR:
                await self.cluster.kill("monitor")
                await asyncio.sleep(step.duration)
                await self.cluster.restart("monitor")
            else:
                self.cluster.stop_process("monitor")
                try:
                    await asyncio.sleep(step.duration)
                finally:
                    self.cluster.continue_process("monitor")
            self.record(kind, "monitor", t, duration=round(time.monotonic() - started, 3))

    async def _flood(self, step: sched.Step) -> None:
        kind = step.kind
        async with self.lock("flood"):
            name = await self.cluster.broker_with_role("active") or "broker-a"
            t = self.now()
            out = self.folder / "flood.jsonl"
            cfg = {
                "role": "flood",
                "address": self.cluster.address[name],
                "topic": FLOOD_TOPIC,
                "count": self.cfg.flood_streams,
                "seconds": step.duration,
                "out": str(out),
                "log": str(self.folder / "flood.log"),
            }
            started = time.monotonic()
            async with child_process("sokutatsu.cli.chaos_client", json.dumps(cfg), what="flood") as proc:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), step.duration + 60)
            records, _ = check.read_lines(out)
            result: dict[str, Any] = next((r for r in reversed(records) if r.get("e") == "flood"), {})
            self.record(
                kind,
                name,
                t,
                duration=round(time.monotonic() - started, 3),
                streams=self.cfg.flood_streams,
                accepted=result.get("accepted"),
                refused=result.get("refused"),
            )

    async def _restart_publisher(self, step: sched.Step) -> None:
        kind = step.kind
        async with self.lock("publisher"):
            client = self.publishers[step.target]
            t = self.now()
            await client.kill()
            await client.stack.aclose()
            await asyncio.sleep(step.duration)
            fresh = Client(client.name, client.cfg)
            await fresh.start()
            self.publishers[step.target] = fresh
            self.record(kind, step.target, t, duration=step.duration)

    async def nemesis(self, steps: list[sched.Step]) -> None:
        for step in steps:
            await asyncio.sleep(step.delay)
            await self.take(step)
        await asyncio.gather(*self.background)

    # ---------------------------------------------------------------- drain --
    def histories(self) -> tuple[list[check.PublisherHistory], list[check.SubscriberHistory], int]:
        torn = 0
        pubs = []
        for name in PUBLISHERS:
            records, t = check.read_lines(self.folder / f"{name}.jsonl")
            torn += t
            pubs.append(check.publisher_history(name, records))
        subs = []
        for name, settings in SUBSCRIBERS.items():
            records, t = check.read_lines(self.folder / f"{name}.jsonl")
            torn += t
            subs.append(check.subscriber_history(name, records, settings.get("keys", ()), settings.get("prefixes", ())))
        return pubs, subs, torn

    async def churn_check(self) -> dict[str, Any]:
        """After the drain: both brokers must come to hold the same churn subscriptions (bounded wait),
        and a subscription whose last call went to both brokers and was answered OK by both must be held
        (created) or not (deleted), when no call on it had an unknown outcome. A creation may have expired
        since (either is right) once CHURN_EXPIRY_SECONDS have passed from the first of the creations that
        end its calls (a creation of one that exists is refused; expiry counts from the copy's making, never
        earlier than its call)."""
        started = time.monotonic()
        held: dict[str, list[str] | None] = {}
        while True:
            held = {b: await self.cluster.churn_held(b) for b in BROKERS}
            same = held["broker-a"] is not None and held["broker-a"] == held["broker-b"]
            if same or time.monotonic() - started > CHURN_SETTLE_SECONDS:
                break
            await asyncio.sleep(0.5)
        calls: dict[str, list[dict[str, Any]]] = {}
        for call in self.churn_log:
            calls.setdefault(call["name"], []).append(call)
        now = self.now()
        expected: dict[str, bool] = {}
        for name, made in calls.items():
            if any(call.get(b, "OK") not in CHURN_SURE for call in made for b in BROKERS):
                continue  # a call whose outcome is unknown may still have been applied
            last = made[-1]
            if not all(last.get(b) == "OK" for b in BROKERS):
                continue
            if last["operation"] == "create":
                first = len(made) - 1
                while first and made[first - 1]["operation"] == "create":
                    first -= 1
                if now - made[first]["t"] >= CHURN_EXPIRY_SECONDS:
                    continue  # it may have expired since
            expected[name] = last["operation"] == "create"
        stats = {b: await self.cluster.stats(b) for b in BROKERS}
        wrong = sorted(
            name
            for name, want in expected.items()
            if held["broker-a"] is not None and (name in held["broker-a"]) != want
        )
        return {
            "same": same,
            "held": held,
            "waited_s": round(time.monotonic() - started, 2),
            "expected": expected,
            "wrong": wrong,
            # Expiries each broker made since its last start (a restart resets the count).
            "expired": {b: (reply.subscriptions_expired if reply else None) for b, reply in stats.items()},
        }

    async def drain(self) -> dict[str, Any]:
        """Publishers stop and wait for their acks; subscribers get (bounded) what was acknowledged."""
        await self.subscribers["slow"].tell("fast")
        started = time.monotonic()
        flushed = await asyncio.gather(*(c.finish(self.cfg.drain_seconds) for c in self.publishers.values()))
        while time.monotonic() - started < self.cfg.drain_seconds:
            pubs, subs, _ = self.histories()
            if all(check.check_subscriber(pubs, s).lost == 0 for s in subs):
                break
            await asyncio.sleep(0.5)
        drained = round(time.monotonic() - started, 2)
        closed = await asyncio.gather(*(c.finish(15.0) for c in self.subscribers.values()))
        return {
            "drain_s": drained,
            "publishers_flushed": dict(zip(self.publishers, flushed, strict=True)),
            "subscribers_closed": dict(zip(self.subscribers, closed, strict=True)),
        }


def _brief(extra: dict[str, Any]) -> str:
    keep = ("duration", "role", "settle_timed_out", "accepted", "refused")
    return " ".join(f"{k}={v}" for k, v in extra.items() if k in keep and v not in (None, False))


def migration_overlaps(switchovers: list[dict[str, Any]], faults: list[dict[str, Any]], end: float) -> bool:
    """Whether a broker fault hit while the slow subscriber was migrated (between a SLOW move and the next)."""
    moves = sorted((s for s in switchovers if s["subscriber"] == "slow" and not s["error"]), key=lambda s: s["t"])
    windows = []
    for i, move in enumerate(moves):
        if move["reason"] == "SLOW":
            windows.append((move["t"], moves[i + 1]["t"] if i + 1 < len(moves) else end))
    return any(
        f["kind"] in sched.BROKER_FAULTS and start <= f["t"] + f.get("duration", 0.0) and f["t"] <= stop
        for f in faults
        for start, stop in windows
    )


def evidence(folder: Path, limit: int = 40) -> list[str]:
    """Log lines that tell what happened (warnings, errors, roles, gaps), from every process of the schedule."""
    words = ("WARNING", "ERROR", "becomes active", "promot", "demot", "rejoin", "gap", "never arrived", "Traceback")
    lines: list[str] = []
    for path in sorted([*folder.glob("*.log"), *(folder / "suite" / "logs").glob("*.log")]):
        with contextlib.suppress(OSError):
            lines.extend(
                f"{path.stem}: {line.strip()[:300]}"
                for line in path.read_text(errors="replace").splitlines()
                if any(w in line for w in words)
            )
    return lines[-limit:] if len(lines) > limit else lines


async def run_schedule(seed: int, cfg: ChaosConfig, folder: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run one schedule in ``folder``; the schedule's entry for the report."""
    await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
    steps = sched.draw(seed, cfg.seconds)
    churn = sched.churn_calls(seed, cfg.seconds)
    cluster = Cluster(folder, cfg.delivery_workers)
    run = ScheduleRun(seed, folder, cfg, cluster, progress)
    pollers: list[asyncio.Task[None]] = []
    error = ""
    drain: dict[str, Any] = {}
    stopped: list[tuple[str, int]] = []
    wall = time.monotonic()
    try:
        await cluster.start()
        run.t0 = time.time()
        pollers = [asyncio.create_task(run.poll_roles()), asyncio.create_task(run.poll_switchovers())]
        await run.start_clients()
        churner = asyncio.create_task(run.churner(churn))
        run.background.append(churner)
        await run.nemesis(steps)
        await churner
        drain = await run.drain()
        drain["churn"] = await run.churn_check()
    except Exception as exc:  # noqa: BLE001 - the schedule is reported as failed, the next one runs
        error = f"{type(exc).__name__}: {exc}"
        progress(f"  seed {seed}: harness error: {error}")
    finally:
        for task in run.background:
            task.cancel()
        for client in [*run.publishers.values(), *run.subscribers.values()]:
            await client.kill()
            with contextlib.suppress(Exception):
                await client.stack.aclose()
        for task in pollers:
            task.cancel()
        await asyncio.gather(*pollers, *run.background, return_exceptions=True)
        stopped = await cluster.stop()
    end = time.time()
    result = _result(run, steps=steps, drain=drain, stopped=stopped, error=error, end=end, wall=time.monotonic() - wall)
    result["churn_calls"] = [c.as_dict() for c in churn]
    return result


def _result(
    run: ScheduleRun,
    *,
    steps: list[sched.Step],
    drain: dict[str, Any],
    stopped: list[tuple[str, int]],
    error: str,
    end: float,
    wall: float,
) -> dict[str, Any]:
    pubs, subs, torn = run.histories()
    verdicts = [check.check_subscriber(pubs, s) for s in subs]
    all_stalls = [s for p in pubs for s in check.stalls(p)]
    faults = sorted(run.faults, key=lambda f: f["t"])
    fault_times = [run.t0 + f["t"] for f in faults]
    summary = check.summarize_stalls(all_stalls, fault_times)
    for fault, stall in zip(faults, summary.per_fault_s, strict=True):
        fault["stall_after_s"] = round(stall, 3)
    switchovers = sorted(run.switchovers.values(), key=lambda s: s["t"])
    relative = [check.RoleSample(s.at - run.t0, s.roles) for s in run.samples]
    windows = check.two_active_windows(relative)
    lost = sum(v.lost for v in verdicts)
    duplicates = sum(v.duplicates for v in verdicts)
    reordered = sum(v.reordered for v in verdicts)
    gaps = sum(v.gaps for v in verdicts)
    unexpected = sum(v.unexpected for v in verdicts)
    actives = check.max_actives(run.samples)
    unflushed = [p for p, ok in drain.get("publishers_flushed", {}).items() if not ok]
    result = {
        "seed": run.seed,
        "folder": str(run.folder),
        "duration_s": round(end - run.t0, 2) if run.t0 else 0.0,
        "wall_s": round(wall, 2),
        "steps": [s.as_dict() for s in steps],
        "meets_minimum": sched.meets_minimum(steps),
        "faults": faults,
        "lost": lost,
        "duplicates": duplicates,
        "reordered": reordered,
        "gaps": gaps,
        "unexpected": unexpected,
        "max_actives": actives,
        "two_active_windows": windows[:20],
        "publish_stall_max_s": round(summary.max_s, 3),
        "publish_stall_p99_s": round(summary.p99_s, 3),
        "longest_stall": (
            {
                "publisher": summary.longest.publisher_id,
                "start": round(summary.longest.start - run.t0, 3),
                "end": round(summary.longest.end - run.t0, 3),
            }
            if summary.longest
            else None
        ),
        "stalls": [
            {"p": s.publisher_id, "start": round(s.start - run.t0, 3), "s": round(s.seconds, 3)}
            for s in all_stalls
            if s.seconds >= 0.1
        ],
        "acknowledged": {p.publisher_id: len(p.acks) for p in pubs},
        "publisher_starts": {p.publisher_id: len(p.starts) for p in pubs},
        "subscribers": [v.as_dict() for v in verdicts],
        "client_errors": {h.publisher_id: h.errors for h in pubs if h.errors}
        | {h.subscriber_id: h.errors for h in subs if h.errors},
        "switchovers": switchovers,
        "churn": run.churn_log,
        "migration_overlapped_fault": migration_overlaps(switchovers, faults, end - run.t0),
        "link_via_proxy": run.cluster.link_via_proxy,
        "active_timeline": _active_timeline(relative),
        "drain": drain,
        "unflushed_publishers": unflushed,
        "settle_timeouts": sum(1 for f in faults if f.get("settle_timed_out")),
        "torn_lines": torn,
        "services_stopped": dict(stopped),
        "error": error,
    }
    result["violations"] = violations(result)
    if result["violations"]:
        result["evidence"] = evidence(run.folder)
    return result


def violations(result: dict[str, Any]) -> list[str]:
    """The promises a schedule broke, in words (empty: none)."""
    out = [f"{k}={result[k]}" for k in ("lost", "duplicates", "reordered", "gaps", "unexpected") if result.get(k)]
    if result["max_actives"] > 1:
        out.append(f"max_actives={result['max_actives']}")
    if result["unflushed_publishers"]:
        out.append(f"publishing stopped: {', '.join(result['unflushed_publishers'])} not acknowledged at the end")
    churn = result.get("drain", {}).get("churn")
    if churn and None in churn["held"].values():
        out.append(f"a broker did not answer ListSubscriptions after the drain: {churn['held']}")
    elif churn and not churn["same"]:
        out.append(f"durable subscriptions differ between the brokers: {churn['held']}")
    if churn and churn["wrong"]:
        out.append(f"churn subscriptions not as their last call on both brokers left them: {churn['wrong']}")
    if result["error"]:
        out.append(f"harness error: {result['error']}")
    return out


def _active_timeline(samples: list[check.RoleSample]) -> list[list[Any]]:
    """Runs of equal role answers: [start, end, {broker: role}] (for the HTML timeline)."""
    out: list[list[Any]] = []
    for s in samples:
        roles = {b: r for b, (r, _) in s.roles.items()}
        if out and out[-1][2] == roles:
            out[-1][1] = round(s.at, 3)
        else:
            out.append([round(s.at, 3), round(s.at, 3), roles])
    return out


def run_many(seeds: list[int], cfg: ChaosConfig, folder: Path, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run the schedules one after the other. Each one's result is also written, as soon as it is
    checked, to ``<folder>/seed-<n>/result.json`` and summed up in one line, so a long run that is
    interrupted keeps what it found."""
    results: list[dict[str, Any]] = []
    for seed in seeds:
        progress(f"schedule seed {seed}: {cfg.seconds:g} s of faults")
        result = asyncio.run(run_schedule(seed, cfg, folder / f"seed-{seed}", progress))
        (folder / f"seed-{seed}" / "result.json").write_text(json.dumps(result, indent=1, default=str))
        progress(
            f"schedule seed {seed}: lost {result.get('lost')}, duplicates {result.get('duplicates')}, "
            f"reordered {result.get('reordered')}, gaps {result.get('gaps')}, "
            f"unexpected {result.get('unexpected')}, max_actives "
            f"{result.get('max_actives')}, longest stall {result.get('publish_stall_max_s')} s, "
            f"violations {result.get('violations') or 'none'}"
        )
        results.append(result)
    return results


def random_seeds(count: int, first: int | None) -> list[int]:
    start = first if first is not None else random.SystemRandom().randrange(1, 10**6)
    return list(range(start, start + count))


__all__ = ["ChaosConfig", "run_many", "run_schedule", "violations"]

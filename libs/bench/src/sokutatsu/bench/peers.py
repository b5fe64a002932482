"""``sokutatsu bench peers``: Sokutatsu against RabbitMQ and NATS JetStream, one machine, one run.

The same process model for every system: the publisher runs in this process (asyncio),
each consumer in a process of its own (:mod:`sokutatsu.bench.peers_consumer`), and the
servers are whatever runs on loopback (RabbitMQ on 5672, NATS on 4222) or, for Sokutatsu, a
broker pair and its monitor started fresh for each scenario. Clients and settings per system:
:mod:`sokutatsu.bench.peers_clients`. Three scenarios, 1 KiB bodies, persistent and acknowledged:

* **throughput**: ``messages`` published as fast as the window of unacknowledged messages
  allows, one consumer; msgs/s = messages / (first publish to last delivery).
* **latency**: a fixed offered rate (paced every millisecond), one consumer; p50/p99/max of
  receive time minus publish time.
* **slow consumer**: the same fixed rate to two consumers of the same exchange / stream /
  topic; after ``before_seconds`` one of them drops to ``SLOW_FRACTION`` of the rate. What
  happens to the *other* consumer's latency: mean, p99 and max after the slow-down relative to
  before. (Sokutatsu: the monitor moves the slow one to the standby.)

A system that does not answer on its port is reported as skipped; the others are measured.

With Sokutatsu, two references are measured in the latency scenario of the same run:
``sokutatsu-single`` (one broker: the pair's second copy left out) and ``grpc-floor`` (a bare
Python gRPC relay, :mod:`sokutatsu.bench.floor`: the same two hops with no broker work).
They say how much of Sokutatsu's latency is its own work and how much is Python gRPC's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sokutatsu.bench.common import broker_process, cpu_sample, pair_with_monitor, service_process, steal_percent
from sokutatsu.bench.peers_clients import PREFETCH, WINDOW, Peer, make_body, peer_named
from sokutatsu.bench.slow import audit
from sokutatsu.cli.children import child_process, child_result, tell
from sokutatsu.cli.measure import machine, percentile
from sokutatsu.core.tls import open_channel

SYSTEMS = ("sokutatsu", "rabbitmq", "nats")
# Measured in the latency scenario only, when Sokutatsu is (see the module's docstring).
REFERENCES = ("sokutatsu-single", "grpc-floor")
PORTS = {"rabbitmq": 5672, "nats": 4222}
SIZE = 1024
SLOW_FRACTION = 0.05


@dataclass(frozen=True)
class PeersConfig:
    messages: int  # throughput scenario
    rate: int  # offered msgs/s in the latency and slow-consumer scenarios
    latency_seconds: float
    before_seconds: float
    slow_seconds: float


# 1,000 msgs/s: below what every system's Python client sustains here (aio-pika publishes about
# 2,500 confirmed msgs/s on this machine), so latency is not a queue that builds up.
QUICK = PeersConfig(messages=20_000, rate=1000, latency_seconds=4.0, before_seconds=3.0, slow_seconds=6.0)
FULL = PeersConfig(messages=100_000, rate=1000, latency_seconds=20.0, before_seconds=10.0, slow_seconds=20.0)


# ------------------------------------------------------------------ processes --
@dataclass
class Setup:
    """Where one scenario of one system runs."""

    peer: Peer
    system: str
    addresses: Sequence[str] = ()
    budget: int = 0
    monitor: str = ""


@contextlib.contextmanager
def setup(system: str, cfg: PeersConfig) -> Iterator[Setup]:
    if system in REFERENCES:
        with reference(system) as address:
            yield Setup(peer_named(system, [address]), system, [address])
        return
    if system != "sokutatsu":
        yield Setup(peer_named(system), system)
        return
    # A fresh pair and monitor per scenario. The slow consumer's budget is one second of
    # publishing; the monitor's threshold floor is half of that (as bench slow-subscriber).
    budget = cfg.rate * SIZE
    monitor = {"stats_interval_ms": "50", "slow_threshold_min": str(max(1, cfg.rate // 2))}
    with (
        tempfile.TemporaryDirectory(prefix="sokutatsu-bench-peers-") as tmp,
        pair_with_monitor(Path(tmp), monitor=monitor) as pair,
    ):
        yield Setup(peer_named(system, pair.addresses, budget), system, pair.addresses, budget, pair.monitor.address)


@contextlib.contextmanager
def reference(system: str) -> Iterator[str]:
    """The address of a fresh ``sokutatsu-single`` broker or ``grpc-floor`` relay."""
    if system == "sokutatsu-single":
        with broker_process() as broker:
            yield broker.address
        return
    with (
        tempfile.TemporaryDirectory(prefix="sokutatsu-bench-floor-") as tmp,
        service_process("sokutatsu.bench.floor", "SOKUTATSU_FLOOR_", Path(tmp), "grpc-floor") as relay,
    ):
        yield relay.address


def consumer(
    where: Setup, name: str, count: int, slow_rate: float = 0
) -> contextlib.AbstractAsyncContextManager[asyncio.subprocess.Process]:
    return child_process(
        "sokutatsu.bench.peers_consumer",
        where.system,
        ",".join(where.addresses),
        str(where.budget if slow_rate else 0),
        name,
        str(count),
        str(slow_rate),
        what=f"{where.system} consumer {name}",
    )


async def publish_paced(peer: Peer, rate: int, count: int, mark_after: float = 0.0) -> tuple[int, int]:
    """Publish ``count`` messages at ``rate``; returns (start ns, ns when ``mark_after`` s had passed)."""
    mark_ns = 0
    async with peer.sender() as sender:
        start_ns = time.time_ns()
        start = time.perf_counter()
        sent = 0
        while sent < count:
            elapsed = time.perf_counter() - start
            if mark_after and not mark_ns and elapsed >= mark_after:
                mark_ns = time.time_ns()
            due = min(count, int(elapsed * rate) + 1)
            while sent < due:
                sent += 1
                await sender.send(make_body(sent, SIZE))
            await asyncio.sleep(0.001)
        await sender.flush()
    return start_ns, mark_ns


# ------------------------------------------------------------------ scenarios --
def _latency_figures(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    if not ordered:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "mean_ms": round(statistics.fmean(ordered), 3),
        "p50_ms": round(percentile(ordered, 0.50), 3),
        "p99_ms": round(percentile(ordered, 0.99), 3),
        "max_ms": round(ordered[-1], 3),
    }


async def throughput(system: str, cfg: PeersConfig) -> dict[str, Any]:
    with setup(system, cfg) as where:
        await where.peer.prepare(["tput"])
        try:
            async with consumer(where, "tput", cfg.messages) as proc:
                async with where.peer.sender() as sender:
                    start_ns = time.time_ns()
                    for seq in range(1, cfg.messages + 1):
                        await sender.send(make_body(seq, SIZE))
                    await sender.flush()
                    acked_ns = time.time_ns()
                got = await child_result(proc, 300)
        finally:
            await where.peer.cleanup()
    seconds = (got["done_ns"] - start_ns) / 1e9
    return {
        "messages": got["received"],
        "seconds": round(seconds, 3),
        "msgs_per_s": round(got["received"] / seconds),
        "publish_acked_msgs_per_s": round(cfg.messages / ((acked_ns - start_ns) / 1e9)),
        "audit": audit(got["seqs"], cfg.messages),
    }


async def latency(system: str, cfg: PeersConfig) -> dict[str, Any]:
    total = int(cfg.rate * cfg.latency_seconds)
    with setup(system, cfg) as where:
        await where.peer.prepare(["lat"])
        try:
            async with consumer(where, "lat", total) as proc:
                await publish_paced(where.peer, cfg.rate, total)
                got = await child_result(proc, 120)
        finally:
            await where.peer.cleanup()
    return {"rate": cfg.rate, "messages": got["received"], **_latency_figures(got["latency_ms"])} | {
        "audit": audit(got["seqs"], total)
    }


async def slow_consumer(system: str, cfg: PeersConfig) -> dict[str, Any]:
    total = int(cfg.rate * (cfg.before_seconds + cfg.slow_seconds))
    slow_rate = max(1.0, cfg.rate * SLOW_FRACTION)
    with setup(system, cfg) as where:
        await where.peer.prepare(["normal", "slow"])
        try:
            async with consumer(where, "normal", total) as normal, consumer(where, "slow", 0, slow_rate) as slow:
                publishing = asyncio.create_task(publish_paced(where.peer, cfg.rate, total, cfg.before_seconds))
                await asyncio.sleep(cfg.before_seconds)
                await tell(slow, "slow")
                _, slow_at_ns = await publishing
                got = await child_result(normal, 300)
                await tell(slow, "stop")
                slow_got = await child_result(slow, 60)
            moved = await _moved(where.monitor) if where.monitor else None
        finally:
            await where.peer.cleanup()
    before = [lat for p, lat in zip(got["published_ns"], got["latency_ms"], strict=True) if p < slow_at_ns]
    after = [lat for p, lat in zip(got["published_ns"], got["latency_ms"], strict=True) if p >= slow_at_ns]
    b, a = _latency_figures(before), _latency_figures(after)
    slow_audit = audit(slow_got["seqs"], 0)
    return {
        "rate": cfg.rate,
        "slow_rate": slow_rate,
        "messages": total,
        "normal_before": b,
        "normal_after": a,
        "after_over_before": {k: _ratio(a[k], b[k]) for k in ("mean_ms", "p99_ms", "max_ms")},
        "normal_audit": audit(got["seqs"], total),
        "slow_received": slow_got["received"],
        "slow_audit": {"duplicates": slow_audit["duplicates"], "reordered": slow_audit["reordered"]},
        "slow_moved_to_standby": moved,
    }


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 2) if top is not None and bottom else None


async def _moved(monitor: str) -> dict[str, Any] | None:

    from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc  # noqa: PLC0415

    async with open_channel(monitor) as channel:
        status = await monitor_pb2_grpc.MonitorStub(channel).GetStatus(
            monitor_pb2.GetStatusRequest(recent_switchovers=100), timeout=10
        )
    moves = [s for s in status.recent_switchovers if s.subscriber_id == "slow" and not s.error]
    if not moves:
        return None
    return {"switch_ms": moves[-1].total_micros / 1000, "depth": moves[-1].depth, "threshold": moves[-1].threshold}


def reachable(system: str) -> str | None:
    """None when the system answers on loopback, else why not."""
    port = PORTS.get(system)
    if port is None:
        return None
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return None
    except OSError as exc:
        return f"nothing answers on 127.0.0.1:{port} ({exc.strerror or exc})"


async def _scenario(
    run: Callable[[str, PeersConfig], Awaitable[dict[str, Any]]], system: str, cfg: PeersConfig
) -> dict[str, Any]:
    """One scenario's figures with the CPU steal during it, or the error that ended it."""
    before = cpu_sample()
    try:
        figures = await run(system, cfg)
    except Exception as exc:  # noqa: BLE001 - one failing system or scenario must not hide the others
        figures = {"error": f"{type(exc).__name__}: {exc}"}
    figures["cpu_steal_percent"] = steal_percent(before, cpu_sample())
    return figures


async def measure(cfg: PeersConfig, systems: Sequence[str] = SYSTEMS, say: Any = print) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in systems:
        missing = reachable(system)
        if missing:
            say(f"{system}: skipped, {missing}")
            out[system] = {"skipped": missing}
            continue
        out[system] = {}
        for scenario, run in (("throughput", throughput), ("latency", latency), ("slow_consumer", slow_consumer)):
            say(f"{system}: {scenario} ...")
            out[system][scenario] = await _scenario(run, system, cfg)
    if "sokutatsu" in systems:
        for system in REFERENCES:
            say(f"{system}: latency (reference) ...")
            out[system] = {"latency": await _scenario(latency, system, cfg)}
    return {
        "benchmark": "peers",
        "systems": out,
        "ratios": ratios(out),
        "table": markdown_table(out),
        "setup": (
            f"{SIZE}-byte persistent bodies; publisher in the benchmark process, each consumer its own process "
            f"(asyncio); window of {WINDOW} unacknowledged publishes, consumer prefetch/credits {PREFETCH}; "
            f"throughput: {cfg.messages} messages, one consumer; latency: {cfg.rate} msgs/s for "
            f"{cfg.latency_seconds:g}s; slow consumer: {cfg.rate} msgs/s to two consumers, one drops to "
            f"{SLOW_FRACTION:.0%} after {cfg.before_seconds:g}s for {cfg.slow_seconds:g}s. Sokutatsu: broker pair "
            "(every publish acknowledged by both) with the monitor in migrate mode; RabbitMQ: aio-pika, durable "
            "fanout exchange and classic queues, publisher confirms; NATS: nats-py, JetStream file storage, "
            "publish_async acks, durable pull consumers. References (latency only): sokutatsu-single, one broker "
            "without standby or monitor; grpc-floor, a bare Python gRPC relay (two hops, no broker work)"
        ),
        "config": cfg.__dict__,
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def ratios(out: dict[str, Any]) -> dict[str, Any]:
    """Sokutatsu's figures over each peer's, from this one run (the machine is noisy)."""
    ours = out.get("sokutatsu", {})
    found: dict[str, Any] = {}
    for peer in ("rabbitmq", "nats"):
        theirs = out.get(peer, {})
        with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
            found[f"throughput_sokutatsu_over_{peer}"] = round(
                ours["throughput"]["msgs_per_s"] / theirs["throughput"]["msgs_per_s"], 2
            )
        with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
            found[f"slow_consumer_normal_p99_after_{peer}_over_sokutatsu"] = round(
                theirs["slow_consumer"]["normal_after"]["p99_ms"] / ours["slow_consumer"]["normal_after"]["p99_ms"], 2
            )
        with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
            found[f"slow_consumer_normal_mean_after_{peer}_over_sokutatsu"] = round(
                theirs["slow_consumer"]["normal_after"]["mean_ms"] / ours["slow_consumer"]["normal_after"]["mean_ms"],
                2,
            )
    floor = out.get("grpc-floor", {})
    for system in ("sokutatsu", "sokutatsu-single", "rabbitmq", "nats"):
        with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
            # How far above two bare Python gRPC hops each system's median latency is.
            found[f"latency_p50_{system}_over_grpc_floor"] = round(
                out[system]["latency"]["p50_ms"] / floor["latency"]["p50_ms"], 2
            )
    return found


def _cell(figures: dict[str, Any], *path: str) -> str:
    value: Any = figures
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return "n/a"
        value = value[key]
    return "n/a" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def markdown_table(out: dict[str, Any]) -> str:
    lines = [
        "| system | msgs/s | p50 ms | p99 ms | normal consumer under a slow one: mean before → after ms "
        "| p99 before → after ms | max after ms | lost/dup/reordered |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, f in out.items():
        if "skipped" in f:
            lines.append(f"| {system} | skipped: {f['skipped']} | | | | | | |")
            continue
        bad = sum(
            v
            for s in ("throughput", "latency", "slow_consumer")
            for k in ("audit", "normal_audit", "slow_audit")
            for v in (f.get(s, {}).get(k) or {}).values()
        )
        errors = "; ".join(f"{s}: {f[s]['error']}" for s in f if isinstance(f[s], dict) and "error" in f[s])
        lines.append(
            f"| {system} | {_cell(f, 'throughput', 'msgs_per_s')} | {_cell(f, 'latency', 'p50_ms')} "
            f"| {_cell(f, 'latency', 'p99_ms')} "
            f"| {_cell(f, 'slow_consumer', 'normal_before', 'mean_ms')} → "
            f"{_cell(f, 'slow_consumer', 'normal_after', 'mean_ms')} "
            f"| {_cell(f, 'slow_consumer', 'normal_before', 'p99_ms')} → "
            f"{_cell(f, 'slow_consumer', 'normal_after', 'p99_ms')} "
            f"| {_cell(f, 'slow_consumer', 'normal_after', 'max_ms')} | {bad}{' ' + errors if errors else ''} |"
        )
    return "\n".join(lines)

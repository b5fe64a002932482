"""``sokutatsu bench slow-subscriber``: seed 000's experiment (§4) on this code.

For each message size and each mode, a publisher sends at a fixed rate to one
normal and one slow subscriber; partway through, the slow one's consume rate
drops sharply (to ``SLOW_FRACTION`` of the publish rate). On the normal
subscriber the publish→receive latency of every message is measured (one
clock); for both subscribers, the sequence numbers received.

* ``flow-to-disk`` (the seed's baseline): one broker serves both; the slow
  subscriber's queue spills to that broker's disk when over its budget.
* ``migrate`` (the seed's method): a broker pair and the monitor; the monitor
  moves the slow subscriber to the standby, which alone spills.

Latencies are reported relative to the normal subscriber's mean before the
slow-down, as the seed's Tables 6 and 7: *before* is what was published before
the slow-down, *during* what was published between the slow-down and the
moment the mode reacted (the flow-to-disk queue started spilling; the
switchover finished), *after* the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sokutatsu.bench.common import cpu_sample, pair_with_monitor, started, steal_percent
from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.cli.children import child_process, child_result, tell
from sokutatsu.cli.measure import machine
from sokutatsu.client import BufferFull, Publisher
from sokutatsu.core.tls import client_config, open_channel
from sokutatsu.harness.broker import BrokerProcess
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc

TOPIC = "ticks"
SIZES = (4096, 16384, 65536, 262144)
# Bytes per second offered: low enough that the disk is not the bottleneck for flow-to-disk
# (the seed chose its rates that way), the same for every size.
BYTES_PER_SECOND = 8 * 2**20
MAX_RATE = 2000
# After the slow-down the slow subscriber consumes this share of the publish rate.
SLOW_FRACTION = 0.05
# The slow subscriber's queue budget, in seconds of publishing (at least a few messages).
BUDGET_SECONDS = 1.0
STEP_NAMES = {
    monitor_pb2.SWITCHOVER_STEP_POSITION: "position",
    monitor_pb2.SWITCHOVER_STEP_ACCEPT: "accept",
    monitor_pb2.SWITCHOVER_STEP_REDIRECT: "redirect",
    monitor_pb2.SWITCHOVER_STEP_RELEASE: "release",
}


@dataclass(frozen=True)
class SlowConfig:
    before_seconds: float
    slow_seconds: float
    sizes: tuple[int, ...] = SIZES

    def rate(self, size: int) -> int:
        return max(10, min(MAX_RATE, BYTES_PER_SECOND // size))

    def count(self, size: int) -> int:
        return int(self.rate(size) * (self.before_seconds + self.slow_seconds))

    def budget(self, size: int) -> int:
        return max(8 * size, int(self.rate(size) * size * BUDGET_SECONDS))


QUICK = SlowConfig(before_seconds=3.0, slow_seconds=6.0)
FULL = SlowConfig(before_seconds=10.0, slow_seconds=25.0)


@dataclass
class Run:
    """What one (size, mode) run observed."""

    size: int
    mode: str
    rate: int
    sent: int
    slow_at_ns: int
    reacted_at_ns: int | None
    normal: dict[str, Any]
    slow: dict[str, Any]
    switch: dict[str, Any] = field(default_factory=dict)
    cpu_steal_percent: float | None = None


# ------------------------------------------------------------------ processes --
def subscriber(
    addresses: Sequence[str], subscriber_id: str, *, mode: str, budget: int, count: int, slow_rate: float
) -> contextlib.AbstractAsyncContextManager[asyncio.subprocess.Process]:
    return child_process(
        "sokutatsu.bench.slow_sub",
        ",".join(addresses),
        TOPIC,
        subscriber_id,
        mode,
        str(budget),
        str(count),
        str(slow_rate),
        what=f"benchmark subscriber {subscriber_id}",
    )


async def _publish(addresses: Sequence[str], size: int, rate: int, count: int, slow_at: float) -> int:
    """Publish ``count`` messages at ``rate``; returns the wall-clock ns at which ``slow_at`` s passed."""
    body = b"x" * size
    slow_ns = 0
    async with Publisher(list(addresses), f"feed-{size}", ack_timeout=120, config=client_config()) as pub:
        start = time.perf_counter()
        sent = 0
        while sent < count:
            elapsed = time.perf_counter() - start
            if not slow_ns and elapsed >= slow_at:
                slow_ns = time.time_ns()
            due = min(count, int(elapsed * rate) + 1)
            while sent < due:
                try:
                    pub.publish_nowait(TOPIC, "7203.T", body)
                except BufferFull:
                    await pub.flush()
                    continue
                sent += 1
            await asyncio.sleep(0.001)
        await pub.flush()
    return slow_ns


async def _spill_started(address: str, subscriber_id: str, stop: asyncio.Event) -> int | None:
    """Flow-to-disk's reaction: when the slow queue first has messages on disk (polled every 10 ms)."""
    async with open_channel(address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        while not stop.is_set():
            stats = await admin.GetStats(broker_pb2.GetStatsRequest(), timeout=10)
            for sub in stats.subscribers:
                if sub.subscriber_id == subscriber_id and sub.spilled_count:
                    return time.time_ns()
            await asyncio.sleep(0.01)
    return None


async def _run_mode(cfg: SlowConfig, size: int, mode: str, addresses: Sequence[str], monitor: str) -> Run:
    rate = cfg.rate(size)
    count = cfg.count(size)
    budget = cfg.budget(size)
    normal_id, slow_id = f"normal-{size}", f"slow-{size}"
    before = cpu_sample()
    async with (
        subscriber(addresses, normal_id, mode=mode, budget=budget * 64, count=count, slow_rate=0) as normal,
        subscriber(
            addresses, slow_id, mode=mode, budget=budget, count=count, slow_rate=max(1.0, rate * SLOW_FRACTION)
        ) as slow,
    ):
        stop = asyncio.Event()
        watch = asyncio.create_task(_spill_started(addresses[0], slow_id, stop)) if mode == "flow-to-disk" else None
        publishing = asyncio.create_task(_publish(addresses, size, rate, count, cfg.before_seconds))
        await asyncio.sleep(cfg.before_seconds)
        await tell(slow, "slow")
        slow_at_ns = await publishing
        await tell(slow, "fast")  # drain, so delivery of everything can be checked
        normal_result = await child_result(normal, 300)
        slow_result = await child_result(slow, 600)
        stop.set()
        reacted = await watch if watch is not None else None
    switch: dict[str, Any] = {}
    if mode == "migrate":
        switch = await _switch_record(monitor, slow_id)
        reacted = switch.get("ended_ns")
    return Run(
        size=size,
        mode=mode,
        rate=rate,
        sent=count,
        slow_at_ns=slow_at_ns,
        reacted_at_ns=reacted,
        normal=normal_result,
        slow=slow_result,
        switch=switch,
        cpu_steal_percent=steal_percent(before, cpu_sample()),
    )


async def _switch_record(monitor: str, subscriber_id: str) -> dict[str, Any]:
    async with open_channel(monitor) as channel:
        status = await monitor_pb2_grpc.MonitorStub(channel).GetStatus(
            monitor_pb2.GetStatusRequest(recent_switchovers=100), timeout=10
        )
    moves = [
        s
        for s in status.recent_switchovers
        if s.subscriber_id == subscriber_id and s.reason == monitor_pb2.SWITCHOVER_REASON_SLOW and not s.error
    ]
    if not moves:
        return {}
    first = min(moves, key=lambda s: s.steps[0].started_unix_nano if s.steps else 0)
    started = first.steps[0].started_unix_nano if first.steps else 0
    return {
        "total_ms": first.total_micros / 1000,
        "steps_ms": {STEP_NAMES.get(t.step, str(t.step)): t.duration_micros / 1000 for t in first.steps},
        "started_ns": started,
        "ended_ns": started + first.total_micros * 1000,
        "depth": first.depth,
        "threshold": first.threshold,
        "moves": len(moves),
    }


async def measure_size(cfg: SlowConfig, size: int) -> dict[str, Run]:
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-slow-") as tmp:
        folder = Path(tmp)
        broker = BrokerProcess.with_settings(folder / "ftd", instance="ftd")
        with started(broker):
            runs["flow-to-disk"] = await _run_mode(cfg, size, "flow-to-disk", [broker.address], "")
        monitor = {"stats_interval_ms": "50", "slow_threshold_min": str(max(1, cfg.budget(size) // size // 2))}
        with pair_with_monitor(folder, monitor=monitor) as pair:
            runs["migrate"] = await _run_mode(cfg, size, "migrate", pair.addresses, pair.monitor.address)
    return runs


# ------------------------------------------------------------------- analysis --
def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def audit(seqs: Sequence[int], sent: int) -> dict[str, int]:
    """Lost, duplicated and out-of-order deliveries of one subscriber (all must be 0)."""
    seen: set[int] = set()
    duplicates = reordered = 0
    last = 0
    for seq in seqs:
        if seq in seen:
            duplicates += 1
            continue
        seen.add(seq)
        if seq < last:
            reordered += 1
        last = max(last, seq)
    lost = sum(1 for seq in range(1, sent + 1) if seq not in seen)
    return {"lost": lost, "duplicates": duplicates, "reordered": reordered}


def phases(run: Run) -> dict[str, list[float]]:
    """The normal subscriber's latencies by the publish time of each message."""
    out: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    reacted = run.reacted_at_ns or run.slow_at_ns
    for published, latency in zip(run.normal["published_ns"], run.normal["latency_ms"], strict=True):
        if published < run.slow_at_ns:
            out["before"].append(latency)
        elif published < reacted:
            out["during"].append(latency)
        else:
            out["after"].append(latency)
    return out


def per_hundred(run: Run) -> list[float]:
    """Mean latency of each 100 messages, relative to the mean before the slow-down (Figs 5 and 6)."""
    base = _mean(phases(run)["before"])
    lat = run.normal["latency_ms"]
    return [round(_mean(lat[i : i + 100]) / base, 3) for i in range(0, len(lat), 100)]


def summarize(ftd: Run, mig: Run) -> dict[str, Any]:
    f, m = phases(ftd), phases(mig)
    f_base, m_base = _mean(f["before"]), _mean(m["before"])
    f_after = _mean(f["after"]) / f_base
    f_during = _mean(f["during"]) / f_base if f["during"] else None
    m_after = _mean(m["after"]) / m_base
    slow_after_ftd = f["during"] + f["after"]
    slow_after_mig = m["during"] + m["after"]
    f_worst = max(slow_after_ftd, default=float("nan")) / f_base
    m_worst = max(slow_after_mig, default=float("nan")) / m_base
    return {
        "size": ftd.size,
        "rate": ftd.rate,
        "messages": ftd.sent,
        "before_mean_ms": {"flow-to-disk": round(f_base, 3), "migrate": round(m_base, 3)},
        "ftd_after_mean": round(f_after, 2),
        "ftd_during_mean": round(f_during, 2) if f_during is not None else None,
        "migrate_after_mean": round(m_after, 2),
        "mean_ratio": round(f_after / m_after, 1),
        "ftd_worst": round(f_worst, 1),
        "migrate_worst": round(m_worst, 1),
        "worst_ratio": round(f_worst / m_worst, 1),
        "switch_ms": mig.switch,
        "ftd_reacted_ms_after_slowdown": (
            round((ftd.reacted_at_ns - ftd.slow_at_ns) / 1e6, 1) if ftd.reacted_at_ns else None
        ),
        "audit": {
            mode: {
                who: audit(getattr(run, who)["seqs"], run.sent) | {"gaps": getattr(run, who)["gaps"]}
                for who in ("normal", "slow")
            }
            for mode, run in (("flow-to-disk", ftd), ("migrate", mig))
        },
        "cpu_steal_percent": {"flow-to-disk": ftd.cpu_steal_percent, "migrate": mig.cpu_steal_percent},
        "per_hundred": {"flow-to-disk": per_hundred(ftd), "migrate": per_hundred(mig)},
        "slow_from_message": {"flow-to-disk": len(f["before"]), "migrate": len(m["before"])},
    }


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Tables 6 and 7 of the seed, with this run's figures."""
    lines = [
        "| size | ftd after | ftd during | migrate after | mean ratio ftd/migrate | ftd worst | migrate worst "
        "| worst ratio | switch ms | lost/dup/reordered |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bad = sum(v for mode in r["audit"].values() for who in mode.values() for v in who.values())
        lines.append(
            f"| {r['size'] // 1024} KiB | {r['ftd_after_mean']} | {r['ftd_during_mean']} | {r['migrate_after_mean']} "
            f"| {r['mean_ratio']} | {r['ftd_worst']} | {r['migrate_worst']} | {r['worst_ratio']} "
            f"| {r['switch_ms'].get('total_ms', 'n/a')} | {bad} |"
        )
    return "\n".join(lines)


async def measure(cfg: SlowConfig) -> dict[str, Any]:
    rows = []
    for size in cfg.sizes:
        runs = await measure_size(cfg, size)
        rows.append(summarize(runs["flow-to-disk"], runs["migrate"]))
    return {
        "benchmark": "slow-subscriber",
        "sizes": list(cfg.sizes),
        "rows": rows,
        "table": markdown_table(rows),
        "setup": (
            f"publisher at min({MAX_RATE}, {BYTES_PER_SECOND // 2**20} MiB/s / size) msgs/s; one normal and one slow "
            f"subscriber, each its own process; the slow one drops to {SLOW_FRACTION:.0%} of the rate after "
            f"{cfg.before_seconds:g}s for {cfg.slow_seconds:g}s, then drains; slow queue budget "
            f"{BUDGET_SECONDS:g}s of publishing; flow-to-disk on one broker, migrate on a pair with the monitor"
        ),
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

"""``sokutatsu bench soak``: publish for N minutes with a slow and a stalled subscriber; memory must stay bounded.

A broker pair and the monitor, each its own process, with an explicit memory
budget: the broker-wide limit on message bytes held in memory (``MAX_BYTES``),
each subscriber queue's budget (``QUEUE_BUDGET``; over it a queue spills to
disk) and the tail the active keeps of a moved subscriber (``AWAY_TAIL``). The
check is each broker process's resident set size against ``--rss-budget-mib``.

The benchmark process publishes at a fixed offered rate with the SDK's
``Publisher`` (every message acknowledged) to three subscribers, each its own
process (``python -m sokutatsu.bench.soak ROLE ...``), all durable, overflow
mode ``migrate``:

* *normal* consumes as fast as messages come; it checks every message arrives
  exactly once, in order, and measures publish→receive latency (one clock);
* *slow* consumes at a small fraction of the rate, so the monitor moves it to
  the standby, whose queue spills to disk; when publishing ends it is told to
  drain, and must then have received every message exactly once, in order;
* *stalled* subscribes and never takes a message: the SDK grants no credit
  beyond its first window, the connection stays open. Its durable queue is
  kept (on disk past the budget) within its retention: ``--retention-mib``
  gives its subscription that maximum on disk (drop_oldest; the broker default,
  8 GiB, otherwise). When the slow one has drained, it reads what is left and
  reports what its SDK was told it lost (retention gaps, with reason and count)
  against what it did not get.

Every few seconds each process's ``VmRSS`` (``/proc/<pid>/status``) and each
broker's ``GetStats`` (held and spilled messages, per-subscriber depth) are
sampled. The result has a per-minute table (messages sent, the normal
subscriber's latency percentiles, the largest RSS, the depth of each queue)
and the checks; a PNG (RSS over time, normal latency per minute) is written
next to the JSON.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from grpc import aio
from rich.console import Console

from sokutatsu.bench.common import PairRun, cpu_sample, pair_with_monitor, steal_percent
from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.cli.children import child_process, child_result, stdin_words, tell
from sokutatsu.cli.measure import machine, percentile, settle_collector, write_json
from sokutatsu.client import BufferFull, Message, Publisher, Subscriber
from sokutatsu.core.tls import client_config, open_channel

console = Console(highlight=False, soft_wrap=True)

TOPIC = "soak"
READY = "ready"
ROLES = ("normal", "slow", "stalled")
MIB = 2**20


@dataclass(frozen=True)
class SoakConfig:
    minutes: float = 30.0
    rate: int = 500  # messages per second offered
    size: int = 1024  # body bytes
    slow_rate: float = 10.0  # what the slow subscriber consumes per second while publishing goes on
    max_bytes: int = 64 * MIB  # SOKUTATSU_BROKER_MAX_BYTES: message bytes a broker may hold in memory
    queue_budget: int = 4 * MIB  # SOKUTATSU_BROKER_QUEUE_BUDGET and each subscription's memory budget
    away_tail: int = 4 * MIB  # SOKUTATSU_BROKER_AWAY_TAIL
    # The check: each broker's largest VmRSS. The interpreter with gRPC and the broker's code is about
    # 60 MiB; MAX_BYTES of messages may be held on top, with their bookkeeping.
    rss_budget: int = 192 * MIB
    sample_seconds: float = 5.0
    # The stalled subscription's retention maximum on disk (drop_oldest); 0 = the broker's default.
    retention_max_bytes: int = 0
    drain_limit_seconds: float = 600.0  # how long the slow subscriber may take to catch up at the end

    @property
    def seconds(self) -> float:
        return self.minutes * 60

    def broker_settings(self) -> dict[str, str]:
        return {
            "max_bytes": str(self.max_bytes),
            "queue_budget": str(self.queue_budget),
            "away_tail": str(self.away_tail),
            "default_mode": "migrate",
        }


# ----------------------------------------------------------- subscriber child --
class _Tally:
    """What one subscriber process received: exactly-once and order, and (normal) latencies."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.received = 0
        self.duplicates = 0
        self.reordered = 0
        self.last = 0
        self.published_ns = array.array("q")
        self.latency_ms = array.array("d")

    def add(self, message: Message, keep_latency: bool) -> None:
        now = time.time_ns()
        seq = message.publisher_seq
        self.received += 1
        if seq in self.seen:
            self.duplicates += 1
            return
        self.seen.add(seq)
        if seq < self.last:
            self.reordered += 1
        self.last = max(self.last, seq)
        if keep_latency:
            self.published_ns.append(message.publish_time_unix_nano)
            self.latency_ms.append((now - message.publish_time_unix_nano) / 1e6)


def per_minute_latency(tally: _Tally, start_ns: int) -> list[dict[str, Any]]:
    """Latency percentiles of the messages published in each minute since ``start_ns``."""
    buckets: dict[int, list[float]] = {}
    for published, latency in zip(tally.published_ns, tally.latency_ms, strict=True):
        buckets.setdefault(max(0, (published - start_ns) // 60_000_000_000), []).append(latency)
    rows = []
    for minute in sorted(buckets):
        values = sorted(buckets[minute])
        rows.append(
            {
                "minute": minute + 1,
                "count": len(values),
                "p50_ms": round(percentile(values, 0.5), 3),
                "p99_ms": round(percentile(values, 0.99), 3),
                "p999_ms": round(percentile(values, 0.999), 3),
                "max_ms": round(values[-1], 3),
            }
        )
    return rows


async def _consume(sub: Subscriber, tally: _Tally, role: str, pace: list[float], target: list[int]) -> None:
    next_at = time.monotonic()
    async for message in sub:
        tally.add(message, keep_latency=role == "normal")
        # The stalled one lost what its retention discarded: it is done at the last message sent.
        if target and (tally.last if role == "stalled" else len(tally.seen)) >= target[0]:
            return
        if pace[0]:
            next_at = max(next_at + 1 / pace[0], time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())


async def subscriber_main(argv: Sequence[str]) -> dict[str, Any]:
    """``ROLE ADDRESSES SUBSCRIBER BUDGET SLOW_RATE RETENTION``; steered by ``fast`` and ``end COUNT START_NS LIMIT``.

    The stalled one takes nothing until ``end``; then it reads until it has the last message sent.
    """
    role, addresses, subscriber_id, budget, slow_rate, retention = argv
    tally = _Tally()
    pace = [float(slow_rate) if role == "slow" else 0.0]
    target: list[int] = []
    async with Subscriber(
        addresses.split(","),
        subscriber_id,
        TOPIC,
        durable=True,
        mode="migrate",
        memory_budget=int(budget),
        retention_max_bytes=int(retention),
        on_gap="report",
        flow_limit=100 if role == "stalled" else 1000,
        config=client_config(),
    ) as sub:
        await asyncio.wait_for(sub.connected.wait(), 30)
        print(READY, flush=True)  # noqa: T201 - protocol with the parent process
        consumer = None if role == "stalled" else asyncio.create_task(_consume(sub, tally, role, pace, target))
        start_ns = 0
        async for word in stdin_words():
            if word == "fast":
                pace[0] = 0.0
            elif word.startswith("end "):
                count, start, limit = word.split()[1:]
                target.append(int(count))
                start_ns = int(start)
                if role == "stalled":
                    consumer = asyncio.create_task(_consume(sub, tally, role, pace, target))
                if consumer is not None:
                    if len(tally.seen) >= target[0]:
                        consumer.cancel()
                    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                        await asyncio.wait_for(consumer, float(limit))
                break
        result = {
            "role": role,
            "received": tally.received,
            "distinct": len(tally.seen),
            "duplicates": tally.duplicates,
            "reordered": tally.reordered,
            "highest_seq": tally.last,
            "reached_target": bool(target) and (tally.last if role == "stalled" else len(tally.seen)) >= target[0],
            "sdk_gaps": len(sub.gaps),
            # What the SDK was told was discarded by retention (reason and count), and gaps it was not told of.
            "told_lost": sum(g.dropped for g in sub.gaps),
            "told_lost_by_reason": {
                "retention bytes": sum(g.over_bytes for g in sub.gaps),
                "retention age": sum(g.over_age for g in sub.gaps),
            },
            "gaps_without_reason": sum(1 for g in sub.gaps if not g.reason),
            "first_gaps": [
                {"first": g.first_missing, "last": g.last_missing, "reason": g.reason, "dropped": g.dropped}
                for g in sub.gaps[:5]
            ],
            "sdk_duplicates": sub.duplicates,
            "connected_at_end": sub.connected.is_set(),
            "broker_at_end": sub.broker_id,
        }
        if role == "normal":
            result["per_minute"] = per_minute_latency(tally, start_ns)
            everything = sorted(tally.latency_ms)
            result["latency_ms"] = {
                "p50": round(percentile(everything, 0.5), 3),
                "p99": round(percentile(everything, 0.99), 3),
                "p999": round(percentile(everything, 0.999), 3),
                "max": round(everything[-1], 3) if everything else None,
            }
    return result


# ----------------------------------------------------------------- sampling --
def vm_rss(pid: int) -> int | None:
    """Resident set size of a process in bytes, from ``/proc/<pid>/status`` (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


async def _broker_stats(stub: broker_pb2_grpc.BrokerAdminAsyncStub) -> broker_pb2.BrokerStats | None:
    try:
        stats: broker_pb2.BrokerStats = await stub.GetStats(broker_pb2.GetStatsRequest(), timeout=10)
    except aio.AioRpcError:
        return None
    return stats


def _stats_row(stats: broker_pb2.BrokerStats | None) -> dict[str, Any]:
    if stats is None:
        return {"error": "GetStats failed"}
    return {
        "role": broker_pb2.BrokerRole.Name(stats.role).removeprefix("BROKER_ROLE_").lower(),
        "held_count": stats.held_count,
        "held_bytes": stats.held_bytes,
        "spilled_count": stats.spilled_count,
        "spilled_bytes": stats.spilled_bytes,
        "rejected_total": stats.rejected_total,
        "dropped_total": stats.dropped_total,
        "subscribers": {
            s.subscriber_id: {
                "state": broker_pb2.QueueState.Name(s.state).removeprefix("QUEUE_STATE_").lower(),
                "connected": s.connected,
                "depth": s.depth,
                "memory_bytes": s.memory_bytes,
                "spilled_count": s.spilled_count,
                "spilled_bytes": s.spilled_bytes,
                "in_flight": s.in_flight,
                "disk_bytes": s.disk_bytes,
                "max_disk_bytes": s.retention.max_bytes,
                "dropped_retention_bytes": s.dropped_retention_bytes,
                "dropped_retention_age": s.dropped_retention_age,
            }
            for s in stats.subscribers
        },
    }


async def _sample_loop(
    pair: PairRun, cfg: SoakConfig, start: float, samples: list[dict[str, Any]], folder: Path
) -> None:
    processes = {"broker-a": pair.active, "broker-b": pair.standby, "monitor": pair.monitor}
    async with contextlib.AsyncExitStack() as stack:
        stubs: dict[str, broker_pb2_grpc.BrokerAdminAsyncStub] = {}
        for name in ("broker-a", "broker-b"):
            channel = await stack.enter_async_context(open_channel(processes[name].address))
            stubs[name] = broker_pb2_grpc.BrokerAdminStub(channel)
        while True:
            row: dict[str, Any] = {"t": round(time.monotonic() - start, 1)}
            row["rss"] = {name: vm_rss(run.pid) for name, run in processes.items()}
            for name, stub in stubs.items():
                row[name] = _stats_row(await _broker_stats(stub))
            # Bytes of files under each broker's state folder (segment files, catalog), and of the
            # stalled subscriber's queue folder, measured on the file system.
            states = {"broker-a": pair.active.state_dir, "broker-b": pair.standby.state_dir}
            row["state_dir_bytes"] = {b: _folder_bytes(state) for b, state in states.items()}
            row["stalled_folder_bytes"] = {
                b: _folder_bytes(state / "queues" / TOPIC / "soak-stalled") for b, state in states.items()
            }
            samples.append(row)
            await asyncio.sleep(cfg.sample_seconds)


# --------------------------------------------------------------- publishing --
async def _publish(addresses: Sequence[str], cfg: SoakConfig, stop_at: float, sent_marks: list[int]) -> dict[str, Any]:
    """Offer ``cfg.rate`` messages a second until ``stop_at`` (monotonic); every message acknowledged."""
    body = b"s" * cfg.size
    sent = behind = 0
    async with Publisher(list(addresses), "soak-feed", ack_timeout=120, config=client_config()) as pub:
        start = time.monotonic()
        next_mark = start + 60
        while (now := time.monotonic()) < stop_at:
            due = int((now - start) * cfg.rate) + 1
            while sent < due:
                try:
                    pub.publish_nowait(TOPIC, f"K{sent % 64}", body)
                except BufferFull:
                    behind += 1
                    await pub.wait_for_room()
                    continue
                sent += 1
            if now >= next_mark:
                sent_marks.append(sent)
                next_mark += 60
            await asyncio.sleep(0.005)
        sent_marks.append(sent)
        await pub.flush()
        return {
            "sent": sent,
            "acked_through": pub.acked_seq,
            "refused": pub.refused,
            "dropped": pub.dropped,
            "duplicates": pub.duplicates,
            "buffer_full_waits": behind,
            "offered_seconds": round(time.monotonic() - start, 1),
        }


def _subscriber(role: str, pair: PairRun, cfg: SoakConfig) -> contextlib.AbstractAsyncContextManager[Any]:
    budget = cfg.queue_budget
    return child_process(
        "sokutatsu.bench.soak",
        role,
        ",".join(pair.addresses),
        f"soak-{role}",
        str(budget),
        str(cfg.slow_rate),
        str(cfg.retention_max_bytes if role == "stalled" else 0),
        what=f"soak subscriber {role}",
    )


async def run(cfg: SoakConfig, progress: Any = None) -> dict[str, Any]:
    """Start the pair and the monitor, soak, and return the result (with ``checks``)."""
    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-soak-") as tmp:
        folder = Path(tmp)
        monitor = {"stats_interval_ms": "100"}
        with pair_with_monitor(folder, broker=cfg.broker_settings(), monitor=monitor) as pair:
            result = await _soak(cfg, pair, progress, folder)
            result["disk_bytes_at_end"] = _folder_bytes(folder)
            return result


def _folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total


async def _soak(cfg: SoakConfig, pair: PairRun, progress: Any, folder: Path) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    sent_marks: list[int] = []
    load_before = os.getloadavg()
    cpu_before = cpu_sample()
    async with (
        _subscriber("normal", pair, cfg) as normal,
        _subscriber("slow", pair, cfg) as slow,
        _subscriber("stalled", pair, cfg) as stalled,
    ):
        start = time.monotonic()
        start_ns = time.time_ns()
        sampler = asyncio.create_task(_sample_loop(pair, cfg, start, samples, folder))
        reporter = asyncio.create_task(_report(progress, start, cfg, samples, sent_marks))
        try:
            published = await _publish(pair.addresses, cfg, start + cfg.seconds, sent_marks)
            publish_ended = time.monotonic() - start
            sent = published["sent"]
            # The slow subscriber drains; the normal one has everything within moments.
            await tell(slow, "fast")
            await tell(normal, f"end {sent} {start_ns} 120")
            normal_result = await child_result(normal, 180)
            await tell(slow, f"end {sent} {start_ns} {cfg.drain_limit_seconds}")
            slow_result = await child_result(slow, cfg.drain_limit_seconds + 60)
            drained = time.monotonic() - start
            await asyncio.sleep(cfg.sample_seconds)  # one more sample after the drain
            await tell(stalled, f"end {sent} {start_ns} {cfg.drain_limit_seconds}")
            stalled_result = await child_result(stalled, cfg.drain_limit_seconds + 60)
        finally:
            reporter.cancel()
            sampler.cancel()
            await asyncio.gather(reporter, sampler, return_exceptions=True)
    return summarize(
        cfg,
        published=published,
        normal=normal_result,
        slow=slow_result,
        stalled=stalled_result,
        samples=samples,
        sent_marks=sent_marks,
        publish_ended_s=publish_ended,
        drained_s=drained,
        load=[load_before, os.getloadavg()],
        steal=steal_percent(cpu_before, cpu_sample()),
        pids={"broker-a": pair.active.pid, "broker-b": pair.standby.pid},
    )


async def _report(
    progress: Any, start: float, cfg: SoakConfig, samples: list[dict[str, Any]], sent_marks: list[int]
) -> None:
    """A line a minute while the soak runs (when a ``progress`` callable is given)."""
    if progress is None:
        return
    minute = 0
    while True:
        # A moment after the minute, so the publisher has counted it.
        await asyncio.sleep(max(0.0, start + (minute + 1) * 60 + 2 - time.monotonic()))
        minute += 1
        if not samples:
            continue
        last = samples[-1]
        rss = ", ".join(f"{k} {v / MIB:.0f}" for k, v in last["rss"].items() if v)
        progress(
            f"  minute {minute}/{cfg.minutes:g}: sent {sent_marks[-1] if sent_marks else 0}; RSS MiB {rss}; "
            f"depth slow {_depth(last, 'soak-slow')}, stalled {_depth(last, 'soak-stalled')}"
        )


def _depth(sample: dict[str, Any], subscriber: str) -> int:
    """The depth of a subscriber's queue on the broker that serves it (the largest, if unclear)."""
    depths = [
        b.get("subscribers", {}).get(subscriber, {}) for b in (sample.get("broker-a", {}), sample.get("broker-b", {}))
    ]
    serving = [d["depth"] for d in depths if d.get("state") == "serving"]
    return int(max(serving or [d.get("depth", 0) for d in depths] or [0]))


# ------------------------------------------------------------------ summary --
def summarize(
    cfg: SoakConfig,
    *,
    published: dict[str, Any],
    normal: dict[str, Any],
    slow: dict[str, Any],
    stalled: dict[str, Any],
    samples: list[dict[str, Any]],
    sent_marks: list[int],
    publish_ended_s: float,
    drained_s: float,
    load: list[tuple[float, float, float]],
    steal: float | None,
    pids: dict[str, int],
) -> dict[str, Any]:
    sent = published["sent"]
    for result in (normal, slow, stalled):
        result["lost"] = sent - result["distinct"]
    disk = stalled_disk(samples)
    max_rss = {
        name: max((s["rss"][name] or 0 for s in samples), default=0) for name in ("broker-a", "broker-b", "monitor")
    }
    brokers = ("broker-a", "broker-b")
    max_held = {b: max((s[b].get("held_bytes", 0) for s in samples), default=0) for b in brokers}
    max_spilled = {b: max((s[b].get("spilled_bytes", 0) for s in samples), default=0) for b in brokers}
    end = samples[-1] if samples else {}
    checks = {
        "normal_exactly_once_in_order": normal["lost"] == 0
        and normal["duplicates"] == 0
        and normal["reordered"] == 0
        and normal["sdk_gaps"] == 0,
        "slow_exactly_once_in_order_after_drain": slow["lost"] == 0
        and slow["duplicates"] == 0
        and slow["reordered"] == 0
        and slow["sdk_gaps"] == 0,
        "every_publish_acknowledged": published["acked_through"] == sent and published["refused"] == 0,
        "broker_rss_within_budget": all(max_rss[b] <= cfg.rss_budget for b in brokers),
        "held_bytes_within_max_bytes": all(max_held[b] <= cfg.max_bytes for b in brokers),
        "stalled_still_connected": bool(stalled["connected_at_end"]),
        # It reads at the end: every message it did not get, it was told of, with the reason.
        "stalled_told_all_it_lost": bool(stalled["reached_target"])
        and stalled["lost"] == stalled["told_lost"]
        and stalled["gaps_without_reason"] == 0
        and stalled["duplicates"] == 0
        and stalled["reordered"] == 0,
    }
    if cfg.retention_max_bytes:
        checks["stalled_disk_within_retention"] = all(
            v <= cfg.retention_max_bytes for v in (*disk["max_disk_bytes"].values(), *disk["max_folder_bytes"].values())
        )
    return {
        "benchmark": "soak",
        "config": asdict(cfg),
        "setup": (
            f"broker pair + monitor, each its own process (MAX_BYTES {cfg.max_bytes // MIB} MiB, QUEUE_BUDGET "
            f"{cfg.queue_budget // MIB} MiB, AWAY_TAIL {cfg.away_tail // MIB} MiB, DEFAULT_MODE migrate); the "
            f"benchmark process publishes {cfg.rate} msgs/s of {cfg.size} B (SDK Publisher to both brokers, every "
            f"message acknowledged) for {cfg.minutes:g} min; three subscriber processes, durable, mode migrate: "
            f"normal (as fast as it can), slow ({cfg.slow_rate:g} msgs/s, drains when publishing ends), stalled "
            f"(never takes a message: no credit beyond the SDK's first window of 100); VmRSS and GetStats every "
            f"{cfg.sample_seconds:g} s"
        ),
        "offered_rate": cfg.rate,
        "published": published,
        "normal": normal,
        "slow": slow,
        "stalled": stalled | {"queues_at_end": _queues(end, "soak-stalled")},
        "stalled_disk": disk,
        "slow_queues_before_drain": _queues(_sample_before(samples, publish_ended_s), "soak-slow"),
        "stalled_policy": (
            "durable subscription, overflow mode migrate: the monitor moves it to the standby like any queue over "
            "its threshold; the serving broker keeps what it has not acknowledged, in memory up to the queue budget "
            "and on disk past it, within its retention (max bytes on disk "
            f"{cfg.retention_max_bytes // MIB if cfg.retention_max_bytes else 'the broker default of 8192'} MiB, "
            "drop_oldest: the oldest on disk are discarded and it is told when it reads); the active keeps only "
            "AWAY_TAIL bytes of it"
        ),
        "publish_seconds": round(publish_ended_s, 1),
        "slow_drained_at_s": round(drained_s, 1),
        "max_rss_bytes": max_rss,
        "max_rss_mib": {k: round(v / MIB, 1) for k, v in max_rss.items()},
        "rss_budget_mib": round(cfg.rss_budget / MIB, 1),
        "max_held_bytes": max_held,
        "max_spilled_bytes": max_spilled,
        "rss_growth_mib": rss_growth(samples, publish_ended_s),
        "minutes": minute_table(samples, sent_marks, normal.get("per_minute", []), publish_ended_s),
        "samples": samples,
        "checks": checks,
        "passed": all(checks.values()),
        "pids": pids,
        "load_average": {"start": list(load[0]), "end": list(load[1])},
        "cpu_steal_percent": steal,
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def stalled_disk(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The stalled subscriber's queue on disk over time: per broker, the segment files' bytes the
    broker reports (SubscriberStats.disk_bytes) and its folder's bytes on the file system."""
    brokers = ("broker-a", "broker-b")

    def reported(sample: dict[str, Any], broker: str) -> int:
        return int(sample.get(broker, {}).get("subscribers", {}).get("soak-stalled", {}).get("disk_bytes", 0))

    series = [
        {
            "t": s["t"],
            **{f"{b}_disk_bytes": reported(s, b) for b in brokers},
            **{f"{b}_folder_bytes": s.get("stalled_folder_bytes", {}).get(b, 0) for b in brokers},
        }
        for s in samples
    ]
    dropped = {
        b: max(
            (
                s.get(b, {}).get("subscribers", {}).get("soak-stalled", {}).get("dropped_retention_bytes", 0)
                for s in samples
            ),
            default=0,
        )
        for b in brokers
    }
    return {
        "max_disk_bytes": {b: max((r[f"{b}_disk_bytes"] for r in series), default=0) for b in brokers},
        "max_folder_bytes": {b: max((r[f"{b}_folder_bytes"] for r in series), default=0) for b in brokers},
        "max_state_dir_bytes": {
            b: max((s.get("state_dir_bytes", {}).get(b, 0) for s in samples), default=0) for b in brokers
        },
        "dropped_retention_bytes": dropped,
        "series": series,
    }


def _sample_before(samples: list[dict[str, Any]], t: float) -> dict[str, Any]:
    before = [s for s in samples if s["t"] <= t]
    return before[-1] if before else {}


def _queues(sample: dict[str, Any], subscriber: str) -> dict[str, Any]:
    return {b: sample.get(b, {}).get("subscribers", {}).get(subscriber) for b in ("broker-a", "broker-b")}


def rss_growth(samples: list[dict[str, Any]], publish_ended_s: float) -> dict[str, float | None]:
    """Each process's RSS at the end of publishing minus its RSS after the first minute (or the first sample)."""
    during = [s for s in samples if s["t"] <= publish_ended_s]
    if not during:
        return {}
    first = next((s for s in during if s["t"] >= 60), during[0])
    last = during[-1]
    return {
        name: round(((last["rss"][name] or 0) - (first["rss"][name] or 0)) / MIB, 1)
        for name in ("broker-a", "broker-b", "monitor")
    }


def minute_table(
    samples: list[dict[str, Any]], sent_marks: list[int], latency: list[dict[str, Any]], publish_ended_s: float
) -> list[dict[str, Any]]:
    """One row per minute of publishing (the last may be partial)."""
    by_minute = {row["minute"]: row for row in latency}
    rows = []
    previous = 0
    for index, mark in enumerate(sent_marks):
        minute = index + 1
        within = [s for s in samples if index * 60 <= s["t"] < minute * 60 and s["t"] <= publish_ended_s]
        lat = by_minute.get(minute, {})
        rows.append(
            {
                "minute": minute,
                "sent": mark - previous,
                "normal_p50_ms": lat.get("p50_ms"),
                "normal_p99_ms": lat.get("p99_ms"),
                "normal_max_ms": lat.get("max_ms"),
                "max_rss_mib": {
                    name: round(max((s["rss"][name] or 0 for s in within), default=0) / MIB, 1)
                    for name in ("broker-a", "broker-b", "monitor")
                },
                "slow_depth": _depth(within[-1], "soak-slow") if within else None,
                "stalled_depth": _depth(within[-1], "soak-stalled") if within else None,
                "stalled_disk_mib": {
                    b: round(within[-1][b].get("subscribers", {}).get("soak-stalled", {}).get("disk_bytes", 0) / MIB, 1)
                    if within
                    else None
                    for b in ("broker-a", "broker-b")
                },
                "spilled_mib": {
                    b: round(within[-1][b].get("spilled_bytes", 0) / MIB, 1) if within else None
                    for b in ("broker-a", "broker-b")
                },
            }
        )
        previous = mark
    return rows


def markdown(result: dict[str, Any]) -> str:
    """The per-minute table and the checks, as Markdown."""
    lines = [
        "| min | sent | normal p50 ms | normal p99 ms | RSS a MiB | RSS b MiB | RSS monitor MiB "
        "| slow depth | stalled depth | spilled a/b MiB | stalled disk a/b MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["minutes"]:
        rss = r["max_rss_mib"]
        lines.append(
            f"| {r['minute']} | {r['sent']} | {r['normal_p50_ms']} | {r['normal_p99_ms']} | {rss['broker-a']} "
            f"| {rss['broker-b']} | {rss['monitor']} | {r['slow_depth']} | {r['stalled_depth']} "
            f"| {r['spilled_mib']['broker-a']}/{r['spilled_mib']['broker-b']} "
            f"| {r['stalled_disk_mib']['broker-a']}/{r['stalled_disk_mib']['broker-b']} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    """RSS of each process over time and the normal subscriber's latency per minute, one PNG."""
    import matplotlib  # noqa: PLC0415 - matplotlib only when plotting

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the backend

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 10))
    ts = [s["t"] / 60 for s in result["samples"]]
    for name in ("broker-a", "broker-b", "monitor"):
        top.plot(ts, [(s["rss"][name] or 0) / MIB for s in result["samples"]], label=f"{name} RSS", linewidth=1)
    top.axhline(result["rss_budget_mib"], color="red", linewidth=0.8, linestyle="--", label="broker RSS budget")
    top.axvline(result["publish_seconds"] / 60, color="grey", linewidth=0.8, linestyle=":")
    top.set_xlabel("minutes")
    top.set_ylabel("MiB")
    top.set_ylim(bottom=0)
    top.set_title(f"Soak: RSS over time ({result['offered_rate']} msgs/s offered; dotted: publishing ends)")
    top.legend(loc="upper left", fontsize=8)
    top.grid(True, alpha=0.3)
    series = result["stalled_disk"]["series"]
    for name in ("broker-a", "broker-b"):
        middle.plot(
            [r["t"] / 60 for r in series],
            [r[f"{name}_folder_bytes"] / MIB for r in series],
            label=f"{name}: stalled queue's files",
            linewidth=1,
        )
    limit = result["config"]["retention_max_bytes"]
    if limit:
        middle.axhline(limit / MIB, color="red", linewidth=0.8, linestyle="--", label="retention max bytes")
    middle.set_xlabel("minutes")
    middle.set_ylabel("MiB")
    middle.set_ylim(bottom=0)
    middle.set_title("Stalled subscriber: its queue on disk (drop_oldest)")
    middle.legend(loc="upper left", fontsize=8)
    middle.grid(True, alpha=0.3)
    rows = result["normal"].get("per_minute", [])
    minutes = [r["minute"] for r in rows]
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max")):
        bottom.plot(minutes, [r[key] for r in rows], marker="o", markersize=3, linewidth=1, label=label)
    bottom.set_yscale("log")
    bottom.set_xlabel("minute of publishing")
    bottom.set_ylabel("ms")
    bottom.set_title("Normal subscriber: publish→receive latency per minute")
    bottom.legend(fontsize=8)
    bottom.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_soak(  # noqa: PLR0917 - typer commands take one parameter per option
    minutes: Annotated[
        float, typer.Option("--minutes", min=0.05, help="Minutes of publishing (fractions allowed; report: 30).")
    ] = 30.0,
    quick: Annotated[bool, typer.Option("--quick", help="One minute, for a smoke run.")] = False,
    rate: Annotated[int, typer.Option("--rate", min=1, help="Messages per second offered.")] = SoakConfig.rate,
    size: Annotated[int, typer.Option("--size", min=16, help="Message body bytes.")] = SoakConfig.size,
    rss_budget_mib: Annotated[
        int, typer.Option("--rss-budget-mib", min=16, help="Each broker's largest RSS must stay at or under this.")
    ] = SoakConfig.rss_budget // MIB,
    max_bytes_mib: Annotated[
        int, typer.Option("--max-bytes-mib", min=1, help="The brokers' MAX_BYTES (message bytes held in memory).")
    ] = SoakConfig.max_bytes // MIB,
    queue_budget_mib: Annotated[
        int, typer.Option("--queue-budget-mib", min=1, help="The brokers' QUEUE_BUDGET and each subscription's.")
    ] = SoakConfig.queue_budget // MIB,
    retention_mib: Annotated[
        int,
        typer.Option(
            "--retention-mib",
            min=0,
            help="The stalled subscription's retention maximum on disk, drop_oldest (0 = the broker default).",
        ),
    ] = 0,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the result here (and the plot next to it, .png).")
    ] = None,
) -> None:
    """Publish for N minutes with one normal, one slow and one stalled subscriber; broker RSS within budget, no loss."""
    cfg = SoakConfig(
        minutes=1.0 if quick else minutes,
        rate=rate,
        size=size,
        rss_budget=rss_budget_mib * MIB,
        max_bytes=max_bytes_mib * MIB,
        queue_budget=queue_budget_mib * MIB,
        away_tail=min(SoakConfig.away_tail, queue_budget_mib * MIB),
        retention_max_bytes=retention_mib * MIB,
    )
    console.print(
        f"bench soak: {cfg.minutes:g} min at an offered {cfg.rate} msgs/s of {cfg.size} B "
        f"({cfg.rate * cfg.size / 1024:.0f} KiB/s); slow subscriber {cfg.slow_rate:g} msgs/s, one stalled; "
        f"broker MAX_BYTES {cfg.max_bytes // MIB} MiB, QUEUE_BUDGET {cfg.queue_budget // MIB} MiB; "
        f"RSS budget {cfg.rss_budget // MIB} MiB per broker; load average {os.getloadavg()[0]:.2f}"
    )
    settle_collector()
    result = asyncio.run(run(cfg, progress=console.print))
    console.print(markdown(result))
    normal, slow, stalled = result["normal"], result["slow"], result["stalled"]
    pub = result["published"]
    console.print(
        f"published {pub['sent']} (acknowledged through {pub['acked_through']}, refused {pub['refused']}); "
        f"normal: received {normal['received']}, lost {normal['lost']}, duplicates {normal['duplicates']}, "
        f"reordered {normal['reordered']}, latency p50 {normal['latency_ms']['p50']} ms p99 "
        f"{normal['latency_ms']['p99']} ms; slow (after draining, {result['slow_drained_at_s']} s): lost "
        f"{slow['lost']}, duplicates {slow['duplicates']}, reordered {slow['reordered']}; stalled (reading at the "
        f"end): received {stalled['distinct']}, lost {stalled['lost']}, told it lost {stalled['told_lost']} "
        f"({stalled['told_lost_by_reason']}), duplicates {stalled['duplicates']}, reordered {stalled['reordered']}"
    )
    disk = result["stalled_disk"]
    console.print(
        "stalled queue on disk, largest MiB (reported / files): "
        + ", ".join(
            f"{b} {disk['max_disk_bytes'][b] / MIB:.1f} / {disk['max_folder_bytes'][b] / MIB:.1f}"
            for b in ("broker-a", "broker-b")
        )
        + (f" (retention {cfg.retention_max_bytes // MIB} MiB)" if cfg.retention_max_bytes else "")
        + "; discarded by retention: "
        + ", ".join(f"{b} {n}" for b, n in disk["dropped_retention_bytes"].items())
    )
    console.print(
        "max RSS MiB: "
        + ", ".join(f"{k} {v}" for k, v in result["max_rss_mib"].items())
        + f" (budget {result['rss_budget_mib']:g} per broker); max held MiB: "
        + ", ".join(f"{k} {v / MIB:.1f}" for k, v in result["max_held_bytes"].items())
        + f" (MAX_BYTES {cfg.max_bytes // MIB}); max spilled MiB: "
        + ", ".join(f"{k} {v / MIB:.1f}" for k, v in result["max_spilled_bytes"].items())
        + "; RSS growth while publishing (after minute 1) MiB: "
        + ", ".join(f"{k} {v:+.1f}" for k, v in result["rss_growth_mib"].items() if v is not None)
    )
    if json_path is not None:
        result["plot"] = str(plot(result, json_path.with_suffix(".png")))
        write_json(json_path, result)
        console.print(f"wrote {json_path} and {result['plot']}")
    failed = [name for name, ok in result["checks"].items() if not ok]
    console.print("checks: " + ("all passed" if not failed else "FAILED: " + ", ".join(failed)))
    if failed:
        raise typer.Exit(1)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ROLES:
        raise SystemExit(
            f"usage: python -m sokutatsu.bench.soak {{{'|'.join(ROLES)}}} ADDRESSES ID BUDGET RATE RETENTION"
        )
    print(json.dumps(asyncio.run(subscriber_main(sys.argv[1:]))))  # noqa: T201

"""``sokutatsu bench switchover``: how long the monitor's four switchover steps take.

A broker pair and a monitor, each its own process; a publisher offers a fixed
rate to both brokers and one subscriber (overflow mode migrate) consumes it.
The monitor is asked (``RequestSwitchover``) to move the subscriber to the
other broker, again and again, while messages flow; each answer carries the
four step timings. At the end the subscriber must have received every message
exactly once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpc import aio

from sokutatsu.bench.common import cpu_sample, pair_with_monitor, steal_percent
from sokutatsu.cli.measure import machine, percentile
from sokutatsu.client import BufferFull, Publisher, Subscriber
from sokutatsu.core.tls import client_config, open_channel
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc

TOPIC = "switch-bench"
SUBSCRIBER = "bench-switch"
STEP_NAMES = {
    monitor_pb2.SWITCHOVER_STEP_POSITION: "position",
    monitor_pb2.SWITCHOVER_STEP_ACCEPT: "accept",
    monitor_pb2.SWITCHOVER_STEP_REDIRECT: "redirect",
    monitor_pb2.SWITCHOVER_STEP_RELEASE: "release",
}


@dataclass
class SwitchConfig:
    switches: int
    rate: int
    pause: float
    size: int = 1024


QUICK = SwitchConfig(switches=10, rate=2000, pause=0.3)
FULL = SwitchConfig(switches=60, rate=2000, pause=0.5)


async def _publish(addresses: list[str], cfg: SwitchConfig, stop: asyncio.Event) -> int:
    body = b"x" * cfg.size
    sent = 0
    async with Publisher(addresses, "bench-switch-pub", config=client_config()) as pub:
        start = time.perf_counter()
        while not stop.is_set():
            due = int((time.perf_counter() - start) * cfg.rate) + 1
            while sent < due:
                try:
                    pub.publish_nowait(TOPIC, f"K{sent % 100}", body)
                except BufferFull:
                    break
                sent += 1
            await asyncio.sleep(0.001)
        await pub.flush()
    return sent


async def _consume(sub: Subscriber, seqs: list[int], expected: list[int]) -> None:
    async for message in sub:
        seqs.append(message.publisher_seq)
        if expected and len(seqs) >= expected[0]:
            return


async def measure(cfg: SwitchConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-switch-") as tmp:
        folder = Path(tmp)
        with pair_with_monitor(folder, monitor={"auto_switch": "false"}) as pair:
            return await _run(cfg, pair.addresses, pair.monitor.address)


async def _run(cfg: SwitchConfig, addresses: list[str], monitor_address: str) -> dict[str, Any]:
    seqs: list[int] = []
    expected: list[int] = []
    switches: list[monitor_pb2.Switchover] = []
    failures: list[str] = []
    stop = asyncio.Event()
    sub = Subscriber(addresses, SUBSCRIBER, TOPIC, durable=True, mode="migrate", config=client_config())
    await sub.start()
    before = cpu_sample()
    try:
        await asyncio.wait_for(sub.connected.wait(), 30)
        consumer = asyncio.create_task(_consume(sub, seqs, expected))
        publisher = asyncio.create_task(_publish(addresses, cfg, stop))
        async with open_channel(monitor_address) as channel:
            stub = monitor_pb2_grpc.MonitorStub(channel)
            await _wait_assigned(stub)
            await asyncio.sleep(cfg.pause)
            for _ in range(cfg.switches):
                try:
                    record = await stub.RequestSwitchover(
                        monitor_pb2.RequestSwitchoverRequest(subscriber_id=SUBSCRIBER, topic=TOPIC), timeout=30
                    )
                except aio.AioRpcError as exc:
                    failures.append(f"{exc.code().name}: {exc.details()}")
                else:
                    if record.error:
                        failures.append(record.error)
                    else:
                        switches.append(record)
                await asyncio.sleep(cfg.pause)
        stop.set()
        expected.append(await publisher)
        if len(seqs) < expected[0]:
            await asyncio.wait_for(consumer, 60)
        else:
            consumer.cancel()
    finally:
        stop.set()
        await sub.close()
    steal = steal_percent(before, cpu_sample())
    sent = expected[0] if expected else 0
    return _result(cfg, switches=switches, failures=failures, seqs=seqs, sent=sent, sub=sub, steal=steal)


async def _wait_assigned(stub: monitor_pb2_grpc.MonitorAsyncStub) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(aio.AioRpcError):
            await stub.GetAssignment(monitor_pb2.GetAssignmentRequest(subscriber_id=SUBSCRIBER, topic=TOPIC), timeout=5)
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the monitor never saw the benchmark subscriber")


def _result(
    cfg: SwitchConfig,
    *,
    switches: list[monitor_pb2.Switchover],
    failures: list[str],
    seqs: list[int],
    sent: int,
    sub: Subscriber,
    steal: float | None,
) -> dict[str, Any]:
    totals = sorted(s.total_micros / 1000 for s in switches)
    steps: dict[str, list[float]] = {name: [] for name in STEP_NAMES.values()}
    for s in switches:
        for step in s.steps:
            steps[STEP_NAMES.get(step.step, "other")].append(step.duration_micros / 1000)
    distinct = set(seqs)
    return {
        "benchmark": "switchover",
        "switches": len(switches),
        "failed": len(failures),
        "failures": failures[:10],
        "switch_ms_p50": round(statistics.median(totals), 3) if totals else None,
        "switch_ms_p90": round(percentile(totals, 0.9), 3) if totals else None,
        "switch_ms_max": round(totals[-1], 3) if totals else None,
        "step_ms_p50": {k: round(statistics.median(v), 3) for k, v in steps.items() if v},
        "step_ms_max": {k: round(max(v), 3) for k, v in steps.items() if v},
        "rate": cfg.rate,
        "size": cfg.size,
        "sent": sent,
        "received": len(seqs),
        "lost": sent - len(distinct & set(range(1, sent + 1))),
        "duplicates": len(seqs) - len(distinct),
        "sdk_dropped_duplicates": sub.duplicates,
        "in_order": seqs == sorted(seqs),
        "gaps": len(sub.gaps),
        "cpu_steal_percent": steal,
        "setup": "broker pair + monitor, each its own process; publisher and subscriber in the benchmark "
        "process; the monitor moves the subscriber to the other broker on request, while messages flow",
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

"""``sokutatsu bench throughput``: one publisher to one subscriber through one broker.

1 KiB bodies, persistent, acknowledged. Two measurements, each on a fresh
broker process, with the publisher and the subscriber each in its own process (asyncio), and the broker in a third:

* **throughput**: the publisher sends as fast as acknowledgements allow
  (``publish_nowait`` with at most ``max_pending`` unacknowledged); msgs/s is
  messages received divided by the time from the first publish to the last
  delivery;
* **latency**: the publisher offers a fixed rate (default 5,000 msgs/s),
  paced every millisecond; each delivery's latency is its receive time minus
  its publish time (one clock, one machine).

With ``--tracing`` both are run twice in one invocation: first untraced, then with every
process tracing to files (``SOKUTATSU_TRACE_DIR``, a temporary folder: the broker's gRPC
spans, the SDK's send and process spans of docs/tracing.md), to give what tracing costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sokutatsu.bench.common import broker_process, cpu_sample, steal_percent
from sokutatsu.cli.children import child_process, child_result
from sokutatsu.cli.measure import machine, percentile
from sokutatsu.client import BufferFull, Publisher, Subscriber
from sokutatsu.core.telemetry import setup_telemetry
from sokutatsu.core.tls import client_config


@dataclass
class ThroughputConfig:
    messages: int
    rate: int
    seconds: float
    size: int = 1024


QUICK = ThroughputConfig(messages=30_000, rate=5_000, seconds=3.0)
FULL = ThroughputConfig(messages=300_000, rate=5_000, seconds=20.0)


SUBSCRIBER_READY = "ready"


async def subscriber_main(address: str, topic: str, count: int) -> dict[str, Any]:
    """The subscriber side, run in its own process: receive ``count`` messages, report times and latencies."""
    latencies: list[float] = []
    trace_dir = os.environ.get("SOKUTATSU_TRACE_DIR")
    telemetry = setup_telemetry("bench", "subscriber", Path(trace_dir) if trace_dir else None)
    async with Subscriber(address, f"bench-{topic}", topic, config=client_config()) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
        print(SUBSCRIBER_READY, flush=True)  # noqa: T201 - protocol with the parent process
        received = 0
        first_ns = 0
        async for message in sub:
            now = time.time_ns()
            if not received:
                first_ns = now
            latencies.append((now - message.publish_time_unix_nano) / 1e6)
            received += 1
            if received == count:
                break
        done_ns = time.time_ns()
        gaps = len(sub.gaps)
        duplicates = sub.duplicates
    telemetry.shutdown()
    ordered = sorted(latencies)
    return {
        "received": received,
        "first_ns": first_ns,
        "done_ns": done_ns,
        "p50_ms": round(percentile(ordered, 0.50), 3),
        "p99_ms": round(percentile(ordered, 0.99), 3),
        "max_ms": round(ordered[-1], 3) if ordered else None,
        "gaps": gaps,
        "duplicates": duplicates,
    }


def subscriber_process(
    address: str, topic: str, count: int
) -> contextlib.AbstractAsyncContextManager[asyncio.subprocess.Process]:
    return child_process("sokutatsu.bench.throughput", address, topic, str(count), what="benchmark subscriber")


async def measure_throughput(address: str, cfg: ThroughputConfig) -> dict[str, Any]:
    body = b"x" * cfg.size
    async with (
        subscriber_process(address, "bench", cfg.messages) as sub,
        Publisher(address, "bench-pub", config=client_config()) as pub,
    ):
        start_ns = time.time_ns()
        for i in range(cfg.messages):
            while True:
                try:
                    pub.publish_nowait("bench", f"K{i % 500}", body)
                    break
                except BufferFull:
                    await pub.flush()
        await pub.flush()
        published_ns = time.time_ns()
        result = await child_result(sub, 300)
    seconds = (result["done_ns"] - start_ns) / 1e9
    return {
        "messages": result["received"],
        "seconds": round(seconds, 3),
        "msgs_per_s": round(result["received"] / seconds),
        "publish_acked_msgs_per_s": round(cfg.messages / ((published_ns - start_ns) / 1e9)),
        "gaps": result["gaps"],
        "duplicates": result["duplicates"],
    }


async def measure_latency(address: str, cfg: ThroughputConfig) -> dict[str, Any]:
    body = b"x" * cfg.size
    total = int(cfg.rate * cfg.seconds)
    async with (
        subscriber_process(address, "latency", total) as sub,
        Publisher(address, "lat-pub", linger=0, config=client_config()) as pub,
    ):
        start = time.perf_counter()
        sent = 0
        while sent < total:
            due = min(total, int((time.perf_counter() - start) * cfg.rate) + 1)
            while sent < due:
                pub.publish_nowait("latency", f"K{sent % 500}", body)
                sent += 1
            await asyncio.sleep(0.001)
        await pub.flush()
        result = await child_result(sub, 120)
    return {
        "rate": cfg.rate,
        "messages": result["received"],
        "p50_ms": result["p50_ms"],
        "p99_ms": result["p99_ms"],
        "max_ms": result["max_ms"],
        "gaps": result["gaps"],
        "duplicates": result["duplicates"],
    }


async def run(cfg: ThroughputConfig) -> dict[str, Any]:
    with broker_process() as broker:
        before = cpu_sample()
        throughput = await measure_throughput(broker.address, cfg)
        throughput["cpu_steal_percent"] = steal_percent(before, cpu_sample())
    with broker_process() as broker:
        before = cpu_sample()
        latency = await measure_latency(broker.address, cfg)
        latency["cpu_steal_percent"] = steal_percent(before, cpu_sample())
    return {
        "benchmark": "throughput",
        "msgs_per_s": throughput["msgs_per_s"],
        "p50_ms": latency["p50_ms"],
        "p99_ms": latency["p99_ms"],
        "rate": cfg.rate,
        "size": cfg.size,
        "throughput": throughput,
        "latency": latency,
        "setup": "1 publisher process -> 1 broker process -> 1 subscriber process (asyncio each); "
        "persistent, acknowledged, 1 KiB bodies, loopback",
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


async def run_tracing_comparison(cfg: ThroughputConfig) -> dict[str, Any]:
    """:func:`run` untraced, then traced to files in every process; the traced/untraced ratios."""
    off = await run(cfg)
    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-traces-") as folder:
        os.environ["SOKUTATSU_TRACE_DIR"] = folder  # for the broker and subscriber processes
        telemetry = setup_telemetry("bench", "publisher", Path(folder))
        try:
            on = await run(cfg)
        finally:
            telemetry.shutdown()
            del os.environ["SOKUTATSU_TRACE_DIR"]
        files = list(Path(folder).glob("*.jsonl"))  # noqa: ASYNC240 - after the run, a few small files
        lines = sum(len(f.read_text().splitlines()) for f in files)
        size = sum(f.stat().st_size for f in files)
    return {
        "benchmark": "throughput-tracing",
        "untraced": off,
        "traced": on,
        "traced_vs_untraced": {
            "msgs_per_s": round(on["msgs_per_s"] / off["msgs_per_s"], 3),
            "p50_ms": round(on["p50_ms"] / off["p50_ms"], 3),
            "p99_ms": round(on["p99_ms"] / off["p99_ms"], 3),
        },
        "trace_files": {"export_lines": lines, "bytes": size},
        "machine": off["machine"],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(subscriber_main(sys.argv[1], sys.argv[2], int(sys.argv[3])))))  # noqa: T201

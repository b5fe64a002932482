"""A real run's traces analysed: a client process publishes through a real broker to two
subscribers, every process traces to files (SOKUTATSU_TRACE_DIR), and Spark reads what they
wrote. The audit finds every message of the unfiltered subscriber processed once, and the
latency table counts them all."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.broker.fix_broker import BrokerProcess

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.timeout(180), pytest.mark.spark]

N = 2_000

CLIENT = """
import asyncio, os, sys
from pathlib import Path
from sokutatsu.client import Publisher, Subscriber
from sokutatsu.core.telemetry import setup_telemetry

N = int(sys.argv[2])

async def main():
    telemetry = setup_telemetry("e2e", "client", Path(os.environ["SOKUTATSU_TRACE_DIR"]))
    async with Subscriber(sys.argv[1], "desk", "ticks") as desk, Subscriber(
        sys.argv[1], "even-desk", "ticks", keys=["even"]
    ) as even:
        await asyncio.wait_for(desk.connected.wait(), 10)
        await asyncio.wait_for(even.connected.wait(), 10)
        async with Publisher(sys.argv[1], "feed") as pub:
            for i in range(1, N + 1):
                pub.publish_nowait("ticks", "even" if i % 2 == 0 else "odd", b"x" * 100)
                if i % 100 == 0:
                    await pub.flush()
                    await asyncio.sleep(0.02)
            await pub.flush()
        got = 0
        async for _ in desk:
            got += 1
            if got == N:
                break
        async for message in even:
            if message.publisher_seq == N:
                break
    telemetry.shutdown()
    print(got, flush=True)

asyncio.run(main())
"""


async def test_a_real_runs_traces_show_every_message_processed_once(
    broker_factory: Callable[..., BrokerProcess], spark: SparkSession, tmp_path: Path
) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)
    from sokutatsu.analytics.reader import read_spans  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    traces = tmp_path / "traces"
    broker = broker_factory()
    broker.env["SOKUTATSU_TRACE_DIR"] = str(traces)
    broker.start()
    env = {**os.environ, "SOKUTATSU_TRACE_DIR": str(traces)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, broker.address, str(N), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode == 0, err.decode()[-3000:]
    assert int(out) == N
    broker.stop()  # flushes its spans

    read = read_spans(spark, str(traces))
    assert read.malformed_lines == 0
    # (The broker traces its unary RPCs only, and this run calls none.)
    services = {r["service_name"] for r in read.spans.select("service_name").distinct().collect()}
    assert "sokutatsu-e2e" in services

    audit = {(r["subscriber"], r["topic"]): r.asDict() for r in transforms.loss_audit(read.spans).collect()}
    desk = audit[("desk", "ticks")]
    assert (desk["sent"], desk["processed"], desk["lost"], desk["duplicates"]) == (N, N, 0, 0)
    # The filtered subscriber's links account for its messages and the odd ones its filter left out
    # (the broker's previous_seq vouches), except number 1: before its first message nothing is known.
    even = audit[("even-desk", "ticks")]
    assert (even["sent"], even["processed"], even["lost"], even["duplicates"]) == (N, N - 1, 1, 0)

    latency = transforms.delivery_latency(read.spans, 1.0).where("subscriber = 'desk'").collect()
    assert sum(r["messages"] for r in latency) == N
    assert all(0 <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] for r in latency)

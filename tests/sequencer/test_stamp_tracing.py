"""The ordered publisher's stamping latency in the traces (docs/tracing.md): a client process with
an OpenTelemetry SDK writes ``sequencer.stamp`` spans while it publishes through two real
sequencers to a real broker pair; every stamp request it made is in them, once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from sokutatsu.sequencer.server import create_total_order_topic
from tests.broker.fix_broker import Pair
from tests.helpers import trace_spans
from tests.sequencer.fix_sequencer import GroupFactory

pytestmark = pytest.mark.timeout(180)
TOPIC = "orders"

CLIENT = """
import asyncio, os, sys
from pathlib import Path
from sokutatsu.client import OrderedPublisher
from sokutatsu.core.telemetry import setup_telemetry

sequencer, brokers, domain, batches = sys.argv[1], sys.argv[2].split(","), sys.argv[3], int(sys.argv[4])

async def main():
    telemetry = setup_telemetry("stamp-test", domain, Path(os.environ["SOKUTATSU_TRACE_DIR"]))
    messages = 0
    async with OrderedPublisher(sequencer, brokers, "orders", domain=domain, client_id=f"feed-{domain}") as pub:
        for b in range(batches):
            n = 1 + b % 7
            await asyncio.gather(*(pub.publish_nowait("K", b"x") for _ in range(n)))
            messages += n
            await asyncio.sleep(0.005)
        ranges = pub.ranges
    telemetry.shutdown()
    print(messages, ranges, flush=True)

asyncio.run(main())
"""


async def test_every_stamp_request_is_traced_with_its_round_trip(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory, tmp_path: Path
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a", "b"], pair.addresses, TOPIC)
    await create_total_order_topic(pair.addresses, TOPIC)
    for process in reversed(list(group.values())):
        process.start()
    traces = tmp_path / "traces"
    env = {**os.environ, "SOKUTATSU_TRACE_DIR": str(traces)}
    clients = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLIENT,
            group[domain].address,
            ",".join(pair.addresses),
            domain,
            "120",
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for domain in ("a", "b")
    ]
    results = {}
    for domain, child in zip(("a", "b"), clients, strict=True):
        out, err = await asyncio.wait_for(child.communicate(), 120)
        assert child.returncode == 0, err.decode()[-3000:]
        messages, ranges = map(int, out.split())
        results[domain] = (messages, ranges)

    stamps = [a for name, a in trace_spans(traces) if name == "sequencer.stamp"]
    for domain, (messages, ranges) in results.items():
        spans = [a for a in stamps if a["sokutatsu.domain"] == domain]
        assert spans, f"no sequencer.stamp span for domain {domain}"
        assert {a["messaging.client.id"] for a in spans} == {f"feed-{domain}"}
        assert {a["server.address"] for a in spans} == {group[domain].address}
        # Every request the publisher had answered (one range each) is in one span, with its round trip.
        assert sum(a["sokutatsu.stamp.requests"] for a in spans) == ranges
        assert sum(a["messaging.batch.message_count"] for a in spans) == messages
        latencies = [ns for a in spans for ns in a["sokutatsu.stamp.latency_ns"]]
        assert len(latencies) == ranges
        assert all(ns > 0 for ns in latencies)
        assert all(a["sokutatsu.distribution.id"] >= 1 for a in spans)

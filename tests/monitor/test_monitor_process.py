"""The monitor as a real process, watching real broker processes: statuses, restart, failover.

What needs the brokers' switchover RPCs (moves with publishers and subscribers) is in the
end-to-end tests; here the monitor's own answers are checked against a real pair.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc
from tests.broker.fix_broker import BrokerProcess
from tests.monitor.fix_monitor import MonitorProcess

pytestmark = pytest.mark.timeout(120)

Pair = tuple[BrokerProcess, BrokerProcess]


async def _refused(call: Awaitable[object]) -> aio.AioRpcError:
    try:
        await call
    except aio.AioRpcError as error:
        return error
    raise AssertionError("the monitor accepted bad input")


def _closed_ports() -> str:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return f"broker-a=127.0.0.1:{ports[0]},broker-b=127.0.0.1:{ports[1]}"


def _placements(status: monitor_pb2.MonitorStatus) -> dict[tuple[str, str], tuple[str, bool]]:
    return {(a.subscriber_id, a.topic): (a.broker_id, a.migrated) for a in status.assignments}


async def _create_subscription(address: str, subscriber_id: str, topic: str = "prices") -> None:
    async with aio.insecure_channel(address) as channel:
        await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
            broker_pb2.CreateSubscriptionRequest(
                subscription=broker_pb2.Subscription(
                    subscriber_id=subscriber_id,
                    topic=topic,
                    durable=True,
                    overflow_mode=broker_pb2.OVERFLOW_MODE_MIGRATE,
                    memory_budget_bytes=2**20,
                )
            ),
            timeout=10,
        )


def _pair_seen(status: monitor_pb2.MonitorStatus) -> bool:
    roles = {b.broker_id: (b.serving, b.role) for b in status.brokers}
    return roles == {
        "broker-a": (True, broker_pb2.BROKER_ROLE_ACTIVE),
        "broker-b": (True, broker_pb2.BROKER_ROLE_STANDBY),
    }


def _pair_linked(status: monitor_pb2.MonitorStatus) -> bool:
    """The pair seen, and each broker hearing the other: a switchover needs the pair's link (the source
    refuses to redirect or release a subscriber while it does not hear its peer). Serving is not
    enough: each broker's stream to the other opens after it starts."""
    return _pair_seen(status) and all(b.peer_up for b in status.brokers)


async def test_without_brokers_it_serves_and_says_why(monitor_factory: Callable[..., MonitorProcess]) -> None:
    monitor = monitor_factory(brokers=_closed_ports())
    monitor.start()
    # Each broker's error starts as "not contacted yet"; wait for the monitor's first attempts to fail.
    status = await monitor.until(
        lambda s: all("UNAVAILABLE" in b.error for b in s.brokers), "both brokers reported unreachable"
    )
    assert [b.broker_id for b in status.brokers] == ["broker-a", "broker-b"]
    assert not any(b.serving for b in status.brokers)
    assert all("UNAVAILABLE" in b.error for b in status.brokers), [b.error for b in status.brokers]
    assert status.active_broker_id == ""
    async with aio.insecure_channel(monitor.address) as channel:
        stub = monitor_pb2_grpc.MonitorStub(channel)
        error = await _refused(stub.GetAssignment(monitor_pb2.GetAssignmentRequest(subscriber_id="x"), timeout=10))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "no broker has sent its statistics yet" in (error.details() or "")
        error = await _refused(stub.RequestSwitchover(monitor_pb2.RequestSwitchoverRequest(), timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert monitor.stop() == 0
    assert "Traceback" not in monitor.log()


async def test_bad_requests_against_a_real_pair(
    broker_pair: Callable[..., Pair], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    a, b = broker_pair()
    await _create_subscription(a.address, "desk-1")
    monitor = monitor_factory((a, b))
    monitor.start()
    status = await monitor.until(
        lambda s: _pair_seen(s) and any(x.subscriber_id == "desk-1" for x in s.assignments), "the pair and desk-1"
    )
    assert status.active_broker_id == "broker-a"
    async with aio.insecure_channel(monitor.address) as channel:
        stub = monitor_pb2_grpc.MonitorStub(channel)
        cases: list[tuple[Awaitable[object], grpc.StatusCode, str]] = [
            (
                stub.GetAssignment(monitor_pb2.GetAssignmentRequest(subscriber_id="nobody"), timeout=10),
                grpc.StatusCode.NOT_FOUND,
                "no subscriber 'nobody' at broker-a or broker-b",
            ),
            (
                stub.RequestSwitchover(monitor_pb2.RequestSwitchoverRequest(subscriber_id="nobody"), timeout=10),
                grpc.StatusCode.NOT_FOUND,
                "no subscriber 'nobody'",
            ),
            (
                stub.RequestSwitchover(
                    monitor_pb2.RequestSwitchoverRequest(subscriber_id="desk-1", topic="news"), timeout=10
                ),
                grpc.StatusCode.NOT_FOUND,
                "no subscription of 'desk-1' on topic 'news'",
            ),
            (
                stub.RequestSwitchover(
                    monitor_pb2.RequestSwitchoverRequest(subscriber_id="desk-1", to_broker_id="broker-z"), timeout=10
                ),
                grpc.StatusCode.NOT_FOUND,
                "no broker 'broker-z'; the pair is broker-a and broker-b",
            ),
            (
                stub.GetAssignment(monitor_pb2.GetAssignmentRequest(topic="prices"), timeout=10),
                grpc.StatusCode.INVALID_ARGUMENT,
                "subscriber_id is empty",
            ),
        ]
        for call, code, says in cases:
            error = await _refused(call)
            assert (error.code(), says in (error.details() or "")) == (code, True), error.details()

        assigned = await stub.GetAssignment(monitor_pb2.GetAssignmentRequest(subscriber_id="desk-1"), timeout=10)
        assert (assigned.topic, assigned.overflow_mode) == ("prices", broker_pb2.OVERFLOW_MODE_MIGRATE)
        assert assigned.threshold > 0
        assert "budget 1.0 MiB" in assigned.threshold_basis

        watch = stub.WatchAssignments(monitor_pb2.WatchAssignmentsRequest(subscriber_id="desk-1"))
        first = await asyncio.wait_for(watch.read(), 10)
        assert isinstance(first, monitor_pb2.Assignment)
        assert (first.subscriber_id, first.topic) == ("desk-1", "prices")
        watch.cancel()
    assert monitor.stop() == 0
    assert "Traceback" not in monitor.log()


async def test_a_restarted_monitor_rebuilds_the_same_view(
    broker_pair: Callable[..., Pair], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    a, b = broker_pair()
    for name in ("desk-1", "desk-2"):
        await _create_subscription(a.address, name)
    monitor = monitor_factory((a, b))
    monitor.start()
    before = await monitor.until(lambda s: _pair_seen(s) and len(s.assignments) == 2, "two subscriptions")
    monitor.kill9()
    monitor.start()
    after = await monitor.until(lambda s: _pair_seen(s) and len(s.assignments) == 2, "two subscriptions again")
    assert _placements(after) == _placements(before)
    assert after.active_broker_id == before.active_broker_id == "broker-a"


async def test_failover_is_recorded_and_traced_when_the_active_dies(
    broker_pair: Callable[..., Pair], monitor_factory: Callable[..., MonitorProcess], tmp_path: Path
) -> None:
    traces = tmp_path / "traces"
    a, b = broker_pair()
    monitor = monitor_factory((a, b))
    monitor.env["SOKUTATSU_TRACE_DIR"] = str(traces)
    monitor.start()
    await monitor.until(_pair_seen, "the pair")
    a.kill9()
    status = await monitor.until(
        lambda s: any(r.reason == monitor_pb2.SWITCHOVER_REASON_FAILOVER and r.finished for r in s.recent_switchovers),
        "a failover record",
    )
    record = next(r for r in status.recent_switchovers if r.reason == monitor_pb2.SWITCHOVER_REASON_FAILOVER)
    assert (record.from_broker_id, record.to_broker_id, record.subscriber_id) == ("broker-a", "broker-b", "")
    assert [s.step for s in record.steps] == [monitor_pb2.SWITCHOVER_STEP_DETECT, monitor_pb2.SWITCHOVER_STEP_PROMOTE]
    assert record.epoch > 0
    assert record.total_micros == sum(s.duration_micros for s in record.steps)
    assert next(x for x in status.brokers if x.broker_id == "broker-a").error
    assert monitor.stop() == 0

    spans = [
        span
        for file in traces.glob("monitor-*.jsonl")
        for line in file.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    failover = next(s for s in spans if s["name"] == "failover")
    attributes = {x["key"]: x["value"].get("stringValue") for x in failover["attributes"]}
    assert (attributes["sokutatsu.from_broker"], attributes["sokutatsu.to_broker"]) == ("broker-a", "broker-b")
    assert attributes["sokutatsu.reason"] == "FAILOVER"
    promote = next(s for s in spans if s["name"] == "switchover.promote")
    assert promote["parentSpanId"] == failover["spanId"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "300"},  # a wide terminal: one line per row
    )


async def test_manual_switchover_there_and_back_and_the_status_command(
    broker_pair: Callable[..., Pair], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    a, b = broker_pair()
    await _create_subscription(a.address, "desk-1")
    monitor = monitor_factory((a, b))
    monitor.start()
    await monitor.until(
        lambda s: _pair_linked(s) and any(x.broker_id == "broker-a" for x in s.assignments), "desk-1 on broker-a"
    )
    there = await monitor.switchover("desk-1")  # empty to_broker_id: the other broker
    assert (there.from_broker_id, there.to_broker_id, there.reason) == (
        "broker-a",
        "broker-b",
        monitor_pb2.SWITCHOVER_REASON_MANUAL,
    )
    assert there.error == "", there.error
    assert there.finished
    assert not there.redirected  # nobody was connected
    assert [s.step for s in there.steps] == [
        monitor_pb2.SWITCHOVER_STEP_POSITION,
        monitor_pb2.SWITCHOVER_STEP_ACCEPT,
        monitor_pb2.SWITCHOVER_STEP_REDIRECT,
        monitor_pb2.SWITCHOVER_STEP_RELEASE,
    ]
    await monitor.until(
        lambda s: [(x.broker_id, x.migrated) for x in s.assignments] == [("broker-b", True)], "desk-1 on broker-b"
    )
    async with aio.insecure_channel(monitor.address) as channel:
        stub = monitor_pb2_grpc.MonitorStub(channel)
        error = await _refused(
            stub.RequestSwitchover(
                monitor_pb2.RequestSwitchoverRequest(subscriber_id="desk-1", to_broker_id="broker-b"), timeout=10
            )
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "already served by broker-b" in (error.details() or "")

    shown = _cli("status", "--monitor", monitor.address)
    assert shown.returncode == 0, shown.stderr
    for says in (
        "active broker-a",
        "broker-b",
        "standby",
        "desk-1",
        "manual",
        "position",
        "release",
        "ok",
        "retention",
    ):
        assert says in shown.stdout, f"{says!r} not in:\n{shown.stdout}"
    as_json = _cli("status", "--monitor", monitor.address, "--json")
    body = json.loads(as_json.stdout)
    assert [x["broker_id"] for x in body["brokers"]] == ["broker-a", "broker-b"]
    assert body["assignments"][0]["migrated"] is True
    assert body["recent_switchovers"][0]["id"] == there.id
    # Retention per subscription on each broker: the limits in force (the broker defaults here).
    retention = {r["broker_id"]: r for r in body["retention"]}
    assert retention["broker-a"]["subscribers"][0]["policy"] == "drop_oldest"
    assert retention["broker-b"]["subscribers"][0]["max_bytes"] == 8 * 2**30
    assert retention["broker-a"]["subscription_expiry_s"] == 7 * 86400

    back = await monitor.switchover("desk-1", "prices", "broker-a")
    assert (back.from_broker_id, back.to_broker_id, back.error) == ("broker-b", "broker-a", "")
    await monitor.until(
        lambda s: [(x.broker_id, x.migrated) for x in s.assignments] == [("broker-a", False)], "desk-1 back"
    )
    assert monitor.stop() == 0
    assert "Traceback" not in monitor.log()


def test_status_command_without_a_monitor_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = _cli("status", "--monitor", f"127.0.0.1:{port}")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"sokutatsu: error: monitor at 127.0.0.1:{port}: UNAVAILABLE")

"""Every service as a real process: SERVING, its API, a graceful stop on SIGTERM, clear start-up errors."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.core.dsn import create_database, database_dsn
from sokutatsu.core.health import check, wait_serving
from sokutatsu.core.tls import open_channel
from sokutatsu.core.v1 import process_pb2, process_pb2_grpc
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc
from tests.helpers import START_LIMIT_SECONDS, ServiceProc, ensure_stopped, run_once, start_service, stop

GRACE_SECONDS = 2.0


async def _reflected(address: str) -> set[str]:
    async with open_channel(address, cluster=True) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        names: set[str] = set()
        async for response in stub.ServerReflectionInfo(iter([request])):
            names |= {s.name for s in response.list_services_response.service}
        return names


async def _first_call(module: str, address: str) -> tuple[grpc.StatusCode, str]:
    """One call into each service's own API: its status code and details."""
    async with open_channel(address, cluster=True) as channel:
        try:
            if module == "sokutatsu.broker":
                # A role change without a role: refused with a reason.
                await broker_pb2_grpc.BrokerControlStub(channel).SetRole(broker_pb2.SetRoleRequest(), timeout=10)
            elif module == "sokutatsu.monitor":
                await monitor_pb2_grpc.MonitorStub(channel).GetStatus(monitor_pb2.GetStatusRequest(), timeout=10)
            elif module == "sokutatsu.sequencer":
                sequencer = sequencer_pb2_grpc.SequencerStub(channel)
                await sequencer.GetStatus(sequencer_pb2.GetStatusRequest(), timeout=10)
            else:
                queues = queuedb_pb2_grpc.QueueServiceStub(channel)
                await queues.ListQueues(queuedb_pb2.ListQueuesRequest(), timeout=10)
        except aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


SERVICES = {
    "sokutatsu.broker": {
        "sokutatsu.broker.v1.Broker",
        "sokutatsu.broker.v1.BrokerAdmin",
        "sokutatsu.broker.v1.BrokerControl",
    },
    "sokutatsu.monitor": {"sokutatsu.monitor.v1.Monitor"},
    "sokutatsu.sequencer": {"sokutatsu.sequencer.v1.Sequencer"},
    "sokutatsu.queuedb": {"sokutatsu.queuedb.v1.QueueService", "sokutatsu.queuedb.v1.Transfer"},
}
PREFIX = {
    "sokutatsu.broker": "SOKUTATSU_BROKER_",
    "sokutatsu.monitor": "SOKUTATSU_MONITOR_",
    "sokutatsu.sequencer": "SOKUTATSU_SEQUENCER_",
    "sokutatsu.queuedb": "SOKUTATSU_QUEUEDB_",
}
# What the first call answers: served RPCs answer, pending ones name their issue.
FIRST_CALL = {
    "sokutatsu.broker": (grpc.StatusCode.INVALID_ARGUMENT, "SetRoleRequest.role 0 is not a role a broker takes"),
    "sokutatsu.monitor": (grpc.StatusCode.OK, ""),
    "sokutatsu.sequencer": (grpc.StatusCode.OK, ""),
    "sokutatsu.queuedb": (grpc.StatusCode.OK, ""),
}


@pytest.fixture(scope="module")
def node_dsn(pg_dsn: str) -> str:
    create_database(pg_dsn, "sokutatsu_lifecycle")
    return database_dsn(pg_dsn, "sokutatsu_lifecycle")


def _env(module: str, node_dsn: str, folder: Path, **extra: str) -> dict[str, str]:
    env = {
        PREFIX[module] + "LISTEN": "127.0.0.1:0",
        "SOKUTATSU_GRACE_SECONDS": str(GRACE_SECONDS),
        **extra,
    }
    if module == "sokutatsu.queuedb":
        env["SOKUTATSU_QUEUEDB_DSN"] = node_dsn
    if module == "sokutatsu.broker":
        env["SOKUTATSU_BROKER_STATE_DIR"] = str(folder / "broker-state")
    if module == "sokutatsu.sequencer":
        env["SOKUTATSU_SEQUENCER_STATE_DIR"] = str(folder / "sequencer-state")
    return env


@pytest.fixture
def started(request: pytest.FixtureRequest, node_dsn: str, tmp_path: Path) -> Iterator[ServiceProc]:
    module: str = request.param
    proc = start_service(module, _env(module, node_dsn, tmp_path), tmp_path)
    try:
        yield proc
    finally:
        ensure_stopped(proc.process)


@pytest.mark.parametrize("started", sorted(SERVICES), indirect=True)
def test_service_serves_then_stops_on_sigterm(started: ServiceProc, request: pytest.FixtureRequest) -> None:
    module = request.node.callspec.params["started"]

    async def probe() -> None:
        # Just started: SERVING may take a moment (queue-db checks its database first).
        await wait_serving(started.address, within=START_LIMIT_SECONDS)
        for name in SERVICES[module]:
            assert await check(started.address, name) == "SERVING"
        assert {*SERVICES[module], "sokutatsu.core.v1.Process"} <= await _reflected(started.address)
        async with open_channel(started.address, cluster=True) as channel:
            figures = await process_pb2_grpc.ProcessStub(channel).GetProcessStats(
                process_pb2.GetProcessStatsRequest(), timeout=10
            )
        assert (figures.service, figures.pid) == (module.removeprefix("sokutatsu."), started.process.pid)
        assert figures.rss_bytes > 0
        code, details = await _first_call(module, started.address)
        expected_code, expected_text = FIRST_CALL[module]
        assert code == expected_code
        assert expected_text in details

    asyncio.run(probe())
    assert stop(started.process) == 0
    log = started.output()
    assert "stopping" in log
    assert "stopped" in log
    assert "Traceback" not in log


def test_busy_port_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_once(
            "sokutatsu.broker",
            {"SOKUTATSU_BROKER_LISTEN": f"127.0.0.1:{port}", "SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / "broker")},
        )
    assert result.returncode == 1
    # The whole of stderr: gRPC's own log line is silenced (GRPC_VERBOSITY set before grpc loads).
    assert result.stderr.splitlines() == [
        f"sokutatsu-broker: error: cannot listen on 127.0.0.1:{port}: the port is already in use "
        "(set SOKUTATSU_BROKER_LISTEN to another host:port)"
    ]


def test_queuedb_without_dsn_is_a_settings_error() -> None:
    result = run_once("sokutatsu.queuedb", {"SOKUTATSU_QUEUEDB_LISTEN": "127.0.0.1:0", "SOKUTATSU_QUEUEDB_DSN": ""})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "sokutatsu-queuedb: error: SOKUTATSU_QUEUEDB_DSN is not set: give this node's PostgreSQL DSN"
    ]


def test_queuedb_with_unreachable_database_is_one_line() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    result = run_once(
        "sokutatsu.queuedb",
        {
            "SOKUTATSU_QUEUEDB_LISTEN": "127.0.0.1:0",
            "SOKUTATSU_QUEUEDB_DSN": f"postgresql://x:secret@127.0.0.1:{port}/db",
        },
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sokutatsu-queuedb: error: cannot connect to PostgreSQL at ")
    assert "secret" not in result.stderr
    assert "Traceback" not in result.stderr


# A password that libpq cannot parse, and so quotes in its error (issue #20 item 7).
UNPARSABLE_DSN = "postgresql://x:s3%zzcret@127.0.0.1:1/db"


@pytest.mark.parametrize(
    ("module", "env"),
    [
        ("sokutatsu.queuedb", {"SOKUTATSU_QUEUEDB_LISTEN": "127.0.0.1:0", "SOKUTATSU_QUEUEDB_DSN": UNPARSABLE_DSN}),
        (
            "sokutatsu.queuedb.transferd",
            {
                "SOKUTATSU_TRANSFER_LISTEN": "127.0.0.1:0",
                "SOKUTATSU_TRANSFER_NODE": "node1",
                "SOKUTATSU_TRANSFER_PEERS": "node2=127.0.0.1:1",
                "SOKUTATSU_TRANSFER_DSN": UNPARSABLE_DSN,
            },
        ),
    ],
)
def test_an_unparsable_dsn_is_one_line_without_the_password(module: str, env: dict[str, str]) -> None:
    result = run_once(module, env)
    assert result.returncode in {1, 2}
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "DSN" in lines[0]
    assert "s3" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_server_spans_go_to_the_trace_dir(node_dsn: str, tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    proc = start_service(
        "sokutatsu.broker", _env("sokutatsu.broker", node_dsn, tmp_path, SOKUTATSU_TRACE_DIR=str(traces)), tmp_path
    )
    try:
        asyncio.run(wait_serving(proc.address, within=START_LIMIT_SECONDS))
        asyncio.run(_first_call("sokutatsu.broker", proc.address))
    finally:
        ensure_stopped(proc.process)
    # Spans are flushed when the service stops.
    assert proc.process.returncode == 0, proc.output()
    spans = [
        span
        for file in traces.glob("broker-*.jsonl")
        for line in file.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    names = [s["name"] for s in spans]
    assert "/sokutatsu.broker.v1.BrokerControl/SetRole" in names
    refused = next(s for s in spans if s["name"].endswith("/SetRole"))
    attributes = {a["key"]: a["value"] for a in refused["attributes"]}
    assert attributes["rpc.grpc.status_code"] == {"intValue": str(grpc.StatusCode.INVALID_ARGUMENT.value[0])}


def test_sigint_stops_gracefully_too(node_dsn: str, tmp_path: Path) -> None:
    proc = start_service("sokutatsu.monitor", _env("sokutatsu.monitor", node_dsn, tmp_path), tmp_path)
    try:
        assert stop(proc.process, signal.SIGINT) == 0
    finally:
        ensure_stopped(proc.process)
    assert "Traceback" not in proc.output()

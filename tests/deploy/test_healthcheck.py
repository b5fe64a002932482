"""``python -m sokutatsu.core.healthcheck``, the containers' health check, against a real gRPC server.

The server runs in the test's event loop on 127.0.0.1:0 with the standard health service;
the check runs as a real subprocess, so its exit status is what Docker would see.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

SERVICE = "sokutatsu.test.v1.Probe"
# A bound that only stops a hung test; nothing asserts on time.
LIMIT_SECONDS = 30.0


class Server:
    def __init__(self, server: aio.Server, health: health_aio.HealthServicer, port: int) -> None:
        self.server = server
        self.health = health
        self.address = f"127.0.0.1:{port}"


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    health = health_aio.HealthServicer()
    grpc_server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        yield Server(grpc_server, health, port)
    finally:
        await grpc_server.stop(None)


async def healthcheck(*args: str) -> tuple[int, str]:
    """Run the check as Docker does; return its exit status and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sokutatsu.core.healthcheck",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), LIMIT_SECONDS)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert out == b"", "the check prints nothing on stdout"
    assert process.returncode is not None
    return process.returncode, err.decode()


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_serving_server_is_healthy(server: Server) -> None:
    assert await healthcheck(server.address) == (0, "")


async def test_named_services_are_checked_too(server: Server) -> None:
    assert await healthcheck(server.address, SERVICE) == (0, "")
    status, err = await healthcheck(server.address, SERVICE, "sokutatsu.test.v1.Missing")
    assert status == 1
    assert err == f"healthcheck: {server.address} sokutatsu.test.v1.Missing: SERVICE_UNKNOWN\n"


async def test_not_serving_is_unhealthy(server: Server) -> None:
    await server.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert await healthcheck(server.address) == (0, "")
    status, err = await healthcheck(server.address, SERVICE)
    assert status == 1
    assert err == f"healthcheck: {server.address} {SERVICE}: NOT_SERVING\n"


async def test_shutting_down_is_unhealthy(server: Server) -> None:
    # What every Sokutatsu server does first on SIGTERM.
    await server.health.enter_graceful_shutdown()
    status, err = await healthcheck(server.address)
    assert status == 1
    assert err == f"healthcheck: {server.address}: NOT_SERVING\n"


async def test_wildcard_host_is_asked_on_loopback(server: Server) -> None:
    port = server.address.rpartition(":")[2]
    assert await healthcheck(f"0.0.0.0:{port}") == (0, "")


async def test_nothing_listening_is_unhealthy() -> None:
    address = f"127.0.0.1:{free_port()}"
    status, err = await healthcheck(address, "--timeout", "1")
    assert status == 1
    assert err == f"healthcheck: {address}: no answer within 1s (is the service listening there?)\n"


@pytest.mark.parametrize("args", [["broker-a"], ["broker-a:99999"], ["127.0.0.1:7201", "--timeout", "0"], []])
async def test_malformed_command_line_is_a_usage_error(args: list[str]) -> None:
    status, err = await healthcheck(*args)
    assert status == 2
    assert "usage: python -m sokutatsu.core.healthcheck" in err

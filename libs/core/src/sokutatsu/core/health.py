"""Client side of gRPC health checking: wait until a server reports SERVING."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sokutatsu.core.tls import open_channel


async def check(address: str, service: str = "", rpc_timeout: float = 2.0) -> str:
    """The health status name of ``service`` at ``address`` (``UNREACHABLE`` if it does not answer)."""
    async with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def wait_serving(address: str, within: float, service: str = "") -> None:
    """Return once ``address`` reports SERVING; raise ``TimeoutError`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    status = "UNREACHABLE"
    while time.monotonic() < deadline:
        status = await check(address, service)
        if status == "SERVING":
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{address} did not report SERVING within {within:g}s (last: {status})")

"""``sokutatsu.core.v1.Process/GetProcessStats``, served by the shared bootstrap on every port:
the process's figures and its auth refusals by code (issue #10: violations counted)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from grpc import aio

from sokutatsu.core.server import ServiceContext
from sokutatsu.core.v1 import process_pb2, process_pb2_grpc
from tests.helpers import served
from tests.security.fix_auth import AuthFile

RPC_SECONDS = 10.0


async def _nothing(server: aio.Server, context: ServiceContext) -> Sequence[str]:
    return []


async def _stats(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> process_pb2.ProcessStats:
    async with aio.insecure_channel(address) as channel:
        reply: process_pb2.ProcessStats = await process_pb2_grpc.ProcessStub(channel).GetProcessStats(
            process_pb2.GetProcessStatsRequest(), metadata=metadata, timeout=RPC_SECONDS
        )
        return reply


async def test_every_service_port_answers_with_its_process_figures(tmp_path: Path) -> None:
    async with served(tmp_path, _nothing) as address:
        stats = await _stats(address)
    assert (stats.service, stats.instance, stats.pid) == ("probe", "probe", os.getpid())
    assert stats.rss_bytes > 0
    assert stats.uptime_seconds >= 0
    assert not stats.auth
    assert not stats.tls
    assert stats.auth_refusals == stats.unauthenticated == stats.permission_denied == 0


async def test_auth_refusals_are_counted_by_code(tmp_path: Path, auth_file: AuthFile) -> None:
    async with served(tmp_path, _nothing, auth=auth_file.policy) as address:
        async with aio.insecure_channel(address) as channel:
            stub = process_pb2_grpc.ProcessStub(channel)
            request = process_pb2.GetProcessStatsRequest()
            refused = []
            for metadata in ((), (("authorization", "Bearer not-a-token"),), auth_file.metadata("app")):
                with pytest.raises(aio.AioRpcError) as error:
                    await stub.GetProcessStats(request, metadata=metadata, timeout=RPC_SECONDS)
                refused.append(error.value.code())
        assert refused == [
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
        ]
        stats = await _stats(address, auth_file.metadata("admin"))
        by_service = await _stats(address, auth_file.metadata("svc"))
    assert stats.auth
    assert (stats.unauthenticated, stats.permission_denied, stats.auth_refusals) == (2, 1, 3)
    assert by_service.auth_refusals == 3

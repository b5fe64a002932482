"""The request budget (issue #20, item 5), on a real ``serve()``: request bytes held at once are
bounded per service and per connection, refused ``RESOURCE_EXHAUSTED`` beyond, and given back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from sokutatsu.core.server import ServiceContext
from tests.helpers import served

SERVICE = "sokutatsu.test.v1.Budget"
MIB = 2**20
LIMIT_SECONDS = 30.0


def _identity(b: bytes) -> bytes:
    return b


class Holder:
    """``Hold`` keeps each request until ``release`` is set; ``Frames`` reads a stream to its end."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = 0
        self.frames = 0

    async def hold(self, request: bytes, context: aio.ServicerContext[Any, Any]) -> bytes:
        self.holding += 1
        await self.release.wait()
        return b"held %d" % len(request)

    async def read(self, requests: AsyncIterator[bytes], context: aio.ServicerContext[Any, Any]) -> bytes:
        async for _ in requests:
            self.frames += 1
        return b"read %d" % self.frames

    async def register(self, server: aio.Server, context: ServiceContext) -> Sequence[str]:
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Hold": grpc.unary_unary_rpc_method_handler(self.hold, _identity, _identity),
                        "Frames": grpc.stream_unary_rpc_method_handler(self.read, _identity, _identity),
                    },
                ),
            )
        )
        return [SERVICE]


def _connection(address: str) -> aio.Channel:
    """A channel on a connection of its own (gRPC otherwise shares one between equal channels)."""
    return aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


async def _hold(channel: aio.Channel, size: int) -> bytes:
    result: bytes = await channel.unary_unary(f"/{SERVICE}/Hold", _identity, _identity)(b"x" * size, timeout=20)
    return result


async def _until(condition: Any) -> None:
    async with asyncio.timeout(LIMIT_SECONDS):
        while not condition():  # noqa: ASYNC110 - the handler's count, polled
            await asyncio.sleep(0.01)


async def test_the_service_holds_at_most_its_budget(tmp_path: Path) -> None:
    holder = Holder()
    budget = {"max_request_bytes_in_flight": 3 * MIB, "max_request_bytes_per_connection": 64 * MIB}
    async with served(tmp_path, holder.register, runtime=budget) as address:
        one, two, three = _connection(address), _connection(address), _connection(address)
        async with one, two, three:
            held = [asyncio.create_task(_hold(one, MIB)), asyncio.create_task(_hold(two, MIB))]
            await _until(lambda: holder.holding == 2)
            try:
                await _hold(three, 2 * MIB)
            except aio.AioRpcError as error:
                refused = error
            else:
                raise AssertionError("a request over the service's budget was taken")
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SOKUTATSU_MAX_REQUEST_BYTES_IN_FLIGHT" in (refused.details() or "")
            assert holder.holding == 2, "the refused request reached the handler"
            holder.release.set()
            assert await asyncio.gather(*held) == [b"held %d" % MIB] * 2
            # What the two held is given back: the same request now goes through.
            assert await _hold(three, 2 * MIB) == b"held %d" % (2 * MIB)


async def test_one_connection_holds_at_most_its_share(tmp_path: Path) -> None:
    holder = Holder()
    budget = {"max_request_bytes_in_flight": 64 * MIB, "max_request_bytes_per_connection": 3 * MIB // 2}
    async with served(tmp_path, holder.register, runtime=budget) as address:
        greedy, other = _connection(address), _connection(address)
        async with greedy, other:
            first = asyncio.create_task(_hold(greedy, MIB))
            await _until(lambda: holder.holding == 1)
            try:
                await _hold(greedy, MIB)
            except aio.AioRpcError as error:
                refused = error
            else:
                raise AssertionError("a connection took more than its share")
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SOKUTATSU_MAX_REQUEST_BYTES_PER_CONNECTION" in (refused.details() or "")
            second = asyncio.create_task(_hold(other, MIB))  # another connection has its own share
            await _until(lambda: holder.holding == 2)
            holder.release.set()
            assert list(await asyncio.gather(first, second)) == [b"held %d" % MIB] * 2


async def test_a_stream_holds_one_frame_at_a_time(tmp_path: Path) -> None:
    """Ten 1 MiB frames through a 3 MiB budget: each frame is given back when the next is read."""
    holder = Holder()
    budget = {"max_request_bytes_in_flight": 3 * MIB, "max_request_bytes_per_connection": 3 * MIB}
    async with served(tmp_path, holder.register, runtime=budget) as address, _connection(address) as channel:
        frames = channel.stream_unary(f"/{SERVICE}/Frames", _identity, _identity)
        assert await frames(iter([b"f" * MIB] * 10), timeout=20) == b"read 10"
        # And the budget is whole again afterwards.
        holder.release.set()
        assert await _hold(channel, 2 * MIB + MIB // 2) == b"held %d" % (2 * MIB + MIB // 2)

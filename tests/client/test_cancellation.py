"""Cancellation in the SDK: a task cancelled while it awaits the SDK stops (the SDK never swallows a
cancellation), and the SDK's own cancellations are not reported as a broker's answer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import Publisher
from sokutatsu.client._accumulator import Accumulator
from sokutatsu.client._retry import write_frame
from sokutatsu.client.config import ClientConfig
from tests.client.fake_broker import serve_stream


async def test_a_publish_cancelled_as_its_acknowledgement_arrives_is_cancelled() -> None:
    """asyncio.wait_for on Python 3.11 returns, instead of raising, when the task is cancelled just as
    what it waits for completes: a task cancelled in ``publish()`` as its acknowledgement came went on
    publishing, and a fuzz canary's close waited for it for good (a CI run, 120 s). Cancelled in that
    order fifty times, the wait raises CancelledError each time."""
    swallowed = 0
    for _ in range(50):
        accumulator = Accumulator(max_pending=10, ack_timeout=30.0)
        waiting = asyncio.create_task(accumulator.wait_acked(1))
        await asyncio.sleep(0)
        accumulator._waiters[1].set_result(None)  # the acknowledgement arrives
        await asyncio.sleep(0)
        waiting.cancel()  # as the task awaiting it is cancelled
        try:
            await waiting
        except asyncio.CancelledError:
            continue
        swallowed += 1
    assert swallowed == 0, f"the cancellation was swallowed {swallowed} times of 50"


class _Refuses:
    """A Broker/Publish endpoint that refuses every stream RESOURCE_EXHAUSTED (as a broker whose
    MAX_STREAMS_PER_CLIENT the client's principal has reached)."""

    def __init__(self) -> None:
        self.opened = 0

    async def publish(
        self, requests: AsyncIterator[broker_pb2.PublishRequest], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[broker_pb2.PublishResponse]:
        self.opened += 1
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the principal already holds 1 stream")
        yield broker_pb2.PublishResponse()  # pragma: no cover - makes this an async generator

    async def serve(self) -> tuple[aio.Server, str]:
        return await serve_stream("Publish", self.publish, broker_pb2.PublishRequest, broker_pb2.PublishResponse)


async def test_a_publisher_closed_as_a_stream_opens_keeps_the_broker_s_refusal_as_its_last_error() -> None:
    """Found by a fresh-clone CI run (tests/security/test_limits.py): ``start()`` gave up on a broker that
    refused its stream and said "CANCELLED: Locally cancelled by application!" instead of the refusal.
    With a token the channel has an interceptor, and the link's first write awaits the interceptors'
    task; closing cancels the link there, and grpc.aio then cancels that task, turns the cancellation
    into "RPC already finished", and reports the call as cancelled locally. The link took that for the
    stream's failure. Here the close lands exactly there: the link is woken for its next attempt and runs
    to its first wait before the close."""
    broker = _Refuses()
    server, address = await broker.serve()
    config = ClientConfig(token="token-of-p")  # noqa: S106 - a test's token: the channel gets an interceptor
    publisher = Publisher(address, "p", config=config, connect_timeout=30)
    starting = asyncio.create_task(publisher.start())
    try:
        link = publisher._links[0]
        for _ in range(1000):  # bounded: only stops a hung test
            if link.last_error:
                break
            await asyncio.sleep(0.01)
        assert link.last_error.startswith("RESOURCE_EXHAUSTED"), link.last_error
        link.reconnect_now.set()
        await asyncio.sleep(0)  # the link wakes and opens its next stream: its write awaits the interceptors
        await publisher.close()
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await server.stop(None)
    assert link.last_error == "RESOURCE_EXHAUSTED: the principal already holds 1 stream", link.last_error


async def _fails() -> None:
    raise ValueError("a child of the link's task group failed (a broken stream)")


async def test_a_write_on_an_ended_stream_after_a_failed_task_group_is_not_a_cancellation() -> None:
    """A review's schedule against the first form of the mend above: on Python 3.11 a TaskGroup whose
    child failed leaves ``cancelling()`` raised in its parent (the link's task after any broken
    stream), and the mend read that as a cancellation: the next write on a stream that had already
    ended raised CancelledError, and a publisher link with a token died for good without a word. A
    write that ends on a finished stream raises the stream's status, whatever ``cancelling()`` said
    before it."""
    broker = _Refuses()
    server, address = await broker.serve()
    try:
        with contextlib.suppress(ExceptionGroup):
            async with asyncio.TaskGroup() as group:
                group.create_task(_fails())
        config = ClientConfig(token="token-of-p")  # noqa: S106 - a test's token: the channel gets an interceptor
        async with config.channel(address) as channel:
            call = channel.stream_stream(
                "/sokutatsu.broker.v1.Broker/Publish",
                request_serializer=broker_pb2.PublishRequest.SerializeToString,
                response_deserializer=broker_pb2.PublishResponse.FromString,
            )()
            assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the stream has ended
            frame = broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id="p", first_unacked_seq=1))
            with pytest.raises(aio.AioRpcError) as raised:
                await write_frame(call, frame)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await server.stop(None)

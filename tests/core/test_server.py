"""The gRPC bootstrap, in process: a real server on 127.0.0.1:0 with a test service."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link

from sokutatsu.core import errors
from sokutatsu.core.server import ServiceContext
from sokutatsu.core.span_files import JsonLinesSpanExporter
from tests.helpers import served

SERVICE = "sokutatsu.test.v1.Probe"
# Bounds that only stop a hung test (well under pytest's timeout); no assertion is about time.
LIMIT_SECONDS = 30.0


def _identity(b: bytes) -> bytes:
    return b


async def _raise(request: bytes, context: aio.ServicerContext[Any, Any]) -> bytes:
    kind = request.decode()
    if kind == "not-found":
        raise errors.NotFound("topic 'prices' does not exist; create it first")
    if kind == "exhausted":
        raise errors.ResourceExhausted("broker max_bytes (64 MiB) reached")
    if kind == "bug":
        raise RuntimeError("secret internal detail")
    return b"ok:" + request


async def _stream(request: bytes, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
    yield b"first"
    raise errors.Unavailable("peer broker is down; retry")


def _handler(extra: dict[str, grpc.RpcMethodHandler[Any, Any]] | None = None) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Call": grpc.unary_unary_rpc_method_handler(_raise, _identity, _identity),
            "Stream": grpc.unary_stream_rpc_method_handler(_stream, _identity, _identity),
            **(extra or {}),
        },
    )


@dataclass
class Probe:
    address: str
    stop: asyncio.Event
    health: Any
    background_cancelled: asyncio.Event


@contextlib.asynccontextmanager
async def _probe_server(
    tmp_path: Path, grace: float, extra: dict[str, grpc.RpcMethodHandler[Any, Any]] | None = None
) -> AsyncIterator[Probe]:
    """serve() in this event loop with the probe service (plus ``extra`` methods); stopped on exit."""
    stop = asyncio.Event()
    background_cancelled = asyncio.Event()
    health: list[Any] = []

    async def register(srv: aio.Server, context: ServiceContext) -> Sequence[str]:
        srv.add_generic_rpc_handlers((_handler(extra),))
        health.append(context.health)

        async def background() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                background_cancelled.set()

        context.start_background(background(), "probe-background")
        return [SERVICE]

    async with served(tmp_path, register, grace=grace, stop=stop, limit=LIMIT_SECONDS) as address:
        yield Probe(address=address, stop=stop, health=health[0], background_cancelled=background_cancelled)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[str]:
    async with _probe_server(tmp_path, grace=1.0) as probe:
        yield probe.address
    assert probe.background_cancelled.is_set(), "background tasks are cancelled and awaited on stop"


async def _call(address: str, payload: bytes) -> bytes:
    async with aio.insecure_channel(address) as channel:
        method = channel.unary_unary(f"/{SERVICE}/Call", _identity, _identity)
        result: bytes = await method(payload, timeout=10)
        return result


async def test_domain_errors_become_status_codes(server: str) -> None:
    assert await _call(server, b"fine") == b"ok:fine"
    with pytest.raises(aio.AioRpcError) as info:
        await _call(server, b"not-found")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "topic 'prices' does not exist; create it first"
    with pytest.raises(aio.AioRpcError) as info:
        await _call(server, b"exhausted")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_unexpected_errors_become_internal_without_details(server: str) -> None:
    with pytest.raises(aio.AioRpcError) as info:
        await _call(server, b"bug")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError" in (info.value.details() or "")
    assert "secret internal detail" not in (info.value.details() or "")


async def test_streaming_error_arrives_after_the_items(server: str) -> None:
    received: list[bytes] = []

    async def drain(call: Any) -> None:
        async for item in call:
            received.append(item)  # noqa: PERF401 - items before the error must be kept

    async with aio.insecure_channel(server) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Stream", _identity, _identity)(b"", timeout=10)
        with pytest.raises(aio.AioRpcError) as info:
            await drain(call)
    assert received == [b"first"]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_health_and_reflection(server: str) -> None:
    async with aio.insecure_channel(server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = set()
        async for response in responses:
            names = {s.name for s in response.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


async def test_health_watch_follows_the_status(tmp_path: Path) -> None:
    """Watch works through the bootstrap's interceptors (OpenTelemetry's made it UNKNOWN: issue #20)."""
    async with _probe_server(tmp_path, grace=1.0) as probe, aio.insecure_channel(probe.address) as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        watch = health_pb2_grpc.HealthStub(channel).Watch(request, timeout=LIMIT_SECONDS)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await probe.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()


async def test_health_list_names_every_service(server: str) -> None:
    async with aio.insecure_channel(server) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
    statuses = {name: response.status for name, response in reply.statuses.items()}
    assert statuses == {"": health_pb2.HealthCheckResponse.SERVING, SERVICE: health_pb2.HealthCheckResponse.SERVING}


# What a stock grpcio client sets for client-side health checking (gRFC A17): its channel only
# sends calls to a server whose health Watch reports SERVING.
CLIENT_SIDE_HEALTH = json.dumps(
    {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
)


async def test_a_client_side_health_checking_channel_reaches_the_service(server: str) -> None:
    async with aio.insecure_channel(server, options=[("grpc.service_config", CLIENT_SIDE_HEALTH)]) as channel:
        method = channel.unary_unary(f"/{SERVICE}/Call", _identity, _identity)
        assert await method(b"fine", timeout=10) == b"ok:fine"


async def _written(request: bytes, context: aio.ServicerContext[Any, Any]) -> None:
    """A response stream in grpcio's reader/writer style (a coroutine that writes), as health Watch is."""
    await context.write(b"one")
    await context.write(b"two")


async def test_a_response_stream_written_by_a_coroutine_is_served(tmp_path: Path) -> None:
    extra = {"Written": grpc.unary_stream_rpc_method_handler(_written, _identity, _identity)}
    async with _probe_server(tmp_path, grace=1.0, extra=extra) as probe, aio.insecure_channel(probe.address) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Written", _identity, _identity)(b"", timeout=10)
        assert [item async for item in call] == [b"one", b"two"]
        assert await call.code() == grpc.StatusCode.OK


SlowHandler = Callable[[bytes, aio.ServicerContext[Any, Any]], Coroutine[Any, Any, bytes]]


def _slow(handler: SlowHandler) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    return {"Slow": grpc.unary_unary_rpc_method_handler(handler, _identity, _identity)}


async def _until_shutdown_began(health: Any) -> None:
    """Wait until the server is stopping: health reports NOT_SERVING (step 1 of the stop)."""
    request = health_pb2.HealthCheckRequest(service="")
    while (await health.Check(request, None)).status == health_pb2.HealthCheckResponse.SERVING:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def test_stop_lets_an_in_flight_call_finish_within_the_grace(tmp_path: Path) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(request: bytes, context: aio.ServicerContext[Any, Any]) -> bytes:
        entered.set()
        await release.wait()
        return b"finished"

    # A grace far longer than the call needs: the call ends when the test releases it.
    async with (
        _probe_server(tmp_path, grace=LIMIT_SECONDS / 2, extra=_slow(slow)) as probe,
        aio.insecure_channel(probe.address) as channel,
    ):
        method = channel.unary_unary(f"/{SERVICE}/Slow", _identity, _identity)
        call = asyncio.ensure_future(method(b"", timeout=2 * LIMIT_SECONDS))
        await asyncio.wait_for(entered.wait(), LIMIT_SECONDS)
        probe.stop.set()  # what SIGTERM does
        await asyncio.wait_for(_until_shutdown_began(probe.health), LIMIT_SECONDS)
        release.set()
        assert await call == b"finished"


async def test_a_call_longer_than_the_grace_is_cancelled(tmp_path: Path) -> None:
    entered, handler_cancelled = asyncio.Event(), asyncio.Event()

    async def never_done(request: bytes, context: aio.ServicerContext[Any, Any]) -> bytes:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise
        return b"unreachable"

    async with (
        _probe_server(tmp_path, grace=0.2, extra=_slow(never_done)) as probe,
        aio.insecure_channel(probe.address) as channel,
    ):
        method = channel.unary_unary(f"/{SERVICE}/Slow", _identity, _identity)
        call = asyncio.ensure_future(method(b"", timeout=2 * LIMIT_SECONDS))
        await asyncio.wait_for(entered.wait(), LIMIT_SECONDS)
        probe.stop.set()
        with pytest.raises(aio.AioRpcError) as info:
            await asyncio.wait_for(call, LIMIT_SECONDS)
    assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert handler_cancelled.is_set(), "the handler is cancelled, not left running"


def test_json_lines_exporter_writes_otlp_json(tmp_path: Path) -> None:
    path = tmp_path / "traces" / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("send") as producer:
        context = producer.get_span_context()
    with tracer.start_as_current_span("process", links=[Link(context)]):
        pass
    provider.shutdown()
    lines = path.read_text().splitlines()
    spans = [
        span
        for line in lines
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"send", "process"}
    assert by_name["send"]["traceId"] == format(context.trace_id, "032x")
    assert by_name["send"]["spanId"] == format(context.span_id, "016x")
    assert by_name["process"]["links"][0]["spanId"] == format(context.span_id, "016x")


def test_echo_cuts_a_long_value_and_says_how_long_it_was() -> None:
    """How refusals show a client's value (issue #20): whole up to ECHO_LIMIT, else cut."""
    assert errors.echo("prices") == "'prices'"
    assert errors.echo("x" * errors.ECHO_LIMIT) == repr("x" * errors.ECHO_LIMIT)
    assert errors.echo("y" * 2**20) == f"{'y' * errors.ECHO_LIMIT!r}… (1048576 characters)"
    nul = b"\x00"
    assert errors.echo(nul * 200) == f"{nul * errors.ECHO_LIMIT!r}… (200 bytes)"
    assert errors.echo(7) == "7"


async def test_serve_returns_only_after_the_cancelled_calls_have_unwound(tmp_path: Path) -> None:
    """A handler cancelled at the end of the grace period may still have work in its ``finally``
    (pair.receive_watermarks awaits its reader there) after grpcio's server.stop() has returned.
    serve() waits for it: a call task still pending when serve() returns is cancelled by the
    closing event loop, and grpcio then prints that cancellation's traceback to stderr, past any
    log filter (CI caught it in tests/broker/test_pair_stop.py)."""
    entered, unwound = asyncio.Event(), asyncio.Event()

    async def slow_to_unwind(request: bytes, context: aio.ServicerContext[Any, Any]) -> bytes:
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.2)  # cleanup that awaits, after the cancellation
            unwound.set()
        return b"unreachable"

    async with (
        _probe_server(tmp_path, grace=0.05, extra=_slow(slow_to_unwind)) as probe,
        aio.insecure_channel(probe.address) as channel,
    ):
        method = channel.unary_unary(f"/{SERVICE}/Slow", _identity, _identity)
        call = asyncio.ensure_future(method(b"", timeout=2 * LIMIT_SECONDS))
        await asyncio.wait_for(entered.wait(), LIMIT_SECONDS)
        probe.stop.set()
    # _probe_server has awaited serve(): the handler's cleanup must be over by then.
    assert unwound.is_set(), "serve() returned while a cancelled call was still unwinding"
    await asyncio.gather(call, return_exceptions=True)  # the client sees the cancellation

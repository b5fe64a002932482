"""Authentication and authorisation on every RPC (docs/security.md).

Every method of every service's descriptor is called on a real ``serve()`` (the services'
bootstrap, auth on) whose servicer answers every method with an empty reply after reading the
whole request stream: a missing and a wrong token are ``UNAUTHENTICATED``, a principal without
the permission ``PERMISSION_DENIED``, and the right principal gets through. Then real broker and
monitor processes with auth on: a pair with a monitor working end to end as the service
principal, and a client that cannot attach as, or move, another principal's subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import BrokerError, ClientConfig, Publisher, Subscriber
from sokutatsu.core.auth import ADMIN, DEQUEUE, ENQUEUE, PUBLISH, SERVICE, SUBSCRIBE
from sokutatsu.core.auth_rules import RULES
from sokutatsu.core.server import ServiceContext
from sokutatsu.core.tls import open_channel
from sokutatsu.core.v1 import process_pb2
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc
from sokutatsu.queuedb.v1 import queuedb_pb2
from sokutatsu.sequencer.v1 import sequencer_pb2
from tests.broker.fix_broker import BrokerProcess, until
from tests.helpers import served
from tests.monitor.fix_monitor import MonitorProcess
from tests.security.fix_auth import AuthFile
from tests.security.fix_tls import Certs

pytestmark = pytest.mark.timeout(120)

LIMIT_SECONDS = 30.0
RPC_SECONDS = 10.0
DESCRIPTORS = (
    broker_pb2.DESCRIPTOR,
    monitor_pb2.DESCRIPTOR,
    sequencer_pb2.DESCRIPTOR,
    queuedb_pb2.DESCRIPTOR,
    process_pb2.DESCRIPTOR,
)
# Who holds each permission in tests/security/fix_auth.py.
HOLDER = {PUBLISH: "app", SUBSCRIBE: "app", ENQUEUE: "app", DEQUEUE: "app", ADMIN: "admin", SERVICE: "svc"}


def all_methods() -> list[MethodDescriptor]:
    return [m for d in DESCRIPTORS for s in d.services_by_name.values() for m in s.methods]


def full_name(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _fill(message: Message, queue_side: bool, subscriber: str) -> None:
    """Name every topic, queue and subscriber in ``message`` as principal "app" may use them."""
    for field in message.DESCRIPTOR.fields:
        if field.type == FieldDescriptor.TYPE_STRING and not field.is_repeated:
            if field.name in ("topic", "name", "queue"):
                setattr(message, field.name, "q.a" if queue_side else "t.a")
            elif field.name == "subscriber_id":
                setattr(message, field.name, subscriber)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not field.is_repeated:
            if field.message_type is None or field.message_type.GetOptions().map_entry:
                continue
            _fill(getattr(message, field.name), queue_side, subscriber)


def requests_for(method: MethodDescriptor, subscriber: str = "app-1") -> list[Message]:
    """What a client of ``method`` sends (several frames for request streams)."""
    name = full_name(method)
    if name.endswith(".Broker/Publish"):
        return [
            broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id="p")),
            broker_pb2.PublishRequest(batch=broker_pb2.PublishBatch(topic="t.a")),
        ]
    if name.endswith(".Broker/Subscribe"):
        subscription = broker_pb2.Subscription(subscriber_id=subscriber, topic="t.a")
        return [broker_pb2.SubscribeRequest(open=broker_pb2.SubscribeOpen(subscription=subscription))]
    request = message_factory.GetMessageClass(method.input_type)()
    _fill(request, "queuedb" in name, subscriber)
    return [request]


def _handler(method: MethodDescriptor) -> grpc.RpcMethodHandler[Any, Any]:
    """Reads the whole request (so every frame is checked), answers an empty reply."""
    parse = message_factory.GetMessageClass(method.input_type).FromString
    reply = message_factory.GetMessageClass(method.output_type)

    async def unary_unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Message:
        return reply()

    async def unary_stream(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Message]:
        yield reply()

    async def stream_unary(requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]) -> Message:
        async for _ in requests:
            pass
        return reply()

    async def stream_stream(
        requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Message]:
        async for _ in requests:
            pass
        yield reply()

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler(unary_unary, parse, reply.SerializeToString),
        (False, True): grpc.unary_stream_rpc_method_handler(unary_stream, parse, reply.SerializeToString),
        (True, False): grpc.stream_unary_rpc_method_handler(stream_unary, parse, reply.SerializeToString),
        (True, True): grpc.stream_stream_rpc_method_handler(stream_stream, parse, reply.SerializeToString),
    }
    return kinds[(method.client_streaming, method.server_streaming)]


@contextlib.asynccontextmanager
async def every_service(tmp_path: Path, auth_file: AuthFile, tls: Any = None) -> AsyncIterator[str]:
    """serve() with auth on and every method of every service; its address."""

    async def register(srv: aio.Server, context: ServiceContext) -> Sequence[str]:
        services: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}
        for method in all_methods():
            services.setdefault(method.containing_service.full_name, {})[method.name] = _handler(method)
        for service, handlers in services.items():
            srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        return list(services)

    async with served(tmp_path, register, tls=tls, auth=auth_file.policy, limit=LIMIT_SECONDS) as address:
        yield address


async def call_once(
    channel: aio.Channel, method: MethodDescriptor, requests: list[Message], metadata: Sequence[tuple[str, str]]
) -> aio.AioRpcError | None:
    """One call of ``method``: its error, or None when it succeeded."""
    name = full_name(method)
    parse = message_factory.GetMessageClass(method.output_type).FromString

    def serialize(m: Message) -> bytes:
        return m.SerializeToString()

    async def frames() -> AsyncIterator[Message]:
        for request in requests:
            yield request

    try:
        if method.client_streaming and method.server_streaming:
            stream = channel.stream_stream(name, serialize, parse)(frames(), metadata=metadata, timeout=RPC_SECONDS)
            async for _ in stream:
                pass
        elif method.client_streaming:
            await channel.stream_unary(name, serialize, parse)(frames(), metadata=metadata, timeout=RPC_SECONDS)
        elif method.server_streaming:
            async for _ in channel.unary_stream(name, serialize, parse)(
                requests[0], metadata=metadata, timeout=RPC_SECONDS
            ):
                pass
        else:
            await channel.unary_unary(name, serialize, parse)(requests[0], metadata=metadata, timeout=RPC_SECONDS)
    except aio.AioRpcError as error:
        return error
    return None


async def call(
    channel: aio.Channel, method: MethodDescriptor, requests: list[Message], metadata: Sequence[tuple[str, str]] = ()
) -> grpc.StatusCode:
    """The status of a call of ``method`` (OK when it succeeded).

    grpcio's asyncio client loses the server's status of a request stream the server ended while
    the client was still writing: a write that fails after the status replaces it with
    ``INTERNAL`` ``Failed "execute_batch"`` (grpc/grpc#36066, fix proposed in grpc/grpc#43486).
    A refusal before the server reads is exactly that case, so such a call is made again.
    """
    code = grpc.StatusCode.OK
    for _ in range(20):
        error = await call_once(channel, method, requests, metadata)
        if error is None:
            return grpc.StatusCode.OK
        code = error.code()
        lost = code == grpc.StatusCode.INTERNAL and "execute_batch" in (error.debug_error_string() or "")
        if not (lost and method.client_streaming):
            return code
    return code


@pytest.fixture(autouse=True)
def _no_security_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TLS_CERT", "TLS_KEY", "TLS_CA", "TLS_CLIENT_AUTH", "AUTH_FILE", "AUTH_TOKEN"):
        monkeypatch.delenv(f"SOKUTATSU_{name}", raising=False)


def test_every_rpc_of_every_service_has_a_rule() -> None:
    names = {full_name(m) for m in all_methods()}
    assert names - set(RULES) == set(), "RPCs without an authorisation rule in sokutatsu.core.auth_rules"
    assert set(RULES) - names == set(), "rules for RPCs that no service has"


async def test_every_rpc_refuses_missing_and_wrong_tokens_and_the_unpermitted(
    tmp_path: Path, auth_file: AuthFile
) -> None:
    wrong: list[str] = []
    async with every_service(tmp_path, auth_file) as address, open_channel(address, cluster=True) as channel:
        for method in all_methods():
            name = full_name(method)
            rule = RULES[name]
            requests = requests_for(method)
            outsiders = ["nobody"] + (["app"] if rule.permission in (ADMIN, SERVICE) else [])
            expected = [
                ("no token", (), grpc.StatusCode.UNAUTHENTICATED),
                ("a wrong token", (("authorization", "Bearer not-a-token"),), grpc.StatusCode.UNAUTHENTICATED),
                ("an empty token", (("authorization", "Bearer "),), grpc.StatusCode.UNAUTHENTICATED),
                ("another scheme", (("authorization", "Basic YTpi"),), grpc.StatusCode.UNAUTHENTICATED),
                *((who, auth_file.metadata(who), grpc.StatusCode.PERMISSION_DENIED) for who in outsiders),
                (HOLDER[rule.permission], auth_file.metadata(HOLDER[rule.permission]), grpc.StatusCode.OK),
                ("svc", auth_file.metadata("svc"), grpc.StatusCode.OK),
            ]
            for who, metadata, want in expected:
                got = await call(channel, method, requests, metadata)
                if got != want:
                    wrong.append(f"{name} with {who}: {got.name}, expected {want.name}")
        # Health and reflection stay open.
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_SECONDS)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert wrong == []


async def test_a_principal_cannot_use_another_principals_subscriber_id(tmp_path: Path, auth_file: AuthFile) -> None:
    by_name = {full_name(m): m for m in all_methods()}
    owned = [
        "/sokutatsu.broker.v1.Broker/Subscribe",
        "/sokutatsu.broker.v1.BrokerAdmin/CreateSubscription",
        "/sokutatsu.broker.v1.BrokerAdmin/DeleteSubscription",
        "/sokutatsu.monitor.v1.Monitor/GetAssignment",
        "/sokutatsu.monitor.v1.Monitor/WatchAssignments",
    ]
    wrong: list[str] = []
    async with every_service(tmp_path, auth_file) as address, open_channel(address, cluster=True) as channel:
        for name in owned:
            method = by_name[name]
            for who, subscriber, want in [
                ("app", "other-1", grpc.StatusCode.PERMISSION_DENIED),
                ("app", "otherwise", grpc.StatusCode.PERMISSION_DENIED),
                ("app", "app", grpc.StatusCode.OK),
                ("app", "app-2", grpc.StatusCode.OK),
                ("other", "other-1", grpc.StatusCode.OK),
                ("other", "app-1", grpc.StatusCode.PERMISSION_DENIED),
                ("svc", "other-1", grpc.StatusCode.OK),
                # An admin manages and looks up any subscription, but attaching needs a subscribe grant.
                ("admin", "other-1", grpc.StatusCode.PERMISSION_DENIED if "Subscribe" in name else grpc.StatusCode.OK),
            ]:
                got = await call(channel, method, requests_for(method, subscriber), auth_file.metadata(who))
                if got != want:
                    wrong.append(f"{name} by {who} as {subscriber}: {got.name}, expected {want.name}")
        # Moving a subscriber is admin's, whoever it belongs to.
        switch = by_name["/sokutatsu.monitor.v1.Monitor/RequestSwitchover"]
        got = await call(channel, switch, requests_for(switch, "app-1"), auth_file.metadata("app"))
        assert got == grpc.StatusCode.PERMISSION_DENIED
    assert wrong == []


async def test_each_publish_batch_is_checked_for_its_topic(
    tmp_path: Path, auth_file: AuthFile, caplog: pytest.LogCaptureFixture
) -> None:
    publish = next(m for m in all_methods() if full_name(m).endswith(".Broker/Publish"))
    frames = [*requests_for(publish), broker_pb2.PublishRequest(batch=broker_pb2.PublishBatch(topic="secret"))]
    with caplog.at_level(logging.WARNING, logger="sokutatsu.core.auth_interceptor"):
        async with every_service(tmp_path, auth_file) as address, open_channel(address, cluster=True) as channel:
            assert await call(channel, publish, requests_for(publish), auth_file.metadata("app")) == grpc.StatusCode.OK
            for _ in range(3):
                got = await call(channel, publish, frames, auth_file.metadata("app"))
                assert got == grpc.StatusCode.PERMISSION_DENIED
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, refusals  # logged once per principal and method
    assert "'secret'" in refusals[0]
    assert "app" in refusals[0]


async def test_open_channel_sends_the_token_over_tls_and_a_client_certificate_names_a_principal(
    tmp_path: Path, auth_file: AuthFile, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    mtls = certs.server.server(client_ca=certs.ca)
    stats = next(m for m in all_methods() if full_name(m).endswith(".BrokerAdmin/GetStats"))
    topics = next(m for m in all_methods() if full_name(m).endswith(".BrokerAdmin/CreateSubscription"))
    async with every_service(tmp_path, auth_file, tls=mtls) as address:
        # The development client certificate is principal "app": it may subscribe, not administer.
        async with open_channel(address, tls=certs.client_tls(client=certs.client)) as channel:
            assert await call(channel, topics, requests_for(topics)) == grpc.StatusCode.OK
            assert await call(channel, stats, requests_for(stats)) == grpc.StatusCode.PERMISSION_DENIED
        # A token (as call credentials over TLS) names the principal before the certificate does.
        tls = certs.client_tls(client=certs.client)
        async with open_channel(address, tls=tls, token=auth_file.tokens["admin"]) as channel:
            assert await call(channel, stats, requests_for(stats)) == grpc.StatusCode.OK
        monkeypatch.setenv("SOKUTATSU_AUTH_TOKEN", "not-a-token")
        async with open_channel(address, tls=tls) as channel:
            assert await call(channel, stats, requests_for(stats)) == grpc.StatusCode.UNAUTHENTICATED
    async with every_service(tmp_path, auth_file) as address:
        # Plaintext (loopback): the environment's token, through a client interceptor.
        monkeypatch.setenv("SOKUTATSU_AUTH_TOKEN", auth_file.tokens["admin"])
        async with open_channel(address) as channel:
            assert await call(channel, stats, requests_for(stats)) == grpc.StatusCode.OK


# ------------------------------------------------------ real processes ------


def _with_auth(process: BrokerProcess | MonitorProcess, auth_file: AuthFile) -> None:
    process.env.update(auth_file.env("svc"))


async def test_a_pair_and_its_monitor_work_with_auth_on_and_refuse_others(
    broker_factory: Callable[..., BrokerProcess],
    monitor_factory: Callable[..., MonitorProcess],
    auth_file: AuthFile,
) -> None:
    a = broker_factory(instance="broker-a", role="active", peer_timeout_ms="500")
    _with_auth(a, auth_file)
    a.start()
    b = broker_factory(instance="broker-b", role="standby", peer=a.address, peer_timeout_ms="500")
    _with_auth(b, auth_file)
    b.start()
    monitor = monitor_factory((a, b))
    _with_auth(monitor, auth_file)
    monitor.start()
    admin = auth_file.metadata("admin")

    async def status() -> monitor_pb2.MonitorStatus:
        async with aio.insecure_channel(monitor.address) as channel:
            reply: monitor_pb2.MonitorStatus = await monitor_pb2_grpc.MonitorStub(channel).GetStatus(
                monitor_pb2.GetStatusRequest(), metadata=admin, timeout=RPC_SECONDS
            )
            return reply

    async def pair_seen() -> bool:
        # The monitor polls both brokers, and they hear each other, as the service principal.
        seen = {(x.broker_id, x.serving, x.role) for x in (await status()).brokers}
        if seen != {
            ("broker-a", True, broker_pb2.BROKER_ROLE_ACTIVE),
            ("broker-b", True, broker_pb2.BROKER_ROLE_STANDBY),
        }:
            return False
        for broker in (a, b):
            async with aio.insecure_channel(broker.address) as channel:
                stats = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
                    broker_pb2.GetStatsRequest(), metadata=admin, timeout=RPC_SECONDS
                )
            if not stats.peer_up:
                return False
        return True

    await until(pair_seen, "the monitor to see both brokers serving")

    app = auth_file.tokens["app"]

    async def b_holds_app_1() -> bool:
        async with aio.insecure_channel(b.address) as channel:
            stats = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
                broker_pb2.GetStatsRequest(), metadata=admin, timeout=RPC_SECONDS
            )
        return any(s.subscriber_id == "app-1" for s in stats.subscribers)

    async with (
        Subscriber(
            a.address, "app-1", "t.prices", durable=True, mode="migrate", config=ClientConfig(token=app)
        ) as subscriber,
        Publisher(a.address, "app-pub", config=ClientConfig(token=app)) as publisher,
    ):
        # Published only once broker-b holds app-1 (from broker-a's subscription list). Published
        # before, broker-a's holdings may bring it to broker-b with "one" in it: broker-b then says
        # it may lack "one" (it does), and the switchover rightly waits for the subscriber to
        # acknowledge "one", which the SDK does only when the next message is asked for.
        await until(b_holds_app_1, "broker-b to hold app-1")
        await publisher.publish("t.prices", "k", b"one")
        await publisher.flush()
        first = await asyncio.wait_for(anext(aiter(subscriber)), LIMIT_SECONDS)
        assert first.body == b"one"

        async def assigned() -> bool:
            return any(x.subscriber_id == "app-1" for x in (await status()).assignments)

        await until(assigned, "the monitor to see app-1")
        async with aio.insecure_channel(monitor.address) as channel:
            stub = monitor_pb2_grpc.MonitorStub(channel)
            request = monitor_pb2.RequestSwitchoverRequest(subscriber_id="app-1", topic="t.prices")
            with pytest.raises(aio.AioRpcError) as refused:
                await stub.RequestSwitchover(request, metadata=auth_file.metadata("app"), timeout=RPC_SECONDS)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            moved = await stub.RequestSwitchover(request, metadata=admin, timeout=LIMIT_SECONDS)
            assert (moved.to_broker_id, moved.error) == ("broker-b", ""), moved
        await publisher.publish("t.prices", "k", b"two")
        await publisher.flush()
        second = await asyncio.wait_for(anext(aiter(subscriber)), LIMIT_SECONDS)
        assert second.body == b"two"

    # Another principal cannot attach as app-1, on either broker, nor publish without a token.
    for broker in (a, b):
        async with aio.insecure_channel(broker.address) as channel:
            open_frame = broker_pb2.SubscribeRequest(
                open=broker_pb2.SubscribeOpen(
                    subscription=broker_pb2.Subscription(subscriber_id="app-1", topic="t.prices", durable=True)
                )
            )

            async def frames(frame: broker_pb2.SubscribeRequest = open_frame) -> AsyncIterator[Any]:
                yield frame

            with pytest.raises(aio.AioRpcError) as denied:
                async for _ in broker_pb2_grpc.BrokerStub(channel).Subscribe(
                    frames(), metadata=auth_file.metadata("other"), timeout=RPC_SECONDS
                ):
                    pass
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(aio.AioRpcError) as nobody:
                await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(broker_pb2.GetStatsRequest(), timeout=10)
            assert nobody.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The refusals are counted in the broker's stats.
    for broker in (a, b):
        async with aio.insecure_channel(broker.address) as channel:
            stats = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
                broker_pb2.GetStatsRequest(), metadata=admin, timeout=RPC_SECONDS
            )
        assert stats.auth_refusals == 2, stats  # the Subscribe as app-1 and the GetStats without a token
    # The SDK with a wrong token: the broker's refusal, as the SDK's one error type.
    with pytest.raises(BrokerError) as sdk_refused:
        async with Publisher(a.address, "app-pub-2", config=ClientConfig(token=app[::-1])):  # a token nobody has
            pass
    assert sdk_refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "sokutatsu auth token" in sdk_refused.value.detail
    logs = a.log() + b.log() + monitor.log()
    assert "Traceback" not in logs
    # Auth was on in each process; only the test's own bad calls were refused, never a service's link.
    assert all("auth on" in log for log in (a.log(), b.log(), monitor.log()))
    refusals = [line for line in logs.splitlines() if "auth:" in line]
    expected = (
        "Subscribe to principal other",
        "GetStats to peer",
        "Publish to peer",
        "RequestSwitchover to principal app",
    )
    assert all(any(e in line for e in expected) for line in refusals), refusals

"""Limits per connection (docs/security.md): each refuses with its documented status, is counted
in ``BrokerStats.client_limits``, leaves other clients alone, and never trips the SDK or the pair.

Real broker processes and real gRPC. A client is one gRPC connection with auth off (the channels
here use a local subchannel pool, so each is its own connection) and the principal with auth on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import ClientConfig, Publisher, Subscriber, Unreachable
from sokutatsu.core.runtime_settings import RuntimeSettings, ServiceSettings
from sokutatsu.core.server import ServiceContext, serve
from sokutatsu.core.tls import open_channel
from tests.broker.fix_broker import BrokerProcess, Pair, stats, until
from tests.broker.raw import batch, message, open_publish, open_subscribe, publish, read_seqs
from tests.helpers import run_once
from tests.security.fix_auth import AuthFile

pytestmark = pytest.mark.timeout(120)

RPC_SECONDS = 10.0
MiB = 2**20
# Each channel its own connection (gRPC otherwise shares one between channels with the same options).
OWN_CONNECTION = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", 64 * MiB),
    ("grpc.max_receive_message_length", 64 * MiB),
]


@pytest.fixture(autouse=True)
def _no_security_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TLS_CERT", "TLS_KEY", "TLS_CA", "TLS_CLIENT_AUTH", "AUTH_FILE", "AUTH_TOKEN", "MAX_FRAME_BYTES"):
        monkeypatch.delenv(f"SOKUTATSU_{name}", raising=False)


@contextlib.asynccontextmanager
async def connection(address: str, token: str | None = None) -> AsyncIterator[aio.Channel]:
    """One gRPC connection of its own (sending ``token`` as a bearer token on every call)."""
    async with open_channel(address, options=OWN_CONNECTION, token=token or "") as channel:
        yield channel


async def _status(work: Awaitable[object]) -> aio.AioRpcError:
    try:
        await work
    except aio.AioRpcError as error:
        return error
    raise AssertionError("the broker accepted what is over its limit")


async def _limits(address: str) -> broker_pb2.ClientLimits:
    return (await stats(address)).client_limits


async def _create(channel: aio.Channel, subscriber: str, topic: str = "t.limits") -> broker_pb2.Subscription:
    subscription = broker_pb2.Subscription(subscriber_id=subscriber, topic=topic, durable=True)
    await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
        broker_pb2.CreateSubscriptionRequest(subscription=subscription), timeout=RPC_SECONDS
    )
    return subscription


async def _bystander_check(address: str) -> None:
    """Another client publishes and receives as usual."""
    async with Subscriber(address, "bystander", "t.other") as sub, Publisher(address, "bystander-pub") as pub:
        await asyncio.wait_for(sub.connected.wait(), RPC_SECONDS)
        await pub.publish("t.other", "K", b"fine")
        async for m in sub:
            assert m.body == b"fine"
            break


# ----------------------------------------------------------------- max frame --


async def test_a_frame_over_the_maximum_is_refused_by_grpc_with_resource_exhausted(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory()
    broker.env["SOKUTATSU_MAX_FRAME_BYTES"] = "4MiB"
    broker.start()
    body = b"x" * (MiB - 1024)
    async with connection(broker.address) as channel:
        # Just under the frame limit: stored and acknowledged.
        call, _ = await open_publish(channel, "big")
        ack = await publish(call, batch("t.frames", [message("big", s, body=body) for s in range(1, 4)]))
        assert ack.acked_through_seq == 3
        # Over it (5 bodies of almost 1 MiB in one frame): gRPC refuses it before the broker reads it.
        error = await _status(publish(call, batch("t.frames", [message("big", s, body=body) for s in range(4, 9)])))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (error.details() or "")
        # Every RPC, not only the streams: an admin call over the limit too.
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        error = await _status(
            admin.CreateTopic(
                broker_pb2.CreateTopicRequest(topic=broker_pb2.Topic(name="x" * (5 * MiB))), timeout=RPC_SECONDS
            )
        )
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The connection is not poisoned: the same publisher resumes on a new stream.
    async with connection(broker.address) as channel:
        call, opened = await open_publish(channel, "big")
        assert opened.last_seq == 3
    assert (await _limits(broker.address)).max_frame_bytes == 4 * MiB
    await _bystander_check(broker.address)


async def test_every_service_takes_the_frame_limit_from_the_shared_bootstrap(tmp_path: Path) -> None:
    """The bootstrap's ``serve()`` (every service's) with a 4 MiB limit, probed on reflection."""
    announce = tmp_path / "announce.json"
    stop = asyncio.Event()

    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        return []

    task = asyncio.create_task(
        serve(
            service="probe",
            settings=ServiceSettings(listen="127.0.0.1:0", instance="probe"),
            runtime=RuntimeSettings(grace_seconds=0.5, announce_file=announce, max_frame_bytes=4 * MiB),
            register=register,
            listen_var="SOKUTATSU_PROBE_LISTEN",
            stop=stop,
        )
    )
    try:
        await until(_exists(announce), "the probe service to serve")
        address = json.loads(announce.read_text())["address"]
        async with connection(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            for size, refused in ((3 * MiB, False), (5 * MiB, True)):
                request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * size)
                call = stub.ServerReflectionInfo(iter([request]), timeout=RPC_SECONDS)
                if refused:
                    error = await _status(call.read())
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "Received message larger than max" in (error.details() or "")
                else:
                    answer = await call.read()
                    assert isinstance(answer, reflection_pb2.ServerReflectionResponse)
                    assert answer.HasField("error_response")  # no such symbol: answered, not refused
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def _exists(path: Path) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await asyncio.to_thread(path.exists)

    return check


def test_the_frame_setting_is_checked_at_start(tmp_path: Path) -> None:
    env = {"SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / "state"), "SOKUTATSU_BROKER_LISTEN": "127.0.0.1:0"}
    too_small = run_once("sokutatsu.broker", {**env, "SOKUTATSU_MAX_FRAME_BYTES": "1MiB"})
    assert too_small.returncode == 2
    assert "SOKUTATSU_MAX_FRAME_BYTES" in too_small.stderr
    assert "expected 4MiB to 1GiB" in too_small.stderr
    # A body that could never fit in a frame is a configuration error, not a refusal later.
    body_too_big = run_once(
        "sokutatsu.broker", {**env, "SOKUTATSU_MAX_FRAME_BYTES": "4MiB", "SOKUTATSU_BROKER_MAX_BODY": "4MiB"}
    )
    assert body_too_big.returncode == 1
    assert "does not fit in a frame of SOKUTATSU_MAX_FRAME_BYTES" in body_too_big.stderr


# ---------------------------------------------------------- max batch messages --


async def test_a_batch_over_the_maximum_is_invalid_argument_naming_the_setting(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(max_batch_messages="10")
    broker.start()
    async with connection(broker.address) as channel:
        call, opened = await open_publish(channel, "batcher")
        assert opened.max_batch_messages == 10
        ack = await publish(call, batch("t.batch", [message("batcher", s) for s in range(1, 11)]))
        assert ack.acked_through_seq == 10
        error = await _status(publish(call, batch("t.batch", [message("batcher", s) for s in range(11, 22)])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a PublishBatch of 11 messages is over the broker's maximum of 10 per batch" in (error.details() or "")
    assert "SOKUTATSU_BROKER_MAX_BATCH_MESSAGES" in (error.details() or "")
    limits = await _limits(broker.address)
    assert (limits.max_batch_messages, limits.batch_refusals) == (10, 1)
    await _bystander_check(broker.address)


async def test_the_sdk_keeps_its_batches_within_the_brokers_maximum(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(max_batch_messages="7")
    broker.start()
    async with Subscriber(broker.address, "reader", "t.sdk") as sub:
        await asyncio.wait_for(sub.connected.wait(), RPC_SECONDS)
        # batch_messages far over the broker's 7: the SDK sends at most 7 per frame.
        async with Publisher(broker.address, "sdk", batch_messages=500, linger=0.05) as pub:
            for i in range(300):
                pub.publish_nowait("t.sdk", "K", str(i).encode())
            await pub.flush()
            assert pub.refused == 0
        seqs = []
        async for m in sub:
            seqs.append(m.publisher_seq)
            if len(seqs) == 300:
                break
    assert seqs == list(range(1, 301))
    limits = await _limits(broker.address)
    assert limits.batch_refusals == 0
    assert limits.throttled_batches == 0  # no rate limit by default


# ------------------------------------------------------------ streams per client --


async def test_one_stream_over_the_maximum_is_resource_exhausted_for_that_connection_only(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(max_streams_per_client="2")
    broker.start()
    async with connection(broker.address) as first, connection(broker.address) as second:
        publishing, _ = await open_publish(first, "p1")
        subscribing = await open_subscribe(first, "s1", "t.streams", credits=10)
        # A third stream on the same connection, either kind, is refused.
        error = await _status(open_publish(first, "p2"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already holds 2 Publish and Subscribe streams" in (error.details() or "")
        assert "SOKUTATSU_BROKER_MAX_STREAMS_PER_CLIENT" in (error.details() or "")
        error = await _status(open_subscribe(first, "s2", "t.streams", credits=10))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The streams it holds keep working.
        await publish(publishing, batch("t.streams", [message("p1", 1)]))
        assert await read_seqs(subscribing, 1) == [1]
        # Another connection is another client.
        other, _ = await open_publish(second, "p3")
        await open_subscribe(second, "s3", "t.streams", credits=10)
        # Once a stream ends, the first connection may open one again.
        await publishing.done_writing()
        assert await publishing.read() == aio.EOF

        async def reopened() -> bool:
            try:
                call, _ = await open_publish(first, "p2")
            except aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                return False
            call.cancel()
            return True

        await until(reopened, "the ended stream to free its place")
        other.cancel()
    limits = await _limits(broker.address)
    assert limits.max_streams_per_client == 2
    assert limits.stream_refusals >= 2


# ------------------------------------------------------ subscriptions per client --


async def test_one_subscription_over_the_maximum_is_resource_exhausted(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(max_subscriptions_per_client="2")
    broker.start()
    async with connection(broker.address) as channel, connection(broker.address) as other:
        await _create(channel, "durable-1")
        await _create(channel, "durable-1")  # the same one again is no new subscription
        live = await open_subscribe(channel, "live-1", "t.limits", credits=10)
        # Two held (one durable it created, one live non-durable): both kinds of a third are refused.
        error = await _status(_create(channel, "durable-2"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already holds 2 subscriptions" in (error.details() or "")
        assert "SOKUTATSU_BROKER_MAX_SUBSCRIPTIONS_PER_CLIENT" in (error.details() or "")
        error = await _status(open_subscribe(channel, "live-2", "t.limits", credits=10))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Attaching to the durable subscription it holds is no new subscription.
        attached = await open_subscribe(channel, "durable-1", "t.limits", credits=10, durable=True)
        attached.cancel()
        # The same live subscriber reconnecting takes over its stream: no new subscription.
        again = await open_subscribe(channel, "live-1", "t.limits", credits=10)
        assert await live.read() is aio.EOF
        error = await _status(open_subscribe(channel, "live-2", "t.limits", credits=10))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Another client is not counted with it.
        await _create(other, "durable-3")
        # Ending the live stream and deleting the durable one make room again.
        again.cancel()

        async def room() -> bool:
            try:
                await _create(channel, "durable-2")
            except aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                return False
            return True

        await until(room, "the ended live subscription to free its place")
        await broker_pb2_grpc.BrokerAdminStub(channel).DeleteSubscription(
            broker_pb2.DeleteSubscriptionRequest(topic="t.limits", subscriber_id="durable-1"), timeout=RPC_SECONDS
        )
        await _create(channel, "durable-4")
        error = await _status(_create(channel, "durable-5"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    limits = await _limits(broker.address)
    assert limits.max_subscriptions_per_client == 2
    assert limits.subscription_refusals >= 4


# ------------------------------------------------------------------ publish rate --


async def test_a_publisher_over_the_rate_is_throttled_not_refused(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(max_publish_rate="500")
    broker.start()
    async with Subscriber(broker.address, "reader", "t.rate") as sub:
        await asyncio.wait_for(sub.connected.wait(), RPC_SECONDS)
        async with Publisher(broker.address, "fast", batch_messages=100) as pub:
            for i in range(1500):
                await pub.wait_for_room()
                pub.publish_nowait("t.rate", "K", str(i).encode())
            await pub.flush()
            assert (pub.refused, pub.dropped) == (0, 0)
        seqs = []
        async for m in sub:
            seqs.append(m.publisher_seq)
            if len(seqs) == 1500:
                break
    assert seqs == list(range(1, 1501))
    both = await stats(broker.address)
    # 1500 messages against a bucket of 500: the broker held batches back instead of refusing any.
    assert both.client_limits.max_publish_rate == 500
    assert both.client_limits.throttled_batches > 0
    assert both.rejected_total == 0


# ------------------------------------------------------------------ with auth on --


async def test_with_auth_a_client_is_the_principal_and_service_principals_are_not_limited(
    broker_factory: Callable[..., BrokerProcess], auth_file: AuthFile
) -> None:
    broker = broker_factory(max_streams_per_client="1")
    broker.env.update(auth_file.env("svc"))
    broker.start()
    app = auth_file.tokens["app"]
    async with connection(broker.address, app) as one, connection(broker.address, app) as two:
        held, _ = await open_publish(one, "app-p1")
        # The principal's second connection shares its limit.
        for _ in range(3):
            error = await _status(open_publish(two, "app-p2"))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "principal app already holds 1" in (error.details() or "")
        # The SDK's Publisher of that principal cannot open its stream: start() says why.
        with pytest.raises(Unreachable, match=r"RESOURCE_EXHAUSTED.*SOKUTATSU_BROKER_MAX_STREAMS_PER_CLIENT"):
            async with Publisher(broker.address, "app-sdk", config=ClientConfig(token=app), connect_timeout=2):
                pass
        # Another principal is another client.
        async with connection(broker.address, auth_file.tokens["other"]) as other:
            call, _ = await open_publish(other, "other-p1")
            call.cancel()
        held.cancel()
    # The suite's own links (a service principal) are not limited.
    async with connection(broker.address, auth_file.tokens["svc"]) as service:
        calls = [(await open_publish(service, f"svc-{i}"))[0] for i in range(3)]
        for call in calls:
            call.cancel()
    async with connection(broker.address, auth_file.tokens["admin"]) as admin:
        result = await broker_pb2_grpc.BrokerAdminStub(admin).GetStats(broker_pb2.GetStatsRequest(), timeout=10)
    assert result.client_limits.stream_refusals >= 4
    # Logged once for the principal, not once per refusal.
    refusals = [line for line in broker.log().splitlines() if "limit: max streams per client refused" in line]
    assert len(refusals) == 1, refusals
    assert "principal app" in refusals[0]


# --------------------------------------------------------------------- the pair --


async def test_tight_limits_leave_the_pair_and_the_sdk_working(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await pair_factory(
        max_streams_per_client="2", max_subscriptions_per_client="1", max_batch_messages="50", max_publish_rate="5000"
    )
    async with Subscriber(pair.addresses, "pair-reader", "t.pair") as sub:
        await asyncio.wait_for(sub.connected.wait(), RPC_SECONDS)
        async with Publisher(pair.addresses, "pair-pub") as pub:
            for i in range(500):
                pub.publish_nowait("t.pair", "K", str(i).encode())
            await pub.flush()
        seqs = []
        async for m in sub:
            seqs.append(m.publisher_seq)
            if len(seqs) == 500:
                break
    assert seqs == list(range(1, 501))
    for address in pair.addresses:
        result = await stats(address)
        assert result.peer_up
        limits = result.client_limits
        assert (limits.batch_refusals, limits.stream_refusals, limits.subscription_refusals) == (0, 0, 0)


# ------------------------------------------------- caps on client-supplied amounts --
# (docs/security.md, Caps on client-supplied amounts; issue #20 item 3)

U64_MAX = 2**64 - 1
KiB = 2**10


async def _details(error: aio.AioRpcError, *parts: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    for part in parts:
        assert part in (error.details() or ""), (part, error.details())


async def _create_with_budget(channel: aio.Channel, subscriber: str, topic: str, budget: int) -> None:
    subscription = broker_pb2.Subscription(
        subscriber_id=subscriber, topic=topic, durable=True, memory_budget_bytes=budget
    )
    await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
        broker_pb2.CreateSubscriptionRequest(subscription=subscription), timeout=RPC_SECONDS
    )


async def test_a_subscription_that_never_reads_cannot_starve_other_publishers_with_its_budget(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """The attack of issue #20 item 3: a subscription asking memory_budget_bytes = 2^64-1 that never
    reads, a publisher filling it, and another publisher whose persistent messages must still be taken."""
    broker = broker_factory(max_bytes="1MiB", queue_budget="64KiB", max_queue_budget="256KiB")
    broker.start()
    body = b"h" * KiB
    async with connection(broker.address) as channel:
        try:
            await _create_with_budget(channel, "hog", "t.hog", U64_MAX)
        except aio.AioRpcError as error:
            await _details(error, "memory_budget_bytes")
            # The most the attacker can get instead.
            await _create_with_budget(channel, "hog", "t.hog", 256 * KiB)
        # The hog's publisher sends 2 MiB (twice MAX_BYTES) of persistent messages; nobody reads them.
        hog, _ = await open_publish(channel, "hog-pub")
        seq = 0
        for _ in range(32):
            ack = await publish(hog, batch("t.hog", [message("hog-pub", seq + i, body=body) for i in range(1, 65)]))
            seq = ack.acked_through_seq
        # Another client's persistent messages are still taken, all of them.
        await _create(channel, "victim", "t.victim")
        victim, _ = await open_publish(channel, "victim-pub")
        for first in range(1, 201, 50):
            ack = await publish(
                victim, batch("t.victim", [message("victim-pub", s, body=body) for s in range(first, first + 50)])
            )
            assert list(ack.rejected) == [], ack.rejected[0].message
            assert ack.acked_through_seq == first + 49
        hog.cancel()
        victim.cancel()
    s = await stats(broker.address)
    assert s.rejected_total == 0
    [hog_stats] = [q for q in s.subscribers if q.subscriber_id == "hog"]
    assert hog_stats.memory_budget_bytes <= 256 * KiB


async def test_the_memory_budget_is_capped_at_the_setting(broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(max_queue_budget="256KiB")
    broker.start()
    async with connection(broker.address) as channel:
        await _create_with_budget(channel, "at-cap", "t.cap", 256 * KiB)
        for over in (256 * KiB + 1, 2**32, 2**63 - 1, U64_MAX):
            error = await _status(_create_with_budget(channel, "over-cap", "t.cap", over))
            await _details(
                error,
                f"Subscription.memory_budget_bytes {over!r} is over the broker's maximum of {256 * KiB} bytes",
                "SOKUTATSU_BROKER_MAX_QUEUE_BUDGET",
            )
        # The same on a non-durable Subscribe.
        subscription = broker_pb2.Subscription(subscriber_id="live", topic="t.cap", memory_budget_bytes=256 * KiB + 1)
        call = channel.stream_stream(
            "/sokutatsu.broker.v1.Broker/Subscribe",
            request_serializer=broker_pb2.SubscribeRequest.SerializeToString,
            response_deserializer=broker_pb2.SubscribeResponse.FromString,
        )()
        await call.write(
            broker_pb2.SubscribeRequest(open=broker_pb2.SubscribeOpen(subscription=subscription, credits=10))
        )
        error = await _status(call.read())
        await _details(error, "memory_budget_bytes", "SOKUTATSU_BROKER_MAX_QUEUE_BUDGET")
    s = await stats(broker.address)
    assert [q.memory_budget_bytes for q in s.subscribers if q.subscriber_id == "at-cap"] == [256 * KiB]
    await _bystander_check(broker.address)


async def test_credits_are_capped_at_the_setting(broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(max_credits="5000")
    broker.start()
    # 5000: above the SDK's default flow_limit (1000), as a cap must be (the bystander uses the SDK).
    async with connection(broker.address) as channel:
        at_cap = await open_subscribe(channel, "at-cap", "t.credits", credits=5000)
        for over in (5001, 2**31, 2**32 - 1):
            error = await _status(open_subscribe(channel, f"over-{over}", "t.credits", credits=over))
            await _details(error, f"SubscribeOpen.credits {over!r} is over the broker's maximum of 5000", "MAX_CREDITS")
        # More credit on an open stream: up to the cap, not past it.
        small = await open_subscribe(channel, "small", "t.credits", credits=100)
        await small.write(broker_pb2.SubscribeRequest(credit=broker_pb2.SubscriberCredit(credits=4900)))
        await small.write(broker_pb2.SubscribeRequest(credit=broker_pb2.SubscriberCredit(credits=1)))
        error = await _status(small.read())
        await _details(error, "SubscriberCredit.credits 1 would bring the stream's outstanding credit to 5001", "5000")
        at_cap.cancel()
    await _bystander_check(broker.address)


async def _open_at(channel: aio.Channel, publisher: str, first_unacked: int) -> broker_pb2.PublishOpened:
    call = channel.stream_stream(
        "/sokutatsu.broker.v1.Broker/Publish",
        request_serializer=broker_pb2.PublishRequest.SerializeToString,
        response_deserializer=broker_pb2.PublishResponse.FromString,
    )()
    await call.write(
        broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id=publisher, first_unacked_seq=first_unacked))
    )
    response = await call.read()
    assert isinstance(response, broker_pb2.PublishResponse), response
    call.cancel()
    return response.opened


async def test_a_new_publishers_first_number_is_capped_at_the_setting(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(max_first_seq="1000000")
    broker.start()
    async with connection(broker.address) as channel:
        assert (await _open_at(channel, "at-cap", 1_000_000)).last_seq == 999_999
        for over in (1_000_001, 2**53 + 1, 2**63, U64_MAX):
            error = await _status(_open_at(channel, f"open-{over}", over))
            await _details(
                error,
                f"PublishOpen.first_unacked_seq {over!r} is over the broker's maximum of 1000000",
                "SOKUTATSU_BROKER_MAX_FIRST_SEQ",
            )
        # A publisher's first message: the same cap.
        first, _ = await open_publish(channel, "first-at-cap")
        ack = await publish(first, batch("t.seq", [message("first-at-cap", 1_000_000)]))
        assert ack.acked_through_seq == 1_000_000
        for over in (1_000_001, 2**63, U64_MAX):
            call, _ = await open_publish(channel, f"first-{over}")
            error = await _status(publish(call, batch("t.seq", [message(f"first-{over}", over)])))
            await _details(error, f"publisher_seq {over!r} is over the broker's maximum of 1000000", "MAX_FIRST_SEQ")
        # A known publisher continues past the cap: it is about new publishers only.
        ack = await publish(first, batch("t.seq", [message("first-at-cap", 1_000_001)]))
        assert ack.acked_through_seq == 1_000_001
        first.cancel()
    await _bystander_check(broker.address)


async def test_watch_stats_interval_is_bounded(broker: BrokerProcess) -> None:
    async with connection(broker.address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        watch = admin.WatchStats(broker_pb2.WatchStatsRequest(interval_ms=3_600_000), timeout=RPC_SECONDS)
        first = await watch.read()
        assert isinstance(first, broker_pb2.BrokerStats)
        watch.cancel()
        for over in (3_600_001, 2**31, 2**32 - 1):
            call = admin.WatchStats(broker_pb2.WatchStatsRequest(interval_ms=over), timeout=RPC_SECONDS)
            error = await _status(call.read())
            await _details(error, f"WatchStatsRequest.interval_ms {over!r} is outside 10 to 3600000")

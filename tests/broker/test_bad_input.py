"""Bad input gets a documented status with an actionable message; everyone else keeps being served."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import Publisher, Subscriber
from sokutatsu.core.tls import open_channel
from tests.broker.fix_broker import BrokerProcess
from tests.broker.raw import batch, message, open_publish, open_subscribe, publish

pytestmark = pytest.mark.timeout(120)


async def _status(work: Awaitable[object]) -> aio.AioRpcError:
    try:
        await work
    except aio.AioRpcError as error:
        return error
    raise AssertionError("the broker accepted bad input")


async def _publish_error(address: str, request: broker_pb2.PublishRequest) -> aio.AioRpcError:
    async with aio.insecure_channel(address) as channel:
        call, _ = await open_publish(channel, "bad-publisher")
        return await _status(publish(call, request))


@pytest.fixture
async def watched(broker: BrokerProcess) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """A healthy subscriber and publisher around each bad input; the check proves nothing was lost for them."""
    async with Subscriber(broker.address, "bystander", "good") as sub, Publisher(broker.address, "good") as pub:
        await asyncio.wait_for(sub.connected.wait(), 10)
        await pub.publish("good", "K", b"before")

        async def check() -> None:
            await pub.publish("good", "K", b"after")
            bodies = []
            async for m in sub:
                bodies.append(m.body)
                if len(bodies) == 2:
                    break
            assert bodies == [b"before", b"after"]
            assert sub.gaps == []

        yield check


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (batch("", [message("bad-publisher", 1)]), "invalid topic name ''"),
        (batch("no spaces", [message("bad-publisher", 1)]), "invalid topic name 'no spaces'"),
        (batch("t", [message("bad-publisher", 1, key="")]), "invalid key ''"),
        (batch("t", [message("bad-publisher", 1, key="two words")]), "invalid key 'two words'"),
        (batch("t", [message("bad-publisher", 2), message("bad-publisher", 1)]), "seq 1 follows 2"),
        (batch("t", [message("someone-else", 1)]), "names publisher 'someone-else'"),
        (broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id="x")), "must be a PublishBatch"),
    ],
    ids=["empty-topic", "bad-topic", "empty-key", "bad-key", "seq-backwards", "other-publisher", "second-open"],
)
async def test_bad_publish_frames(
    broker: BrokerProcess, watched: Callable[[], Awaitable[None]], request_: broker_pb2.PublishRequest, says: str
) -> None:
    error = await _publish_error(broker.address, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in (error.details() or "")
    await watched()


async def test_body_over_the_maximum(broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(max_body="1KiB")
    broker.start()
    error = await _publish_error(broker.address, batch("t", [message("bad-publisher", 1, body=b"x" * 1025)]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "body of 1025 bytes is over the broker's maximum of 1024 (SOKUTATSU_BROKER_MAX_BODY)" in (
        error.details() or ""
    )


async def test_publisher_seq_gap_is_refused(broker: BrokerProcess, watched: Callable[[], Awaitable[None]]) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        call, _ = await open_publish(channel, "gappy")
        await publish(call, batch("t", [message("gappy", 1)]))
        error = await _status(publish(call, batch("t", [message("gappy", 5)])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "seq 5 follows 1; sequence numbers must have no gaps (resend from 2)" in (error.details() or "")
    await watched()


async def test_unknown_durable_subscription(broker: BrokerProcess, watched: Callable[[], Awaitable[None]]) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        error = await _status(open_subscribe(channel, "nobody", "good", credits=10, durable=True))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "no subscription of 'nobody' to topic 'good'; create it first" in (error.details() or "")
    await watched()


async def test_credits_must_be_positive(broker: BrokerProcess, watched: Callable[[], Awaitable[None]]) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        error = await _status(open_subscribe(channel, "zero", "good", credits=0))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "credits must be at least 1" in (error.details() or "")
        call = await open_subscribe(channel, "empty-credit", "good", credits=5)
        await call.write(broker_pb2.SubscribeRequest(credit=broker_pb2.SubscriberCredit(credits=0)))
        error = await _status(call.read())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must grant credits (at least 1) or acknowledge a position" in (error.details() or "")
    await watched()


async def test_garbage_frames(broker: BrokerProcess, watched: Callable[[], Awaitable[None]]) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        for method in ("Publish", "Subscribe"):
            call: aio.StreamStreamCall[bytes, bytes] = channel.stream_stream(f"/sokutatsu.broker.v1.Broker/{method}")()
            await call.write(b"\xff\xff\xff\xff not a protobuf")
            error = await _status(call.read())
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "could not be decoded" in (error.details() or "")
    await watched()


async def test_admin_errors(broker: BrokerProcess) -> None:
    async with aio.insecure_channel(broker.address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        error = await _status(admin.DeleteTopic(broker_pb2.DeleteTopicRequest(name="missing"), timeout=10))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        sub = broker_pb2.Subscription(subscriber_id="s", topic="t", durable=True)
        await admin.CreateSubscription(broker_pb2.CreateSubscriptionRequest(subscription=sub), timeout=10)
        sub.filter.exact_keys.append("K")
        error = await _status(admin.CreateSubscription(broker_pb2.CreateSubscriptionRequest(subscription=sub)))
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS
        error = await _status(admin.DeleteTopic(broker_pb2.DeleteTopicRequest(name="t"), timeout=10))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        error = await _status(admin.WatchStats(broker_pb2.WatchStatsRequest(interval_ms=1)).read())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_unknown_overflow_mode_is_refused_naming_the_allowed_values(broker: BrokerProcess) -> None:
    """Issue #20: overflow_mode 99 was stored silently as the broker's default (flow-to-disk)."""
    async with aio.insecure_channel(broker.address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        sub = broker_pb2.Subscription(subscriber_id="s99", topic="t99", durable=True, overflow_mode=99)  # type: ignore[arg-type]
        error = await _status(admin.CreateSubscription(broker_pb2.CreateSubscriptionRequest(subscription=sub)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.details() or ""
        assert "Subscription.overflow_mode 99 is not an OverflowMode" in details
        assert "OVERFLOW_MODE_FLOW_TO_DISK = 1, OVERFLOW_MODE_MIGRATE = 2" in details
        listed = await admin.ListSubscriptions(broker_pb2.ListSubscriptionsRequest(), timeout=10)
        assert [s.subscriber_id for s in listed.subscriptions] == []
        # A non-durable subscription opened on the stream is refused the same way.
        call = channel.stream_stream(
            "/sokutatsu.broker.v1.Broker/Subscribe",
            request_serializer=broker_pb2.SubscribeRequest.SerializeToString,
            response_deserializer=broker_pb2.SubscribeResponse.FromString,
        )()
        opening = broker_pb2.SubscribeOpen(subscription=sub, credits=1)
        opening.subscription.durable = False
        await call.write(broker_pb2.SubscribeRequest(open=opening))
        error = await _status(call.read())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Subscription.overflow_mode 99" in (error.details() or "")
        # The known values are taken.
        sub.overflow_mode = broker_pb2.OVERFLOW_MODE_MIGRATE
        created = await admin.CreateSubscription(broker_pb2.CreateSubscriptionRequest(subscription=sub), timeout=10)
        assert created.subscription.overflow_mode == broker_pb2.OVERFLOW_MODE_MIGRATE


async def test_a_peer_frame_with_an_unknown_role_is_refused(broker: BrokerProcess) -> None:
    """A DeliveredWatermarks frame's role is ACTIVE or STANDBY; 99 is not read as either."""
    async with open_channel(broker.address, cluster=True) as channel:
        control = broker_pb2_grpc.BrokerControlStub(channel)
        frame = broker_pb2.DeliveredWatermarks(broker_id="broker-x", epoch=1, session=1)
        frame.role = 99  # type: ignore[assignment]
        error = await _status(control.ReplicateWatermarks(iter([frame]), timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "DeliveredWatermarks.role 99 is not a role a broker takes" in (error.details() or "")
        role = await control.GetRole(broker_pb2.GetRoleRequest(), timeout=10)
        assert role.role == broker_pb2.BROKER_ROLE_ACTIVE


PUBLISHER_SCRIPT = """
import asyncio, sys
from sokutatsu.client import Publisher

async def main():
    async with Publisher(sys.argv[1], "doomed") as pub:
        seq = 0
        while True:
            for _ in range(50):
                seq = pub.publish_nowait("crash", "K", b"x" * 512)
            await pub.flush()
            print(seq, flush=True)

asyncio.run(main())
"""


async def test_a_publisher_killed_mid_stream_loses_nothing_acknowledged(
    broker: BrokerProcess, watched: Callable[[], Awaitable[None]]
) -> None:
    async with Subscriber(broker.address, "audit", "crash") as audit:
        await asyncio.wait_for(audit.connected.wait(), 10)
        child = subprocess.Popen(  # noqa: ASYNC220 - the test drives it synchronously on purpose
            [sys.executable, "-c", PUBLISHER_SCRIPT, broker.address], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None
            acked = 0
            for _ in range(20):
                acked = int(child.stdout.readline())
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            if child.stdout is not None:
                child.stdout.close()
        seqs = []
        async for m in audit:
            if m.publisher_id == "doomed":
                seqs.append(m.publisher_seq)
                if len(seqs) == acked:
                    break
        assert seqs == list(range(1, acked + 1))
    await watched()


async def test_control_rpcs_refuse_bad_requests(broker: BrokerProcess) -> None:
    async with open_channel(broker.address, cluster=True) as channel:
        control = broker_pb2_grpc.BrokerControlStub(channel)
        role = await control.GetRole(broker_pb2.GetRoleRequest(), timeout=10)
        assert (role.broker_id, role.role, role.peer_up) == ("broker-a", broker_pb2.BROKER_ROLE_ACTIVE, False)
        error = await _status(control.GetSwitchPosition(broker_pb2.GetSwitchPositionRequest(), timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        error = await _status(
            control.GetSwitchPosition(
                broker_pb2.GetSwitchPositionRequest(topic="prices", subscriber_id="nobody"), timeout=10
            )
        )
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "prices" in (error.details() or "")
        await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
            broker_pb2.CreateSubscriptionRequest(
                subscription=broker_pb2.Subscription(subscriber_id="desk", topic="prices", durable=True)
            ),
            timeout=10,
        )
        # Without a peer nothing may be redirected or released: the queue would have nowhere to go.
        error = await _status(
            control.RedirectSubscriber(
                broker_pb2.RedirectSubscriberRequest(topic="prices", subscriber_id="desk", target="127.0.0.1:1"),
                timeout=10,
            )
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not heard from" in (error.details() or "")
        error = await _status(
            control.RedirectSubscriber(
                broker_pb2.RedirectSubscriberRequest(topic="prices", subscriber_id="desk"), timeout=10
            )
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        error = await _status(
            control.AcceptSubscriber(
                broker_pb2.AcceptSubscriberRequest(
                    subscription=broker_pb2.Subscription(subscriber_id="x", topic="prices", durable=False)
                ),
                timeout=10,
            )
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "durable" in (error.details() or "")
        await control.SetRole(broker_pb2.SetRoleRequest(role=broker_pb2.BROKER_ROLE_ACTIVE, epoch=3), timeout=10)
        error = await _status(
            control.SetRole(broker_pb2.SetRoleRequest(role=broker_pb2.BROKER_ROLE_STANDBY, epoch=2), timeout=10)
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "epoch 2 is older than broker-a's epoch 3" in (error.details() or "")
        # The same role at the same epoch: a SetRole re-sent after a lost answer is OK, and changes nothing.
        again = await control.SetRole(
            broker_pb2.SetRoleRequest(role=broker_pb2.BROKER_ROLE_ACTIVE, epoch=3), timeout=10
        )
        assert (again.role, again.epoch) == (broker_pb2.BROKER_ROLE_ACTIVE, 3)
        # Another role at the same epoch: a role change needs a newer epoch.
        error = await _status(
            control.SetRole(broker_pb2.SetRoleRequest(role=broker_pb2.BROKER_ROLE_STANDBY, epoch=3), timeout=10)
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "broker-a is already active at epoch 3: a different role needs a newer epoch" in (error.details() or "")
        role = await control.GetRole(broker_pb2.GetRoleRequest(), timeout=10)
        assert (role.role, role.epoch) == (broker_pb2.BROKER_ROLE_ACTIVE, 3)
        for lease_ms in (1, 60_001):  # the grace of a promotion: 10 to 60000 ms, 0 for the peer timeout
            request = broker_pb2.SetRoleRequest(role=broker_pb2.BROKER_ROLE_ACTIVE, epoch=4, lease_ms=lease_ms)
            error = await _status(control.SetRole(request, timeout=10))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"SetRoleRequest.lease_ms {lease_ms} is outside 10 to 60000" in (error.details() or "")
        role = await control.GetRole(broker_pb2.GetRoleRequest(), timeout=10)
        assert (role.role, role.epoch) == (broker_pb2.BROKER_ROLE_ACTIVE, 3)  # refused before any change
        error = await _status(control.SetRole(broker_pb2.SetRoleRequest(role=99, epoch=4), timeout=10))  # type: ignore[arg-type]
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "SetRoleRequest.role 99 is not a role a broker takes: use BROKER_ROLE_ACTIVE = 1 or" in (
            error.details() or ""
        )
        error = await _status(
            control.SetRole(broker_pb2.SetRoleRequest(role=broker_pb2.BROKER_ROLE_UNSPECIFIED, epoch=4), timeout=10)
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT

"""The broker pair against real processes: shadows, the four switchover steps, failover, rejoin.

The monitor decides when to switch; these tests drive the brokers' control RPCs
themselves (the same four steps) to check what each broker promises.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import BufferFull, Message, Publisher, Subscriber
from sokutatsu.core.tls import open_channel
from tests.broker.fix_broker import BrokerProcess, Pair, stats, subscriber_stats, until

pytestmark = pytest.mark.timeout(180)
TOPIC = "prices"


def _covers(position: dict[str, int], floor: dict[str, int]) -> bool:
    return all(position.get(p, 0) >= seq for p, seq in floor.items())


async def switch(source: BrokerProcess, target: BrokerProcess, target_id: str, subscriber_id: str) -> int:
    """The four steps, as the monitor runs them; returns how many times step 1 was asked."""
    async with open_channel(source.address, cluster=True) as s_ch, open_channel(target.address, cluster=True) as t_ch:
        src, dst = broker_pb2_grpc.BrokerControlStub(s_ch), broker_pb2_grpc.BrokerControlStub(t_ch)
        subs = await broker_pb2_grpc.BrokerAdminStub(s_ch).ListSubscriptions(
            broker_pb2.ListSubscriptionsRequest(topic=TOPIC), timeout=10
        )
        spec = next(s for s in subs.subscriptions if s.subscriber_id == subscriber_id)
        asks = 0
        while True:
            asks += 1
            position = await src.GetSwitchPosition(
                broker_pb2.GetSwitchPositionRequest(subscriber_id=subscriber_id, topic=TOPIC), timeout=10
            )
            try:
                accepted = await dst.AcceptSubscriber(
                    broker_pb2.AcceptSubscriberRequest(subscription=spec, position=position.position), timeout=10
                )
            except aio.AioRpcError as exc:
                # A broker that has not yet had its peer's holdings refuses for now; the monitor asks again.
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                assert asks < 2000, "the taking broker never had its peer's holdings"
                await asyncio.sleep(0.005)
                continue
            if _covers(dict(position.position.last_seq), dict(accepted.floor.last_seq)):
                break
            assert asks < 2000, (
                f"the switch position {dict(position.position.last_seq)} never covered the taking broker's floor "
                f"{dict(accepted.floor.last_seq)}"
            )
            await asyncio.sleep(0.005)
        await src.RedirectSubscriber(
            broker_pb2.RedirectSubscriberRequest(
                subscriber_id=subscriber_id, topic=TOPIC, target=target.address, target_broker_id=target_id
            ),
            timeout=10,
        )
        await src.ReleaseSubscriber(
            broker_pb2.ReleaseSubscriberRequest(subscriber_id=subscriber_id, topic=TOPIC), timeout=10
        )
        return asks


async def _publish(
    pair: Pair, publisher_id: str, count: int, pace: float = 0.0, *, gate: asyncio.Event | None = None, gate_at: int = 0
) -> Publisher:
    """Publish ``count`` messages (every 50, sleep ``pace``); before message ``gate_at`` wait for ``gate``."""
    async with Publisher(pair.addresses, publisher_id, ack_timeout=60) as pub:
        for i in range(count):
            if gate is not None and i == gate_at:
                await pub.flush()
                await gate.wait()
            while True:
                try:
                    pub.publish_nowait(TOPIC, f"K{i % 20:02d}", f"{publisher_id}:{i + 1}".encode())
                    break
                except BufferFull:
                    await pub.flush()
            if pace and i % 50 == 49:
                await asyncio.sleep(pace)
        await pub.flush()
        return pub


class Consumer:
    """Reads a subscription into a list, optionally slowly, until it has ``count`` messages."""

    def __init__(self, pair: Pair, subscriber_id: str, count: int, *, budget: int = 0) -> None:
        self.sub = Subscriber(pair.addresses, subscriber_id, TOPIC, durable=True, mode="migrate", memory_budget=budget)
        self.count = count
        self.got: list[Message] = []
        self.brokers: list[str] = []
        self.delay = 0.0

    async def run(self) -> None:
        async for message in self.sub:
            self.got.append(message)
            if not self.brokers or self.brokers[-1] != self.sub.broker_id:
                self.brokers.append(self.sub.broker_id)
            if self.delay:
                await asyncio.sleep(self.delay)
            if len(self.got) == self.count:
                break

    def check(self, expected: dict[str, int]) -> None:
        per: dict[str, list[int]] = defaultdict(list)
        for m in self.got:
            per[m.publisher_id].append(m.publisher_seq)
            assert m.body == f"{m.publisher_id}:{m.publisher_seq}".encode()
        for publisher, n in expected.items():
            assert per[publisher] == list(range(1, n + 1)), f"{publisher}: not exactly once in order"
        assert not self.sub.gaps


@contextlib.asynccontextmanager
async def consuming(*consumers: Consumer) -> AsyncIterator[list[asyncio.Task[None]]]:
    for c in consumers:
        await c.sub.start()
    tasks = [asyncio.create_task(c.run()) for c in consumers]
    try:
        yield tasks
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        for t in tasks:
            t.cancel()
        for c in consumers:
            await c.sub.close()


async def test_the_standby_holds_each_message_until_the_active_subscriber_acknowledges_it(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await pair_factory()
    desk = Consumer(pair, "desk", 3000)
    async with consuming(desk):
        await asyncio.wait_for(desk.sub.connected.wait(), 10)
        await _publish(pair, "feed", 3000)
    desk.check({"feed": 3000})
    assert desk.brokers == ["broker-a"]
    shadow = await subscriber_stats(pair.standby.address, "desk")
    assert shadow.state == broker_pb2.QUEUE_STATE_SHADOW
    assert (await subscriber_stats(pair.active.address, "desk")).state == broker_pb2.QUEUE_STATE_SERVING

    async def trimmed() -> bool:
        s = await subscriber_stats(pair.standby.address, "desk")
        return s.depth == 0 and s.acked.last_seq.get("feed") == 3000

    try:
        await until(trimmed, "the standby to drop what the subscriber acknowledged at the active")
    except AssertionError as exc:
        standby = await subscriber_stats(pair.standby.address, "desk")
        active = await subscriber_stats(pair.active.address, "desk")
        raise AssertionError(f"{exc}\nstandby: {standby}\nactive: {active}") from None
    held = await stats(pair.standby.address)
    assert held.held_count == 0


async def test_switchover_and_back_mid_stream_lose_and_double_nothing(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await pair_factory()
    total = 12_000
    slow = Consumer(pair, "slow", total)
    normal = Consumer(pair, "normal", total)
    async with consuming(slow, normal):
        await asyncio.wait_for(asyncio.gather(slow.sub.connected.wait(), normal.sub.connected.wait()), 10)
        slow.delay = 0.0005
        publishing = asyncio.create_task(_publish(pair, "feed", total, pace=0.01))
        await until(lambda: _async(len(slow.got) > 1500), "the slow subscriber to get going")
        await switch(pair.active, pair.standby, "broker-b", "slow")
        assert (await subscriber_stats(pair.active.address, "slow")).state == broker_pb2.QUEUE_STATE_AWAY
        await until(lambda: _async(slow.sub.broker_id == "broker-b"), "the slow subscriber to reach the standby")
        slow.delay = 0.0
        moved_at = len(slow.got)
        await until(lambda: _async(len(slow.got) > moved_at + 2000), "more for the slow subscriber on the standby")
        asks = await switch(pair.standby, pair.active, "broker-a", "slow")
        assert asks >= 1
        await publishing
    slow.check({"feed": total})
    normal.check({"feed": total})
    assert slow.brokers == ["broker-a", "broker-b", "broker-a"]
    assert normal.brokers == ["broker-a"]
    assert (await subscriber_stats(pair.standby.address, "slow")).state == broker_pb2.QUEUE_STATE_SHADOW


async def test_kill9_of_the_active_mid_stream_fails_over_with_nothing_lost(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await pair_factory()
    total = 10_000
    a, b = Consumer(pair, "desk-1", total), Consumer(pair, "desk-2", total)
    async with consuming(a, b):
        await asyncio.wait_for(asyncio.gather(a.sub.connected.wait(), b.sub.connected.wait()), 10)
        publishing = asyncio.create_task(_publish(pair, "feed", total, pace=0.005))
        await until(lambda: _async(len(a.got) > 3000), "delivery to get going")
        pair.active.kill9()
        await publishing
    for c in (a, b):
        c.check({"feed": total})
        assert c.brokers == ["broker-a", "broker-b"]
    role = await _role(pair.standby.address)
    assert role.role == broker_pb2.BROKER_ROLE_ACTIVE
    # The old active comes back on its address and rejoins as standby.
    pair.active.env["SOKUTATSU_BROKER_LISTEN"] = pair.active.address
    pair.active.env["SOKUTATSU_BROKER_PEER"] = pair.standby.address
    pair.active.start()
    assert (await _role(pair.active.address)).role == broker_pb2.BROKER_ROLE_STANDBY

    async def heard() -> bool:
        return (await _role(pair.standby.address)).peer_up and (await _role(pair.active.address)).peer_up

    await until(heard, "the two brokers to hear each other again")
    more = Consumer(pair, "desk-3", 500)
    async with consuming(more):
        await _publish(pair, "feed-2", 500)
    more.check({"feed-2": 500})
    assert more.brokers == ["broker-b"]


async def test_an_active_back_from_kill9_before_any_subscriber_came_leaves_one_active(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """Found by an attacker's review: a bare pair (no monitor); the active is killed and started again
    while no subscriber comes to the standby (the standby promotes itself only when one comes while it
    does not hear its peer). The restarted broker comes back as standby (invariant 2), so both were
    standby for good, each redirecting every subscriber to the other: a durable subscriber got nothing.
    Now the caught-up one of two standbys that hear each other takes the active role (invariant 2): the
    old standby, which holds everything; the subscriber gets what was published, before and after."""
    pair = await pair_factory()
    async with Publisher(pair.addresses, "feed", connect_timeout=1) as pub:
        sub = Subscriber(pair.addresses, "desk", TOPIC, durable=True)
        await sub.start()
        await sub.close()  # a durable subscription, its subscriber away
        await pub.publish(TOPIC, "K", b"before")
        pair.active.kill9()
        pair.active.env["SOKUTATSU_BROKER_LISTEN"] = pair.active.address
        pair.active.start()

        async def one_active() -> bool:
            roles = [(await _role(b.address)).role for b in (pair.active, pair.standby)]
            return roles == [broker_pb2.BROKER_ROLE_STANDBY, broker_pb2.BROKER_ROLE_ACTIVE]

        await until(one_active, "the old standby to take the active role")
        await pub.publish(TOPIC, "K", b"after")
    async with Subscriber(pair.addresses, "desk", TOPIC, durable=True) as sub:
        bodies = [(await asyncio.wait_for(anext(sub), 30)).body for _ in range(2)]
    assert bodies == [b"before", b"after"]


async def _role(address: str) -> broker_pb2.RoleInfo:
    async with open_channel(address, cluster=True) as channel:
        info: broker_pb2.RoleInfo = await broker_pb2_grpc.BrokerControlStub(channel).GetRole(
            broker_pb2.GetRoleRequest(), timeout=10
        )
        return info


async def _async(value: bool) -> bool:
    return value


async def test_a_publish_made_just_after_the_active_died_is_acknowledged_by_the_survivor(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """The survivor first acknowledges as one of two (its peer's silence is still short); once
    the peer counts as down it restates the ack as single-copy, and the publisher goes on."""
    pair = await pair_factory()
    async with Publisher(pair.addresses, "feed", ack_timeout=30) as pub:
        await pub.publish(TOPIC, "K", b"feed:1")
        pair.active.kill9()
        seqs = [pub.publish_nowait(TOPIC, "K", f"feed:{i}".encode()) for i in range(2, 202)]
        await pub.flush()
        assert pub.acked_seq == seqs[-1] == 201
    survivor = await stats(pair.standby.address)
    assert not survivor.peer_up
    assert survivor.published_total == 201
    # It holds everything acknowledged and knew the peer's holdings: caught up, its peer silent or
    # not (a monitor promotes a caught-up standby at once; it said false here and waited 10 s).
    assert survivor.caught_up
    assert survivor.queues_behind == 0


async def test_kill9_of_the_standby_serving_a_caught_up_subscriber_loses_nothing(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """The active keeps a tail for a subscriber it handed to the standby: when the standby dies,
    a subscriber within that tail comes back to the active and misses nothing."""
    pair = await pair_factory()
    total = 8000
    desk = Consumer(pair, "desk", total)
    async with consuming(desk):
        await asyncio.wait_for(desk.sub.connected.wait(), 10)
        publishing = asyncio.create_task(_publish(pair, "feed", total, pace=0.005))
        await until(lambda: _async(len(desk.got) > 1000), "delivery to get going")
        await switch(pair.active, pair.standby, "broker-b", "desk")
        await until(lambda: _async(len(desk.got) > 3000 and desk.sub.broker_id == "broker-b"), "more on the standby")
        pair.standby.kill9()
        await publishing
    desk.check({"feed": total})
    assert desk.brokers == ["broker-a", "broker-b", "broker-a"]


async def test_only_the_standby_spills_for_a_migrated_subscriber(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """A slow subscriber on the standby: its queue there outgrows the budget and goes to disk;
    the active keeps only a bounded tail for it in memory and writes nothing."""
    pair = await pair_factory(away_tail="16KiB")
    total = 6000
    slow = Consumer(pair, "slow", total, budget=32 * 2**10)
    async with consuming(slow):
        await asyncio.wait_for(slow.sub.connected.wait(), 10)
        await switch(pair.active, pair.standby, "broker-b", "slow")
        await until(lambda: _async(slow.sub.broker_id == "broker-b"), "the subscriber to reach the standby")
        slow.delay = 0.005
        await _publish(pair, "feed", total)

        async def spilled() -> bool:
            return (await subscriber_stats(pair.standby.address, "slow")).spilled_count > 0

        await until(spilled, "the standby to spill the slow subscriber's queue")
        away = await subscriber_stats(pair.active.address, "slow")
        assert away.state == broker_pb2.QUEUE_STATE_AWAY
        assert away.spilled_count == 0
        assert away.memory_bytes <= 16 * 2**10
        assert (await stats(pair.active.address)).spilled_count == 0
        slow.delay = 0.0
    slow.check({"feed": total})
    assert slow.brokers == ["broker-b"]


async def _subscriptions(address: str) -> set[str]:
    async with open_channel(address, cluster=True) as channel:
        listed = await broker_pb2_grpc.BrokerAdminStub(channel).ListSubscriptions(
            broker_pb2.ListSubscriptionsRequest(topic=TOPIC), timeout=10
        )
    return {s.subscriber_id for s in listed.subscriptions}


async def _create_on(address: str, subscriber_id: str) -> None:
    spec = Subscriber([address], subscriber_id, TOPIC, durable=True, mode="migrate")._subscription  # the wire message
    async with open_channel(address, cluster=True) as channel:
        await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
            broker_pb2.CreateSubscriptionRequest(subscription=spec), timeout=10
        )


@pytest.mark.parametrize("created_on", ["active", "standby"])
async def test_a_durable_subscription_created_on_one_broker_reaches_the_other(
    pair_factory: Callable[..., Awaitable[Pair]], created_on: str
) -> None:
    """A client's CreateSubscription that reached one broker only: the pair copies it over its
    own link, so the other broker holds it too (as a shadow on the standby)."""
    pair = await pair_factory()
    one, other = (pair.active, pair.standby) if created_on == "active" else (pair.standby, pair.active)
    await _create_on(one.address, "desk")
    await until(lambda: _has(other.address, "desk"), "the subscription to reach the other broker")
    expected = broker_pb2.QUEUE_STATE_SHADOW if other is pair.standby else broker_pb2.QUEUE_STATE_SERVING
    assert (await subscriber_stats(other.address, "desk")).state == expected
    desk = Consumer(pair, "desk", 500)
    async with consuming(desk):
        await _publish(pair, "feed", 500)
    desk.check({"feed": 500})
    assert desk.brokers == ["broker-a"]


async def _has(address: str, subscriber_id: str) -> bool:
    return subscriber_id in await _subscriptions(address)


async def test_a_standby_that_was_down_when_a_subscription_was_made_holds_it_after_rejoining(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """Made while the standby was down, the subscription reaches it when it comes back; once it
    is back, a kill -9 of the active fails the subscriber over to it with nothing lost."""
    pair = await pair_factory()
    pair.standby.kill9()
    desk = Consumer(pair, "desk", 1000)
    async with consuming(desk):
        await asyncio.wait_for(desk.sub.connected.wait(), 10)
        await _publish(pair, "feed", 500)
        await until(lambda: _async(len(desk.got) == 500), "the first 500 before the standby returns")
        pair.standby.env["SOKUTATSU_BROKER_LISTEN"] = pair.standby.address
        pair.standby.start()
        await until(lambda: _has(pair.standby.address, "desk"), "the subscription to reach the rejoined standby")
        assert (await subscriber_stats(pair.standby.address, "desk")).state == broker_pb2.QUEUE_STATE_SHADOW
        # From here the standby holds every message for the subscriber; the active dies mid-stream.
        async with Publisher(pair.addresses, "feed-2", ack_timeout=60) as pub:
            for i in range(250):
                await pub.publish(TOPIC, "K", f"feed-2:{i + 1}".encode())
            pair.active.kill9()
            for i in range(250, 500):
                await pub.publish(TOPIC, "K", f"feed-2:{i + 1}".encode())
    desk.check({"feed": 500, "feed-2": 500})
    assert desk.brokers == ["broker-a", "broker-b"]


async def test_a_subscription_deleted_on_one_broker_is_deleted_on_both_and_not_brought_back(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """DeleteSubscription sent to one broker: the peer deletes its copy from the next frame (invariant 8;
    before, it kept it for good, a shadow on the standby that never expires), and no list of the peer's
    brings it back on the broker the call reached."""
    pair = await pair_factory()
    await _create_on(pair.active.address, "gone")
    await until(lambda: _has(pair.standby.address, "gone"), "the subscription to reach the standby")
    async with open_channel(pair.standby.address, cluster=True) as channel:
        await broker_pb2_grpc.BrokerAdminStub(channel).DeleteSubscription(
            broker_pb2.DeleteSubscriptionRequest(topic=TOPIC, subscriber_id="gone"), timeout=10
        )
    # The active's next list (sent because of this creation) still names "gone".
    await _create_on(pair.active.address, "later")
    await until(lambda: _has(pair.standby.address, "later"), "the next list to reach the standby")

    async def gone_from_the_active() -> bool:
        return not await _has(pair.active.address, "gone")

    await until(gone_from_the_active, "the deletion to reach the active")
    assert await _subscriptions(pair.standby.address) == {"later"}
    assert await _subscriptions(pair.active.address) == {"later"}

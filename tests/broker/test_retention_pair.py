"""Retention and expiry in a pair of real broker processes: what one broker's retention
discarded is discarded on the other too, and an expired subscription goes on both."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import GapError, Publisher, Subscriber
from tests.broker.fix_broker import Pair, stats, subscriber_stats, until
from tests.broker.test_pair import TOPIC, switch

pytestmark = pytest.mark.timeout(180)
RECEIVE_LIMIT_SECONDS = 60.0


async def _publish_kib(pair: Pair, total: int) -> None:
    """``total`` persistent messages of about 1 KiB from publisher ``src``, acknowledged by the pair."""
    async with Publisher(pair.addresses, "src", ack_timeout=60) as pub:
        for i in range(1, total + 1):
            pub.publish_nowait(TOPIC, "K", f"{i:08d}".encode() + b"x" * 1000)
            if i % 50 == 0:
                await pub.flush()
        await pub.flush()


async def _listed(address: str) -> list[str]:
    async with aio.insecure_channel(address) as channel:
        listed = await broker_pb2_grpc.BrokerAdminStub(channel).ListSubscriptions(
            broker_pb2.ListSubscriptionsRequest(topic=TOPIC), timeout=10
        )
    return [s.subscriber_id for s in listed.subscriptions]


async def test_a_subscriber_moved_back_after_drops_is_told_once_and_loses_nothing_else(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """The standby serves a subscriber that stopped reading and discards the oldest of its queue
    (drop_oldest). The active, whose away copy could hold everything (a large tail), discards the
    same messages from the standby's watermarks; moved back to the active, the subscriber is told
    of exactly those, is not sent any of them, and gets every later message once, in order."""
    limit, total = 256 * 1024, 1000
    pair = await pair_factory(queue_budget="32KiB", retention_max_bytes=str(limit), away_tail="16MiB")
    subscriber = Subscriber(pair.addresses, "slow", TOPIC, durable=True, mode="migrate")
    async with subscriber as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
    await switch(pair.active, pair.standby, "broker-b", "slow")
    assert (await subscriber_stats(pair.active.address, "slow")).state == broker_pb2.QUEUE_STATE_AWAY
    await _publish_kib(pair, total)

    async def same_on_both() -> bool:
        served = await subscriber_stats(pair.standby.address, "slow")
        away = await subscriber_stats(pair.active.address, "slow")
        return served.dropped_retention_bytes > 0 and served.depth == away.depth

    await until(same_on_both, "the active's copy to discard what the standby's retention discarded")
    served = await subscriber_stats(pair.standby.address, "slow")
    assert served.disk_bytes <= limit
    dropped = served.dropped_retention_bytes
    assert served.depth + dropped == total
    await switch(pair.standby, pair.active, "broker-a", "slow")
    seqs: list[int] = []
    gaps: list[GapError] = []
    async with Subscriber(pair.addresses, "slow", TOPIC, durable=True, mode="migrate") as sub:
        while len(seqs) < total - dropped:
            try:
                message = await asyncio.wait_for(sub.__anext__(), 30)
            except GapError as gap:
                gaps.append(gap)
                continue
            seqs.append(message.publisher_seq)
        assert sub.broker_id == "broker-a"
    assert [(g.first_missing, g.last_missing, g.reason, g.over_bytes) for g in gaps] == [
        (1, dropped, "retention bytes", dropped)
    ]
    assert seqs == list(range(dropped + 1, total + 1))


async def test_an_expired_subscription_is_deleted_on_both_brokers(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """Nobody attaches to a durable subscription: the broker that serves it expires it and the
    peer, whose copy is a shadow (never attached there either way), deletes it when told."""
    pair = await pair_factory(subscription_expiry="2s")
    spec = Subscriber(pair.addresses, "idle", TOPIC, durable=True)._subscription  # the wire message
    for address in pair.addresses:
        async with aio.insecure_channel(address) as channel:
            await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
                broker_pb2.CreateSubscriptionRequest(subscription=spec), timeout=10
            )
    assert await _listed(pair.standby.address) == ["idle"]

    async def gone_on_both() -> bool:
        return not await _listed(pair.active.address) and not await _listed(pair.standby.address)

    await until(gone_on_both, "the subscription to expire on both brokers", limit=60)
    assert (await stats(pair.active.address)).subscriptions_expired == 1
    assert (await stats(pair.standby.address)).subscriptions_expired == 1
    assert "the peer expired it" in pair.standby.log()


@pytest.mark.parametrize("again_on", ["active", "standby"])
async def test_a_subscription_created_again_on_one_broker_after_it_expired_is_held_by_both(
    pair_factory: Callable[..., Awaitable[Pair]], again_on: str
) -> None:
    """Review of #20: the peer kept an expired subscription's name among those it deleted, so when a
    client created it again and the call reached one broker only, the other never took it from that
    broker's list: a single copy, lost with its broker. Now a whole list without the name clears it."""
    pair = await pair_factory(subscription_expiry="3s")
    spec = Subscriber(pair.addresses, "idle", TOPIC, durable=True)._subscription
    for address in pair.addresses:
        async with aio.insecure_channel(address) as channel:
            await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
                broker_pb2.CreateSubscriptionRequest(subscription=spec), timeout=10
            )

    async def gone_on_both() -> bool:
        return not await _listed(pair.active.address) and not await _listed(pair.standby.address)

    await until(gone_on_both, "the subscription to expire on both brokers", limit=60)
    # A client creates it again; the call reaches one broker only (the one that expired it, or
    # the one that was told to).
    created, other = (pair.active, pair.standby) if again_on == "active" else (pair.standby, pair.active)
    async with aio.insecure_channel(created.address) as channel:
        await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
            broker_pb2.CreateSubscriptionRequest(subscription=spec), timeout=10
        )

    async def on_the_other() -> bool:
        return await _listed(other.address) == ["idle"]

    await until(on_the_other, "the other broker to take the subscription from the list", limit=30)


async def test_a_subscriber_moved_to_a_copy_that_discarded_what_it_already_has_is_told_only_what_it_lost(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    """The soak's stalled subscriber: it takes its first window from the active and processes none
    of it (nothing acknowledged), so the standby's shadow copy keeps those messages too, and its
    retention discards them with the oldest. Moved to the standby, the subscriber resumes after
    what it processed (nothing) and says what it received beyond that (``SubscribeOpen.received``):
    the gap it is told of counts only the messages it did not get. (With the SDK resuming from what
    it processed and no ``received``, the count took in the 10 it held: 868 for 858.)"""
    limit, total, window = 256 * 1024, 1000, 10
    pair = await pair_factory(queue_budget="32KiB", retention_max_bytes=str(limit))
    async with Subscriber(
        pair.addresses, "stalled", TOPIC, durable=True, mode="migrate", flow_limit=window, on_gap="report"
    ) as sub:
        await asyncio.wait_for(sub.connected.wait(), 10)
        assert sub.broker_id == "broker-a"
        await _publish_kib(pair, total)

        async def discarded_its_window() -> bool:
            shadow = await subscriber_stats(pair.standby.address, "stalled")
            return shadow.dropped_retention_bytes > window

        await until(discarded_its_window, "the standby's copy to discard the oldest, the window among them")
        assert sub.position == {}  # nothing processed: the window is only in the SDK's buffer
        await switch(pair.active, pair.standby, "broker-b", "stalled")
        seqs: list[int] = []
        try:
            # Only stops a hung receive, with what it got (a bound on waiting, not a timing check).
            async with asyncio.timeout(RECEIVE_LIMIT_SECONDS):
                async for message in sub:
                    seqs.append(message.publisher_seq)
                    if message.publisher_seq == total:
                        break
        except TimeoutError:
            raise AssertionError(
                f"message {total} never came: got {len(seqs)} (last {seqs[-3:]}) from {sub.broker_id}, gaps {sub.gaps}"
            ) from None
        assert sub.broker_id == "broker-b"
        gaps = [(g.first_missing, g.last_missing, g.reason, g.dropped) for g in sub.gaps]
    assert seqs[:window] == list(range(1, window + 1))
    assert seqs == sorted(set(seqs))
    lost = total - len(seqs)
    assert lost > 0
    # Told of every message it lost, and of none it got: each range counts exactly its messages.
    assert sum(g[3] for g in gaps) == lost, gaps
    assert all(g[2] == "retention bytes" and g[3] == g[1] - g[0] + 1 for g in gaps), gaps

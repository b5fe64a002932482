"""The pair's subscription lists (invariant 8, subscription_lists.py) between two brokers in the test's
process: each frame's list part (``DeliveredWatermarks.subscriptions``, ``expired``) applied as
``pair.receive_watermarks`` applies it, in a fixed order."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sokutatsu.broker.broker import Broker
from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.subscription_lists import DELETE, KEPT, TRIMMED, SubscriptionLists
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.settings import load
from tests.broker.test_restart_claim import _running_disk

IDLE = broker_pb2.Subscription(subscriber_id="idle", topic="prices", durable=True)


def _held(broker: Broker) -> bool:
    topic = broker.topics.get("prices")
    return topic is not None and "idle" in topic.queues


class _Link:
    """One stream from sender to receiver, its list part as ``pair._frames`` sends it: only when the
    sender's ``subscriptions_version`` changed (a new stream's first frame: always), applied as
    ``pair.receive_watermarks`` applies it (expired, then the whole list). ``old`` strips the tags, as a
    broker from before them sends its lists."""

    def __init__(self, sender: Broker, receiver: Broker, *, old: bool = False) -> None:
        self.sender, self.receiver, self.old, self.sent, self.frames = sender, receiver, old, -1, 0

    async def step(self) -> bool:
        version = self.sender.subscriptions_version
        if version == self.sent:
            return False
        expired, subscriptions = self.sender.expired_subscriptions(), self.sender.durable_subscriptions()
        if self.old:
            for name in expired:
                del name.creations[:]
            for subscription in subscriptions:
                del subscription.creations[:]
        self.sent = version
        self.frames += 1
        if expired:
            await self.receiver.apply_expired(expired)
        await self.receiver.adopt_subscriptions(subscriptions, whole=True)
        return True


async def _settle(*links: _Link) -> int:
    """Frames until neither side has a new list; a pair that never goes quiet fails (it once did: each
    broker's list made the other send its own again)."""
    for rounds in range(1, 20):
        if not any([await link.step() for link in links]):
            return rounds
    raise AssertionError("the brokers' lists went back and forth without end")


async def _frame(sender: Broker, receiver: Broker) -> None:
    """The list part of the sender's next frame, applied by the receiver, whatever its version."""
    await _Link(sender, receiver).step()


async def _create(*brokers: Broker) -> None:
    for broker in brokers:
        await broker.create_subscription(broker.subscription_spec(IDLE))


async def _expire_on(broker: Broker) -> None:
    """Nobody attached to it there for the expiry (7 days by default)."""
    broker.queue("prices", "idle").idle_since -= 8 * 86400
    await broker.tick_retention()
    assert not _held(broker)


@asynccontextmanager
async def _pair(tmp_path: Path, *, old_active: bool = False) -> AsyncIterator[tuple[Broker, Broker, _Link, _Link]]:
    """An active and a standby that both hold "idle", created by a client on each (as the SDK does), their
    lists exchanged; and the two links. ``old_active``: the active's lists carry no tags."""
    async with _running_disk() as disk:
        active = Broker(load(BrokerSettings, {"SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / "a")}), disk)
        standby = Broker(
            load(
                BrokerSettings, {"SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / "b"), "SOKUTATSU_BROKER_ROLE": "standby"}
            ),
            disk,
        )
        try:
            for broker in (active, standby):
                await broker.open()
            await _create(active, standby)
            links = _Link(active, standby, old=old_active), _Link(standby, active)
            await _settle(*links)
            yield active, standby, *links
        finally:
            for broker in (active, standby):
                await broker.close()


async def test_a_subscription_created_again_on_the_standby_right_after_the_active_expired_it_gets_both_copies(
    tmp_path: Path,
) -> None:
    """Seen as a flaky failure of test_retention_pair (the [standby] case, 2 of 21 runs of tests/broker with
    -n 4): the standby deleted "idle" as its peer had expired it, and a client created it again there before
    the standby's next frame was built, so the frame's whole list already held it; the active, which kept
    the name as deleted until a list came without it, never took it: one copy."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        await _expire_on(active)
        await to_standby.step()
        assert not _held(standby)
        # A client creates it again on the standby only (the active missed the call) before the standby's
        # next frame is built: the list without the name is never sent.
        await _create(standby)
        await _settle(to_active, to_standby)
        assert _held(active), "the active did not take the subscription created again on its peer"
        assert active.lists.tags(("prices", "idle")) == standby.lists.tags(("prices", "idle"))


async def test_a_stale_list_does_not_bring_back_an_expired_subscription(tmp_path: Path) -> None:
    """The rule the tags keep: the standby's frame built before it heard of the expiry still lists "idle"
    (its copy of the creation the active expired), and the active does not make it again."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        standby.subscriptions_version += 1  # a frame of the standby's is on its way, built before the expiry
        await _expire_on(active)
        await to_active.step()
        assert not _held(active), "a list older than the expiry brought the subscription back"
        await _settle(to_standby, to_active)
        assert not _held(active)
        assert not _held(standby)
        assert active.expired_subscriptions() == [], "the expiry is still sent once the standby applied it"


async def test_a_subscription_created_again_on_both_before_the_standby_heard_of_the_expiry_is_held_by_both(
    tmp_path: Path,
) -> None:
    """The SDK creates on both brokers: the active makes a new one, the standby still holds the old one
    (same settings: its answer is the existing one). The expiry then reaches the standby: it deletes the
    old copy and takes the active's new one from the same frame's list. Before the tags, the active
    dropped the expired name from what it sends when it was created again, so the standby kept the old
    copy with the expired backlog."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        old = standby.queue("prices", "idle")
        await _expire_on(active)
        await _create(active, standby)
        await _settle(to_standby, to_active)
        assert _held(active)
        assert _held(standby)
        assert standby.queue("prices", "idle") is not old, "the standby kept the expired creation"
        assert standby.lists.tags(("prices", "idle")) == active.lists.tags(("prices", "idle"))


async def test_a_deleted_subscription_is_not_brought_back_while_the_peer_still_holds_it(tmp_path: Path) -> None:
    """A DeleteSubscription that reached one broker only: the peer's lists still hold the deleted creation,
    and do not bring it back; a later creation on the peer is adopted."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        await active.delete_subscription("prices", "idle")
        standby.subscriptions_version += 1
        await _settle(to_standby, to_active)
        assert not _held(active)
        await standby.delete_subscription("prices", "idle")
        await _create(standby)
        await _settle(to_standby, to_active)
        assert _held(active)


async def test_an_expiry_takes_the_peer_s_copy_holding_a_creation_deleted_on_one_broker_only(tmp_path: Path) -> None:
    """A DeleteSubscription reached the active only; the SDK then created it again on both, so the standby's
    copy holds the old creations and the new one. When the active expires it, the expiry names the old
    creations too (its tombstone): the standby's copy goes. Before (the review of the tags), the expiry named
    the new creation only, the standby kept its copy with the old ones, which the active never took back:
    the expired subscription and its backlog stayed on the standby, where a shadow never expires."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        await active.delete_subscription("prices", "idle")
        await _settle(to_standby, to_active)
        await _create(active, standby)
        await _settle(to_standby, to_active)
        assert _held(active)
        assert _held(standby)
        await _expire_on(active)
        await _settle(to_standby, to_active)
        assert not _held(standby), "the standby kept the subscription its peer expired"
        assert not _held(active)


async def test_an_expiry_from_a_broker_before_the_tags_deletes_by_name(tmp_path: Path) -> None:
    """During an upgrade the active may be a broker from before the tags: its lists and expiries carry
    none. The standby's copy, created here with a tag and holding the active's legacy one too, goes on its
    expiry, by name, as the old rule did (the review found it kept: the active never took it back)."""
    async with _pair(tmp_path, old_active=True) as (active, standby, to_standby, to_active):
        assert "" in standby.lists.tags(("prices", "idle"))
        await _expire_on(active)
        await _settle(to_standby, to_active)
        assert not _held(standby), "the standby kept the subscription its old peer expired"


async def test_the_lists_go_quiet_after_expiries_on_both_brokers(tmp_path: Path) -> None:
    """The review's schedule: the active expires "idle" and the SDK creates it again on both; after a
    failover the other broker expires "other" and it is created again too. Each broker's list then made the
    other bump its version (an expiry it had heard before counted as a change), and they went back and
    forth without end (100 list frames in 50 rounds). _settle fails on that."""
    other = broker_pb2.Subscription(subscriber_id="other", topic="prices", durable=True)
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        for broker in (active, standby):
            await broker.create_subscription(broker.subscription_spec(other))
        await _settle(to_standby, to_active)
        await _expire_on(active)
        await _create(active, standby)
        await _settle(to_standby, to_active)
        standby.take_over(standby.queue("prices", "other"), "failover")
        standby.queue("prices", "other").idle_since -= 8 * 86400
        await standby.tick_retention()
        await _settle(to_standby, to_active)
        for broker in (active, standby):
            await broker.create_subscription(broker.subscription_spec(other))
        await _settle(to_standby, to_active)
        frames = to_standby.frames + to_active.frames
        await active.create_subscription(
            active.subscription_spec(broker_pb2.Subscription(subscriber_id="third", topic="prices", durable=True))
        )
        await _settle(to_standby, to_active)
        assert to_standby.frames + to_active.frames - frames <= 2, "one creation set off more than its own list"
        for broker in (active, standby):
            assert {"idle", "other", "third"} <= set(broker.topics["prices"].queues)


async def test_the_holdings_of_a_subscription_made_again_here_are_taken(tmp_path: Path) -> None:
    """A DeleteSubscription reached the active only, and the SDK created the subscription again on both;
    after a switchover the standby serves it and the active keeps an away copy. The standby's holdings
    name it: the active takes them and leaves its copy away. The review found the tombstone (which
    outlives the creation here, unlike the old name) kept them out: the active then served the subscriber
    its peer served ("the peer does not hold it")."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        await active.delete_subscription("prices", "idle")
        await _settle(to_standby, to_active)
        await _create(active, standby)
        await _settle(to_standby, to_active)
        standby.queue("prices", "idle").serve()
        away = active.queue("prices", "idle")
        away.hand_over(keep_tail=True)
        active.apply_holdings(standby.holdings())
        assert away.state == broker_pb2.QUEUE_STATE_AWAY, "the active serves the subscriber its peer serves"


async def test_creation_tags_survive_a_restart_and_a_catalog_without_them_reads_as_legacy(tmp_path: Path) -> None:
    async with _pair(tmp_path) as (active, *_):
        tags = active.lists.tags(("prices", "idle"))
        assert len(tags) == 2  # each broker's creation, merged from the other's list
    async with _running_disk() as disk:
        again = Broker(load(BrokerSettings, {"SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / "a")}), disk)
        await again.open()
        try:
            assert again.lists.tags(("prices", "idle")) == tags
        finally:
            await again.close()
    catalog = tmp_path / "a" / "catalog.json"
    data = json.loads(catalog.read_text())
    for sub in data["subscriptions"]:
        del sub["creations"]
    catalog.write_text(json.dumps(data))
    async with _running_disk() as disk:
        legacy = Broker(load(BrokerSettings, {"SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / "a")}), disk)
        await legacy.open()
        try:
            assert legacy.lists.tags(("prices", "idle")) == []
            assert [list(s.creations) for s in legacy.durable_subscriptions()] == [[]]
        finally:
            await legacy.close()


def test_legacy_copies_keep_the_old_rule_and_mixed_tags_go_out_whole() -> None:
    """A peer's entry without tags is the legacy creation: tombstoned here, it is kept out until a whole
    list comes without it, as before the tags. A legacy copy that learned a tagged creation sends both."""
    name = ("prices", "idle")
    lists = SubscriptionLists()
    lists.hold(name, [""])
    lists.remove(name)
    assert lists.peer_list({name: frozenset({""})}, whole=True) == ({}, False)
    assert lists.tombstoned(name)
    assert lists.peer_list({}, whole=True) == ({}, False)
    assert not lists.tombstoned(name)
    assert lists.peer_list({name: frozenset({""})}, whole=True) == ({name: frozenset({""})}, False)
    mixed = SubscriptionLists()
    mixed.hold(name, [""])
    assert mixed.peer_list({name: frozenset({"abc"})}, whole=True) == ({}, True)
    assert mixed.tags(name) == ["", "abc"]
    # The peer expired only the tagged creation: the legacy one stays here.
    assert mixed.peer_expired(name, ["abc"]) == TRIMMED
    assert mixed.tags(name) == []
    assert mixed.peer_expired(name, ["abc"]) == KEPT  # heard before: nothing changes
    assert mixed.peer_expired(name, []) == DELETE  # from a broker before the tags: by name


async def _restarted(broker: Broker, state: Path) -> Broker:
    """The same broker's state folder opened again (a restart after a crash: nothing closed)."""
    again = Broker(
        load(BrokerSettings, {"SOKUTATSU_BROKER_STATE_DIR": str(state), "SOKUTATSU_BROKER_ROLE": "standby"}),
        broker.disk,
    )
    await again.open()
    return again


async def test_a_broker_restarted_before_its_peer_heard_of_an_expiry_still_sends_it_and_keeps_the_tombstone(
    tmp_path: Path,
) -> None:
    """The active expires "idle" and is killed before its next frame. Restarted, it must neither take the
    old copy back from the standby's list (its first frame) nor leave the standby's copy of the expired
    subscription in place: the catalog records the tombstone and the expiry to send."""
    async with _pair(tmp_path) as (active, standby, *_):
        await _expire_on(active)
        again = await _restarted(active, tmp_path / "a")
        try:
            await _frame(standby, again)
            assert not _held(again), "the restarted broker took back the copy it had expired"
            await _frame(again, standby)
            assert not _held(standby), "the standby kept the copy its peer had expired before restarting"
            await _frame(standby, again)
            assert not again.lists.tombstoned(("prices", "idle"))
            assert again.expired_subscriptions() == []
        finally:
            await again.close()

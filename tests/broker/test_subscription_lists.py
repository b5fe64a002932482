"""The pair's subscription lists (invariant 8, subscription_lists.py) between two brokers in the test's
process: each frame's list part (``DeliveredWatermarks.subscriptions``, ``expired``) applied as
``pair.receive_watermarks`` applies it, in a fixed order."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from sokutatsu.broker import pair
from sokutatsu.broker.broker import Broker
from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.subscription import SubscriptionSpec
from sokutatsu.broker.subscription_lists import DELETE, KEPT, RENEWED, TRIMMED, SubscriptionLists
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.errors import FailedPrecondition, Unavailable
from sokutatsu.core.settings import load
from tests.broker.test_restart_claim import _running_disk

IDLE = broker_pb2.Subscription(subscriber_id="idle", topic="prices", durable=True)


def _held(broker: Broker) -> bool:
    topic = broker.topics.get("prices")
    return topic is not None and "idle" in topic.queues


ADDRESSES = {"a": "127.0.0.1:7101", "b": "127.0.0.1:7102"}


def _settings(tmp_path: Path, me: str, role: str, **more: str) -> BrokerSettings:
    """broker ``me`` ("a" or "b") with its state under ``tmp_path/me``, its peer the other."""
    other = "b" if me == "a" else "a"
    return load(
        BrokerSettings,
        {
            "SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / me),
            "SOKUTATSU_BROKER_INSTANCE": f"broker-{me}",
            "SOKUTATSU_BROKER_ROLE": role,
            "SOKUTATSU_BROKER_PEER": ADDRESSES[other],
            **{f"SOKUTATSU_BROKER_{key.upper()}": value for key, value in more.items()},
        },
    )


@pytest.fixture(autouse=True)
def _a_frame_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """pair._frames yields a keep-alive whenever nothing else is due: with no keep-alive interval each
    call gives a frame (the frames' contents are the real ones; only when they go is the test's)."""
    monkeypatch.setattr(pair, "KEEPALIVE_SECONDS", 0.0)


class _Link:
    """One stream from sender to receiver: frames built by the real ``pair._frames``, each applied by the
    real ``pair.apply_frame`` when delivered, in order. ``build`` gives the frame's delivery, to run later
    (a frame in flight); ``step`` builds and delivers at once. ``old`` makes the sender a broker from
    before the creation tags: its frames lose what such a broker does not send."""

    def __init__(self, sender: Broker, receiver: Broker, *, old: bool = False) -> None:
        self.sender, self.receiver, self.old, self.frames = sender, receiver, old, 0
        self._stream = pair._frames(sender, ADDRESSES[sender.settings.instance[-1]], 0.0, sender.pair.link_address)
        receiver.peer_version_applied = 0  # a new stream (pair.receive_watermarks)

    async def build(self) -> tuple[bool, Callable[[], Awaitable[None]]]:
        """The sender's next frame (whether it carries a list, and its delivery)."""
        built = await anext(self._stream)
        frame = broker_pb2.DeliveredWatermarks.FromString(built.SerializeToString())  # as the wire gives it
        if self.old:
            frame.creation_tags = False
            frame.subscriptions_applied = frame.subscriptions_version = 0
            del frame.deleted[:]
            for entry in [*frame.subscriptions]:
                del entry.creations[:]
            for name in frame.expired:
                del name.creations[:]
            for held in frame.holdings:
                del held.creations[:]
        listed = frame.subscriptions_included
        self.frames += listed

        async def deliver() -> None:
            await pair.apply_frame(self.receiver, frame)

        return listed, deliver

    async def step(self) -> bool:
        """Build and deliver a frame: whether it carried a list."""
        listed, deliver = await self.build()
        await deliver()
        return listed

    async def close(self) -> None:
        await self._stream.aclose()


async def _settle(*links: _Link) -> int:
    """Frames until neither side has a new list; a pair that never goes quiet fails (it once did: each
    broker's list made the other send its own again)."""
    for rounds in range(1, 20):
        if not any([await link.step() for link in links]):
            return rounds
    raise AssertionError("the brokers' lists went back and forth without end")


async def _create(*brokers: Broker) -> None:
    for broker in brokers:
        await broker.create_subscription(broker.subscription_spec(IDLE))


async def _expire_on(broker: Broker) -> None:
    """Nobody attached to it there for the expiry (7 days by default)."""
    broker.queue("prices", "idle").idle_since -= 8 * 86400
    await broker.tick_retention()
    assert not _held(broker)


@asynccontextmanager
async def _pair(
    tmp_path: Path, *, old_active: bool = False, **more: str
) -> AsyncIterator[tuple[Broker, Broker, _Link, _Link]]:
    """An active and a standby that both hold "idle", created by a client on each (as the SDK does), their
    lists exchanged; and the two links. ``old_active``: the active is a broker from before the tags."""
    async with _running_disk() as disk:
        active = Broker(_settings(tmp_path, "a", "active", **more), disk)
        standby = Broker(_settings(tmp_path, "b", "standby", **more), disk)
        links: tuple[_Link, ...] = ()
        try:
            for broker in (active, standby):
                await broker.open()
            await _create(active, standby)
            links = _Link(active, standby, old=old_active), _Link(standby, active)
            await _settle(*links)
            yield active, standby, *links
        finally:
            for link in links:
                await link.close()
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


async def test_a_deletion_on_one_broker_deletes_the_peer_s_copy_and_a_stale_list_does_not_bring_it_back(
    tmp_path: Path,
) -> None:
    """A DeleteSubscription that reached one broker only: the peer deletes its copy from the next frame
    (before the second review, deletions were not sent, and the peer kept its copy, a shadow that never
    expires, until a client deleted it there too); a list of the peer's built before that frame came does
    not bring it back; a later creation on the peer is taken."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        await active.delete_subscription("prices", "idle")
        standby.subscriptions_version += 1  # a frame of the standby's is on its way, built before the deletion
        await to_active.step()
        assert not _held(active), "a list older than the deletion brought the subscription back"
        await _settle(to_standby, to_active)
        assert not _held(standby), "the standby kept the subscription deleted on its peer"
        assert not _held(active)
        await _create(standby)
        await _settle(to_standby, to_active)
        assert _held(active)


async def test_a_subscription_created_and_deleted_on_both_while_lists_are_in_flight_stays_deleted(
    tmp_path: Path,
) -> None:
    """The second review's first schedule: a client creates "fresh" on both brokers and deletes it on both
    while each broker's list naming its own creation is on its way. Each broker takes the other's creation
    from that list (its deletion never saw it); before deletions were sent, that copy stayed for good."""
    fresh = broker_pb2.Subscription(subscriber_id="fresh", topic="prices", durable=True)
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        for broker in (active, standby):
            await broker.create_subscription(broker.subscription_spec(fresh))
        (_, to_b), (_, to_a) = await to_standby.build(), await to_active.build()
        for broker in (active, standby):
            await broker.delete_subscription("prices", "fresh")
        await to_b()
        await to_a()
        await _settle(to_standby, to_active)
        for broker in (active, standby):
            assert "fresh" not in broker.topics["prices"].queues, broker.settings.instance


async def test_tags_stay_few_through_one_sided_deletions_and_creations(tmp_path: Path) -> None:
    """The second review's third schedule, fifty times: a DeleteSubscription reaches the active only, then
    the SDK creates the subscription on both. Before deletions were sent, the standby's copy gathered a tag
    per round (52 after 50), and the active's tombstone as many, in every list, catalog and expiry."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        for _ in range(50):
            await active.delete_subscription("prices", "idle")
            await _settle(to_standby, to_active)
            await _create(active, standby)
            await _settle(to_standby, to_active)
        for broker in (active, standby):
            assert _held(broker)
            assert len(broker.lists.tags(("prices", "idle"))) <= 2, broker.lists.tags(("prices", "idle"))
            assert len(broker.lists.tombstones()) <= 1, broker.lists.tombstones()


async def test_an_expiry_that_finds_a_subscriber_attached_on_the_peer_leaves_both_copies(tmp_path: Path) -> None:
    """The second review's second schedule: the active expires "idle" and is killed before its next frame;
    the standby, promoted, serves the subscriber; the active restarts and sends the expiry its catalog
    kept. The standby's copy, in use, stays under a new tag, which the restarted broker takes: two
    copies, and a later expiry of the old creation deletes nothing. Before, the standby skipped the expiry,
    the restarted broker kept its tombstone and never took the copy back: one copy, and the next time the
    subscriber disconnected the standby deleted the subscription in use."""
    async with _pair(tmp_path) as (active, standby, _to_standby, _to_active):
        await _expire_on(active)
        again = await _restarted(active, tmp_path)
        links: tuple[_Link, ...] = ()
        try:
            standby.take_over(standby.queue("prices", "idle"), "failover")
            queue, _ = await standby.attach(broker_pb2.SubscribeOpen(subscription=IDLE, credits=10))
            assert queue.attached
            links = _Link(again, standby), _Link(standby, again)
            await _settle(*links)
            assert _held(standby), "the standby deleted the subscription its subscriber is attached to"
            assert _held(again), "the restarted broker did not take back the copy in use on its peer"
            standby.detach(queue)
            again.lists_resend += 1  # its list again, with the old expiry
            await _settle(*links)
            assert _held(standby)
            assert _held(again)
        finally:
            for link in links:
                await link.close()
            await again.close()


async def test_a_peer_before_the_tags_is_sent_no_expiry_of_a_subscription_created_again_here(
    tmp_path: Path,
) -> None:
    """The second review's fourth schedule, on the sender's side: a broker from before the tags deletes by
    name, so an expiry of "idle" sent after a client created it again here would delete the new one there,
    and keep it out for good. Such a peer is sent no expiry of a name held here (the old behaviour); once
    the peer says it understands tags, the list goes again, with the expiry."""
    async with _pair(tmp_path) as (active, _standby, *_):
        await _expire_on(active)
        await _create(active)
        active.note_peer_tags(False)
        assert active.expired_subscriptions() == []
        resend = active.lists_resend
        active.note_peer_tags(True)
        assert active.lists_resend != resend
        assert [n.subscriber_id for n in active.expired_subscriptions()] == ["idle"]


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
    list comes without it (built after the peer heard of the deletion), as before the tags. A legacy copy
    that learned a tagged creation sends both."""
    name = ("prices", "idle")
    lists = SubscriptionLists()
    lists.hold(name, [""])
    lists.remove(name)
    assert lists.peer_list({}, whole=True, applied=2**62) == ({}, False)
    assert lists.tombstoned(name), "a tombstone no catalog write carried yet was forgotten"
    lists.stamp(7)
    assert lists.peer_list({name: frozenset({""})}, whole=True, applied=7) == ({}, False)
    assert lists.tombstoned(name)
    assert lists.peer_list({}, whole=True, applied=6) == ({}, False)
    assert lists.tombstoned(name), "a list built before the peer heard of the deletion forgot its tombstone"
    assert lists.peer_list({}, whole=True, applied=7) == ({}, False)
    assert not lists.tombstoned(name)
    assert lists.peer_list({name: frozenset({""})}, whole=True, applied=7) == ({name: frozenset({""})}, False)
    mixed = SubscriptionLists()
    mixed.hold(name, [""])
    assert mixed.peer_list({name: frozenset({"abc"})}, whole=True, applied=0) == ({}, True)
    assert mixed.tags(name) == ["", "abc"]
    # The peer expired only the tagged creation: the legacy one stays here.
    assert mixed.peer_removed(name, ["abc"], in_use=False) == TRIMMED
    assert mixed.tags(name) == []
    assert mixed.peer_removed(name, ["abc"], in_use=False) == KEPT  # heard before: nothing changes
    assert mixed.peer_removed(name, [], in_use=True) == KEPT  # by name: not a copy in use
    assert mixed.peer_removed(name, [], in_use=False) == DELETE  # a broker before the tags: by name
    used = SubscriptionLists()
    used.hold(name, ["abc"])
    assert used.peer_removed(name, ["abc"], in_use=True) == RENEWED
    assert used.tags(name) not in ([], ["abc"])


async def _restarted(broker: Broker, tmp_path: Path) -> Broker:
    """The same broker's state folder opened again (a restart after a crash: nothing closed); a restarted
    broker comes back as standby (pair_state.py, invariant 2)."""
    again = Broker(_settings(tmp_path, broker.settings.instance[-1], "standby"), broker.disk)
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
        again = await _restarted(active, tmp_path)
        to_again, from_again = _Link(standby, again), _Link(again, standby)
        try:
            await to_again.step()
            assert not _held(again), "the restarted broker took back the copy it had expired"
            await from_again.step()
            assert not _held(standby), "the standby kept the copy its peer had expired before restarting"
            await _settle(to_again, from_again)
            assert not again.lists.tombstoned(("prices", "idle"))
            assert again.expired_subscriptions() == []
        finally:
            for link in (to_again, from_again):
                await link.close()
            await again.close()


NAMES = ("n0", "n1", "n2")


class _Schedule:
    """Two brokers, and per direction the frames built and not yet applied (a stream keeps their order):
    a random schedule of creations, deletions and expiries on one broker or both, frames built and
    delivered, and crashes (the stream's frames lost, the broker opened again on its state)."""

    def __init__(self, brokers: list[Broker], seed: int, tmp_path: Path) -> None:
        self.brokers = brokers
        self.random = random.Random(seed)  # noqa: S311 - a reproducible schedule, not a secret
        self.tmp_path = tmp_path
        self.crashed: list[Broker] = []
        self.links = [_Link(brokers[0], brokers[1]), _Link(brokers[1], brokers[0])]
        self.closed: list[_Link] = []
        self.flight: list[list[Callable[[], Awaitable[None]]]] = [[], []]
        # The last operation on each name made on both brokers, while no one-sided one came after it.
        self.last_on_both: dict[str, str] = {}

    def _spec(self, broker: Broker, name: str) -> SubscriptionSpec:
        return broker.subscription_spec(broker_pb2.Subscription(subscriber_id=name, topic="prices", durable=True))

    async def step(self) -> None:
        roll = self.random.random()
        name = self.random.choice(NAMES)
        which = self.random.choice(["a", "b", "both"])
        on = [self.brokers[i] for i in ((0,) if which == "a" else (1,) if which == "b" else (0, 1))]
        if roll < 0.2:
            for broker in on:
                await broker.create_subscription(self._spec(broker, name))
            self._note(name, which, "create")
        elif roll < 0.35:
            for broker in on:
                if name in broker.topics.get("prices", _NO_TOPIC).queues:
                    await broker.delete_subscription("prices", name)
            self._note(name, which, "delete")
        elif roll < 0.42:
            broker = self.random.choice(self.brokers)
            queue = broker.topics.get("prices", _NO_TOPIC).queues.get(name)
            if queue is not None and queue.state == broker_pb2.QUEUE_STATE_SERVING:
                queue.idle_since -= 8 * 86400
                await broker.tick_retention()
                self._note(name, "one", "expire")  # a creation the expiring copy never saw stays (add wins)
        elif roll < 0.7:
            direction = self.random.randrange(2)
            _, deliver = await self.links[direction].build()
            self.flight[direction].append(deliver)
        elif roll < 0.97:
            direction = self.random.randrange(2)
            if self.flight[direction]:
                await self.flight[direction].pop(0)()
        else:
            await self.crash(self.random.randrange(2))

    def _note(self, name: str, which: str, operation: str) -> None:
        if which == "both":
            self.last_on_both[name] = operation
        else:
            self.last_on_both.pop(name, None)

    async def crash(self, index: int) -> None:
        """kill -9 and start again: its streams' frames are lost, both streams begin with whole lists."""
        old = self.brokers[index]
        self.crashed.append(old)
        self.brokers[index] = await _restarted(old, self.tmp_path)
        self.closed.extend(self.links)
        self.links = [_Link(self.brokers[0], self.brokers[1]), _Link(self.brokers[1], self.brokers[0])]
        self.flight = [[], []]

    async def settle(self) -> None:
        for direction in (0, 1):
            for frame in self.flight[direction]:
                await frame()
        self.flight = [[], []]
        await _settle(*self.links)


_NO_TOPIC = SimpleNamespace(queues={})


@pytest.mark.parametrize("seed", range(60))
async def test_random_schedules_leave_both_brokers_holding_the_same_subscriptions(tmp_path: Path, seed: int) -> None:
    """Invariant 8 under random schedules (the second review's fuzz, kept): once the frames are through,
    the lists go quiet, each subscription is held by both brokers or by neither, a subscription last
    created on both is held, and one last deleted on both is not."""
    async with _running_disk() as disk:
        brokers = [Broker(_settings(tmp_path, "a", "active"), disk), Broker(_settings(tmp_path, "b", "standby"), disk)]
        for broker in brokers:
            await broker.open()
        schedule = _Schedule(brokers, seed, tmp_path)
        try:
            for _ in range(40):
                await schedule.step()
            await schedule.settle()
            held = [set(b.topics.get("prices", _NO_TOPIC).queues) for b in schedule.brokers]
            assert held[0] == held[1], f"seed {seed}: the brokers hold {held[0]} and {held[1]}"
            for name, operation in schedule.last_on_both.items():
                assert (name in held[0]) == (operation == "create"), f"seed {seed}: {name} last {operation}d"
        finally:
            for link in [*schedule.links, *schedule.closed]:
                await link.close()
            for broker in [*schedule.brokers, *schedule.crashed]:
                await broker.close()


async def _publish(broker: Broker, first: int, count: int, topic: str = "prices") -> None:
    """Messages ``first``.. of publisher "p" on ``topic`` (the SDK sends each to both brokers)."""
    messages = [
        broker_pb2.Message(publisher_id="p", publisher_seq=seq, key="K", body=b"x", persistent=True)
        for seq in range(first, first + count)
    ]
    await broker.publish("p", broker.publisher("p"), broker_pb2.PublishBatch(topic=topic, messages=messages))


async def test_a_copy_taken_back_after_a_deletion_knows_what_it_lacks(tmp_path: Path) -> None:
    """The third review's first schedule: the subscriber is attached on the active, which holds messages
    1-3 for it; a client's DeleteSubscription reaches the standby. The active keeps its copy under a new
    tag, and the standby takes it back: with the active's holdings, so that its new copy says it lacks
    1-3. Before, it took it back empty, counted itself caught up, and a failover then lost 1-3 without a
    gap."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        attached, _ = await active.attach(broker_pb2.SubscribeOpen(subscription=IDLE, credits=1))
        try:
            for broker in (active, standby):
                await _publish(broker, 1, 3)
            await _settle(to_standby, to_active)
            await standby.delete_subscription("prices", "idle")
            await _settle(to_standby, to_active)
            for _ in range(2):  # the holdings go with a frame of their own when nothing else changes
                await to_standby.step()
            assert _held(standby), "the standby did not take back the copy in use on its peer"
            copy = standby.queue("prices", "idle")
            assert copy.lacks.get("p", 0) >= 3 or copy.behind, f"lacks {copy.lacks}: it claims 1-3"
        finally:
            active.detach(attached)


async def test_a_copy_the_peer_serves_the_subscriber_from_is_not_deleted_here(tmp_path: Path) -> None:
    """The third review's second schedule: after a switchover the standby serves the subscriber and the
    active's copy is away. A DeleteSubscription there would leave the peer's copy (in use) and the active
    would take it back as a copy of its own, serving beside the peer: it is refused, and says where to
    delete it."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        await standby.accept(IDLE, {})
        await active.release("prices", "idle")
        assert active.queue("prices", "idle").state == broker_pb2.QUEUE_STATE_AWAY
        with pytest.raises(FailedPrecondition, match="served by the peer broker"):
            await active.delete_subscription("prices", "idle")
        await _settle(to_standby, to_active)
        assert _held(active)
        assert _held(standby)


async def test_the_peer_hears_a_deletion_only_once_it_is_on_disk(tmp_path: Path) -> None:
    """The third review's third schedule: a deletion sent before its catalog write ended, applied and
    acknowledged by the peer, was undone by a crash here before the write ended: the subscription came
    back from the old catalog, and the peer, tombstoned, never took it again (one copy). The disk is held
    here while the deletion's write waits: the frames built meanwhile still list the subscription."""
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        hold = asyncio.Event()

        async def held_disk() -> None:
            await hold.wait()

        active.disk.submit(held_disk)
        deleting = asyncio.create_task(active.delete_subscription("prices", "idle"))
        try:
            await asyncio.sleep(0)
            assert not _held(active)
            _, deliver = await to_standby.build()
            await deliver()
            assert _held(standby), "the standby heard of a deletion not yet on disk"
        finally:
            hold.set()
            await deleting
        await _settle(to_standby, to_active)
        assert not _held(standby)


async def test_a_peer_before_the_tags_can_create_again_what_both_deleted(tmp_path: Path) -> None:
    """The third review's fourth schedule (first part): with a peer from before the tags, which
    acknowledges nothing, a tombstone here went only on an acknowledgement, so never: deleted on both,
    then created again on that peer, the subscription stayed there alone. Its whole lists now count as
    acknowledging everything (the old rule)."""
    async with _pair(tmp_path, old_active=True) as (active, standby, to_standby, to_active):
        for broker in (active, standby):
            await broker.delete_subscription("prices", "idle")
        await _settle(to_standby, to_active)
        await _create(active)
        await _settle(to_standby, to_active)
        assert _held(standby), "the standby never took the subscription its old peer created again"


async def test_a_frame_without_a_list_does_not_say_what_the_peer_understands(tmp_path: Path) -> None:
    """The third review's fifth finding: fill frames did not set creation_tags, so each one made the
    broker take its peer for one from before the tags (expiries held back, the list sent again)."""
    async with _pair(tmp_path) as (active, _standby, *_):
        assert active.peer_creation_tags
        resend = active.lists_resend
        await pair.apply_frame(
            active, broker_pb2.DeliveredWatermarks(broker_id="broker-b", role=broker_pb2.BROKER_ROLE_STANDBY)
        )
        assert active.peer_creation_tags
        assert active.lists_resend == resend


async def test_a_write_whose_caller_was_cancelled_still_reaches_the_peer(tmp_path: Path) -> None:
    """The fourth review's first schedule: a CreateSubscription cut off by its deadline while its catalog
    write waited on the disk thread. The write went on, but the peer was told only after the caller's
    await, which never came back: the subscription was on disk here and never reached the peer."""
    fresh = broker_pb2.Subscription(subscriber_id="fresh", topic="prices", durable=True)
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        creating = asyncio.create_task(active.create_subscription(active.subscription_spec(fresh)))
        await asyncio.sleep(0)
        creating.cancel()
        await asyncio.gather(creating, return_exceptions=True)
        await active.disk.call(lambda: None)  # the disk thread ran the write queued before
        await _settle(to_standby, to_active)
        assert "fresh" in standby.topics["prices"].queues, "the peer never heard of a creation written here"


async def test_a_failed_write_is_written_again_and_then_reaches_the_peer(tmp_path: Path) -> None:
    """The fourth review's second schedule: a creation whose catalog write failed (here, a folder where
    the write's temporary file goes) left the queue here, neither on disk nor told to the peer, and a
    client's retry answered OK without writing. The broker writes it again, about once a second, and
    at a client's retry."""
    fresh = broker_pb2.Subscription(subscriber_id="fresh", topic="prices", durable=True)
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        blocker = tmp_path / "a" / "catalog.tmp"
        blocker.mkdir()
        with pytest.raises(IsADirectoryError):
            await active.create_subscription(active.subscription_spec(fresh))
        await _settle(to_standby, to_active)
        assert "fresh" not in standby.topics["prices"].queues
        assert active.catalog_dirty
        blocker.rmdir()
        await active.tick_retention()
        assert not active.catalog_dirty
        await _settle(to_standby, to_active)
        assert "fresh" in standby.topics["prices"].queues, "the peer never heard of the creation written again"


async def test_an_away_copy_may_be_deleted_once_the_peer_is_not_heard(tmp_path: Path) -> None:
    """The fourth review's fifth finding: refused for as long as the copy stays away, the deletion of a
    subscription whose peer is gone for good was impossible (an away copy never expires). With the peer
    not heard for its timeout, it goes ahead."""
    async with _pair(tmp_path, peer_timeout_ms="50") as (active, standby, *_):
        await standby.accept(IDLE, {})
        await active.release("prices", "idle")
        await asyncio.sleep(0.2)  # the standby is not heard from for its timeout (gone)
        assert not active.peer_up
        await active.delete_subscription("prices", "idle")
        assert not _held(active)


@pytest.mark.parametrize("before_holdings", [False, True])
async def test_a_publisher_resuming_after_a_hole_leaves_other_topics_copies_caught_up(
    tmp_path: Path, before_holdings: bool
) -> None:
    """Found by the subscription churn of `sokutatsu chaos` (seed 476376): a publisher that continued on a
    restarted broker after a range its peer acknowledged alone made every queue of every topic lack that
    range, also those of a topic it never publishes to, whose subscribers never acknowledge it: they
    stayed behind for good (caught_up false, the harness's wait for a caught-up pair timed out, and a
    switchover to them would wait at step 2; every failover waited FAILOVER_BEHIND_AFTER_SECONDS). A copy
    lacks at most what the peer's holdings say it put in its own copy, marked once they are in (also when
    the publisher resumed first, as in that seed)."""
    quiet = broker_pb2.Subscription(subscriber_id="quiet", topic="other", durable=True)
    async with _pair(tmp_path) as (active, standby, to_standby, to_active):
        for broker in (active, standby):
            await broker.create_subscription(broker.subscription_spec(quiet))
            await _publish(broker, 1, 3)
        await _settle(to_standby, to_active)
        await _publish(standby, 4, 3)  # acknowledged by the standby alone while the active was down
        again = await _restarted(active, tmp_path)
        links = _Link(again, standby), _Link(standby, again)
        try:
            if not before_holdings:
                for _ in range(3):
                    for link in links:
                        await link.step()
                assert again.pair.synced
            again.resume_publisher("p", again.publisher("p"), 7)  # PublishOpen.first_unacked_seq
            for _ in range(3):
                for link in links:
                    await link.step()
            assert not again.queue("other", "quiet").behind, "a copy of a topic p never sends to lacks p's hole"
            assert again.queue("prices", "idle").lacks.get("p") == 6, "the copy does not lack what the peer holds"
        finally:
            for link in links:
                await link.close()
            await again.close()


@asynccontextmanager
async def _acknowledged_through_3(active: Broker, standby: Broker, *links: _Link) -> AsyncIterator[None]:
    """A subscriber attached to "idle" on the active has acknowledged p's 1-3, which both brokers hold."""
    attached, _ = await active.attach(broker_pb2.SubscribeOpen(subscription=IDLE, credits=10))
    try:
        for broker in (active, standby):
            await _publish(broker, 1, 3)
        attached.ack({"p": 3})
        await _settle(*links)
        yield
    finally:
        active.detach(attached)


async def test_a_hole_not_yet_bounded_keeps_the_broker_from_being_caught_up(tmp_path: Path) -> None:
    """The fifth review's second schedule: the standby stops hearing the active, which acknowledges 4-6
    alone; the publisher resumes on the standby at 7. Its hole waits for holdings the active takes while it
    hears the standby; meanwhile the standby is not caught up (the monitor waits for the active) and takes
    no subscriber over. Before, it counted itself caught up, and a switchover to it passed at {p: 3}."""
    async with (
        _pair(tmp_path, peer_timeout_ms="50") as (active, standby, to_standby, to_active),
        _acknowledged_through_3(active, standby, to_standby, to_active),
    ):
        await asyncio.sleep(0.2)  # the standby no longer hears the active
        await _publish(active, 4, 3)  # acknowledged alone
        standby.resume_publisher("p", standby.publisher("p"), 7)
        assert not standby.caught_up, "a standby with a hole it cannot bound yet counted itself caught up"
        with pytest.raises(Unavailable):
            await standby.accept(IDLE, {"p": 3})


async def test_a_hole_is_bounded_by_holdings_the_peer_took_while_it_heard_this_broker(tmp_path: Path) -> None:
    """The fifth review's first schedule: after a cut both ways, the standby hears the active's frames of
    its old session first (the active does not hear it yet, and acknowledged 4-6 alone), so it counted
    itself synced on old holdings (p: 3). The publisher resumes on it at 7: the hole was bounded by 3 and
    forgotten, and the active's next holdings (p: 6) were skipped for a publisher streaming here, so a
    switchover at {p: 3} passed with 4-6 told as a gap though the active held them. Now it is bounded only
    by holdings taken while the peer heard this broker, and again by each later holdings."""
    async with (
        _pair(tmp_path, peer_timeout_ms="50") as (active, standby, to_standby, to_active),
        _acknowledged_through_3(active, standby, to_standby, to_active),
    ):
        await to_standby.step()
        await asyncio.sleep(0.2)  # cut both ways: neither hears the other
        await _publish(active, 4, 3)  # acknowledged alone
        await to_standby.step()  # the standby hears the active first; the active does not hear it
        standby.resume_publisher("p", standby.publisher("p"), 7)
        standby.publish_stream_opened("p")
        for _ in range(3):  # the active hears the standby: a new session, its holdings (p: 6) go
            await to_active.step()
            await to_standby.step()
        standby.publish_stream_closed("p")
        copy, _ = await standby.accept(IDLE, {"p": 3})
        assert copy.floor.get("p", 0) >= 6, f"floor {copy.floor}: a switchover at p 3 would pass, 4-6 a gap"


async def test_a_hole_marker_is_not_reported_as_held_to_the_peer(tmp_path: Path) -> None:
    """Found by the next chaos run (seed 702424): a publisher's hole raises ``last_enqueued`` in every
    queue, so that the next message's previous_seq tells the hole; the holdings reported that number as
    held, also in a queue of a topic the publisher never sends to, and the peer, bounding a later hole of
    its own by those holdings, marked its copy of that queue as lacking it: behind for good. The holdings
    now say what was put there."""
    quiet = broker_pb2.Subscription(subscriber_id="quiet", topic="other", durable=True)
    async with _pair(tmp_path) as (_active, standby, to_standby, to_active):
        await standby.create_subscription(standby.subscription_spec(quiet))
        await _settle(to_standby, to_active)
        standby.resume_publisher("p", standby.publisher("p"), 7)  # 1-6 acknowledged by the active alone
        held = {(h.topic, h.subscriber_id): dict(h.last_enqueued.last_seq) for h in standby.holdings()}
        assert held[("other", "quiet")] == {}, f"a hole reported as held: {held[('other', 'quiet')]}"
        assert standby.queue("other", "quiet").last_enqueued["p"] == 6  # previous_seq still tells the hole
        await _publish(standby, 7, 1)
        held = {(h.topic, h.subscriber_id): dict(h.last_enqueued.last_seq) for h in standby.holdings()}
        assert held[("prices", "idle")] == {"p": 7}


async def test_a_hole_inside_a_spilled_copy_is_still_lacked_after_a_restart(tmp_path: Path) -> None:
    """The schedule of chaos seed 223254: the standby stops hearing the active, which acknowledges 4-6
    alone; the publisher resumes on the standby at 7. The standby's copy is on disk (over its budget) and
    lacks 4-6; the standby is killed and starts again on its state. Before, the recovered log read as
    contiguous (1-3, 7-9): the copy counted itself caught up without 4-6, and a subscriber moved there was
    told as a gap what the active held."""
    async with _pair(tmp_path, peer_timeout_ms="50", queue_budget="1") as (active, standby, to_standby, to_active):
        for broker in (active, standby):
            await _publish(broker, 1, 3)
        await _settle(to_standby, to_active)
        await asyncio.sleep(0.2)  # the standby no longer hears the active
        await _publish(active, 4, 3)  # acknowledged alone
        standby.resume_publisher("p", standby.publisher("p"), 7)
        await _publish(standby, 7, 3)
        for _ in range(3):  # heard again: the active's holdings (p: 6) bound the hole
            await to_active.step()
            await to_standby.step()
        copy = standby.queue("prices", "idle")
        await copy.written(copy.spill_appended)
        assert copy.lacks == {"p": 6}
        assert copy.disk_count == 6, "the schedule needs the copy on disk"
        await standby.close()  # its marks are in memory: the same whether it is killed or stopped
        again = await _restarted(standby, tmp_path)
        try:
            recovered = again.queue("prices", "idle")
            assert recovered.lacks == {"p": 6}, f"lacks {recovered.lacks}: the hole inside the log was forgotten"
            assert not again.caught_up
        finally:
            await again.close()


@pytest.mark.parametrize("healed_first", [False, True])
async def test_a_hole_the_peer_lost_in_a_crash_is_still_told(tmp_path: Path, healed_first: bool) -> None:
    """A review's schedules against a mend tried and reverted (lowering the predecessor a hole's next
    message names to what the peer's holdings say it holds): the active acknowledges 4-6 alone, in memory,
    and is killed, before or after the link heals; its new holdings hold nothing of them. The next message
    on the standby must still name 6, so the subscriber is told 4-6 are gone (holdings say what the peer
    holds now: they cannot tell a hole none of which was for a copy from one the peer lost)."""
    async with (
        _pair(tmp_path, peer_timeout_ms="50") as (active, standby, to_standby, to_active),
        _acknowledged_through_3(active, standby, to_standby, to_active),
    ):
        await asyncio.sleep(0.2)  # the standby no longer hears the active
        await _publish(active, 4, 3)  # acknowledged alone, in memory only
        standby.resume_publisher("p", standby.publisher("p"), 7)
        if healed_first:
            for _ in range(3):  # heard again: the active's holdings (p: 6) bound the hole
                await to_active.step()
                await to_standby.step()
        again = await _restarted(active, tmp_path)  # killed: 4-6 gone with its memory
        links = _Link(again, standby), _Link(standby, again)
        try:
            for _ in range(3):
                for link in links:
                    await link.step()
            await _publish(standby, 7, 1)
            told = standby.queue("prices", "idle").memory[-1].prev
            assert told >= 6, f"7 names {told} as its predecessor: 4-6, acknowledged and lost, are not told"
        finally:
            for link in links:
                await link.close()
            await again.close()

"""The broker's state and rules: topics, subscriptions, publishers, limits, fan-out.

Everything here runs on the event loop; disk work goes through the
:class:`~sokutatsu.broker.disk_worker.DiskWorker`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sokutatsu.broker.catalog import Catalog, TopicSpec, load_catalog, save_catalog
from sokutatsu.broker.disk_worker import DiskWorker
from sokutatsu.broker.key_index import KeyIndex
from sokutatsu.broker.messages import StoredMessage, Usage, check_key, check_name
from sokutatsu.broker.pair_state import ACTIVE, STANDBY, PairState, Role
from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.subscription import Retention, SubscriptionSpec
from sokutatsu.broker.subscription_lists import (
    DELETE,
    KEPT,
    RENEWED,
    TOMBSTONES_KEPT,
    Name,
    SubscriptionLists,
    encoded,
    tags_of,
)
from sokutatsu.broker.subscription_queue import AWAY, LEAVING, SERVING, SHADOW, SubscriptionQueue
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable, echo
from sokutatsu.core.process_stats import rss_bytes

log = logging.getLogger(__name__)

_STATE_NAMES: dict[int, str] = {SERVING: "serving", SHADOW: "shadow", AWAY: "away", LEAVING: "leaving"}


async def _no_answer() -> broker_pb2.RoleInfo | None:
    return None


class PeerServes(Exception):
    """The peer serves this subscriber; the stream ends with this redirect."""

    def __init__(self, redirect: broker_pb2.Redirect) -> None:
        super().__init__(redirect.reason)
        self.redirect = redirect


# How long a reconnecting subscriber waits for its previous stream to end.
TAKEOVER_SECONDS = 10.0
# The most message bytes in one chunk of a fill (invariant 7): well within a gRPC frame.
FILL_CHUNK_BYTES = 1 << 20
# How long a restarted broker waits for its peer's fill (invariant 7; at least two peer timeouts):
# meanwhile the publishes that reach the reclaimed queue wait for it.
RECLAIM_SECONDS = 2.0
# How long ReleaseSubscriber waits for a redirected stream to end before it refuses (retry):
# well within a caller's deadline (the monitor's is 2 s), so a slow stream is a refusal the
# monitor retries, not a call it takes for an unreachable broker.
RELEASE_WAIT_SECONDS = 1.0


@dataclass
class Topic:
    spec: TopicSpec
    usage: Usage
    queues: dict[str, SubscriptionQueue] = field(default_factory=dict)
    # The queues as a list, and by the keys they take (the publish loop's routing).
    queue_list: list[SubscriptionQueue] = field(default_factory=list)
    index: KeyIndex[SubscriptionQueue] = field(default_factory=lambda: KeyIndex([]))
    # The queues whose retention refuses publishes at its maximum bytes: the only ones a publish asks
    # whether they are full (a queue's retention is fixed when it is made).
    refusers: list[SubscriptionQueue] = field(default_factory=list)
    # Per publisher that published on this topic, its last sequence number this broker took (of
    # any topic: a publisher's numbers run across its topics). A new queue holds what comes after.
    published: dict[str, int] = field(default_factory=dict)

    def took(self, publisher_id: str, last_seq: int) -> None:
        """A batch of ``publisher_id``'s on this topic was taken, up to its ``last_seq``."""
        if last_seq > self.published.get(publisher_id, 0):
            self.published[publisher_id] = last_seq

    def reindex(self) -> None:
        self.queue_list = list(self.queues.values())
        self.index = KeyIndex(self.queue_list)
        self.refusers = [q for q in self.queue_list if q.retention.refuses]


@dataclass
class PublisherState:
    """What the broker knows of one publisher's sequence."""

    last_seq: int = 0
    # True after a persistent message was refused: later ones are refused too
    # until the publisher sends last_seq + 1 again (go-back-N).
    rejecting: bool = False


def _held_numbers(queue: SubscriptionQueue) -> dict[str, int]:
    """The last number of each publisher put in ``queue`` (of one being reclaimed, the last it holds),
    for its holdings: not the number a publisher's hole raised ``last_enqueued`` to while no message of
    that publisher at or past it has been put here since, but the last one held (``hole_marks``: a peer's
    fill into the hole raises it). Reported, the raised number made the peer mark the hole in its copy
    too, and a copy on a topic the publisher never sends to stayed behind for good (chaos seed 702424)."""
    numbers = queue.held_back.holds if queue.held_back is not None else queue.last_enqueued
    if not queue.hole_marks:
        return numbers
    out = dict(numbers)
    for publisher, (before, mark) in queue.hole_marks.items():
        if out.get(publisher) == mark:
            if before:
                out[publisher] = before
            else:
                del out[publisher]
    return out


@dataclass
class _Lists:
    """The subscription lists a catalog write held, for the peer (invariant 8): each durable
    subscription with its creation tags, and the expiries and deletions not yet applied there."""

    held: list[tuple[SubscriptionSpec, list[str]]]
    expired: list[tuple[Name, frozenset[str]]]
    deleted: list[tuple[Name, frozenset[str]]]


@dataclass
class Rates:
    at: float = 0.0
    enqueued: int = 0
    sent: int = 0
    inflow: float = 0.0
    outflow: float = 0.0


class Broker:
    def __init__(self, settings: BrokerSettings, disk: DiskWorker) -> None:
        self.settings = settings
        self.disk = disk
        self.usage = Usage("broker", settings.max_count, settings.max_bytes)
        self.topics: dict[str, Topic] = {}
        self.publishers: dict[str, PublisherState] = {}
        # Role, epoch and peer, with the pair's invariants (pair_state.py).
        self.pair = PairState.load(
            instance=settings.instance,
            role=settings.role,
            peer=settings.peer,
            peer_link=settings.peer_link,
            peer_timeout=settings.peer_timeout_ms / 1000,
            state_dir=settings.state_dir,
            monitored=settings.monitored,
        )
        # Publishers with a publish stream open here, and how many (normally one each): this broker
        # gets everything they send, and any hole before was recorded when the stream opened.
        self.streaming: dict[str, int] = {}
        # Called when the peer comes or goes (open publish streams send a fresh ack, so a
        # publisher waiting for the other broker learns it may count this one alone).
        self.peer_listeners: set[Callable[[], None]] = set()
        self.publisher_streams = 0
        self.subscriber_streams = 0
        self.published_total = 0
        self.duplicates_total = 0
        self.dropped_total = 0
        self.rejected_total = 0
        # Calls auth refused (the bootstrap's counter; 0 with auth off).
        self.auth_refusals: Callable[[], int] = lambda: 0
        self._rates: dict[int, Rates] = {}
        # The peer's answer to GetRole at its client address, or None (pair.py sets it).
        self.peer_role: Callable[[], Awaitable[broker_pb2.RoleInfo | None]] = _no_answer
        self._doubt: asyncio.Future[None] | None = None
        # The list version of the last catalog write that completed: the watermark stream sends the
        # peer that write's lists (``_published``) whenever it changes (pair.py), so the pair holds
        # each durable subscription on both, and hears only what is on disk here. Versions start from
        # the wall clock in ns, so they grow across restarts (the peer acknowledges them: invariant 8).
        self.subscriptions_version = time.time_ns()
        self._next_version = self.subscriptions_version + 1
        self._published: _Lists = _Lists([], [], [])
        # Bumped to send the published lists again (the peer now understands creation tags).
        self.lists_resend = 0
        # The last catalog write failed: what it held is neither on disk nor told to the peer until a
        # later one succeeds (tick_retention tries about once a second).
        self.catalog_dirty = False
        # The peer's list version last applied here, acknowledged in every frame (invariant 8).
        self.peer_version_applied = 0
        # The creation tags of the durable subscriptions held here, and of those deleted or expired
        # here: the peer's lists bring back only a creation a deletion here did not see
        # (subscription_lists.py, invariant 8).
        self.lists = SubscriptionLists()
        # The peer's holdings of its last session, per durable (topic, subscriber id): a queue
        # created here later (adopted from the peer's list, or taken by AcceptSubscriber before the
        # list arrived) takes them when it is made, whatever the order (pair_state.py, invariant 4).
        self._peer_holdings: dict[tuple[str, str], broker_pb2.SubscriberHoldings] = {}
        # Publishers that resumed after a range the peer acknowledged alone (PublishOpen.first_unacked_seq),
        # and up to where: marked in the copies, bounded by the peer's holdings, each time holdings come
        # (_mark_holes); those not yet marked so keep this broker from being caught up.
        self._holes: dict[str, int] = {}
        self._unmarked: dict[str, int] = {}
        # The broker's retention maximums (each queue's default; a subscription may ask for less).
        self.retention = Retention(
            max_bytes=settings.retention_max_bytes,
            max_age_ms=round(settings.retention_max_age * 1000),
            policy=settings.retention_policy,
        )
        # Durable subscriptions expired (SUBSCRIPTION_EXPIRY) here or on the peer since start; the
        # names (with the creation tags) this broker expired, and those a client deleted here, sent to
        # the peer with the list until it lists none of those creations (invariant 8).
        self.subscriptions_expired = 0
        self.expired_names: list[tuple[Name, frozenset[str]]] = []
        self.deleted_names: list[tuple[Name, frozenset[str]]] = []
        # Whether the peer's last frame said it understands creation tags (invariant 8).
        self.peer_creation_tags = False
        self._catalog_path = settings.state_dir / "catalog.json"
        self._queues_dir = settings.state_dir / "queues"
        # Invariant 7 (pair_state.py): queues this broker, restarted, served before and may serve again
        # (held back until the peer's holdings and fill settle it); the fills the peer sent so far; and,
        # on the other side, the fills the peer asked for (per queue, the numbers it holds up to).
        self._reclaiming: dict[tuple[str, str], SubscriptionQueue] = {}
        self._fill_parts: dict[tuple[str, str], list[broker_pb2.QueueFill]] = {}
        self.fills_wanted: dict[tuple[str, str], dict[str, int]] = {}
        # When this broker first heard its peer while it reclaims (monotonic; 0: not yet): a fill that
        # does not come within RECLAIM_SECONDS of it ends the claims; so does not hearing the peer
        # that long after the queues were recovered.
        self._reclaim_since = 0.0
        self._started = time.monotonic()  # set again once open() recovered the queues
        # Bumped when this broker's holdings change within a session (a claim settled): the pair's
        # stream sends them again, so the peer acts on them.
        self.holdings_version = 0
        # Counts changes of which queues are served here: the catalog records them (invariant 7).
        self._served_save: asyncio.Task[None] | None = None
        self._served_dirty = False

    # ------------------------------------------------------------ lifecycle --
    async def open(self) -> None:
        """Load the catalog and recover durable queues' segments left by an earlier run."""
        catalog = await self.disk.call(load_catalog, self._catalog_path)
        self.lists.restore(catalog.tombstones)
        self.expired_names = [(name, tags_of(tags)) for name, tags in catalog.expired]
        self.deleted_names = [(name, tags_of(tags)) for name, tags in catalog.deleted]
        for spec in catalog.topics.values():
            self._add_topic(spec)
        for sub in catalog.subscriptions.values():
            # A catalog written before creation tags has none: the legacy tag, on both brokers.
            tags = tags_of(catalog.creations.get((sub.topic, sub.subscriber_id), ()))
            queue = self._add_queue(sub, creations=tags)
            await queue.recover()
            if queue.disk_count:
                log.info("recovered %d spilled messages for %s on %s", queue.disk_count, sub.subscriber_id, sub.topic)
            name = (sub.topic, sub.subscriber_id)
            if name in catalog.served and queue.state == SHADOW and self.peer:
                # Invariant 7: it served this subscriber before it stopped; the peer's copy may be
                # away (only a tail), so it settles with the peer before anyone serves it.
                queue.hold_back()
                self._reclaiming[name] = queue
        self._published = self._lists()  # what the catalog holds
        await self.disk.call(self._remove_stray_folders, set(self._all_queue_folders()))
        # The claims' limits count from here: the peer can reach this broker only once it serves,
        # which is after the recovery above (its length grows with what is on disk).
        self._started = time.monotonic()

    async def close(self) -> None:
        for topic in self.topics.values():
            for queue in topic.queue_list:
                await queue.close()

    def _all_queue_folders(self) -> list[Path]:
        return [q.folder for t in self.topics.values() for q in t.queue_list if q.spec.durable]

    def _remove_stray_folders(self, keep: set[Path]) -> None:
        if not self._queues_dir.exists():
            return
        for topic_dir in self._queues_dir.iterdir():
            for folder in topic_dir.iterdir():
                if folder not in keep:
                    shutil.rmtree(folder, ignore_errors=True)

    async def _save_catalog(self) -> None:
        """Write the catalog; once it is on disk, the peer may hear the subscription lists it holds,
        under the write's list version, which also stamps the tombstones it carries (invariant 8)."""
        version = self._next_version
        self._next_version += 1
        self.lists.stamp(version)
        data = self._catalog().to_json()
        lists = self._lists()

        def written(write: asyncio.Future[None]) -> None:
            # Also when the caller was cancelled meanwhile (a client's deadline, the pair's stream
            # ending while it applied a frame): the write went on, and the peer must hear it.
            if write.cancelled() or write.exception() is not None:
                self.catalog_dirty = True  # tick_retention writes it again
            elif version > self.subscriptions_version:  # the disk thread runs the writes in order
                self._published = lists
                self.subscriptions_version = version
                self.catalog_dirty = False

        write = asyncio.ensure_future(self.disk.call(save_catalog, self._catalog_path, data))
        write.add_done_callback(written)
        await asyncio.shield(write)

    def _lists(self) -> _Lists:
        return _Lists(
            [
                (q.spec, self.lists.tags((q.spec.topic, q.spec.subscriber_id)))
                for t in self.topics.values()
                for q in t.queue_list
                if q.spec.durable
            ],
            list(self.expired_names),
            list(self.deleted_names),
        )

    def _catalog(self) -> Catalog:
        """What the catalog file holds (built on the event loop; written by the disk thread)."""
        return Catalog(
            topics={name: t.spec for name, t in self.topics.items()},
            subscriptions={
                (q.spec.topic, q.spec.subscriber_id): q.spec
                for t in self.topics.values()
                for q in t.queue_list
                if q.spec.durable
            },
            creations={
                (q.spec.topic, q.spec.subscriber_id): self.lists.tags((q.spec.topic, q.spec.subscriber_id))
                for t in self.topics.values()
                for q in t.queue_list
                if q.spec.durable
            },
            served={
                (q.spec.topic, q.spec.subscriber_id)
                for t in self.topics.values()
                for q in t.queue_list
                if q.spec.durable and q.state in (SERVING, LEAVING)
            }
            # A claim being settled stays recorded: a second crash meanwhile keeps it.
            | set(self._reclaiming),
            tombstones=self.lists.tombstones(),
            expired=[(name, encoded(tags)) for name, tags in self.expired_names],
            deleted=[(name, encoded(tags)) for name, tags in self.deleted_names],
        )

    def _serving_changed(self) -> None:
        """A durable queue started or stopped being served here: record it soon (invariant 7; what
        must be on disk before an answer, ``accept`` awaits itself)."""
        self._served_dirty = True
        if self._served_save is None or self._served_save.done():
            self._served_save = asyncio.get_running_loop().create_task(self._save_served())

    async def _save_served(self) -> None:
        while self._served_dirty:  # changes made while one write runs go in the next
            self._served_dirty = False
            try:
                await self._save_catalog()
            except OSError as exc:
                log.error("could not record which subscribers are served here in %s: %s", self._catalog_path, exc)  # noqa: TRY400
                return

    # --------------------------------------------------------------- topics --
    def _add_topic(self, spec: TopicSpec) -> Topic:
        topic = Topic(spec=spec, usage=Usage(f"topic {spec.name}", spec.max_count, spec.max_bytes))
        self.topics[spec.name] = topic
        return topic

    async def create_topic(self, spec: TopicSpec) -> TopicSpec:
        check_name("topic name", spec.name)
        existing = self.topics.get(spec.name)
        if existing is not None:
            if existing.spec != spec:
                raise AlreadyExists(f"topic {echo(spec.name)} exists with other settings: {existing.spec}")
            return existing.spec
        self._add_topic(spec)
        await self._save_catalog()
        return spec

    async def delete_topic(self, name: str) -> None:
        topic = self._topic(name)
        if topic.queues:
            raise FailedPrecondition(
                f"topic {echo(name)} still has {len(topic.queues)} subscription(s); delete them first"
            )
        del self.topics[name]
        await self._save_catalog()

    def _topic(self, name: str) -> Topic:
        topic = self.topics.get(name)
        if topic is None:
            check_name("topic name", name)
            raise NotFound(f"topic {echo(name)} does not exist; create it first (BrokerAdmin.CreateTopic)")
        return topic

    async def _topic_or_create(self, name: str) -> Topic:
        topic = self.topics.get(name)
        if topic is not None:
            return topic
        if not self.settings.auto_create_topics:
            return self._topic(name)
        check_name("topic name", name)
        topic = self._add_topic(TopicSpec(name=name))
        await self._save_catalog()
        return topic

    # -------------------------------------------------------- subscriptions --
    def _queue_folder(self, spec: SubscriptionSpec) -> Path:
        return self._queues_dir / spec.topic / spec.subscriber_id

    def _add_queue(
        self,
        spec: SubscriptionSpec,
        state: broker_pb2.QueueState.ValueType | None = None,
        creations: Iterable[str] = (),
    ) -> SubscriptionQueue:
        """A new queue; a durable one on the standby starts as a shadow of the active's. A durable one
        holds ``creations`` (the tags of the copy adopted or loaded), or a new creation's tag."""
        topic = self.topics.get(spec.topic) or self._add_topic(TopicSpec(name=spec.topic))
        if state is None:
            state = SHADOW if spec.durable and self.role == broker_pb2.BROKER_ROLE_STANDBY else SERVING
        queue = SubscriptionQueue(
            state=state,
            # Only this topic's publishers: a subscriber never acknowledges another topic's, so a floor
            # for them would hold every switchover of it at step 2 (position below the floor).
            floor=dict(topic.published),
            away_tail=self.settings.away_tail,
            retention=self.retention.within(spec.retention),
            spec=spec,
            folder=self._queue_folder(spec),
            disk=self.disk,
            batch_messages=self.settings.batch_messages,
            batch_bytes=self.settings.batch_bytes,
            linger_seconds=self.settings.linger_ms / 1000,
        )
        topic.queues[spec.subscriber_id] = queue
        topic.reindex()
        if spec.durable:
            self.lists.hold((spec.topic, spec.subscriber_id), creations)
            queue.on_serving = self._serving_changed
        held = self._peer_holdings.get((spec.topic, spec.subscriber_id)) if spec.durable else None
        if held is not None:
            self._take_holdings(queue, held, new=True)
        return queue

    def subscription_spec(self, sub: broker_pb2.Subscription) -> SubscriptionSpec:
        return SubscriptionSpec.from_proto(
            sub,
            self.settings.default_mode,
            self.settings.queue_budget,
            self.settings.max_queue_budget,
            self.retention,
        )

    async def create_subscription(self, spec: SubscriptionSpec) -> SubscriptionSpec:
        topic = await self._topic_or_create(spec.topic)
        existing = topic.queues.get(spec.subscriber_id)
        if existing is not None:
            if existing.spec != spec:
                raise AlreadyExists(
                    f"subscription of {echo(spec.subscriber_id)} to {echo(spec.topic)} exists with other settings; "
                    "delete it first to change them"
                )
            if self.catalog_dirty:  # its creation's write failed: the client's retry writes it
                await self._save_catalog()
            return existing.spec
        self._add_queue(spec)
        if spec.durable:
            # A new creation's tag: the peer adopts it from the next list, whatever it deleted before
            # (an expiry of the old copy still sent to the peer names only the old tags).
            await self._save_catalog()
        return spec

    def expired_subscriptions(self) -> list[broker_pb2.SubscriptionName]:
        """The names this broker expired, with their creation tags, for the peer (sent with the list)."""
        return self._removals(self._published.expired)

    def deleted_subscriptions(self) -> list[broker_pb2.SubscriptionName]:
        """The names a client deleted here, with their creation tags, for the peer (sent with the list)."""
        return self._removals(self._published.deleted)

    def note_peer_tags(self, understood: bool) -> None:
        """The peer's list says whether it understands creation tags. Once it does, the list goes out
        again with every expiry: those of subscriptions created again here were held back (invariant 8)."""
        if understood and not self.peer_creation_tags:
            self.lists_resend += 1
        self.peer_creation_tags = understood

    def _removals(self, names: list[tuple[Name, frozenset[str]]]) -> list[broker_pb2.SubscriptionName]:
        # A peer from before the tags deletes by name: not one created again here since (invariant 8).
        return [
            broker_pb2.SubscriptionName(topic=name[0], subscriber_id=name[1], creations=encoded(tags))
            for name, tags in names
            if self.peer_creation_tags or not self.lists.held(name)
        ]

    def durable_subscriptions(self) -> list[broker_pb2.Subscription]:
        """The list for the peer, as the last catalog write holds it: each durable subscription with
        its creation tags (invariant 8)."""
        subs = []
        for spec, tags in self._published.held:
            sub = spec.to_proto()
            sub.creations.extend(tags)
            subs.append(sub)
        return subs

    async def adopt_subscriptions(
        self, subscriptions: Sequence[broker_pb2.Subscription], *, whole: bool, applied: int = 0
    ) -> None:
        """The peer's durable subscriptions (``whole``: all it holds, built after it applied this
        broker's list version ``applied``): create those this broker lacks.

        A client's ``CreateSubscription`` may have reached one broker only (the other was
        down or did not answer in time); without its queue here, a subscriber redirected
        or failed over to this broker would be refused, and what was published meanwhile
        would not be kept for it. One this broker deleted is brought back only as a creation
        the deletion did not see (subscription_lists.py, invariant 8).
        """
        by_name = {(sub.topic, sub.subscriber_id): sub for sub in subscriptions}
        tombstones = self.lists.tombstone_count
        adopt, merged = self.lists.peer_list(
            {name: tags_of(sub.creations) for name, sub in by_name.items()}, whole=whole, applied=applied
        )
        # A deletion or expiry whose tombstone went is applied on the peer (it lists none of those creations).
        self.expired_names = [(name, tags) for name, tags in self.expired_names if self.lists.tombstoned(name)]
        self.deleted_names = [(name, tags) for name, tags in self.deleted_names if self.lists.tombstoned(name)]
        merged = merged or self.lists.tombstone_count != tombstones  # the catalog forgets them too
        adopted = 0
        for name, creations in adopt.items():
            sub = by_name[name]
            topic = self.topics.get(sub.topic)
            if topic and sub.subscriber_id in topic.queues:  # a non-durable queue of that id
                continue
            try:
                spec = self.subscription_spec(sub)
                topic = await self._topic_or_create(spec.topic)
            except (NotFound, InvalidArgument) as exc:
                log.warning(
                    "the peer's subscription of %r to %r is not created here: %s", sub.subscriber_id, sub.topic, exc
                )
                continue
            if sub.subscriber_id in topic.queues:
                # Made meanwhile (the topic's creation awaited the disk): an AcceptSubscriber that made
                # it serving here must not be replaced by a shadow.
                continue
            queue = self._add_queue(spec, creations=creations)
            adopted += 1
            log.info(
                "created %s's subscription to %s as the peer holds it (%s here)",
                spec.subscriber_id,
                spec.topic,
                _STATE_NAMES[queue.state],
            )
        if adopted or merged:
            await self._save_catalog()

    def queue(self, topic: str, subscriber_id: str) -> SubscriptionQueue:
        queue = self._topic(topic).queues.get(subscriber_id)
        if queue is None:
            raise NotFound(
                f"no subscription of {echo(subscriber_id)} to topic {echo(topic)}; create it first "
                "(BrokerAdmin.CreateSubscription) or subscribe non-durably"
            )
        return queue

    async def delete_subscription(self, topic_name: str, subscriber_id: str) -> None:
        queue = self.queue(topic_name, subscriber_id)
        if queue.attached:
            raise FailedPrecondition(f"{echo(subscriber_id)} is connected to {echo(topic_name)}; disconnect it first")
        if queue.state in (AWAY, LEAVING) and self.peer_up:
            # Deleted here, the peer's copy, which its subscriber is served from, would stay, and this
            # broker would take it back as a copy of its own, serving beside the peer (third review).
            # With the peer not heard (gone, perhaps for good) the delete goes ahead: refused, an
            # away copy, which never expires, could not be deleted at all (fourth review).
            raise FailedPrecondition(
                f"{echo(subscriber_id)}'s subscription to {echo(topic_name)} is served by the peer broker "
                f"(it is {_STATE_NAMES[queue.state]} here); delete it there"
            )
        tags = self._remove_queue(queue)
        if queue.spec.durable:
            # The peer deletes its copy too, from the next frame after the catalog write (invariant 8).
            self.deleted_names = [
                *(n for n in self.deleted_names if n[0] != (topic_name, subscriber_id)),
                ((topic_name, subscriber_id), tags),
            ][-TOMBSTONES_KEPT:]
            await self._save_catalog()

    def _remove_queue(self, queue: SubscriptionQueue) -> frozenset[str]:
        """Take ``queue`` out of its topic and drop it with its segments. A durable one (deleted or
        expired) leaves its creation tags tombstoned (invariant 8): every tag tombstoned for its name
        is returned."""
        tags: frozenset[str] = frozenset()
        topic = self.topics.get(queue.spec.topic)
        if topic is not None and topic.queues.get(queue.spec.subscriber_id) is queue:
            del topic.queues[queue.spec.subscriber_id]
            topic.reindex()
            if queue.spec.durable:  # a non-durable queue of the same id must not take the durable one's
                name = (queue.spec.topic, queue.spec.subscriber_id)
                tags = self.lists.remove(name)
                self._peer_holdings.pop(name, None)
                self._end_reclaim(name, None, "its subscription is gone")
        queue.discard()
        return tags

    async def attach(
        self, open_frame: broker_pb2.SubscribeOpen, listener: Callable[[], None] | None = None
    ) -> tuple[SubscriptionQueue, int]:
        """Attach a subscriber stream to its queue (creating a non-durable one); ``listener``: see
        :meth:`SubscriptionQueue.attach`.

        A subscriber that connects while its previous stream is still attached (a reconnect
        that overtook the old stream's end) takes over: the old stream is ended first.
        """
        await self.confirm_role()
        spec = self.subscription_spec(open_frame.subscription)
        if open_frame.credits < 1:
            raise InvalidArgument("SubscribeOpen.credits must be at least 1 (the SDK default is 1000)")
        if open_frame.credits > self.settings.max_credits:
            raise InvalidArgument(
                f"SubscribeOpen.credits {echo(open_frame.credits)} is over the broker's maximum of "
                f"{self.settings.max_credits} (SOKUTATSU_BROKER_MAX_CREDITS); ask for what your buffer holds"
            )
        topic_now = self.topics.get(spec.topic)
        previous = topic_now.queues.get(spec.subscriber_id) if topic_now else None
        if previous is not None and previous.attached:
            log.info("%s reconnected to %s; ending its previous stream", spec.subscriber_id, spec.topic)
            previous.stop_stream(previous.generation)
            try:
                await asyncio.wait_for(previous.idle.wait(), TAKEOVER_SECONDS)
            except TimeoutError:
                raise Unavailable(
                    f"{echo(spec.subscriber_id)} is still connected to {echo(spec.topic)} "
                    "and its stream did not end; retry"
                ) from None
        if spec.durable:
            known = self.topics.get(spec.topic)
            if spec.subscriber_id not in (known.queues if known else {}) and self._peer_holds_it():
                # The peer is active and up: the subscription is its to serve (this broker
                # has not heard of it yet; the peer's watermark stream brings it here).
                raise PeerServes(broker_pb2.Redirect(target=self.peer, reason="not held here; the active holds it"))
            queue = self.queue(spec.topic, spec.subscriber_id)
            if queue.spec != spec:
                raise FailedPrecondition(
                    f"subscription of {echo(spec.subscriber_id)} to {echo(spec.topic)} "
                    "has other settings than requested"
                )
        else:
            topic = await self._topic_or_create(spec.topic)
            if spec.subscriber_id in topic.queues:
                raise AlreadyExists(
                    f"{echo(spec.subscriber_id)} already subscribes to {echo(spec.topic)}; use another subscriber id"
                )
            queue = self._add_queue(spec)
        if queue.attached:
            raise Unavailable(f"{echo(spec.subscriber_id)} connected to {echo(spec.topic)} twice at once; retry")
        position = dict(open_frame.position.last_seq)
        if queue.state != SERVING:
            await self._claim(queue, position)
        if (
            queue.taken_pending
            and not open_frame.redirected
            and self.peer
            and self.peer_up
            and (queue.lacks_after(position) or self.lacks_unmarked(position))
        ):
            # Invariant 4 (pair_state.py): a broker that took the queue at switchover step 2 serves
            # it from where it holds its messages; a subscriber that comes before the redirect,
            # from further back, goes back to the peer, which serves it until its redirect (chaos
            # seed 7102: served here, it was told 1,249 acknowledged messages as a gap). Only then:
            # a peer whose copy is away would send it back here. And only one that came on its
            # own: one the peer redirected here (its copy is away, or leaving) is served, what this
            # broker lacks told as a gap, or it would bounce between the two for good (a hole
            # recorded here after the switchover's floor check, e.g. a publisher that came back).
            raise PeerServes(
                broker_pb2.Redirect(
                    target=self.peer,
                    reason="this broker lacks messages after your position (it was away); its peer holds them",
                )
            )
        generation = queue.attach(position, open_frame.credits, listener, dict(open_frame.received.last_seq))
        queue.taken_pending = False
        self.subscriber_streams += 1
        return queue, generation

    def _peer_holds_it(self) -> bool:
        return self.role == STANDBY and bool(self.peer) and self.peer_up

    async def _claim(self, queue: SubscriptionQueue, position: dict[str, int]) -> None:
        """A subscriber came for a queue the peer serves: send it there, or serve it when the
        peer is down (a standby then becomes active, for every subscriber).

        The pair's own stream may be cut while the peer still serves clients (a separate
        link between the brokers): before promoting itself, a standby asks the peer's role at
        its client address, and redirects the subscriber when the peer answers as active.
        """
        spec = queue.spec
        why = f"served by the peer ({_STATE_NAMES[queue.state]} here)"
        if (spec.topic, spec.subscriber_id) in self._reclaiming and self.peer_up:
            # Invariant 7 (a standby that does not hear its peer goes on below: promoted, it serves
            # what it holds; monitored, it refuses until the monitor promotes it).
            raise Unavailable(
                f"{self.settings.instance} restarted and served {echo(spec.subscriber_id)} before; it is settling "
                f"with its peer {self.peer} which of the two serves it now: retry"
            )
        if self.peer and self.peer_up:
            raise PeerServes(broker_pb2.Redirect(target=self.peer, reason=why))
        if queue.state == AWAY and (queue.lacks_after(position) or self.lacks_unmarked(position)):
            # Invariant 7 (pair_state.py): the peer served this subscriber and holds on its disk what
            # this copy (a tail) lacks; a peer that comes back serves it again with nothing lost.
            silent = self.pair.silent_for()
            wait = self.settings.away_wait
            if silent < wait:
                log.warning(
                    "refusing %s on %s for now: its position is before the newest messages kept here, and the peer "
                    "%s that served it (and holds the rest) is not heard from for %.1fs; serving it with a gap after "
                    "%gs (SOKUTATSU_BROKER_AWAY_WAIT)",
                    spec.subscriber_id,
                    spec.topic,
                    self.peer,
                    silent,
                    wait,
                )
                raise Unavailable(
                    f"{self.settings.instance} keeps only the newest messages of {echo(spec.subscriber_id)} (the peer "
                    f"{self.peer} served it and holds the rest) and does not hear that peer: it waits up to "
                    f"{wait - silent:.1f}s more for the peer to come back (SOKUTATSU_BROKER_AWAY_WAIT), then serves "
                    "what it has and reports the rest as a gap: retry"
                )
        if self.role == STANDBY:
            info = await self.peer_role() if self.peer else None
            if info is not None and info.role == ACTIVE:
                raise PeerServes(broker_pb2.Redirect(target=self.peer, reason=why + "; the pair's link is down"))
            if self.peer_up:  # the probe awaited: the peer's frames came back meanwhile
                raise PeerServes(broker_pb2.Redirect(target=self.peer, reason=why))
            if self.pair.monitored and self.role == STANDBY:
                # Only the monitor promotes a monitored broker (pair_state.py, invariant 6).
                raise Unavailable(
                    f"{self.settings.instance} is standby and does not hear its peer {self.peer}; the monitor decides "
                    "whether to promote it (SOKUTATSU_BROKER_MONITORED): retry"
                )
            if self.role == STANDBY:  # the probe awaited: a frame or the monitor may have decided meanwhile
                self.pair.promote_alone(f"{spec.subscriber_id} came while the peer is not heard from")
                self._roles_changed()
        if queue.state != SERVING:
            if self.role != ACTIVE:
                raise PeerServes(broker_pb2.Redirect(target=self.peer, reason=why))
            self.take_over(queue, "the peer is not heard from")

    def detach(self, queue: SubscriptionQueue) -> None:
        """The subscriber's stream ended (synchronous: it must run even while being cancelled)."""
        self.subscriber_streams -= 1
        if queue.spec.durable or queue.closed:
            queue.detach()
            return
        # A non-durable queue leaves the index before it reports idle, so a subscriber
        # taking over with the same id creates a fresh one.
        self._remove_queue(queue)
        queue.detach()

    def credit(self, queue: SubscriptionQueue, frame: broker_pb2.SubscriberCredit) -> None:
        has_ack = frame.HasField("acked")
        if frame.credits == 0 and not has_ack:
            raise InvalidArgument("SubscriberCredit must grant credits (at least 1) or acknowledge a position")
        limit = self.settings.max_credits
        if queue.credits + frame.credits > limit:
            raise InvalidArgument(
                f"SubscriberCredit.credits {echo(frame.credits)} would bring the stream's outstanding credit to "
                f"{max(queue.credits, 0) + frame.credits}, over the broker's maximum of {limit} "
                "(SOKUTATSU_BROKER_MAX_CREDITS); grant what your buffer holds"
            )
        if has_ack:
            queue.ack(dict(frame.acked.last_seq))
        queue.grant(frame.credits)

    # ------------------------------------------------------------ publishing --
    def publisher(self, publisher_id: str) -> PublisherState:
        check_name("publisher id", publisher_id)
        return self.publishers.setdefault(publisher_id, PublisherState())

    def _validate(self, publisher_id: str, state: PublisherState, topic: Topic, batch: broker_pb2.PublishBatch) -> None:
        max_body = self.settings.max_body
        total_order = topic.spec.total_order
        previous = 0
        for m in batch.messages:
            seq = m.publisher_seq
            if not previous:
                self.check_first_seq(publisher_id, state, seq, "publisher_seq")
            if seq <= previous:
                raise InvalidArgument(
                    f"publisher {echo(publisher_id)}: seq {seq} follows {previous} in one batch; "
                    "sequence numbers must increase"
                )
            previous = seq
            if m.publisher_id != publisher_id:
                if m.publisher_id:
                    raise InvalidArgument(
                        f"message seq {seq} names publisher {echo(m.publisher_id)} "
                        f"on the stream of {echo(publisher_id)}"
                    )
                m.publisher_id = publisher_id
            check_key(m.key, seq)
            if len(m.body) > max_body:
                raise InvalidArgument(
                    f"message seq {seq}: body of {len(m.body)} bytes is over the broker's maximum of {max_body} "
                    "(SOKUTATSU_BROKER_MAX_BODY)"
                )
            if m.previous_seq:
                m.previous_seq = 0
            if m.HasField("retention_gap"):
                m.ClearField("retention_gap")
            if total_order and not m.HasField("stamp"):
                raise InvalidArgument(f"message seq {seq}: topic {echo(topic.spec.name)} is total-order; stamp it")

    async def publish(
        self, publisher_id: str, state: PublisherState, batch: broker_pb2.PublishBatch
    ) -> tuple[broker_pb2.PublishAck, list[asyncio.Future[None]]]:
        """Store a batch; return its acknowledgement and what must complete before it is sent.

        Messages that went to a queue in flow-to-disk mode are acknowledged only once they
        are fsynced, so an acknowledged message is never only in a queue's spill buffer.
        """
        topic = await self._topic_or_create(batch.topic)
        self._validate(publisher_id, state, topic, batch)
        duplicates = dropped = 0
        rejection: broker_pb2.PublishRejection | None = None
        # refuse_publish queues at their maximum bytes (looked at once per batch).
        full = [q for q in topic.refusers if q.full()]
        usages = (topic.usage, self.usage)
        messages = batch.messages
        spilled: set[SubscriptionQueue] = set()
        for m in messages:
            seq = m.publisher_seq
            last = state.last_seq
            if seq <= last:
                duplicates += 1
                continue
            if last and seq != last + 1:
                if state.rejecting:
                    rejection = self._reject(seq, messages[-1].publisher_seq, "an earlier message was refused")
                    break
                raise InvalidArgument(
                    f"publisher {echo(publisher_id)}: seq {seq} follows {last}; sequence numbers must have no gaps "
                    f"(resend from {last + 1})"
                )
            matching, rejection = self._route(topic, full, m, state, messages[-1].publisher_seq)
            if rejection is not None:
                break
            if not matching:
                state.last_seq = seq
                state.rejecting = False
                self.published_total += 1
                continue
            payload = m.SerializeToString()
            limit = topic.usage.exceeded_by(len(payload)) or self.usage.exceeded_by(len(payload))
            if limit is not None:
                if m.persistent:
                    rejection = self._reject(seq, messages[-1].publisher_seq, f"{limit} reached")
                    state.rejecting = True
                    break
                dropped += 1
                state.last_seq = seq
                continue
            stored = StoredMessage(publisher_id, seq, payload, m.persistent, usages)
            stored.hold(len(matching))
            for queue in matching:
                if queue.enqueue(stored):
                    spilled.add(queue)
            state.last_seq = seq
            state.rejecting = False
            self.published_total += 1
        topic.took(publisher_id, state.last_seq)
        self.duplicates_total += duplicates
        self.dropped_total += dropped
        # single_copy is set as it goes out (mark_alone).
        ack = broker_pb2.PublishAck(acked_through_seq=state.last_seq, duplicates=duplicates, dropped=dropped)
        if rejection is not None:
            ack.rejected.append(rejection)
        return ack, [queue.written(queue.spill_appended) for queue in spilled]

    async def mark_alone(self, ack: broker_pb2.PublishAck) -> None:
        """Set ``single_copy`` (and why not) on an acknowledgement about to go out (pair_state.py,
        invariants 3 and 6), after the checks before acting as active (:meth:`confirm_role`)."""
        await self.confirm_role()
        ack.single_copy, ack.single_copy_refused = self.pair.acks_alone()

    def publish_stream_opened(self, publisher_id: str) -> None:
        self.publisher_streams += 1
        self.streaming[publisher_id] = self.streaming.get(publisher_id, 0) + 1

    def publish_stream_closed(self, publisher_id: str) -> None:
        """Synchronous: it must run even while the stream's handler is being cancelled."""
        self.publisher_streams -= 1
        if self.streaming.get(publisher_id, 0) <= 1:
            self.streaming.pop(publisher_id, None)
        else:
            self.streaming[publisher_id] -= 1

    def _route(
        self,
        topic: Topic,
        full: list[SubscriptionQueue],
        m: broker_pb2.Message,
        state: PublisherState,
        last: int,
    ) -> tuple[list[SubscriptionQueue], broker_pb2.PublishRejection | None]:
        """The queues ``m`` goes to. refuse_publish: a persistent message for a full queue is
        refused (with the rest of its batch, go-back-N); a non-persistent one is not kept for the
        full queues."""
        matching = topic.index.matching(m.key)
        blocked = [q for q in matching if q in full] if full else []
        if not blocked:
            return matching, None
        if m.persistent:
            state.rejecting = True
            return matching, self._refuse_for(blocked[0], m.publisher_seq, last)
        for queue in blocked:
            queue.not_kept(m.publisher_id, m.publisher_seq)
        return [q for q in matching if q not in blocked], None

    def _refuse_for(self, queue: SubscriptionQueue, first: int, last: int) -> broker_pb2.PublishRejection:
        """refuse_publish: ``queue`` is at its maximum bytes on disk."""
        queue.kept.refused_publishes += last - first + 1
        self.rejected_total += last - first + 1
        limit = (
            f"subscription {queue.spec.subscriber_id} to {queue.spec.topic} retention max_bytes "
            f"({queue.retention.max_bytes} bytes, refuse_publish)"
        )
        return broker_pb2.PublishRejection(
            first_seq=first,
            last_seq=last,
            limit=limit,
            message=(
                f"RESOURCE_EXHAUSTED: {limit} reached: persistent messages {first}..{last} were not stored; send "
                "them again once that subscriber catches up, or delete its subscription"
            ),
        )

    def _reject(self, first: int, last: int, why: str) -> broker_pb2.PublishRejection:
        self.rejected_total += last - first + 1
        limit = why.removesuffix(" reached")
        return broker_pb2.PublishRejection(
            first_seq=first,
            last_seq=last,
            limit=limit,
            message=(
                f"{why}: persistent messages {first}..{last} were not stored; send them again once "
                "subscribers catch up, or raise the limit"
            ),
        )

    # ----------------------------------------------------------------- pair --
    @property
    def role(self) -> Role:
        return self.pair.role

    async def confirm_role(self) -> None:
        """Before acting as active: if this broker did not run for a peer timeout, ask the peer
        and step down when it was promoted meanwhile (pair_state.py, invariant 5); a monitored
        active that hears neither its peer nor holds the monitor's lease steps down (invariant 6).
        Concurrent callers wait for the same question."""
        if self.pair.check_lease():
            self._roles_changed()
        if not self.pair.tick():
            return
        if self._doubt is None:
            self._doubt = asyncio.ensure_future(self._ask_peer())
        await asyncio.shield(self._doubt)

    async def _ask_peer(self) -> None:
        try:
            info = await self.peer_role()
            if info is None:
                stepped = self.pair.settle_doubt("", None, 0)
            else:
                stepped = self.pair.settle_doubt(info.broker_id, info.role, info.epoch)
            if stepped:
                self._roles_changed()
        finally:
            self._doubt = None

    @property
    def epoch(self) -> int:
        return self.pair.epoch

    @property
    def peer(self) -> str:
        return self.pair.peer

    @property
    def peer_up(self) -> bool:
        """Whether the peer sent a watermark frame within the peer timeout."""
        return self.pair.peer_up

    def _last_seqs(self) -> dict[str, int]:
        return {publisher: p.last_seq for publisher, p in self.publishers.items()}

    def resume_publisher(self, publisher_id: str, state: PublisherState, first_unacked: int) -> None:
        """``PublishOpen.first_unacked_seq``: continue after a range this broker never got.

        Its peer acknowledged that range alone while this broker was away; every queue
        records the hole (floor and previous_seq), so a subscriber's SDK reports it
        instead of missing it silently.
        """
        self.check_first_seq(publisher_id, state, first_unacked, "PublishOpen.first_unacked_seq")
        jump = first_unacked - 1
        if jump < 1 or state.last_seq >= jump:
            return
        if state.last_seq:
            log.warning(
                "publisher %s continues at %d; this broker has up to %d only (its peer acknowledged the rest alone)",
                publisher_id,
                first_unacked,
                state.last_seq,
            )
        state.last_seq = jump
        state.rejecting = False
        for topic in self.topics.values():
            for queue in topic.queue_list:
                before = queue.last_enqueued.get(publisher_id, 0)
                if before < jump:
                    mark = queue.hole_marks.get(publisher_id)
                    held = mark[0] if mark is not None and mark[1] == before else before  # a mark not yet passed
                    queue.hole_marks[publisher_id] = (held, jump)
                    queue.last_enqueued[publisher_id] = jump  # the next message's previous_seq tells the hole
        # What each copy lacks of the hole is marked once holdings the peer took while it heard this
        # broker are in (until then this broker is not caught up and takes no subscriber over).
        self._holes[publisher_id] = max(self._holes.get(publisher_id, 0), jump)
        self._unmarked[publisher_id] = max(self._unmarked.get(publisher_id, 0), jump)
        if self.pair.synced and self.pair.peer_hears_me:
            self._mark_holes()

    def _mark_holes(self) -> None:
        """Mark in each copy what it lacks of the holes publishers resumed after: the peer's holdings of
        its current session were taken while it heard this broker, when it acknowledges nothing alone, so
        they cover all it did, and a copy lacks at most what the peer put in its own copy. Run again with
        each holdings that come (a later session's may say more: marks only rise). Before, every queue of every topic
        took the whole hole, also one the publisher never sends to: its subscriber never acknowledges that
        publisher, so the copy stayed behind (caught_up false: every failover waited
        FAILOVER_BEHIND_AFTER_SECONDS) and a switchover to it waited at step 2, for good (chaos seed 476376
        with the subscription churn)."""
        for topic in self.topics.values():
            for queue in topic.queue_list:
                held = self._peer_holdings.get((queue.spec.topic, queue.spec.subscriber_id))
                for publisher_id, jump in self._holes.items():
                    if not queue.spec.durable:
                        bound = jump  # the peer holds no copy of it: it may lack all of the hole
                    else:
                        bound = min(jump, held.last_enqueued.last_seq.get(publisher_id, 0)) if held is not None else 0
                    if bound > queue.filled_through.get(publisher_id, 0):  # a fill completed it up to there
                        queue.may_lack(publisher_id, bound)
        self._unmarked = {}

    def lacks_unmarked(self, position: dict[str, int]) -> bool:
        """Whether a hole not yet marked (no holdings since the publisher resumed) may hold messages after
        ``position``: this broker then treats each copy as lacking it."""
        return any(jump > position.get(publisher, 0) for publisher, jump in self._unmarked.items())

    def check_first_seq(self, publisher_id: str, state: PublisherState, seq: int, field: str) -> None:
        """``INVALID_ARGUMENT`` for a publisher this broker has not seen starting over ``MAX_FIRST_SEQ``."""
        limit = self.settings.max_first_seq
        if seq > limit and state.last_seq == 0:
            raise InvalidArgument(
                f"publisher {echo(publisher_id)}: {field} {echo(seq)} is over the broker's maximum of {limit} "
                "for a publisher it has not seen (SOKUTATSU_BROKER_MAX_FIRST_SEQ); number messages from 1"
            )

    def take_over(self, queue: SubscriptionQueue, why: str, *, reindex: bool = True) -> None:
        """Serve a queue the peer served (the peer is down, or this broker was promoted)."""
        log.warning(
            "now serving %s on %s (%s): %s", queue.spec.subscriber_id, queue.spec.topic, _STATE_NAMES[queue.state], why
        )
        queue.serve()
        if reindex:
            self._topic(queue.spec.topic).reindex()

    def _serving(self, topic: str, subscriber_id: str) -> SubscriptionQueue:
        queue = self.queue(topic, subscriber_id)
        if queue.state not in (SERVING, LEAVING):
            raise FailedPrecondition(
                f"{self.settings.instance} does not serve {echo(subscriber_id)} on {echo(topic)} (its copy is "
                f"{_STATE_NAMES[queue.state]}); ask the broker that serves it"
            )
        return queue

    def switch_position(self, topic: str, subscriber_id: str) -> SubscriptionQueue:
        """Switchover step 1: the queue whose acknowledged position is the switch position."""
        return self._serving(topic, subscriber_id)

    async def accept(self, sub: broker_pb2.Subscription, position: dict[str, int]) -> tuple[SubscriptionQueue, int]:
        """Switchover step 2: serve the subscriber from here, dropping what precedes ``position``.

        Refused while the peer is up and its holdings for the current session have not arrived
        (pair_state.py, invariant 4): until then the floor could miss publishers this broker has
        not heard from since it came back.
        """
        spec = self.subscription_spec(sub)
        if not spec.durable:
            raise InvalidArgument("only durable subscriptions move between brokers (Subscription.durable)")
        if (self.peer_up and not self.pair.synced) or self._unmarked:
            raise Unavailable(
                f"{self.settings.instance} has not yet received what its peer holds since it last heard it "
                "(it came back or the pair's link was down); retry in a moment"
            )
        topic = await self._topic_or_create(spec.topic)
        queue = topic.queues.get(spec.subscriber_id)
        if queue is None:
            queue = self._add_queue(spec, SERVING)
            await self._save_catalog()
        elif queue.spec != spec:
            raise FailedPrecondition(
                f"subscription of {echo(spec.subscriber_id)} to {echo(spec.topic)} has other settings here; "
                "delete and recreate it on both brokers"
            )
        self._end_reclaim((spec.topic, spec.subscriber_id), None, "moved here by a switchover")
        queue.serve()
        queue.taken_pending = not queue.attached
        topic.reindex()
        trimmed = queue.trim(position)
        # Invariant 7: that it serves the subscriber is on disk before the peer hands it over (step 4).
        await self._save_catalog()
        return queue, trimmed

    def redirect_subscriber(self, topic: str, subscriber_id: str, redirect: broker_pb2.Redirect) -> bool:
        """Switchover step 3: end the subscriber's stream with a redirect; True if it was connected."""
        queue = self._serving(topic, subscriber_id)
        if not self.peer_up:
            raise FailedPrecondition(
                f"the peer {self.peer or '(unknown)'} is not heard from; {echo(subscriber_id)} stays here"
            )
        return queue.leave(redirect)

    async def release(self, topic: str, subscriber_id: str) -> int:
        """Switchover step 4 (or undoing step 2): stop serving; the active clears its copy,
        the standby keeps it as a shadow. Returns how many messages were cleared.

        After a redirect, the subscriber's stream may still be ending (the redirect frame
        goes after what was already queued on it): this waits for it."""
        queue = self.queue(topic, subscriber_id)
        if queue.state == LEAVING and queue.attached:
            try:
                await asyncio.wait_for(queue.idle.wait(), RELEASE_WAIT_SECONDS)
            except TimeoutError:
                raise FailedPrecondition(
                    f"the redirected stream of {echo(subscriber_id)} is still ending (its client has not read what was "
                    "sent before the redirect); retry"
                ) from None
        if queue.state in (AWAY, SHADOW):
            return 0
        if queue.attached:
            raise FailedPrecondition(f"{echo(subscriber_id)} is connected here; redirect it first (step 3)")
        if not self.peer_up:
            raise FailedPrecondition(
                f"the peer {self.peer or '(unknown)'} is not heard from; keeping {echo(subscriber_id)}'s queue here"
            )
        cleared = queue.hand_over(keep_tail=self.role == ACTIVE)
        self._topic(topic).reindex()
        return cleared

    def set_role(self, role: Role, epoch: int, peer: str, grace: float = 0.0) -> None:
        """The monitor's role change, fenced by epoch (pair_state.py); ``grace``: see ``set_by_monitor``."""
        self.pair.set_by_monitor(role, epoch, grace)
        self.pair.learn_peer(peer, "from the monitor")  # only from a decision that was not refused
        self._roles_changed()

    def _roles_changed(self) -> None:
        """Bring every durable queue in line with the role: an active serves what the peer served
        (shadows and leaving copies); a standby keeps shadows and redirects its streams to the peer."""
        role = self.role
        if role == ACTIVE:
            self.end_reclaims("promoted to active")
        for topic in self.topics.values():
            changed = False
            for queue in topic.queue_list:
                if not queue.spec.durable:
                    continue
                if role == ACTIVE and queue.state in (SHADOW, LEAVING):
                    self.take_over(queue, "promoted to active", reindex=False)
                    changed = True
                elif role == STANDBY:
                    changed = queue.shadow(self.peer) or changed
            if changed:
                topic.reindex()

    def watermarks(self, everything: bool = False) -> list[broker_pb2.SubscriberWatermark]:
        """What the subscribers served here acknowledged since the last call (or all of it)."""
        out = []
        for topic in self.topics.values():
            for queue in topic.queue_list:
                if queue.state in (SERVING, LEAVING) and queue.spec.durable and (queue.acked_dirty or everything):
                    queue.acked_dirty = False
                    out.append(
                        broker_pb2.SubscriberWatermark(
                            topic=queue.spec.topic,
                            subscriber_id=queue.spec.subscriber_id,
                            acked=broker_pb2.Position(last_seq=queue.acked),
                            retention_gaps=queue.kept.to_proto(),
                        )
                    )
        return out

    def apply_watermarks(self, frame: broker_pb2.DeliveredWatermarks) -> None:
        """The peer's frame: it is up; its holdings (at a new session); trim the shadows of the
        subscribers it serves; and, when both are active, the older epoch steps down."""
        self.pair.heard(frame.session, frame.holdings_included, hears_me=not frame.not_hearing_you)
        if self._reclaiming and not self._reclaim_since:
            self._reclaim_since = time.monotonic()
        self.pair.learn_peer(frame.address, "from its watermarks")
        if frame.holdings_included:
            self.apply_holdings(frame.holdings)
        if self.pair.peer_frame(frame.broker_id, frame.role, frame.epoch):
            self._roles_changed()
        for mark in frame.subscribers:
            if self._reclaiming and (mark.topic, mark.subscriber_id) in self._reclaiming:
                self._end_reclaim((mark.topic, mark.subscriber_id), None, "the peer serves it")  # invariant 7
            topic = self.topics.get(mark.topic)
            queue = topic.queues.get(mark.subscriber_id) if topic else None
            if queue is not None and queue.state in (SHADOW, AWAY):
                queue.trim(dict(mark.acked.last_seq), mark.retention_gaps)
        for fill in frame.fills:
            self._apply_fill(fill)

    def lead_both_standby(self, frame: broker_pb2.DeliveredWatermarks) -> None:
        """After the peer's whole frame is applied (pair_state.py, invariant 2)."""
        if self.pair.lead_both_standby(
            frame.broker_id, frame.role, frame.epoch, frame.caught_up, lambda: self.caught_up
        ):
            self._roles_changed()

    def holdings(self) -> list[broker_pb2.SubscriberHoldings]:
        """Per durable queue, the last number of each publisher put in it (pair_state.py, invariant 4);
        of one this broker reclaims, the last it holds (invariant 7: a publisher that came back said
        where it continues, which this copy lacks until the peer's fill)."""
        return [
            broker_pb2.SubscriberHoldings(
                topic=q.spec.topic,
                subscriber_id=q.spec.subscriber_id,
                last_enqueued=broker_pb2.Position(last_seq=_held_numbers(q)),
                serves=q.state in (SERVING, LEAVING),
                reclaims=(q.spec.topic, q.spec.subscriber_id) in self._reclaiming,
                away=q.state == AWAY,
                creations=self.lists.tags((q.spec.topic, q.spec.subscriber_id)),
            )
            for t in self.topics.values()
            for q in t.queue_list
            if q.spec.durable
        ]

    def apply_holdings(self, holdings: Sequence[broker_pb2.SubscriberHoldings]) -> None:
        """The peer put these numbers in its queues (all of them, for its current session); a queue
        here that has less may lack them. They are kept until the next session's: a queue created
        here meanwhile takes them when it is made (``_add_queue``), so no order of the peer's frame,
        its subscription list and an ``AcceptSubscriber`` leaves a new queue saying it holds
        everything (chaos seed 7102; a fresh-clone CI run with AcceptSubscriber between the two).

        A subscriber the peer served (away here) that the peer no longer serves (it restarted) is
        served here again by the active: otherwise each broker would redirect it to the other. When
        the peer reclaims it (invariant 7), the active instead sends the peer what its away copy holds
        after the peer's numbers (``fills_wanted``, sent by the pair's stream). And a restarted
        broker's own claims are settled here: kept, waiting for the fill, while the peer's copy is
        away; given up otherwise.
        """
        # Not those of a subscription deleted here that the peer still holds: made again here, it is
        # a new subscription, whose subscriber never acknowledges the old one's numbers (invariant 8).
        self._peer_holdings = {
            (held.topic, held.subscriber_id): held
            for held in holdings
            if self.lists.takes_holdings((held.topic, held.subscriber_id), held.creations)
        }
        if self._holes:
            self._mark_holes()
        raised = 0
        self.fills_wanted = {}
        for held in self._peer_holdings.values():
            topic = self.topics.get(held.topic)
            queue = topic.queues.get(held.subscriber_id) if topic else None
            if queue is None:
                continue
            raised += self._take_holdings(queue, held)
            self._settle_claims(queue, held)
        for name in [n for n in self._reclaiming if n not in self._peer_holdings]:
            self._end_reclaim(name, None, "the peer does not hold it")
        if self.role == ACTIVE:
            for topic in self.topics.values():
                for queue in topic.queue_list:
                    if queue.state == AWAY and (queue.spec.topic, queue.spec.subscriber_id) not in self._peer_holdings:
                        self.take_over(queue, "the peer does not hold it (it restarted without it)")
        if raised:
            log.info("the peer's holdings: %d publisher floor(s) raised (messages this broker may lack)", raised)

    # ------------------------------------------------------- restart claims --
    @property
    def reclaiming(self) -> int:
        """How many queues this broker, restarted, is settling with its peer (invariant 7)."""
        return len(self._reclaiming)

    def reclaim_overdue(self) -> str:
        """Why the claims being settled end now (invariant 7), or "" while they may go on: the peer's
        fill did not come ``RECLAIM_SECONDS`` (at least two peer timeouts) after this broker first
        heard the peer, or the peer was not heard that long after the queues were recovered."""
        wait = max(RECLAIM_SECONDS, 2 * self.pair.peer_timeout)
        if self._reclaim_since:
            late = time.monotonic() - self._reclaim_since > wait
            return f"the peer's fill did not come within {wait:g}s" if late else ""
        late = time.monotonic() - self._started > wait
        return f"the peer was not heard within {wait:g}s of the start" if late else ""

    def end_reclaims(self, why: str) -> None:
        """Give up every claim still being settled (the peer is gone, or this broker was promoted)."""
        for name in list(self._reclaiming):
            self._end_reclaim(name, None, why)

    def _end_reclaim(self, name: tuple[str, str], fill: list[tuple[int, StoredMessage]] | None, why: str) -> None:
        """Settle a claim: with the peer's ``fill``, serve the subscriber here again, the fill and what
        was held back queued in each publisher's order; without, keep the copy as a shadow, what was
        held back queued after what it holds (``SubscriptionQueue.end_hold_back``)."""
        queue = self._reclaiming.pop(name, None)
        self._fill_parts.pop(name, None)
        if queue is None:
            return
        self.holdings_version += 1  # the peer learns it no longer reclaims it (and whether it serves it)
        filled = queue.end_hold_back(fill)
        if fill is None:
            log.info("%s on %s: not serving it again (%s)", name[1], name[0], why)
            return
        self.take_over(queue, f"it served it before it restarted, and the peer filled in {filled} message(s) ({why})")

    def _apply_fill(self, fill: broker_pb2.QueueFill) -> None:
        """A chunk of what the peer's away copy holds for a subscriber this broker reclaims."""
        name = (fill.topic, fill.subscriber_id)
        if name not in self._reclaiming:
            return  # settled already (a fill sent again on a new stream)
        if fill.first:
            self._fill_parts[name] = []
        chunks = self._fill_parts.get(name)
        if chunks is None:
            return  # a chunk without its first: the stream broke and the peer sends it again
        chunks.append(fill)
        if not fill.last:
            return
        usages = (self.topics[fill.topic].usage, self.usage)  # a reclaimed queue's topic stays (_remove_queue)
        messages: list[tuple[int, StoredMessage]] = []
        for item in (item for chunk in chunks for item in chunk.items):
            header = broker_pb2.Message.FromString(item.message)
            stored = StoredMessage(header.publisher_id, header.publisher_seq, item.message, header.persistent, usages)
            stored.hold(1)
            messages.append((item.previous_seq, stored))
        queue = self._reclaiming.get(name)
        self._end_reclaim(name, messages, "the peer's copy is away")
        acked = dict(chunks[0].acked.last_seq)
        if queue is not None and acked:
            # What its subscriber acknowledged (as the peer's away copy knows it) is owed no more: what the
            # log lacked before its first record is not counted as lacking (an attacker's review: with its
            # subscriber away, the copy stayed behind for good).
            queue.acknowledged(acked)

    def fill_frames(self, sent: set[tuple[str, str]]) -> list[broker_pb2.QueueFill]:
        """The fills the peer asked for (its holdings reclaim a subscriber whose copy here is away)
        and that are not in ``sent`` yet, in chunks of at most :data:`FILL_CHUNK_BYTES`."""
        frames: list[broker_pb2.QueueFill] = []
        for name, position in self.fills_wanted.items():
            if name in sent:
                continue
            sent.add(name)
            topic = self.topics.get(name[0])
            queue = topic.queues.get(name[1]) if topic else None
            if queue is None or queue.state != AWAY:
                if queue is not None and queue.state in (SERVING, LEAVING):
                    queue.acked_dirty = True  # its watermark tells the peer it is served here
                continue
            chunk = broker_pb2.QueueFill(
                topic=name[0], subscriber_id=name[1], first=True, acked=broker_pb2.Position(last_seq=queue.acked)
            )
            size = 0
            for prev, payload in queue.fill_after(position):
                if size and size + len(payload) > FILL_CHUNK_BYTES:
                    frames.append(chunk)
                    chunk = broker_pb2.QueueFill(topic=name[0], subscriber_id=name[1])
                    size = 0
                chunk.items.add(previous_seq=prev, message=payload)
                size += len(payload)
            chunk.last = True
            frames.append(chunk)
        return frames

    def _settle_claims(self, queue: SubscriptionQueue, held: broker_pb2.SubscriberHoldings) -> None:
        """Invariant 7, on the peer's holdings for ``queue``: this broker's own claim (kept while the
        peer's copy is away, until the fill comes), and the peer's (an away copy here fills it in;
        one the peer neither serves nor reclaims is served here)."""
        name = (held.topic, held.subscriber_id)
        if name in self._reclaiming and not held.away:
            self._end_reclaim(name, None, "the peer's copy is not away")
        if queue.state == AWAY and self.role == ACTIVE:
            if held.reclaims:
                self.fills_wanted[name] = dict(held.last_enqueued.last_seq)
            elif not held.serves:
                self.take_over(queue, "the peer no longer serves it (it restarted)")

    def _take_holdings(
        self, queue: SubscriptionQueue, held: broker_pb2.SubscriberHoldings, *, new: bool = False
    ) -> int:
        """Raise ``queue``'s floor to what the peer holds of each publisher; how many rose.

        A ``new`` queue holds nothing from before it was made, so it may lack all of it, also of a
        publisher streaming now: the hole ``resume_publisher`` recorded went only to the queues
        that existed then."""
        raised = 0
        for publisher, seq in held.last_enqueued.last_seq.items():
            if publisher in self.streaming and not new:
                continue  # what the peer has more of is on its way here (or a recorded hole)
            if seq > queue.last_enqueued.get(publisher, 0) and queue.may_lack(publisher, seq):
                raised += 1
        return raised

    @property
    def caught_up(self) -> bool:
        """Whether this broker holds every message its durable subscribers have not acknowledged,
        as far as it knows: it had its peer's holdings of the peer's last session, and no queue
        lacks a message. It stays so when the peer goes silent (a standby whose active died holds
        what was acknowledged; the monitor promotes it at once), and is not so after a restart
        until the peer's holdings arrive (chaos seed 4242: a restarted broker, empty, was promoted
        over a standby that held everything), nor while a publisher's hole waits for them
        (``_unmarked``)."""
        return (not self.peer or self.pair.has_holdings) and not self._unmarked and self.queues_behind == 0

    @property
    def queues_behind(self) -> int:
        return sum(1 for t in self.topics.values() for q in t.queue_list if q.spec.durable and q.behind)

    # ------------------------------------------------------------ retention --
    async def tick_retention(self) -> None:
        """About once a second: discard what is past its queue's maximum age, and expire durable
        subscriptions nobody attached to for SUBSCRIPTION_EXPIRY."""
        if self.catalog_dirty:
            try:
                await self._save_catalog()
            except OSError as exc:
                log.error("could not write the catalog %s (trying again in a second): %s", self._catalog_path, exc)  # noqa: TRY400
        now_ns = time.time_ns()
        for topic in self.topics.values():
            for queue in topic.queue_list:
                queue.expire(now_ns)
        expiry = self.settings.subscription_expiry
        if not expiry:
            return
        now = time.monotonic()
        expired = [
            q
            for t in self.topics.values()
            for q in t.queue_list
            if q.spec.durable and not q.attached and q.state in (SERVING, LEAVING) and now - q.idle_since >= expiry
        ]
        why = f"nobody attached to it for {expiry:g} s (SOKUTATSU_BROKER_SUBSCRIPTION_EXPIRY)"
        names = [((q.spec.topic, q.spec.subscriber_id), self._expire(q, why)) for q in expired]
        if expired:
            self.expired_names = (self.expired_names + names)[-TOMBSTONES_KEPT:]
            # The next watermark frame after the write carries the list, and with it the expired names.
            await self._save_catalog()

    def _expire(self, queue: SubscriptionQueue, why: str) -> frozenset[str]:
        """Delete an expired durable subscription here; return its creation tags."""
        log.warning(
            "expired the durable subscription of %s to %s (%d messages, %d bytes on disk freed): %s",
            queue.spec.subscriber_id,
            queue.spec.topic,
            queue.depth,
            queue.file_bytes,
            why,
        )
        tags = self._remove_queue(queue)
        self.subscriptions_expired += 1
        return tags

    async def apply_removed(self, names: Sequence[broker_pb2.SubscriptionName], *, expired: bool) -> None:
        """The peer expired (``expired``) or a client deleted there these durable subscriptions: delete
        the copies here, but not one holding a creation the peer did not remove, nor one a subscriber is
        attached to here (invariant 8)."""
        what = "expired" if expired else "deleted"
        changed = 0
        for name in names:
            topic = self.topics.get(name.topic)
            queue = topic.queues.get(name.subscriber_id) if topic else None
            if queue is None or not queue.spec.durable:
                continue
            verdict = self.lists.peer_removed((name.topic, name.subscriber_id), name.creations, in_use=queue.attached)
            if verdict == KEPT:
                continue  # heard before, or by name on a copy in use: nothing changes, nothing goes back
            changed += 1
            if verdict == RENEWED:
                # The peer takes the copy back as a new one: with this copy's holdings, so that it does
                # not count itself as holding what it deleted (the holdings go with the next frame).
                self.holdings_version += 1
            if verdict != DELETE:
                log.info(
                    "kept %s's subscription to %s, which the peer %s: %s",
                    name.subscriber_id,
                    name.topic,
                    what,
                    "a subscriber is attached to it here" if queue.attached else "it was created again here",
                )
            elif expired:
                self._expire(queue, "the peer expired it")
            else:
                log.warning(
                    "deleted the durable subscription of %s to %s (%d messages): the peer deleted it",
                    name.subscriber_id,
                    name.topic,
                    queue.depth,
                )
                self._remove_queue(queue)
        if changed:
            # The peer hears the whole list after the write: without the copies deleted here, which
            # lets it forget their tags; with those kept, under their new creation's tag, which it adopts.
            await self._save_catalog()

    # ---------------------------------------------------------------- stats --
    def tick_rates(self) -> None:
        """Update per-queue in/out rates (called about once a second)."""
        alive = set()
        for topic in self.topics.values():
            for queue in topic.queue_list:
                key = id(queue)
                alive.add(key)
                now, enqueued, sent = queue.rates_sample()
                rates = self._rates.get(key)
                if rates is None:
                    self._rates[key] = Rates(now, enqueued, sent)
                    continue
                dt = now - rates.at
                if dt > 0:
                    rates.inflow = (enqueued - rates.enqueued) / dt
                    rates.outflow = (sent - rates.sent) / dt
                rates.at, rates.enqueued, rates.sent = now, enqueued, sent
        for key in set(self._rates) - alive:
            del self._rates[key]

    def stats(self) -> broker_pb2.BrokerStats:
        out = broker_pb2.BrokerStats(
            broker_id=self.settings.instance,
            role=self.role,
            time_unix_nano=time.time_ns(),
            held_count=self.usage.count,
            held_bytes=self.usage.bytes,
            rss_bytes=rss_bytes(),
            dropped_total=self.dropped_total,
            rejected_total=self.rejected_total,
            publisher_streams=self.publisher_streams,
            subscriber_streams=self.subscriber_streams,
            published_total=self.published_total,
            duplicates_total=self.duplicates_total,
            max_count=self.usage.max_count,
            max_bytes=self.usage.max_bytes,
            peer=self.peer,
            peer_up=self.peer_up,
            epoch=self.epoch,
            auth_refusals=self.auth_refusals(),
            caught_up=self.caught_up,
            queues_behind=self.queues_behind,
            retention=self.retention.to_proto(),
            subscription_expiry_s=round(self.settings.subscription_expiry),
            subscriptions_expired=self.subscriptions_expired,
        )
        now_ns = time.time_ns()
        # Once per WatchStats interval per watcher (the monitor's SOKUTATSU_MONITOR_STATS_INTERVAL_MS,
        # 100 ms by default), for every subscription: each entry is built in place (``add``, map
        # fields from dicts), the retention from fields its Retention keeps, not from throwaway protos.
        add = out.subscribers.add
        no_rates = Rates()
        for topic in self.topics.values():
            for queue in topic.queue_list:
                rates = self._rates.get(id(queue), no_rates)
                spec = queue.spec
                kept = queue.kept
                out.spilled_count += queue.disk_count
                out.spilled_bytes += queue.disk_bytes
                add(
                    subscriber_id=spec.subscriber_id,
                    topic=spec.topic,
                    connected=queue.attached,
                    depth=queue.depth,
                    memory_bytes=queue.memory_bytes,
                    memory_budget_bytes=spec.budget,
                    spilled_count=queue.disk_count + queue.spilling + len(queue.spill_buffer),
                    dropped_retention_bytes=kept.dropped_bytes,
                    dropped_retention_age=kept.dropped_age,
                    refused_publishes=kept.refused_publishes,
                    retention=queue.retention.proto_fields,
                    disk_bytes=queue.file_bytes,
                    oldest_age_ms=queue.oldest_age_ms(now_ns),
                    behind=spec.durable and queue.behind,
                    spilled_bytes=queue.disk_bytes,
                    in_flight=len(queue.in_flight),
                    credits=max(queue.credits, 0),
                    inflow_per_second=rates.inflow,
                    outflow_per_second=rates.outflow,
                    delivered={"last_seq": queue.delivered},
                    overflow_mode=spec.overflow_mode,
                    state=queue.state,
                    acked={"last_seq": queue.acked},
                )
        return out

"""The keys, publishers and subscribers of ``sokutatsu bench fanout``, per system.

* Keys: ``KEYS`` market keys named ``G<gg>.K<kkk>``, where ``gg`` is the key's number modulo
  ``GROUPS``; message ``seq`` (1, 2, ...) has key number ``(seq - 1) % KEYS``. A filtered
  subscriber ``j`` takes the keys of group ``j % GROUPS``, about 1/16 of them (18 or 19 of 300),
  by one prefix: ``G<gg>.`` (Sokutatsu: ``prefixes``; NATS: the subject filter
  ``fanout.G<gg>.*``; nats-server 2.9 has no list of filter subjects, so exact keys would not
  be comparable).
* **sokutatsu**: the SDK's ``Publisher`` to the broker pair (each batch acknowledged by both),
  durable ``Subscriber`` s (credits: the SDK's default 1,000) sharing one ``SubscriberConnection``
  per consumer process (one SubscribeMany stream per broker).
* **nats-push** / **nats-pull**: nats-py, a JetStream stream with file storage, acknowledged
  publishes (``publish_async``); per subscriber a durable consumer (explicit acks, at most
  ``PREFETCH`` unacknowledged): push consumers delivered to a callback, or pull consumers
  fetched in batches of up to 100. A consumer process holds one NATS connection for all its
  subscribers (as the Sokutatsu SDK's subscribers share one process).
* **nats-push-r3**: as nats-push, on a JetStream cluster of three nats-server processes the bench
  starts (``fanout.nats_cluster``), the stream replicated on all three (``num_replicas=3``): NATS with
  its messages on more than one server, as Sokutatsu's pair holds every message on both brokers. Its
  clients are given the cluster's URLs (``addresses``); the other NATS systems use ``NATS_URL``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sokutatsu.bench.peers_clients import WINDOW, publish_with_room

KEYS = 300
GROUPS = 16
TOPIC = "fanout"
STREAM = "SOKUTATSU_FANOUT"
SUBJECTS = "fanout.>"
PREFETCH = 1000
NATS_URL = "nats://127.0.0.1:4222"
SYSTEMS = ("sokutatsu", "nats-push", "nats-pull", "nats-push-r3")
# The stream's copies per NATS system (one server, or the bench's cluster of three).
REPLICAS = {"nats-push": 1, "nats-pull": 1, "nats-push-r3": 3}


def nats_servers(addresses: Sequence[str]) -> list[str]:
    """The NATS URLs to connect to: the bench's cluster when it gave them, else ``NATS_URL``."""
    return list(addresses) or [NATS_URL]


def key_of(seq: int) -> str:
    index = (seq - 1) % KEYS
    return f"G{index % GROUPS:02d}.K{index:03d}"


def group_of(seq: int) -> int:
    return ((seq - 1) % KEYS) % GROUPS


def subscriber_group(index: int, filtered: bool) -> int | None:
    """The key group subscriber ``index`` filters on (None: every key)."""
    return index % GROUPS if filtered else None


def expected(total: int, group: int | None) -> int:
    """How many of messages 1..total a subscriber of ``group`` must receive."""
    if group is None:
        return total
    return sum(1 for seq in range(1, total + 1) if group_of(seq) == group)


def subscriber_name(index: int) -> str:
    return f"fan-{index:03d}"


# --------------------------------------------------------------- publishers --
class KeyedSender(Protocol):
    async def send(self, key: str, body: bytes) -> None:
        """Hand one message over; waits only while ``WINDOW`` messages are unacknowledged."""

    async def flush(self) -> None:
        """Wait until every message handed over is acknowledged."""

    @property
    def frames(self) -> int | None:
        """Publish frames written so far, over every broker link (None: not known)."""


@dataclass
class _SokutatsuSender:
    pub: Any  # sokutatsu.client.Publisher

    async def send(self, key: str, body: bytes) -> None:
        await publish_with_room(self.pub, TOPIC, key, body)

    async def flush(self) -> None:
        await self.pub.flush()

    @property
    def frames(self) -> int | None:
        return int(self.pub.frames)


class _NatsSender:
    def __init__(self, js: Any) -> None:
        self.js = js
        self.failure: BaseException | None = None

    async def send(self, key: str, body: bytes) -> None:
        if self.failure is not None:
            raise self.failure
        future = await self.js.publish_async(f"{TOPIC}.{key}", body)  # waits once WINDOW are unacknowledged
        future.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None and self.failure is None:
            self.failure = future.exception()

    async def flush(self) -> None:
        await self.js.publish_async_completed()
        if self.failure is not None:
            raise self.failure

    @property
    def frames(self) -> int | None:
        return None  # nats-py writes what its flusher has buffered; not counted here


@contextlib.asynccontextmanager
async def sender(system: str, addresses: Sequence[str], linger_ms: float | None = None) -> AsyncIterator[KeyedSender]:
    """The publisher of ``system``; ``linger_ms``: the Sokutatsu publisher's linger (None: the SDK's default)."""
    if system == "sokutatsu":
        from sokutatsu.client import Publisher  # noqa: PLC0415
        from sokutatsu.client.publisher import DEFAULT_LINGER  # noqa: PLC0415
        from sokutatsu.core.tls import client_config  # noqa: PLC0415

        async with Publisher(
            list(addresses),
            "bench-fanout",
            max_pending=WINDOW,
            ack_timeout=300,
            config=client_config(),
            linger=DEFAULT_LINGER if linger_ms is None else linger_ms / 1000,
        ) as pub:
            yield _SokutatsuSender(pub)
        return
    import nats  # noqa: PLC0415

    nc = await nats.connect(servers=nats_servers(addresses))
    try:
        yield _NatsSender(nc.jetstream(publish_async_max_pending=WINDOW))
    finally:
        await nc.close()


async def prepare_nats(addresses: Sequence[str] = (), replicas: int = 1) -> None:
    """A fresh JetStream stream (file storage, ``replicas`` copies) for the run; its consumers are made by
    the subscribers. A cluster just started may not have elected its JetStream leader yet: retried for 30 s."""
    import nats  # noqa: PLC0415
    from nats.js import api  # noqa: PLC0415
    from nats.js.errors import NotFoundError  # noqa: PLC0415

    nc = await nats.connect(servers=nats_servers(addresses))
    try:
        js = nc.jetstream()
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                with contextlib.suppress(NotFoundError):
                    await js.delete_stream(STREAM)
                await js.add_stream(
                    name=STREAM, subjects=[SUBJECTS], storage=api.StorageType.FILE, num_replicas=replicas
                )
            except Exception:  # a cluster's JetStream not ready yet (no leader): try again until the deadline
                if replicas == 1 or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)
            else:
                return
    finally:
        await nc.close()


async def cleanup_nats(addresses: Sequence[str] = ()) -> None:
    import nats  # noqa: PLC0415
    from nats.js.errors import NotFoundError  # noqa: PLC0415

    nc = await nats.connect(servers=nats_servers(addresses))
    try:
        with contextlib.suppress(NotFoundError):
            await nc.jetstream().delete_stream(STREAM)
    finally:
        await nc.close()


# -------------------------------------------------------------- subscribers --
# Called with the message body for each delivery, in delivery order.
Take = Callable[[bytes], None]


@dataclass
class Wanted:
    """One subscriber of a consumer process."""

    name: str
    group: int | None
    take: Take


@contextlib.asynccontextmanager
async def subscribed(system: str, addresses: Sequence[str], wanted: Sequence[Wanted]) -> AsyncIterator[None]:
    """Every subscriber connected and receiving into its ``take`` (each delivery acknowledged)."""
    if system == "sokutatsu":
        async with _sokutatsu(addresses, wanted):
            yield
    else:
        async with _nats(system, addresses, wanted):
            yield


@contextlib.asynccontextmanager
async def _sokutatsu(addresses: Sequence[str], wanted: Sequence[Wanted]) -> AsyncIterator[None]:
    from sokutatsu.client import Subscriber, SubscriberConnection  # noqa: PLC0415
    from sokutatsu.core.tls import client_config  # noqa: PLC0415

    config = client_config()
    # The process's subscribers share one SubscribeMany stream per broker (as the NATS clients
    # share one connection per process).
    connection = SubscriberConnection(config=config)
    subs = [
        Subscriber(
            list(addresses),
            one.name,
            TOPIC,
            prefixes=[f"G{one.group:02d}."] if one.group is not None else [],
            durable=True,
            config=config,
            connection=connection,
        )
        for one in wanted
    ]
    tasks: list[asyncio.Task[None]] = []

    async def receive(sub: Any, take: Take) -> None:
        async for message in sub:
            take(message.body)

    try:
        for sub in subs:
            await sub.start()
        await asyncio.wait_for(asyncio.gather(*(s.connected.wait() for s in subs)), 60)
        tasks = [asyncio.create_task(receive(s, w.take)) for s, w in zip(subs, wanted, strict=True)]
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Every subscriber closed at once (each waits up to 2 s for its final acknowledgement).
        await asyncio.gather(*(s.close() for s in subs), return_exceptions=True)
        await connection.close()


@contextlib.asynccontextmanager
async def _nats(system: str, addresses: Sequence[str], wanted: Sequence[Wanted]) -> AsyncIterator[None]:
    import nats  # noqa: PLC0415
    from nats.js import api  # noqa: PLC0415

    nc = await nats.connect(servers=nats_servers(addresses))
    tasks: list[asyncio.Task[None]] = []
    try:
        js = nc.jetstream()
        for one in wanted:
            subject = f"{TOPIC}.G{one.group:02d}.*" if one.group is not None else SUBJECTS
            config = api.ConsumerConfig(
                ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL, max_ack_pending=PREFETCH
            )
            if system in ("nats-push", "nats-push-r3"):
                await js.subscribe(
                    subject,
                    durable=one.name,
                    stream=STREAM,
                    config=config,
                    manual_ack=True,
                    cb=_push_callback(one.take),
                )
            else:
                pull = await js.pull_subscribe(subject, durable=one.name, stream=STREAM, config=config)
                tasks.append(asyncio.create_task(_pull(pull, one.take)))
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()


def _push_callback(take: Take) -> Callable[[Any], Any]:
    from nats.errors import ConnectionClosedError  # noqa: PLC0415

    async def callback(message: Any) -> None:
        take(message.data)
        with contextlib.suppress(ConnectionClosedError):  # the process is closing its connection
            await message.ack()

    return callback


async def _pull(sub: Any, take: Take) -> None:
    from nats.errors import TimeoutError as NatsTimeout  # noqa: PLC0415

    while True:
        try:
            batch = await sub.fetch(batch=100, timeout=1.0)
        except NatsTimeout:
            continue
        for message in batch:
            take(message.data)
            await message.ack()

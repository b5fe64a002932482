"""``SubscriberConnection``: the subscribers of a process share one SubscribeMany stream per broker,
each with its own filter, credits, acknowledgements, position and redirects (real brokers)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import BufferFull, Closed, Message, Publisher, Subscriber, SubscriberConnection
from tests.broker.fix_broker import BrokerProcess, Pair, stats, subscriber_stats, until
from tests.broker.test_pair import TOPIC, switch
from tests.client.fake_broker import serve_stream

pytestmark = pytest.mark.timeout(180)


def _key(i: int) -> str:
    return f"{'ABCD'[i % 4]}.{i % 20:02d}"


async def _publish(addresses: list[str], publisher_id: str, count: int, *, pace: float = 0.0) -> None:
    """Messages 1..count; message s has key ``_key(s - 1)`` and body ``publisher:s``."""
    async with Publisher(addresses, publisher_id, ack_timeout=60) as pub:
        for i in range(count):
            while True:
                try:
                    pub.publish_nowait(TOPIC, _key(i), f"{publisher_id}:{i + 1}".encode())
                    break
                except BufferFull:
                    await pub.flush()
            if pace and i % 50 == 49:
                await asyncio.sleep(pace)
        await pub.flush()


class Reader:
    """Reads one subscriber into a list until it has ``count`` messages; notes the brokers it used."""

    def __init__(self, sub: Subscriber, count: int) -> None:
        self.sub = sub
        self.count = count
        self.got: list[Message] = []
        self.brokers: list[str] = []
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        async for message in self.sub:
            self.got.append(message)
            if not self.brokers or self.brokers[-1] != self.sub.broker_id:
                self.brokers.append(self.sub.broker_id)
            if len(self.got) == self.count:
                break

    def seqs(self) -> dict[str, list[int]]:
        per: dict[str, list[int]] = defaultdict(list)
        for m in self.got:
            assert m.body == f"{m.publisher_id}:{m.publisher_seq}".encode()
            per[m.publisher_id].append(m.publisher_seq)
        return dict(per)


async def test_subscribers_share_one_stream_and_each_gets_its_own_keys(broker: BrokerProcess) -> None:
    total = 2000
    prefixes = {"a": ["A."], "b": ["B."], "ab": ["A.", "B."], "all": []}
    wanted = {name: [s for s in range(1, total + 1) if not p or _key(s - 1)[:2] in p] for name, p in prefixes.items()}
    async with SubscriberConnection() as connection:
        readers = {
            name: Reader(
                Subscriber(
                    broker.address, name, TOPIC, prefixes=p, durable=True, flow_limit=100, connection=connection
                ),
                len(wanted[name]),
            )
            for name, p in prefixes.items()
        }
        for r in readers.values():
            await r.sub.start()
        await asyncio.wait_for(asyncio.gather(*(r.sub.connected.wait() for r in readers.values())), 30)
        assert connection.streams == 1
        assert (await stats(broker.address)).subscriber_streams == 4
        tasks = [asyncio.create_task(r.run()) for r in readers.values()]
        await _publish([broker.address], "feed", total)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for r in readers.values():
            await r.sub.close()
        for name, r in readers.items():
            assert r.seqs() == {"feed": wanted[name]}, name
            assert not r.sub.gaps
            assert r.sub.duplicates == 0
        # Each acknowledged what it processed, on close, over the shared stream.
        for name in prefixes:
            acked = (await subscriber_stats(broker.address, name)).acked.last_seq
            assert acked.get("feed") == wanted[name][-1], name

        async def detached() -> bool:
            return (await stats(broker.address)).subscriber_streams == 0

        await until(detached, "every subscription closed on the shared stream")
    with pytest.raises(Closed):
        connection.link(broker.address)


async def test_a_subscriber_of_a_closed_connection_raises_closed(broker: BrokerProcess) -> None:
    connection = SubscriberConnection()
    await connection.close()
    async with Subscriber(broker.address, "late", TOPIC, connection=connection) as sub:
        with pytest.raises(Closed):
            await asyncio.wait_for(anext(sub), 30)


@pytest.mark.parametrize("delivery_workers", ["0", "1"])
async def test_switchover_moves_one_shared_subscriber_and_loses_or_doubles_nothing(
    pair_factory: Callable[..., Awaitable[Pair]], delivery_workers: str
) -> None:
    """With a delivery worker per broker too (docs/broker.md, Delivery workers): each broker's
    stream then sits at that broker's worker, and the switchover is the same to the client."""
    pair = await pair_factory(delivery_workers=delivery_workers)
    total = 6000
    async with SubscriberConnection() as connection:
        moved = Reader(Subscriber(pair.addresses, "moved", TOPIC, durable=True, connection=connection), total)
        stays = Reader(Subscriber(pair.addresses, "stays", TOPIC, durable=True, connection=connection), total)
        for r in (moved, stays):
            await r.sub.start()
        await asyncio.wait_for(asyncio.gather(moved.sub.connected.wait(), stays.sub.connected.wait()), 30)
        tasks = [asyncio.create_task(r.run()) for r in (moved, stays)]
        publishing = asyncio.create_task(_publish(pair.addresses, "feed", total, pace=0.01))

        async def going() -> bool:
            return len(moved.got) > 1000

        await until(going, "the subscribers to get going")
        await switch(pair.active, pair.standby, "broker-b", "moved")

        async def on_b() -> bool:
            return moved.sub.broker_id == "broker-b" and len(moved.got) > 2500

        await until(on_b, "the moved subscriber to receive on the standby")
        # One stream per broker now; the other subscriber stayed on the active's.
        assert connection.streams == 2
        if delivery_workers != "0":
            workers = {b.address: (await _workers(b.address))[0].address for b in pair.brokers}
            assert {a: link.target for a, link in connection._links.items()} == workers
        assert stays.sub.broker_id == "broker-a"
        await switch(pair.standby, pair.active, "broker-a", "moved")
        await publishing
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for r in (moved, stays):
            await r.sub.close()
    for r in (moved, stays):
        assert r.seqs() == {"feed": list(range(1, total + 1))}, r.sub.subscriber_id
        assert not r.sub.gaps
        assert r.sub.duplicates == 0
    assert moved.brokers == ["broker-a", "broker-b", "broker-a"]
    assert stays.brokers == ["broker-a"]


async def _workers(address: str) -> list[broker_pb2.DeliveryWorkerStats]:
    return list((await stats(address)).delivery_workers)


class ManyOpens:
    """A SubscribeMany endpoint that records each open's ``redirected`` and answers it with ``reply``
    (a Redirect, or Subscribed then an end, OK), keeping the stream open."""

    def __init__(self, reply: Callable[[int], list[broker_pb2.SubscriptionResponse]]) -> None:
        self.reply = reply
        self.redirected: list[bool] = []

    async def subscribe_many(
        self, requests: AsyncIterator[broker_pb2.SubscribeManyRequest], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[broker_pb2.SubscribeManyResponse]:
        async for request in requests:
            for frame in request.frames:
                if frame.WhichOneof("frame") == "open":
                    self.redirected.append(frame.open.redirected)
                    yield broker_pb2.SubscribeManyResponse(frames=self.reply(frame.id))

    async def serve(self) -> tuple[aio.Server, str]:
        return await serve_stream(
            "SubscribeMany", self.subscribe_many, broker_pb2.SubscribeManyRequest, broker_pb2.SubscribeManyResponse
        )


async def test_on_a_shared_stream_the_open_after_a_redirect_says_so_and_no_other_does() -> None:
    def served(lane: int) -> list[broker_pb2.SubscriptionResponse]:
        return [
            broker_pb2.SubscriptionResponse(id=lane, subscribed=broker_pb2.Subscribed(broker_id="b")),
            broker_pb2.SubscriptionResponse(id=lane, ended=broker_pb2.SubscriptionEnded(code=0, message="taken over")),
        ]

    b = ManyOpens(served)
    b_server, b_address = await b.serve()

    def moved(lane: int) -> list[broker_pb2.SubscriptionResponse]:
        return [broker_pb2.SubscriptionResponse(id=lane, redirect=broker_pb2.Redirect(target=b_address))]

    a = ManyOpens(moved)
    a_server, a_address = await a.serve()
    try:
        async with SubscriberConnection() as connection, Subscriber([a_address], "desk", TOPIC, connection=connection):

            async def twice_round() -> bool:
                return len(a.redirected) >= 2 and len(b.redirected) >= 2

            await until(twice_round, "the SDK to go round a (redirected) and b (subscription ended) twice")
            # Each subscription ended on its stream; the streams stayed (one per broker).
            assert connection.streams == 2
    finally:
        await asyncio.gather(a_server.stop(None), b_server.stop(None))
    assert not any(a.redirected), a.redirected  # on its own: first, and after b ended the subscription
    assert all(b.redirected), b.redirected  # each time straight from a's redirect

"""What a reconnect acknowledges: what the application processed, never what only sits in the SDK's
buffer. A real broker; the subscriber's connection is cut by a proxy, and the SDK reconnects on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import Message, Publisher, Subscriber
from tests.broker.fix_broker import BrokerProcess, until
from tests.client.fake_broker import serve_stream
from tests.monitor.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def _durable_behind_a_proxy(broker_factory: Callable[..., BrokerProcess]) -> AsyncIterator[tuple[str, TcpProxy]]:
    """A broker with durable subscription desk on prices, and a proxy to it whose connections a test cuts."""
    broker = broker_factory()
    broker.start()
    proxy = TcpProxy(broker.address)
    await proxy.start()
    try:
        async with Subscriber(broker.address, "desk", "prices", durable=True) as sub:
            await asyncio.wait_for(sub.connected.wait(), 10)
        yield broker.address, proxy
    finally:
        await proxy.close()


async def _drain(sub: Subscriber) -> list[Message]:
    got: list[Message] = []
    while True:
        try:
            got.append(await asyncio.wait_for(anext(sub), 3))
        except TimeoutError:
            return got


@pytest.mark.parametrize("handled_any_of_feed", [True, False])
async def test_messages_buffered_unprocessed_at_a_reconnect_stay_owed(
    broker_factory: Callable[..., BrokerProcess], handled_any_of_feed: bool
) -> None:
    """Found by an attacker's review: the application has handled 4 of feed's 50 messages, the rest wait
    in the SDK's buffer; the connection drops and the SDK reconnects by itself (as after any broken
    stream, a switchover's redirect or a failover); then the application stops and stores
    ``Subscriber.position``, as docs/broker.md says. Before, the SDK reopened with the position it had
    *received* (50), which the broker takes as acknowledged and releases: a later process resuming
    from the stored position (4) never got 5..50, told them as a gap when feed published again (and
    told nothing when the application had handled none of feed). Now the SDK reopens from what was
    processed; the broker sends the buffered messages again and the SDK drops them (its received
    numbers), so nothing is handed twice either."""
    async with _durable_behind_a_proxy(broker_factory) as (address, proxy):
        async with Publisher(address, "other") as other:
            await other.publish("prices", "K0", b"o1")
        async with Publisher(address, "feed") as feed:
            for i in range(50):
                feed.publish_nowait("prices", f"K{i % 5}", b"f")
            await feed.flush()
            sub = Subscriber(proxy.address, "desk", "prices", durable=True, on_gap="report")
            await sub.start()
            handed = [await sub.__anext__()]  # other 1
            if handled_any_of_feed:
                handed += [await sub.__anext__() for _ in range(4)]  # feed 1..4

            async def buffered() -> bool:
                return sub._received.get("feed", 0) == 50

            await until(buffered, "feed's 50 messages in the SDK's buffer")
            before = sub.broker_id, sub._call
            proxy.cut()

            async def reconnected() -> bool:
                return sub.connected.is_set() and sub._call is not None and sub._call is not before[1]

            await until(reconnected, "the SDK to reconnect")
            handed += [await sub.__anext__()]  # the application goes on a little, then stops
            await sub.close()
            stored = sub.position
            await feed.publish("prices", "K0", b"f51")
        again = Subscriber(address, "desk", "prices", durable=True, position=stored, on_gap="report")
        async with again:
            handed += await _drain(again)
    numbers = [(m.publisher_id, m.publisher_seq) for m in handed]
    assert sorted(n for p, n in numbers if p == "feed") == list(range(1, 52)), numbers
    assert len(set(numbers)) == len(numbers), "a message handed twice"
    assert (sub.gaps, again.gaps) == ([], [])


async def test_after_a_reconnect_the_buffer_is_sent_again_dropped_and_the_stream_goes_on(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """The other half of the mend above: with the buffer full (``flow_limit`` 20 of 60 published) when the
    connection drops, the broker sends those 20 again within the new open's credits; the SDK drops
    them (not counted as duplicates) and the stream goes on to the last message: each handed once, in
    order, no gap."""
    async with _durable_behind_a_proxy(broker_factory) as (address, proxy):
        async with Publisher(address, "feed") as feed:
            for i in range(60):
                feed.publish_nowait("prices", f"K{i % 5}", b"f")
            await feed.flush()
        sub = Subscriber(proxy.address, "desk", "prices", durable=True, flow_limit=20, on_gap="report")
        async with sub:
            handed = [await anext(sub) for _ in range(3)]

            async def full() -> bool:
                return sub._received.get("feed", 0) == 22  # 3 handed (2 processed), 20 more buffered

            await until(full, "the SDK's buffer to fill")
            before = sub._call
            proxy.cut()

            async def reconnected() -> bool:
                return sub.connected.is_set() and sub._call is not None and sub._call is not before

            await until(reconnected, "the SDK to reconnect")
            handed += await _drain(sub)
            assert (sub.duplicates, sub.gaps) == (0, [])
    assert [m.publisher_seq for m in handed] == list(range(1, 61))


class _CreditedFake:
    """A broker's Subscribe stream that keeps the broker's credit rule (it sends at most the open's
    credits plus what credit frames grant) and, from the second session on, sends every message it holds
    after the open's position, as broker.py does; the first session sends ``first`` and ends."""

    def __init__(self, first: list[broker_pb2.Message], held: list[broker_pb2.Message]) -> None:
        self.first = first
        self.held = held
        self.sessions = 0
        self.sent_again = 0

    async def subscribe(
        self, requests: AsyncIterator[broker_pb2.SubscribeRequest], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[broker_pb2.SubscribeResponse]:
        opening = (await anext(requests)).open
        self.sessions += 1
        credits = opening.credits
        granted = asyncio.Event()

        async def read() -> None:
            nonlocal credits
            async for request in requests:
                credits += request.credit.credits
                granted.set()

        reader = asyncio.create_task(read())
        yield broker_pb2.SubscribeResponse(subscribed=broker_pb2.Subscribed(broker_id="fake"))
        try:
            after = opening.position.last_seq.get("p", 0)
            todo = self.first if self.sessions == 1 else [m for m in self.held if m.publisher_seq > after]
            while todo:
                while credits <= 0:
                    granted.clear()
                    await granted.wait()
                batch, todo = todo[:credits], todo[credits:]
                credits -= len(batch)
                self.sent_again += len(batch) if self.sessions > 1 else 0
                yield broker_pb2.SubscribeResponse(batch=broker_pb2.DeliveryBatch(messages=batch))
            if self.sessions == 1:
                await asyncio.sleep(0.3)
                return  # the stream ends: the SDK reconnects
            await asyncio.sleep(3600)
        finally:
            reader.cancel()


def _message(seq: int, prev: int) -> broker_pb2.Message:
    return broker_pb2.Message(publisher_id="p", publisher_seq=seq, previous_seq=prev, key="K", body=b"x")


async def test_a_copy_that_sends_again_what_was_skipped_as_a_gap_does_not_stop_the_stream() -> None:
    """A review of the mend above: session 1 sends 1, 2, then 100..107 naming 99 (3..99 told as a gap);
    session 2 comes from a copy that holds 3..99 after all (the other broker) and sends everything after
    the processed position. The SDK drops 3..99 (at or below what it received). With the open's credits
    counting on the broker sending the buffer again, those drops used the credits up for good and the
    stream stopped at 107; each dropped message now gives its credit back."""
    fake = _CreditedFake(
        [_message(1, 0), _message(2, 1), *(_message(s, s - 1) for s in range(100, 108))],
        [_message(s, s - 1) for s in range(1, 300)],
    )
    server, address = await serve_stream(
        "Subscribe", fake.subscribe, broker_pb2.SubscribeRequest, broker_pb2.SubscribeResponse
    )
    try:
        async with Subscriber(address, "desk", "prices", flow_limit=10, on_gap="report", ack_interval=0.02) as sub:

            async def buffered_then_reopened() -> bool:
                return sub._received.get("p", 0) == 107 and fake.sessions >= 2 and sub.connected.is_set()

            await until(buffered_then_reopened, "session 1 to fill the buffer, then the reconnect")
            got = [(await asyncio.wait_for(anext(sub), 30)).publisher_seq for _ in range(2 + 8 + 192)]
    finally:
        await server.stop(None)
    assert got == [1, 2, *range(100, 300)]
    assert [(g.first_missing, g.last_missing) for g in sub.gaps] == [(3, 99)]


async def test_the_buffer_stays_within_flow_limit_when_the_broker_no_longer_holds_it() -> None:
    """The other case of that review: session 2's copy no longer holds 1..10 (its retention discarded
    them); credits given for sending them again went to new messages, and the buffer held twice
    ``flow_limit`` (20 here)."""
    fake = _CreditedFake([_message(s, s - 1) for s in range(1, 11)], [_message(s, s - 1) for s in range(11, 100)])
    server, address = await serve_stream(
        "Subscribe", fake.subscribe, broker_pb2.SubscribeRequest, broker_pb2.SubscribeResponse
    )
    try:
        async with Subscriber(address, "desk", "prices", flow_limit=10, on_gap="report") as sub:

            async def reopened() -> bool:
                return fake.sessions >= 2 and sub.connected.is_set()

            await until(reopened, "the reconnect")
            await asyncio.sleep(0.5)  # what the broker would send by now has come (a bound, not a timing check)
            assert len(sub._buffer) <= 10 + 1  # an open asks for one credit at least, its buffer full or not
    finally:
        await server.stop(None)

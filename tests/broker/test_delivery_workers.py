"""Delivery workers (SOKUTATSU_BROKER_DELIVERY_WORKERS): a broker whose SubscribeMany streams are
served by worker processes and relayed to it, with real broker, worker and client processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc import aio

from sokutatsu.broker.delivery_link import CANCEL, HEADER, HELLO, OPEN
from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import Subscriber, SubscriberConnection
from sokutatsu.client._retry import broken_write
from tests.broker.fix_broker import BrokerProcess, Pair, stats, subscriber_stats, until
from tests.broker.raw import (
    ManyReader,
    batch,
    many_open,
    message,
    moved_to,
    open_publish,
    publish,
    start_many,
)
from tests.broker.test_pair import TOPIC
from tests.client.test_subscriber_connection import Reader, _key, _publish
from tests.security.fix_auth import AuthFile, auth_file

__all__ = ["auth_file"]  # the fixture, for the test below

pytestmark = pytest.mark.timeout(180)


async def _workers(address: str) -> list[broker_pb2.DeliveryWorkerStats]:
    return list((await stats(address)).delivery_workers)


def _link_of(worker: int) -> Path:
    """The link socket a worker was started with: python -m sokutatsu.broker.delivery_worker LINK INDEX LISTEN."""
    return Path(Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")[3].decode())


def _exists(path: Path) -> bool:
    return path.exists()


def _gone(pid: int) -> bool:
    """No such process, or only its exit status is left (a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state == "Z"


async def test_subscribers_on_two_workers_get_everything_once_in_order_within_credits(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(delivery_workers="2")
    broker.start()
    workers = await _workers(broker.address)
    assert [w.ready for w in workers] == [True, True]
    ports = {w.address.rpartition(":")[2] for w in workers}

    # Frame by frame through a worker: test_subscribe_many.py's credits test, with a worker.
    assert (await moved_to(broker.address)).rpartition(":")[2] in ports

    # The SDK: eight connections (a stream each) spread over both workers, each subscriber filtered.
    total = 3000
    prefixes = [[] if i % 2 else ["A." if i % 4 == 0 else "B."] for i in range(8)]
    wanted = {
        f"s{i}": [s for s in range(1, total + 1) if not p or _key(s - 1).startswith(p[0])]
        for i, p in enumerate(prefixes)
    }
    connections = [SubscriberConnection() for _ in range(8)]
    readers = [
        Reader(
            Subscriber(broker.address, name, TOPIC, durable=True, prefixes=p, connection=connections[i]),
            len(wanted[name]),
        )
        for i, (name, p) in enumerate(zip(wanted, prefixes, strict=True))
    ]
    try:
        for r in readers:
            await r.sub.start()
        await asyncio.wait_for(asyncio.gather(*(r.sub.connected.wait() for r in readers)), 60)
        before = await _workers(broker.address)
        # Every stream went to a worker, four to each.
        targets = [c._links[broker.address].target for c in connections]
        assert {t.rpartition(":")[2] for t in targets} == ports
        assert sorted(w.streams for w in before) == [4, 4]
        tasks = [asyncio.create_task(r.run()) for r in readers]
        await _publish([broker.address], "feed", total)
        await asyncio.wait_for(asyncio.gather(*tasks), 90)
        after = await _workers(broker.address)
        for r in readers:
            await r.sub.close()
    finally:
        for c in connections:
            await c.close()
    for (name, want), r in zip(wanted.items(), readers, strict=True):
        assert r.seqs() == {"feed": want}, name
        assert r.sub.duplicates == 0
        assert not r.sub.gaps
    # What one wake-up of the core produced for a worker went out in one write: fewer writes than frames.
    frames = sum(a.link_frames - b.link_frames for a, b in zip(after, before, strict=True))
    writes = sum(a.link_writes - b.link_writes for a, b in zip(after, before, strict=True))
    assert frames > 0
    assert writes * 3 <= frames * 2, (frames, writes)


async def test_a_killed_worker_s_streams_end_its_clients_reopen_and_it_is_started_again(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    broker = broker_factory(delivery_workers="2")
    broker.start()
    # A raw stream through worker 0 that nobody reopens: its lanes are detached when the worker dies.
    first = await _workers(broker.address)
    by_port = {w.address.rpartition(":")[2]: w for w in first}
    raw_at = await moved_to(broker.address)
    victim = by_port[raw_at.rpartition(":")[2]]
    total = 4000
    async with aio.insecure_channel(raw_at) as channel:
        reader = ManyReader(start_many(channel))
        await reader.send(many_open(1, "raw-1", TOPIC, 100), many_open(2, "raw-2", TOPIC, 100))
        await reader.until(lambda: all("subscribed" in reader.kinds(lane) for lane in (1, 2)))
        # SDK subscribers: two connections, one on each worker (the raw stream counts for the victim).
        connections = [SubscriberConnection() for _ in range(2)]
        readers = [
            Reader(Subscriber(broker.address, f"sdk-{i}", TOPIC, durable=True, connection=c), total)
            for i, c in enumerate(connections)
        ]
        try:
            for r in readers:
                await r.sub.start()
            await asyncio.wait_for(asyncio.gather(*(r.sub.connected.wait() for r in readers)), 60)
            assert (await stats(broker.address)).subscriber_streams == 4
            tasks = [asyncio.create_task(r.run()) for r in readers]
            publishing = asyncio.create_task(_publish([broker.address], "feed", total, pace=0.01))

            async def going() -> bool:
                return all(len(r.got) > 500 for r in readers)

            await until(going, "the subscribers to get going")
            os.kill(victim.pid, 9)

            async def restarted() -> bool:
                w = (await _workers(broker.address))[victim.index]
                return w.ready and w.restarts == 1 and w.pid not in (0, victim.pid)

            await until(restarted, "the broker to start the killed worker again")
            await publishing
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            for r in readers:
                await r.sub.close()
        finally:
            for c in connections:
                await c.close()
        with pytest.raises(aio.AioRpcError) as broken:
            await reader.until(lambda: False)
        assert broken.value.code().name == "UNAVAILABLE"

    async def detached() -> bool:
        return (await stats(broker.address)).subscriber_streams == 0

    # The raw lanes were detached once the worker's link closed (nobody reopened them).
    await until(detached, "the killed worker's lanes to be detached")
    for r in readers:
        assert r.seqs() == {"feed": list(range(1, total + 1))}, r.sub.subscriber_id
        assert r.sub.duplicates == 0
        assert not r.sub.gaps


async def test_a_killed_broker_leaves_no_worker(broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(delivery_workers="2")
    broker.start()
    pids = [w.pid for w in await _workers(broker.address)]
    assert all(pids)
    assert len(set(pids)) == 2
    link = _link_of(pids[0])
    assert _exists(link)
    broker.kill9()

    async def gone() -> bool:
        return all(_gone(pid) for pid in pids)

    await until(gone, "the workers of a killed broker to exit")
    # The dead broker could not remove its link's private folder: its workers did.
    assert not _exists(link.parent)


async def test_a_worker_checks_each_frame_s_auth_and_the_core_counts_the_principal_s_streams(
    broker_factory: Callable[..., BrokerProcess], auth_file: AuthFile
) -> None:
    broker = broker_factory(delivery_workers="1", max_streams_per_client="2")
    broker.env.update(auth_file.env("svc"))
    broker.start()
    app = auth_file.metadata("app")
    worker = await moved_to(broker.address, app)
    assert worker == (await _workers_as(broker.address, auth_file.metadata("admin")))[0].address

    async def refused(metadata: tuple[tuple[str, str], ...], *frames: broker_pb2.SubscriptionRequest) -> str:
        """The code a new stream with these frames ends with. A write racing a refusal at the stream's
        start can fail with grpc.aio's INTERNAL "Internal error from Core", which overwrites the
        broker's status (grpc/grpc#36066; 5 of 120 runs under load): the SDK opens the stream again
        then (``_retry.broken_write``), and so does this."""
        for _attempt in range(5):
            async with aio.insecure_channel(worker) as channel:
                reader = ManyReader(start_many(channel, metadata))

                async def refusal(reader: ManyReader) -> None:
                    # The write itself may fail: a call without credentials can be refused before it.
                    await reader.send(*frames)
                    await asyncio.wait_for(reader.until(lambda: False), 30)  # a hang guard, not a measure

                with pytest.raises(aio.AioRpcError) as error:
                    await refusal(reader)
                if not broken_write(error.value):
                    code = error.value.code().name
                    # A refusal the test did not expect says what the client was told and what the broker logged.
                    return code if code != "INTERNAL" else f"{code}: {error.value.details()}\n{broker.log()[-4000:]}"
        return "INTERNAL from every write (grpc/grpc#36066)"

    assert await refused((), many_open(1, "app-1", "t.x", 10)) == "UNAUTHENTICATED"
    assert await refused(app, many_open(1, "other-1", "t.x", 10)) == "PERMISSION_DENIED"  # not app's id
    assert await refused(app, many_open(1, "app-1", "u.x", 10)) == "PERMISSION_DENIED"  # no grant on u.*
    async with aio.insecure_channel(worker) as channel:
        reader = ManyReader(start_many(channel, app))
        # The stream and one subscription are the principal's two streams: a second subscription is over.
        await reader.send(many_open(1, "app-1", "t.x", 10), many_open(2, "app-2", "t.x", 10))
        await reader.until(lambda: bool(reader.kinds(1)) and bool(reader.kinds(2)))
        # A refused first open says why (a CI run saw it ended once: the refused streams above still counted?).
        assert reader.kinds(1) == ["subscribed"], [e.ended for e in reader.events[1]]
        assert reader.events[2][0].ended.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        # The core counts the principal, not the connection: another connection's stream is over too.
        assert await refused(app, many_open(1, "app-3", "t.x", 10)) == "RESOURCE_EXHAUSTED"
        reader.call.cancel()


async def test_a_frame_the_worker_refuses_ends_the_client_s_stream_only_after_the_core_released_it(
    broker_factory: Callable[..., BrokerProcess], auth_file: AuthFile
) -> None:
    """A frame auth refuses on a worker ends the client's stream as any other end of it does: the
    core releases what the stream counted for the principal first. Before, the auth interceptor's
    ``abort`` sent the client the status at once, so a client that opened another stream right away
    could be refused for the one that had ended (a fresh-clone CI run, under load: RESOURCE_EXHAUSTED).
    Here the core is stopped (SIGSTOP) when the frame is refused: the client's stream stays open until
    the core runs again, then ends PERMISSION_DENIED, and the next stream of the principal is served."""
    broker = broker_factory(delivery_workers="1", max_streams_per_client="2")
    broker.env.update(auth_file.env("svc"))
    broker.start()
    assert broker.process is not None
    app = auth_file.metadata("app")
    worker = await moved_to(broker.address, app)
    async with aio.insecure_channel(worker) as channel:
        reader = ManyReader(start_many(channel, app))
        await reader.send(many_open(1, "app-1", "t.x", 10))
        await reader.until(lambda: "subscribed" in reader.kinds(1))  # the core counts this stream for app
        os.kill(broker.process.pid, signal.SIGSTOP)
        try:
            await reader.send(many_open(2, "app-2", "u.x", 10))  # no grant on u.*: refused by the worker
            await asyncio.sleep(0.5)  # well within the worker's wait for the core (CANCEL_ANSWER_SECONDS)
            assert not reader.call.done(), "the client's stream ended before the core released it"
        finally:
            os.kill(broker.process.pid, signal.SIGCONT)
        with pytest.raises(aio.AioRpcError) as error:
            await asyncio.wait_for(reader.until(lambda: False), 30)  # a hang guard, not a measure
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with aio.insecure_channel(worker) as channel:
        reader = ManyReader(start_many(channel, app))
        await reader.send(many_open(1, "app-3", "t.x", 10))
        await reader.until(lambda: bool(reader.kinds(1)))
        assert reader.kinds(1) == ["subscribed"], [e.ended for e in reader.events[1]]
        reader.call.cancel()


async def _workers_as(address: str, metadata: tuple[tuple[str, str], ...]) -> list[broker_pb2.DeliveryWorkerStats]:
    async with aio.insecure_channel(address) as channel:
        reply = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
            broker_pb2.GetStatsRequest(), metadata=metadata, timeout=10
        )
    return list(reply.delivery_workers)


async def test_kill9_of_the_active_core_with_workers_fails_over_with_nothing_lost(
    pair_factory: Callable[..., Awaitable[Pair]],
) -> None:
    pair = await pair_factory(delivery_workers="1")
    old_worker = (await _workers(pair.active.address))[0].pid
    total = 4000
    async with SubscriberConnection() as connection:
        readers = [
            Reader(Subscriber(pair.addresses, f"desk-{i}", TOPIC, durable=True, connection=connection), total)
            for i in range(2)
        ]
        for r in readers:
            await r.sub.start()
        await asyncio.wait_for(asyncio.gather(*(r.sub.connected.wait() for r in readers)), 30)
        tasks = [asyncio.create_task(r.run()) for r in readers]
        publishing = asyncio.create_task(_publish(pair.addresses, "feed", total, pace=0.01))

        async def going() -> bool:
            return all(len(r.got) > 800 for r in readers)

        await until(going, "delivery to get going")
        pair.active.kill9()
        await publishing
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        # The survivor's stream is at the survivor's worker.
        survivor = (await _workers(pair.standby.address))[0].address
        assert connection._links[pair.standby.address].target == survivor
        for r in readers:
            await r.sub.close()
    for r in readers:
        assert r.seqs() == {"feed": list(range(1, total + 1))}, r.sub.subscriber_id
        assert r.sub.duplicates == 0
        assert not r.sub.gaps
        assert r.brokers == ["broker-a", "broker-b"]

    async def gone() -> bool:
        return _gone(old_worker)

    await until(gone, "the dead active's worker to exit")


def _link_frame(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), stream, kind) + payload


async def test_a_cancel_that_comes_with_its_open_leaves_no_stream_on_the_link(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """The core reads a link's frames in whatever pieces they arrive: a client that opens and cancels at
    once may have its OPEN and CANCEL read together, the CANCEL cancelling the relay's task before it
    ran. That stream must not stay counted on the link (it did: the task's own clean-up never ran)."""
    broker = broker_factory(delivery_workers="1")
    broker.start()
    (worker,) = await _workers(broker.address)
    link = _link_of(worker.pid)
    # This test stands in for the worker on its link, frame by frame; the worker, paused, cannot notice
    # that it lost its link (nor be started again) until the test is done.
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        _, writer = await asyncio.open_unix_connection(str(link))
        hello = {"index": 0, "pid": os.getpid(), "address": "127.0.0.1:1"}
        writer.write(
            _link_frame(HELLO, 0, json.dumps(hello).encode())
            + _link_frame(OPEN, 1, b"null")
            + _link_frame(CANCEL, 1)  # in the same read as its OPEN
        )
        await writer.drain()

        async def ours() -> bool:
            return (await _workers(broker.address))[0].address == "127.0.0.1:1"

        await until(ours, "the core to take the test's link for worker 0")

        async def forgotten() -> bool:
            return (await _workers(broker.address))[0].streams == 0

        await until(forgotten, "the core to forget the cancelled stream", limit=10)
        writer.close()
    finally:
        os.kill(worker.pid, signal.SIGCONT)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# A client that never reads, sending opens the broker refuses (each one a SubscriptionEnded of about 250
# bytes for a 22-byte frame): REFUSALS of them hold about 100 MiB of answers unless the broker stops
# reading the client's frames while it holds what it has not written yet.
REFUSED_PER_REQUEST = 50_000
REQUESTS = 8
GROWTH_BOUND = 48 * 2**20


@pytest.mark.parametrize("workers", ["0", "1"])
async def test_a_client_that_never_reads_cannot_make_the_broker_hold_its_answers_without_bound(
    broker_factory: Callable[..., BrokerProcess], workers: str
) -> None:
    # The stream itself is the client's one stream: every subscription it opens is refused.
    broker = broker_factory(delivery_workers=workers, max_streams_per_client="1")
    broker.start()
    assert broker.process is not None
    pids = [broker.process.pid, *(w.pid for w in await _workers(broker.address))]
    target = (await _workers(broker.address))[0].address if workers != "0" else broker.address
    request = broker_pb2.SubscribeManyRequest(frames=[many_open(1, "never-reads", TOPIC, 10)] * REFUSED_PER_REQUEST)
    before = [_rss(pid) for pid in pids]
    async with aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * 2**20)]) as channel:
        call = start_many(channel)

        async def write() -> None:
            for _ in range(REQUESTS):
                await call.write(request)

        writer = asyncio.create_task(write())
        seen: list[int] = []

        async def answered_or_held_back() -> bool:
            """The broker has answered every frame, or it has stopped taking them (the same count of
            refusals on many polls in a row)."""
            seen.append((await stats(broker.address)).client_limits.stream_refusals)
            return seen[-1] == REQUESTS * REFUSED_PER_REQUEST or (len(seen) > 25 and len(set(seen[-25:])) == 1)

        await until(answered_or_held_back, "the client's frames to be answered or held back", limit=120)
        grown = [_rss(pid) - b for pid, b in zip(pids, before, strict=True)]
        assert all(g <= GROWTH_BOUND for g in grown), [f"{g / 2**20:.0f} MiB" for g in grown]

        # Once the client reads, the broker takes the rest: every open is answered, in order, once.
        ended = 0
        responses: AsyncIterator[broker_pb2.SubscribeManyResponse] = call.__aiter__()
        while ended < REQUESTS * REFUSED_PER_REQUEST:
            response = await anext(responses)
            for frame in response.frames:
                assert frame.id == 1
                assert frame.ended.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                ended += 1
        await writer
        call.cancel()

    async def released() -> bool:
        s = await stats(broker.address)
        return s.subscriber_streams == 0 and all(w.streams == 0 for w in s.delivery_workers)

    await until(released, "the stream to be gone")


async def test_a_stream_that_does_not_read_holds_up_no_other_stream_of_its_worker(
    broker_factory: Callable[..., BrokerProcess],
) -> None:
    """The stream that does not read fills its window on the link (4 MiB) and waits; the other stream on
    the same worker gets everything meanwhile, and so does the first once it reads."""
    broker = broker_factory(delivery_workers="1")
    broker.start()
    (worker,) = await _workers(broker.address)
    # 20 MiB of 64 KiB bodies, within the slow lane's credits: over the link's window (4 MiB), the
    # worker's hold (2 MiB) and what gRPC and the loopback sockets buffer for a client that does not
    # read (several MiB, more under load: with 10 MiB, a fresh-clone run under load saw it all go).
    total = 320
    body = b"x" * 65536
    async with aio.insecure_channel(worker.address) as channel, aio.insecure_channel(broker.address) as pub_channel:
        slow, fast = ManyReader(start_many(channel)), ManyReader(start_many(channel))
        await slow.send(many_open(1, "slow", TOPIC, 1000))
        await fast.send(many_open(1, "fast", TOPIC, 1000))
        await slow.until(lambda: "subscribed" in slow.kinds(1))  # then it reads nothing until the end
        await fast.until(lambda: "subscribed" in fast.kinds(1))
        pub, _ = await open_publish(pub_channel, "big")
        for first in range(1, total + 1, 16):
            await publish(pub, batch(TOPIC, [message("big", s, body=body) for s in range(first, first + 16)]))
        await fast.until(lambda: len(fast.seqs.get(1, [])) == total)
        assert fast.seqs[1] == list(range(1, total + 1))

        async def slow_held_back() -> bool:
            s = await subscriber_stats(broker.address, "slow")
            return s.in_flight < total  # the core waits on the slow stream's window

        await until(slow_held_back, "the slow stream to be held back")
        await slow.until(lambda: len(slow.seqs.get(1, [])) == total)
        assert slow.seqs[1] == list(range(1, total + 1))
        for call in (slow.call, fast.call, pub):
            call.cancel()

"""Total order end to end with real processes: a broker pair, one sequencer per domain, several
``OrderedPublisher``s per domain and three ``OrderedSubscriber``s that must all receive every
message in the same order, through distribution changes, a silent domain, a sequencer killed
with -9 and restarted, and a client that takes numbers and dies."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc import aio

from sokutatsu.client import ClientConfig, OrderedPublisher, OrderedSubscriber, Publisher
from sokutatsu.ordering import OrderingError
from sokutatsu.sequencer.server import create_total_order_topic
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc, stamp_pb2
from tests.broker.fix_broker import Pair, until
from tests.helpers import trace_spans
from tests.sequencer.fix_sequencer import GroupFactory, SequencerProcess

pytestmark = pytest.mark.timeout(240)
TOPIC = "orders"


class Reader:
    """An OrderedSubscriber read into a list until it holds ``expected`` data messages."""

    def __init__(self, pair: Pair, name: str, config: ClientConfig | None = None) -> None:
        self.sub = OrderedSubscriber(pair.addresses, name, TOPIC, config=config)
        self.got: list[tuple[str, int]] = []
        self.expected = -1  # set by _wait_all
        self.done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None  # set by ordered_group

    async def run(self) -> None:
        async for message in self.sub:
            self.got.append((message.stamp.domain, message.stamp.seq))
            if 0 <= self.expected <= len(self.got):
                self.done.set()


@contextlib.asynccontextmanager
async def ordered_group(
    pair: Pair, group: dict[str, SequencerProcess], readers: int = 3, *, config: ClientConfig | None = None
) -> AsyncIterator[list[Reader]]:
    """Topic and subscriptions first (they must see the first distribution), then the sequencers."""
    await create_total_order_topic(pair.addresses, TOPIC)
    subs = [Reader(pair, f"reader-{i}", config) for i in range(readers)]
    for r in subs:
        await r.sub.start()
    for process in reversed(list(group.values())):  # the leader (first) last: its peers answer at once
        process.start()
    tasks = []
    for r in subs:
        r.task = asyncio.create_task(r.run())
        tasks.append(r.task)
    try:
        yield subs
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        for r in subs:
            await asyncio.wait_for(r.sub.close(), 30)


async def _feed(  # noqa: PLR0917 - test helper: who publishes, where, how many, how paced
    group: dict[str, SequencerProcess],
    pair: Pair,
    domain: str,
    name: str,
    count: int,
    rng: random.Random,
    *,
    pause: Callable[[int], Awaitable[None]] | None = None,
    config: ClientConfig | None = None,
) -> list[int]:
    """Publish ``count`` messages at a random pace in random batch sizes; return their numbers."""
    numbers: list[int] = []
    async with OrderedPublisher(
        group[domain].address, pair.addresses, TOPIC, domain=domain, client_id=name, config=config
    ) as pub:
        sent = 0
        while sent < count:
            n = min(count - sent, rng.randrange(1, 60))
            futures = [pub.publish_nowait(f"K{(sent + i) % 7}", f"{name}:{sent + i}".encode()) for i in range(n)]
            try:
                stamps = await asyncio.wait_for(asyncio.gather(*futures), 60)
            except TimeoutError:
                raise AssertionError(
                    f"{name}: {n} messages not acknowledged; queue {len(pub._queue)}, acks {len(pub._acks)}, "
                    f"ranges {pub.ranges}, failure {pub._failure!r}, stamping task {_task_state(pub._task)}, "
                    f"publisher acked {pub.publisher.acked_seq} "
                    f"of {pub.publisher.last_seq}"
                ) from None
            numbers.extend(stamp.seq for stamp in stamps)
            sent += n
            if pause is not None:
                await pause(sent)
            await asyncio.sleep(rng.random() * 0.02)
    return numbers


def _task_state(task: asyncio.Task[None] | None) -> str:
    if task is None or not task.done():
        return "running"
    return "cancelled" if task.cancelled() else f"died: {task.exception()!r}"


def _check_same_order(readers: list[Reader], sent: dict[str, list[int]]) -> None:
    first = readers[0].got
    for r in readers[1:]:
        assert r.got == first, "two ordered subscribers disagree on the order"
    for domain, numbers in sent.items():
        received = [seq for d, seq in first if d == domain]
        missing = sorted(set(numbers) - set(received))
        extra = sorted(set(received) - set(numbers))
        assert received == sorted(numbers), f"domain {domain}: missing {missing[:20]}, extra {extra[:20]}"
    assert len(first) == sum(len(n) for n in sent.values())


async def _wait_all(readers: list[Reader], total: int, group: dict[str, SequencerProcess]) -> None:
    for r in readers:
        r.expected = total
        if len(r.got) >= total:
            r.done.set()
    waiting = asyncio.ensure_future(asyncio.gather(*(r.done.wait() for r in readers)))
    try:
        for _ in range(600):  # 60 s only stops a hung test
            if waiting.done():
                return
            _alive(group)
            await asyncio.sleep(0.1)
        merge = readers[0].sub.merge
        heads = {d: min(b, default=None) for d, b in merge.buffers.items()}
        raise AssertionError(
            f"readers got {[len(r.got) for r in readers]} of {total}; ordering by distribution {merge.ordering} "
            f"(newest {merge.newest_distribution}), waiting for {merge.waiting_for}, next {merge.next_seq}, "
            f"lowest buffered {heads}, done {merge.done}"
        )
    finally:
        waiting.cancel()


def _alive(group: dict[str, SequencerProcess]) -> None:
    for process in group.values():
        if process.process is not None and process.process.poll() not in (None, -9):
            raise AssertionError(f"sequencer {process.domain} exited: {process.log()[-3000:]}")


@pytest.mark.parametrize("filler", ["markers", "dummies"])
async def test_three_ordered_subscribers_agree_through_distribution_changes_and_a_silent_domain(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory, filler: str
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a", "b", "c", "quiet"], pair.addresses, TOPIC, filler=filler)
    for process in group.values():
        process.env["SOKUTATSU_TRACE_DIR"] = str(process.folder / "traces")
    rng = random.Random(filler)  # noqa: S311 - reproducible test data
    async with ordered_group(pair, group) as readers:
        feeds = {
            f"{domain}{i}": asyncio.create_task(
                _feed(group, pair, domain, f"{domain}{i}", rng.randrange(300, 900), random.Random(f"{domain}{i}"))  # noqa: S311
            )
            for domain in ("a", "b", "c")
            for i in range(2)
        }
        results = dict(zip(feeds, await asyncio.gather(*feeds.values()), strict=True))
        sent = {d: sorted(n for name, ns in results.items() if name[0] == d for n in ns) for d in ("a", "b", "c")}
        await _wait_all(readers, sum(len(v) for v in sent.values()), group)
    _check_same_order(readers, sent)
    merge = readers[0].sub.merge
    # The rates changed the weights: several distributions were used, and the silent domain
    # never stopped delivery because it filled its share.
    assert merge.counters.distributions >= 3
    quiet = await group["quiet"].status()
    if filler == "markers":
        assert quiet.skip_markers > 0
        assert merge.counters.skip_markers > 0
    else:
        assert quiet.dummy_slots > 0
        assert merge.counters.dummies > 0

    # The traces (docs/tracing.md): each domain's installs, and the quiet domain's fillers, all of them.
    for process in group.values():
        process.stop()  # flushes its spans
    installs = {
        d: [a for n, a in trace_spans(p.folder / "traces") if n == "sequencer.install_distribution"]
        for d, p in group.items()
    }
    for domain, spans in installs.items():
        ids = [a["sokutatsu.distribution.id"] for a in spans]
        assert len(ids) >= 3, domain
        assert ids == sorted(set(ids)), f"{domain}: installs out of order or twice"
        assert all(a["sokutatsu.domain"] == domain for a in spans)
    fills = [a for n, a in trace_spans(group["quiet"].folder / "traces") if n == "sequencer.fill"]
    assert {a["sokutatsu.fill.kind"] for a in fills} == {"skip" if filler == "markers" else "dummy"}
    slots = sum(a["sokutatsu.fill.slots"] for a in fills)
    # At least what its status counted a moment before it stopped (it may have filled since).
    assert slots >= (quiet.skip_slots if filler == "markers" else quiet.dummy_slots) > 0


async def test_when_every_domain_goes_quiet_receivers_get_the_tail_without_a_new_distribution(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    """Domains that sent their share and stopped: the random schedule still draws them before the
    others' last messages. With one distribution for the whole test (an interval of an hour), only
    the quiet domains' top-up lets the receivers reach the end."""
    pair = await pair_factory()
    group = sequencer_group(["a", "b", "c"], pair.addresses, TOPIC, distribution_interval_ms="3600000")
    async with ordered_group(pair, group) as readers:
        feeds = [
            _feed(group, pair, domain, f"{domain}0", 600, random.Random(f"tail-{domain}"))  # noqa: S311
            for domain in ("a", "b", "c")
        ]
        a, b, c = await asyncio.gather(*feeds)
        await _wait_all(readers, 1800, group)
        statuses = [await group[d].status() for d in ("a", "b", "c")]
    _check_same_order(readers, {"a": a, "b": b, "c": c})
    assert readers[0].sub.merge.counters.distributions == 1
    assert {s.distribution.id for s in statuses} == {1}


async def test_a_sequencer_killed_mid_stream_restarts_in_a_new_epoch_and_nothing_is_lost(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a", "b", "c"], pair.addresses, TOPIC)
    restarted = asyncio.Event()

    async def kill_b_once(sent: int) -> None:
        if sent >= 300 and group["b"].starts == 1:
            group["b"].kill9()
            await asyncio.sleep(0.3)
            group["b"].start()
            restarted.set()

    async with ordered_group(pair, group) as readers:
        before = (await group["b"].status()).epoch
        feeds = [
            _feed(group, pair, "a", "a0", 800, random.Random(1)),  # noqa: S311
            _feed(group, pair, "b", "b0", 800, random.Random(2), pause=kill_b_once),  # noqa: S311
            _feed(group, pair, "b", "b1", 800, random.Random(3)),  # noqa: S311
            _feed(group, pair, "c", "c0", 800, random.Random(4)),  # noqa: S311
        ]
        a0, b0, b1, c0 = await asyncio.gather(*feeds)
        assert restarted.is_set()
        sent = {"a": sorted(a0), "b": sorted(b0 + b1), "c": sorted(c0)}
        await _wait_all(readers, sum(len(v) for v in sent.values()), group)
        status = await group["b"].status()
    assert status.epoch == before + 1
    _check_same_order(readers, sent)
    # Numbers continued after the last one handed out before the kill: none was reused.
    assert len(set(sent["b"])) == len(sent["b"])


async def test_numbers_a_dead_client_took_are_filled_and_delivery_goes_on(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a", "b"], pair.addresses, TOPIC)
    async with ordered_group(pair, group) as readers:
        first = await _feed(group, pair, "a", "a0", 50, random.Random(5))  # noqa: S311
        # A client takes 20 numbers of domain a and vanishes without publishing them.
        async with aio.insecure_channel(group["a"].address) as channel:
            call = sequencer_pb2_grpc.SequencerStub(channel).Stamp()
            await call.write(sequencer_pb2.StampRequest(request_id=1, count=20, client_id="doomed", domain="a"))
            response = await call.read()
            assert isinstance(response, sequencer_pb2.StampResponse)
            taken = response.range
            call.cancel()
        later = await _feed(group, pair, "a", "a1", 50, random.Random(6))  # noqa: S311
        other = await _feed(group, pair, "b", "b0", 50, random.Random(7))  # noqa: S311
        await _wait_all(readers, 150, group)
        status = await group["a"].status()
    assert taken.count == 20
    assert status.filled_ranges == 1
    assert readers[0].sub.merge.counters.skip_slots >= 20
    _check_same_order(readers, {"a": sorted(first + later), "b": sorted(other)})


async def test_back_to_back_publishes_each_waiting_for_the_last_never_stall(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    """Publishing the next message as soon as the last is acknowledged lands it while the
    publisher reports the last range published to the sequencer: it must still be stamped
    (it used to wait forever, its wake-up cleared after that report)."""
    pair = await pair_factory()
    group = sequencer_group(["a"], pair.addresses, TOPIC)
    async with ordered_group(pair, group, readers=1) as readers:
        async with OrderedPublisher(group["a"].address, pair.addresses, TOPIC, domain="a", client_id="eager") as pub:
            stamps = [await asyncio.wait_for(pub.publish("k", f"m{i}".encode()), 30) for i in range(300)]
        await _wait_all(readers, 300, group)
    assert [s.seq for s in stamps] == sorted({s.seq for s in stamps})
    _check_same_order(readers, {"a": [s.seq for s in stamps]})


async def test_bad_stamp_requests_get_a_status_a_person_can_act_on(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a"], pair.addresses, TOPIC, max_range="1000")
    async with ordered_group(pair, group, readers=0):
        await until(_installed(group["a"]), "the first distribution")
        cases = [
            (sequencer_pb2.StampRequest(count=1, domain="nowhere"), grpc.StatusCode.NOT_FOUND, "domain 'a'"),
            (sequencer_pb2.StampRequest(count=0), grpc.StatusCode.INVALID_ARGUMENT, "at least 1"),
            (sequencer_pb2.StampRequest(count=1001), grpc.StatusCode.INVALID_ARGUMENT, "1 to 1000"),
        ]
        for request, code, words in cases:
            async with aio.insecure_channel(group["a"].address) as channel:
                call = sequencer_pb2_grpc.SequencerStub(channel).Stamp()
                await call.write(request)
                with pytest.raises(aio.AioRpcError) as caught:
                    await call.read()
                assert caught.value.code() == code
                assert words in (caught.value.details() or "")
        # The SDK reports it as final, naming the domain.
        async with OrderedPublisher(group["a"].address, pair.addresses, TOPIC, domain="elsewhere") as pub:
            with pytest.raises(Exception, match="NOT_FOUND"):
                await asyncio.wait_for(pub.publish("k", b"x"), 30)


def _installed(process: SequencerProcess) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await process.status()).distribution.id >= 1

    return check


async def test_the_subscriber_refuses_a_stamp_it_cannot_order(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a"], pair.addresses, TOPIC)
    async with ordered_group(pair, group, readers=1) as [reader]:
        await until(_installed(group["a"]), "the first distribution")
        # A hand-made stamp with a distribution id no leader announced.
        bogus = stamp_pb2.Stamp(distribution_id=99, domain="a", epoch=1, seq=1, kind=stamp_pb2.STAMP_KIND_DATA)
        async with Publisher(pair.addresses, "forger") as pub:
            seq = pub._enqueue(TOPIC, "k", b"forged", None, True, bogus.SerializeToString())  # the SDK's stamped path
            await pub.wait_acked(seq)
        assert reader.task is not None
        with pytest.raises(OrderingError, match="distribution id 99"):
            await asyncio.wait_for(reader.task, 60)

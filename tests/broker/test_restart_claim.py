"""The queue's side of a restarted broker's claim (pair_state.py, invariant 7): what its segment log
tells it holds, and how the peer's fill and what arrived meanwhile go in, each message once, with
its true predecessor; and a race of the broker's own found beside it (an adopted subscription replacing
an accepted one). The whole exchange between two real brokers is in test_pair_faults.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sokutatsu.broker.broker import Broker
from sokutatsu.broker.disk_worker import DiskWorker
from sokutatsu.broker.messages import StoredMessage, Usage
from sokutatsu.broker.segment_log import SegmentLog
from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.subscription import SubscriptionSpec
from sokutatsu.broker.subscription_queue import SERVING, SHADOW, SubscriptionQueue
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.settings import load

PREV = struct.Struct("<Q")


def _message(publisher: str, seq: int, body: bytes = b"x") -> StoredMessage:
    payload = broker_pb2.Message(publisher_id=publisher, publisher_seq=seq, body=body).SerializeToString()
    message = StoredMessage(publisher, seq, payload, True)
    message.hold(1)
    return message


@contextlib.asynccontextmanager
async def _running_disk() -> AsyncIterator[DiskWorker]:
    """A broker's disk worker, running (as the broker's bootstrap runs it)."""
    disk = DiskWorker()
    worker = asyncio.create_task(disk.run())
    try:
        yield disk
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        disk.close()


@contextlib.asynccontextmanager
async def _queue(folder: Path) -> AsyncIterator[SubscriptionQueue]:
    spec = SubscriptionSpec(
        subscriber_id="desk",
        topic="prices",
        exact_keys=frozenset(),
        prefixes=(),
        durable=True,
        mode="migrate",
        budget=1 << 40,
    )
    async with _running_disk() as disk:
        queue = SubscriptionQueue(
            spec=spec,
            folder=folder,
            disk=disk,
            batch_messages=100,
            batch_bytes=1 << 20,
            linger_seconds=0.0,
            state=SHADOW,
        )
        try:
            yield queue
        finally:
            queue.discard()


def _queued(queue: SubscriptionQueue) -> list[tuple[str, int, int]]:
    return [(item.publisher_id, item.seq, item.prev) for item in queue.memory]


async def test_a_recovered_queue_knows_which_numbers_its_log_holds(tmp_path: Path) -> None:
    """The last number of each publisher in the log is what it holds up to (the peer fills in after
    it); before the first, it may lack what its subscriber has not acknowledged (it was in memory)."""
    log = SegmentLog(tmp_path)
    log.append([PREV.pack(seq - 1) + _message("p1", seq).payload for seq in range(5, 10)])
    log.append([PREV.pack(seq - 1) + _message("p2", seq).payload for seq in (3, 4)])
    log.close()
    async with _queue(tmp_path) as queue:
        await queue.recover()
        assert queue.disk_count == 7
        assert queue.last_enqueued == {"p1": 9, "p2": 4}
        assert queue.lacks == {"p1": 4, "p2": 2}
        queue.enqueue(_message("p1", 9))  # a publisher sending again what the log holds
        assert queue.depth == 7


async def test_a_recovered_queue_still_lacks_a_hole_inside_its_log(tmp_path: Path) -> None:
    """Found by `make chaos` (seed 223254, 9 messages told as a gap): a publisher resumed after a hole
    (Broker.resume_publisher), so the record after the hole names the hole's last number as its
    predecessor. Recovery took each publisher's records as contiguous and forgot the hole: the restarted
    copy counted itself caught up, and a subscriber moved there was told as a gap what its peer held.
    A record whose predecessor is past the previous record of its publisher marks the copy as lacking
    up to it. (p1's 3 then 10 is a filtered queue's step, no hole: 10 names 3.)"""
    log = SegmentLog(tmp_path)
    records = [("p", 1, 0), ("p", 2, 1), ("p", 3, 2), ("p", 7, 6), ("p", 8, 7), ("p1", 3, 2), ("p1", 10, 3)]
    log.append([PREV.pack(prev) + _message(publisher, seq).payload for publisher, seq, prev in records])
    log.close()
    async with _queue(tmp_path) as queue:
        await queue.recover()
        assert queue.last_enqueued == {"p": 8, "p1": 10}
        assert queue.lacks == {"p": 6, "p1": 2}, "the hole 4-6 inside the log was forgotten"
        assert queue.floor == {"p": 6, "p1": 2}
        queue.trim({"p": 5, "p1": 10})
        assert queue.behind, "acknowledged to 5, the copy still lacks 6"
        queue.trim({"p": 6, "p1": 10})
        assert not queue.behind


async def test_the_peers_fill_goes_before_what_was_held_back_each_message_once(tmp_path: Path) -> None:
    """Held back: 16 and 17, after the publisher came back at 16 (what the active acknowledged alone,
    11 to 15, it never sends here). The fill brings 11 to 16: it goes first, 16 once, and the publish
    that waited goes on only then."""
    async with _queue(tmp_path) as queue:
        queue.last_enqueued = {"p": 10}
        queue.hold_back()
        queue.may_lack("p", 15)  # Broker.resume_publisher: the publisher continues at 16
        queue.last_enqueued["p"] = 15
        for seq in (16, 17):
            assert queue.enqueue(_message("p", seq))
        waiting = queue.written(queue.spill_appended)
        assert queue.depth == 0
        assert not waiting.done()
        filled = queue.end_hold_back([(seq - 1, _message("p", seq)) for seq in range(11, 17)])
        assert filled == 6
        assert _queued(queue) == [("p", seq, seq - 1) for seq in range(11, 18)]
        await asyncio.wait_for(waiting, 5)


async def test_a_fill_that_stops_short_leaves_the_hole_told(tmp_path: Path) -> None:
    """The active's tail did not reach back to 13..15: the next message names 15 as its predecessor,
    so the SDK reports 13..15 as a gap instead of missing them."""
    async with _queue(tmp_path) as queue:
        queue.last_enqueued = {"p": 10}
        queue.hold_back()
        queue.last_enqueued["p"] = 15
        queue.enqueue(_message("p", 16))
        queue.end_hold_back([(10, _message("p", 11)), (11, _message("p", 12))])
        assert _queued(queue) == [("p", 11, 10), ("p", 12, 11), ("p", 16, 15)]


async def test_what_was_held_back_inside_a_hole_is_kept_and_the_rest_of_the_hole_told(tmp_path: Path) -> None:
    """Held back 21..30 (sent here after the restart); then the publisher came back at 41 (the peer
    acknowledged 21..40 alone, not hearing this broker), and no fill came. 21..30 are queued, not
    skipped as below the resume point; the next message, 41, names 40, so 31..40 are told as a gap."""
    async with _queue(tmp_path) as queue:
        queue.last_enqueued = {"p": 20}
        queue.hold_back()
        for seq in range(21, 31):
            queue.enqueue(_message("p", seq))
        queue.may_lack("p", 40)
        queue.last_enqueued["p"] = 40  # Broker.resume_publisher
        queue.end_hold_back()
        queue.enqueue(_message("p", 41))
        assert _queued(queue) == [*(("p", seq, seq - 1) for seq in range(21, 31)), ("p", 41, 40)]


async def test_a_fill_after_a_hole_in_the_tail_names_its_true_predecessor(tmp_path: Path) -> None:
    """The active's tail starts at 14 (its prev is 13): this copy holds up to 10, so the first filled
    message says 13 and the SDK reports 11..13."""
    async with _queue(tmp_path) as queue:
        queue.last_enqueued = {"p": 10}
        queue.hold_back()
        queue.end_hold_back([(13, _message("p", 14)), (14, _message("p", 15))])
        assert _queued(queue) == [("p", 14, 13), ("p", 15, 14)]


async def test_what_was_held_back_before_the_peers_tail_begins_is_kept(tmp_path: Path) -> None:
    """Found by a review: held back here 21..30 (both brokers took and acknowledged them); the peer's away
    copy keeps only a tail, which had dropped 21..25 when it built the fill (more than AWAY_TAIL published
    during the claim), so the fill starts at 26 naming 25. Before, the fill went in first and 21..25, held
    here, were skipped as held already: both brokers had acknowledged them and neither kept them (the
    subscriber was told a gap). What was held back goes in where the fill does not reach."""
    async with _queue(tmp_path) as queue:
        queue.last_enqueued = {"p": 20, "q": 5}
        queue.hold_back()
        for seq in range(21, 31):
            queue.enqueue(_message("p", seq))
        queue.enqueue(_message("q", 6))
        waiting = queue.written(queue.spill_appended)
        queue.end_hold_back([(7, _message("q", 8)), *((seq - 1, _message("p", seq)) for seq in range(26, 31))])
        assert [item for item in _queued(queue) if item[0] == "p"] == [("p", seq, seq - 1) for seq in range(21, 31)]
        assert [item for item in _queued(queue) if item[0] == "q"] == [("q", 6, 5), ("q", 8, 7)]
        await asyncio.wait_for(waiting, 5)


async def test_two_holes_during_the_claim_are_both_told(tmp_path: Path) -> None:
    """Found by a review of the test above's mend: this copy holds p up to 10; the publisher resumes at
    21 (the peer acknowledged 11..20 alone), sends 21 and 22 (held back); its stream breaks, the peer
    acknowledges 23..30 alone, it resumes at 31 and sends 31, 32. The peer's tail had dropped 11..24:
    the fill is 25..32. 21 names 20, so 11..20 (which neither broker holds) are told as a gap, and 25
    names 24. With the mend above but the hole read where the publisher resumed last (30), 21 named 10
    and 11..20 were never told."""
    async with _queue(tmp_path) as queue:
        queue.last_enqueued = {"p": 10}
        queue.hold_back()
        queue.last_enqueued["p"] = 20  # Broker.resume_publisher, the first time
        for seq in (21, 22):
            queue.enqueue(_message("p", seq))
        queue.last_enqueued["p"] = 30  # and the second
        for seq in (31, 32):
            queue.enqueue(_message("p", seq))
        queue.end_hold_back([(seq - 1, _message("p", seq)) for seq in range(25, 33)])
        assert _queued(queue) == [("p", 21, 20), ("p", 22, 21), *(("p", seq, seq - 1) for seq in range(25, 33))]


@pytest.mark.parametrize("resumes", [0, 1, 2, 3])
async def test_random_claims_queue_each_message_once_and_tell_every_gap(tmp_path: Path, resumes: int) -> None:
    """Random schedules of a claim (a review's model, 300 per case): this copy holds p up to H; during
    the claim the publisher resumes ``resumes`` times after holes the peer acknowledged alone, sending
    a few messages here after each; the peer holds everything from 1 to its last but, at random, one
    range, and its fill is its tail from a random start. Once the claim ends, the copy holds, in order
    and once each, every message after H that it held back or the fill brought; each message names a
    predecessor at or past every number missing before it (a gap is told, never missed) and, where
    nothing is missing, the message before it (no gap told that is not one); each message is held by
    the queue if queued, and released otherwise."""
    rng = random.Random(f"claim-{resumes}")  # noqa: S311 - reproducible schedules
    for trial in range(300):
        holds = rng.randint(0, 5)
        seq = holds
        events: list[tuple[str, int]] = []
        for _ in range(resumes):
            seq += rng.randint(0, 6)
            events.append(("resume", seq))
            for _ in range(rng.randint(0, 5)):
                seq += 1
                events.append(("message", seq))
        last = seq + rng.randint(0, 4)
        peer = set(range(1, last + 1))
        if rng.random() < 0.3 and last > holds + 2:
            lost_from = rng.randint(holds + 1, last - 1)
            peer -= set(range(lost_from, rng.randint(lost_from, last - 1) + 1))
        start = rng.randint(holds + 1, last + 1)
        fill = [(n - 1, _message("p", n)) for n in sorted(n for n in peer if n >= start)]
        async with _queue(tmp_path / str(trial)) as queue:
            queue.last_enqueued = {"p": holds} if holds else {}
            queue.hold_back()
            held = []
            for kind, n in events:
                if kind == "resume":
                    queue.last_enqueued["p"] = max(n, queue.last_enqueued.get("p", 0))
                else:
                    held.append(_message("p", n))
                    queue.enqueue(held[-1])
            queue.end_hold_back(fill)
            got = _queued(queue)
            schedule = f"trial {trial}: holds {holds}, {events}, fill from {start} of {sorted(peer)[-1:]}: {got}"
            numbers = [n for _, n, _ in got]
            assert numbers == sorted(set(numbers)), schedule
            assert set(numbers) == {m.seq for m in held} | {m.seq for _, m in fill if m.seq > holds}, schedule
            before = holds
            for _, n, prev in got:
                missing = range(before + 1, n)
                if missing:
                    assert prev >= missing[-1], f"a gap not told before {n}; {schedule}"
                else:
                    assert prev == before, f"a gap told before {n} that is not one; {schedule}"
                before = n
            queued = {id(item.msg) for item in queue.memory}
            for message in [*held, *(m for _, m in fill)]:
                assert message.refs == (1 if id(message) in queued else 0), schedule


async def test_a_fill_ends_what_the_copy_lacked_past_its_log_and_keeps_what_it_lacks_before(tmp_path: Path) -> None:
    """The recovered log holds p's 5..20 (4 and before may have been in memory only: lacked). While the
    claim waits, the peer's holdings say it put up to 50 here (``Broker._take_holdings``: lacks 50). Its
    fill brings 21..50: the copy lacks nothing past its log any more, only what it lacked before its
    first record. Before, it kept lacking 50 until its subscriber acknowledged 50: an idle subscriber's
    copy stayed behind, so the broker was never caught up and every failover to it waited
    FAILOVER_BEHIND_AFTER_SECONDS."""
    log = SegmentLog(tmp_path)
    log.append([PREV.pack(seq - 1) + _message("p", seq).payload for seq in range(5, 21)])
    log.close()
    async with _queue(tmp_path) as queue:
        await queue.recover()
        queue.hold_back()
        queue.may_lack("p", 50)
        queue.end_hold_back([(seq - 1, _message("p", seq)) for seq in range(21, 51)])
        assert queue.lacks == {"p": 4}
        queue.trim({"p": 4})
        assert not queue.behind


async def test_a_fill_short_of_what_the_copy_lacks_leaves_it_lacking(tmp_path: Path) -> None:
    """The fill stops at 30 (the peer's holdings said 50 before, and the peer's tail lost the rest, or a
    later frame will say more): the copy still lacks up to 50. A claim that lapses without a fill leaves
    what the copy lacks as it was."""
    async with _queue(tmp_path) as queue:
        queue.last_enqueued = {"p": 20}
        queue.hold_back()
        queue.may_lack("p", 50)
        queue.end_hold_back([(seq - 1, _message("p", seq)) for seq in range(21, 31)])
        assert queue.lacks == {"p": 50}
    async with _queue(tmp_path / "lapsed") as queue:
        queue.last_enqueued = {"p": 20}
        queue.hold_back()
        queue.may_lack("p", 50)
        queue.end_hold_back()
        assert queue.lacks == {"p": 50}
        assert queue.behind


async def test_a_queue_dropped_while_it_holds_back_releases_what_it_held(tmp_path: Path) -> None:
    """A subscription deleted (or expired) while its restarted broker settles its claim: the messages
    held back leave the broker's and topic's counts, and the publishes that waited go on."""
    usage = Usage("topic prices", 0, 0)
    async with _queue(tmp_path) as queue:
        queue.hold_back()
        held = [StoredMessage("p", seq, b"x" * 10, True, (usage,)) for seq in (1, 2)]
        for message in held:
            message.hold(1)
            queue.enqueue(message)
        waiting = queue.written(queue.spill_appended)
        assert (usage.count, usage.bytes) == (2, 20)
        queue.discard()
        assert (usage.count, usage.bytes) == (0, 0)
        await asyncio.wait_for(waiting, 5)


async def test_a_reclaiming_broker_asks_for_what_its_log_lacks_not_from_where_a_publisher_resumed(
    tmp_path: Path,
) -> None:
    """The holdings of a restarted broker that reclaims a subscriber name what its copy holds, even
    after a publisher came back and said where it continues (``PublishOpen.first_unacked_seq``,
    which raises the queue's last number). Before, they named the resume point, the peer filled in
    only after it, and the subscriber lost what the peer had acknowledged alone in between (2 of 5
    runs of the process test with 300 messages published while the standby was down)."""
    async with _running_disk() as disk, _reclaiming_broker(tmp_path, disk) as second:
        second.resume_publisher("p", second.publisher("p"), 51)  # 21..50 acknowledged by the peer alone
        (held,) = second.holdings()
        assert held.reclaims
        assert dict(held.last_enqueued.last_seq) == {"p": 20}


@contextlib.asynccontextmanager
async def _reclaiming_broker(folder: Path, disk: DiskWorker, first: int = 1) -> AsyncIterator[Broker]:
    """A broker in this process, on a state folder: it serves desk (spilled to disk, ``first`` to 20),
    stops; the one yielded starts there as the restarted standby, reclaiming desk."""
    env = {
        "SOKUTATSU_BROKER_STATE_DIR": str(folder),
        "SOKUTATSU_BROKER_ROLE": "standby",
        "SOKUTATSU_BROKER_INSTANCE": "broker-b",
        "SOKUTATSU_BROKER_PEER": "127.0.0.1:1",
        "SOKUTATSU_BROKER_QUEUE_BUDGET": "1KiB",
    }
    desk = broker_pb2.Subscription(subscriber_id="desk", topic="prices", durable=True)
    before = Broker(load(BrokerSettings, env), disk)
    await before.open()
    await before.create_subscription(before.subscription_spec(desk))
    queue = before.queue("prices", "desk")
    queue.serve()  # as after AcceptSubscriber: this standby serves desk
    for seq in range(first, 21):
        queue.enqueue(_message("p", seq, b"x" * 200))  # over the budget in a few: spilled
    await queue.written(queue.spill_appended)
    await before._save_catalog()  # what AcceptSubscriber records on disk
    assert queue.disk_count == 21 - first
    await before.close()
    second = Broker(load(BrokerSettings, env), disk)
    await second.open()
    assert second.reclaiming == 1
    try:
        yield second
    finally:
        await second.close()


def _fill(seqs: range, acked: dict[str, int] | None = None) -> broker_pb2.QueueFill:
    """The peer's fill of desk: ``seqs`` of publisher p, each naming the one before."""
    items = [broker_pb2.QueueFillItem(previous_seq=seq - 1, message=_message("p", seq).payload) for seq in seqs]
    return broker_pb2.QueueFill(
        topic="prices",
        subscriber_id="desk",
        items=items,
        first=True,
        last=True,
        acked=broker_pb2.Position(last_seq=acked or {}),
    )


async def test_a_reclaimed_copy_takes_what_its_subscriber_acknowledged_from_the_fill(tmp_path: Path) -> None:
    """Found by an attacker's review: the restarted broker's log begins at 4 (the subscriber had received
    and acknowledged 1..3 from memory before the crash), so its copy may lack 3 and up (recovery), which
    no fill brings (it brings what comes after the log). With its subscriber away, the copy stayed
    behind for good: the broker was not caught up, and every failover to it waited
    FAILOVER_BEHIND_AFTER_SECONDS. The peer's fill now carries what the subscriber acknowledged as the
    peer's away copy knows it (from this broker's watermarks before the crash): 3, so nothing is lacked."""
    async with _running_disk() as disk, _reclaiming_broker(tmp_path, disk, first=4) as second:
        queue = second.queue("prices", "desk")
        assert queue.lacks == {"p": 3}
        second._apply_fill(_fill(range(21, 26), acked={"p": 3}))
        assert second.reclaiming == 0
        assert not queue.behind
        assert queue.acked == {"p": 3}


async def test_a_fill_from_a_peer_that_knows_less_acknowledged_leaves_the_lack(tmp_path: Path) -> None:
    """The same, the peer knowing the subscriber acknowledged only 2 (or an older peer, which sends
    nothing): 3 may still be owed, so the copy is still behind."""
    async with _running_disk() as disk, _reclaiming_broker(tmp_path, disk, first=4) as second:
        queue = second.queue("prices", "desk")
        second._apply_fill(_fill(range(21, 26), acked={"p": 2}))
        assert queue.behind


@pytest.mark.parametrize("filled_to", [50, 35])
async def test_holdings_after_a_fill_into_a_hole_say_what_the_fill_brought(tmp_path: Path, filled_to: int) -> None:
    """A reviewer's note, made a schedule: the reclaiming broker's holdings say 20 while a publisher's
    hole (21..50, acknowledged by the peer alone) is marked; the peer's fill then brings 21..``filled_to``.
    The copy holds them, so its holdings say ``filled_to``. Before, a fill that ended exactly at the hole's
    mark (50) left them saying 20 (the mark's number read as a hole not passed), and one that ended
    inside it (35) said 20 too: the peer then took this copy for one holding less than it does."""
    async with _running_disk() as disk, _reclaiming_broker(tmp_path, disk) as second:
        second.resume_publisher("p", second.publisher("p"), 51)
        second._apply_fill(_fill(range(21, filled_to + 1)))
        assert second.reclaiming == 0
        queue = second.queue("prices", "desk")
        assert queue.depth == filled_to
        (held,) = second.holdings()
        assert dict(held.last_enqueued.last_seq) == {"p": filled_to}
        # The publisher resumes again after a second hole (51..80): the mark starts from what is held.
        second.resume_publisher("p", second.publisher("p"), 81)
        assert queue.hole_marks == {"p": (filled_to, 80)}
        (held,) = second.holdings()
        assert dict(held.last_enqueued.last_seq) == {"p": filled_to}


async def test_a_reclaimed_copy_the_fill_completed_is_not_marked_again_by_later_holdings(tmp_path: Path) -> None:
    """Found by a review: the publisher resumed at 51 while desk was reclaimed; the peer's holdings said 50
    (the copy may lack 21..50) and its fill brought 21..50, so the copy lacks nothing. The peer's holdings
    of a later session (after a blip of the pair's link) marked the hole in every copy again
    (``Broker._mark_holes`` runs with each holdings), this one included: it lacked 50 again, and with its
    subscriber away the broker stayed behind for good. A copy a fill completed up to a number is not
    marked as lacking up to it again."""
    async with _running_disk() as disk, _reclaiming_broker(tmp_path, disk) as second:
        second.resume_publisher("p", second.publisher("p"), 51)
        held = broker_pb2.SubscriberHoldings(
            topic="prices",
            subscriber_id="desk",
            last_enqueued=broker_pb2.Position(last_seq={"p": 50}),
            away=True,
            creations=second.lists.tags(("prices", "desk")),
        )
        second.apply_holdings([held])
        queue = second.queue("prices", "desk")
        assert queue.lacks == {"p": 50}
        second._apply_fill(_fill(range(21, 51)))
        assert queue.lacks == {}
        second.apply_holdings([held])  # the peer's holdings of its next session
        assert queue.lacks == {}
        assert not queue.behind


async def test_a_subscription_adopted_from_the_peer_does_not_replace_one_accepted_meanwhile(tmp_path: Path) -> None:
    """``adopt_subscriptions`` creates the topic first, which awaits the disk (the catalog); an
    ``AcceptSubscriber`` that came meanwhile made the queue, serving. Adopting then made a second
    queue, a shadow, in its place: the switchover's subscriber was redirected as "served by the peer
    (shadow here)" (seen in make test). A broker in this process; the adoption is let run up to its
    first wait, then the accept runs."""
    env = {"SOKUTATSU_BROKER_STATE_DIR": str(tmp_path), "SOKUTATSU_BROKER_ROLE": "standby"}
    desk = broker_pb2.Subscription(subscriber_id="desk", topic="prices", durable=True)
    async with _running_disk() as disk:
        broker = Broker(load(BrokerSettings, env), disk)
        await broker.open()
        adopting = asyncio.create_task(broker.adopt_subscriptions([desk], whole=True))
        await asyncio.sleep(0)  # the adoption made the topic and waits for the catalog on disk
        accepted, _ = await broker.accept(desk, {})
        await adopting
        assert broker.queue("prices", "desk") is accepted
        assert accepted.state == SERVING

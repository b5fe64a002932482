"""The chaos checker, the schedule draw and the link proxy, on made-up histories and local sockets.

Each kind of violation has a history that shows it, so a checker that stopped seeing it fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from sokutatsu.cli import chaos_check as check
from sokutatsu.cli import chaos_schedule as sched
from sokutatsu.cli.chaos_proxy import LinkProxy
from sokutatsu.cli.chaos_report import html_report
from sokutatsu.cli.chaos_run import migration_overlaps, violations


def _publisher(
    publisher_id: str, keys: dict[int, str], acked_at: dict[int, float] | None = None
) -> check.PublisherHistory:
    history = check.PublisherHistory(publisher_id)
    for seq, key in keys.items():
        at = (acked_at or {}).get(seq, float(seq))
        history.acks[seq] = check.Ack(key, float(seq) - 0.5, at)
    return history


def _subscriber(delivered: list[tuple[str, int]], **kwargs: object) -> check.SubscriberHistory:
    sub = check.SubscriberHistory("s", **kwargs)  # type: ignore[arg-type]
    sub.delivered = delivered
    return sub


PUBS = [_publisher("p", {1: "A-1", 2: "B-1", 3: "A-2", 4: "A-3"}), _publisher("q", {1: "A-1", 2: "A-2"})]
EVERYTHING = [("p", 1), ("q", 1), ("p", 2), ("p", 3), ("q", 2), ("p", 4)]


def test_a_clean_history_has_no_violation() -> None:
    verdict = check.check_subscriber(PUBS, _subscriber(EVERYTHING))
    assert (verdict.expected, verdict.delivered, verdict.violations) == (6, 6, 0)


def test_unacknowledged_messages_may_arrive_or_not() -> None:
    # p's 5 was never acknowledged (its publisher died): delivering it is fine, missing it too.
    assert check.check_subscriber(PUBS, _subscriber([*EVERYTHING, ("p", 5)])).violations == 0


def test_lost_messages_are_counted_with_their_ranges() -> None:
    verdict = check.check_subscriber(PUBS, _subscriber([("p", 1), ("p", 4), ("q", 2)]))
    assert verdict.lost == 3
    assert verdict.lost_ranges == {"p": [(2, 3)], "q": [(1, 1)]}


def test_duplicates_are_counted() -> None:
    verdict = check.check_subscriber(PUBS, _subscriber([*EVERYTHING, ("p", 3), ("q", 1)]))
    assert (verdict.duplicates, verdict.lost, verdict.reordered) == (2, 0, 0)
    assert verdict.duplicate_ranges == {"p": [(3, 3)], "q": [(1, 1)]}


def test_reordering_within_a_publisher_is_counted_but_not_across_publishers() -> None:
    verdict = check.check_subscriber(PUBS, _subscriber([("p", 1), ("p", 3), ("p", 2), ("q", 2), ("q", 1), ("p", 4)]))
    assert verdict.reordered == 2
    assert verdict.reordered_examples == [("p", 3, 2), ("q", 2, 1)]
    assert verdict.lost == verdict.duplicates == 0


def test_gaps_count_the_acknowledged_matching_messages_they_cover() -> None:
    sub = _subscriber(EVERYTHING, prefixes=("A-",))
    sub.gaps = [check.Gap("p", 2, 3, 0.0), check.Gap("q", 7, 9, 0.0)]
    verdict = check.check_subscriber(PUBS, sub)
    # p's 2 has key B-1 (not matched); q's 7..9 were never acknowledged.
    assert verdict.gaps == 1
    assert verdict.gap_reports == [("p", 2, 3, 1)]


def test_filters_decide_what_is_expected() -> None:
    assert check.matches("A-1", (), ())
    assert check.matches("A-1", (), ("A-",))
    assert not check.matches("B-1", ("B-2",), ("A-",))
    verdict = check.check_subscriber(PUBS, _subscriber([("p", 2)], keys=("B-1",)))
    assert (verdict.expected, verdict.violations) == (1, 0)
    assert check.check_subscriber(PUBS, _subscriber([], keys=("B-1",))).lost == 1


def test_another_subscriptions_message_is_counted_as_unexpected() -> None:
    # p's 2 (B-1) came to a subscriber of A- keys: on a shared stream, another lane's frame.
    verdict = check.check_subscriber(PUBS, _subscriber(EVERYTHING, prefixes=("A-",)))
    assert (verdict.unexpected, verdict.unexpected_examples, verdict.violations) == (1, [("p", 2, "B-1")], 1)
    assert violations(_schedule(unexpected=1)) == ["unexpected=1"]
    # Unacknowledged ones have no known key: not counted.
    assert check.check_subscriber(PUBS, _subscriber([("p", 9)], prefixes=("A-",))).unexpected == 0


def test_stalls_wait_from_the_later_of_publish_and_previous_ack() -> None:
    history = check.PublisherHistory("p")
    history.acks = {
        1: check.Ack("k", 0.0, 0.01),
        2: check.Ack("k", 0.02, 3.0),  # pending from 0.02: a 2.98 s stall
        3: check.Ack("k", 0.03, 3.0),  # acknowledged with 2: no wait of its own
        4: check.Ack("k", 10.0, 10.5),  # published long after: waits 0.5 s
    }
    stalls = check.stalls(history)
    assert [round(s.seconds, 2) for s in stalls] == [0.01, 2.98, 0.0, 0.5]
    summary = check.summarize_stalls(stalls, [0.015, 9.0])
    assert round(summary.max_s, 2) == 2.98
    assert [round(x, 2) for x in summary.per_fault_s] == [2.98, 0.5]
    assert summary.longest is not None
    assert summary.longest.start == 0.02


def test_two_actives_in_one_poll_are_seen() -> None:
    samples = [
        check.RoleSample(0.0, {"a": ("ACTIVE", 0), "b": ("STANDBY", 0)}),
        check.RoleSample(0.05, {"a": ("ACTIVE", 0), "b": ("ACTIVE", 1)}),
        check.RoleSample(0.1, {"a": ("ACTIVE", 0), "b": ("ACTIVE", 1)}),
        check.RoleSample(0.15, {"a": ("", 0), "b": ("ACTIVE", 1)}),
    ]
    assert check.max_actives(samples) == 2
    assert check.two_active_windows(samples) == [{"start": 0.05, "end": 0.1, "polls": 2, "epochs": {"a": 0, "b": 1}}]
    assert check.max_actives(samples[3:]) == 1


def test_histories_are_read_from_json_lines_even_with_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "pub.jsonl"
    lines = [
        {"e": "start", "t": 1.0, "pid": 1, "first": 1},
        {"e": "ack", "s": 1, "k": "A-1", "pt": 1.0, "t": 1.1},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"e": "ack", "s": 2, "k"')
    records, torn = check.read_lines(path)
    history = check.publisher_history("p", records)
    assert (list(history.acks), history.starts, torn) == ([1], [1.0], 1)
    sub = check.subscriber_history(
        "s", [{"e": "msg", "p": "p", "s": 1, "t": 2.0}, {"e": "gap", "p": "p", "first": 2, "last": 3, "t": 2.1}]
    )
    assert sub.delivered == [("p", 1)]
    assert sub.gaps == [check.Gap("p", 2, 3, 2.1)]


def test_every_schedule_holds_the_required_faults_and_a_seed_gives_the_same_schedule() -> None:
    for seed in range(200):
        steps = sched.draw(seed, 30.0)
        assert sched.meets_minimum(steps), (seed, steps)
        slow = [s.kind for s in steps].index(sched.SLOW)
        assert steps[slow + 1].during_migration
        assert steps[slow + 2].kind == sched.RECOVER
    assert sched.draw(7, 60.0) == sched.draw(7, 60.0)
    assert sched.draw(7, 60.0) != sched.draw(8, 60.0)
    assert not sched.meets_minimum([s for s in sched.draw(7, 60.0) if s.kind != sched.CUT])


def test_monitor_link_faults_are_added_without_changing_a_seeds_other_steps() -> None:
    """One monitor-link fault per 20 s of length, from a random stream of their own: the other
    steps of a seed stay as drawn before those faults existed (the tests' fixed seeds keep their
    meaning), and none falls inside the migration group (slow, its fault, recover)."""
    kinds: set[tuple[str, str]] = set()
    for seed in range(200):
        for seconds in (0.0, 30.0, 65.0):
            steps = sched.draw(seed, seconds)
            links = [s for s in steps if s.kind in sched.MONITOR_LINK_FAULTS]
            assert len(links) == int(seconds // sched.MONITOR_LINK_EVERY)
            assert [s for s in steps if s not in links] == sched.draw(seed, seconds, monitor_links=False)
            slow = [s.kind for s in steps].index(sched.SLOW)
            assert steps[slow + 2].kind == sched.RECOVER
            kinds.update((s.kind, s.target) for s in links)
    assert kinds == {(k, t) for k in sched.MONITOR_LINK_FAULTS for t in ("active", "standby")}


def test_the_subscription_churn_is_a_timeline_of_its_own() -> None:
    """About one call per 3 s of length (the delays add up to about the length), the same for a seed,
    every operation on every target across seeds, and the steps of a seed unchanged by it."""
    seen: set[tuple[str, str]] = set()
    for seed in range(200):
        for seconds in (0.0, 30.0, 65.0):
            calls = sched.churn_calls(seed, seconds)
            assert len(calls) == int(seconds // sched.CHURN_EVERY)
            assert calls == sched.churn_calls(seed, seconds)
            assert all(c.kind == sched.CHURN and c.detail.split()[1] in sched.CHURN_NAMES for c in calls)
            assert sched.CHURN not in {s.kind for s in sched.draw(seed, seconds)}
            seen.update((c.detail.split()[0], c.target) for c in calls)
    assert seen == {(op, t) for op in ("create", "delete") for t in ("broker-a", "broker-b", "both")}
    assert 20.0 < sum(c.delay for c in sched.churn_calls(7, 65.0)) < 110.0


def test_a_migration_overlaps_a_broker_fault_only_while_the_subscriber_is_away() -> None:
    moves = [
        {"t": 10.0, "subscriber": "slow", "reason": "SLOW", "error": ""},
        {"t": 20.0, "subscriber": "slow", "reason": "RECOVERED", "error": ""},
    ]
    assert migration_overlaps(moves, [{"t": 15.0, "kind": "kill", "duration": 1.0}], 30.0)
    assert not migration_overlaps(moves, [{"t": 25.0, "kind": "kill", "duration": 1.0}], 30.0)
    assert not migration_overlaps(moves, [{"t": 15.0, "kind": "cut", "duration": 1.0}], 30.0)


def _schedule(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "seed": 1,
        "faults": [{"t": 1.0, "kind": "kill", "target": "broker-a", "duration": 0.5, "stall_after_s": 1.0}],
        "lost": 0,
        "duplicates": 0,
        "reordered": 0,
        "gaps": 0,
        "unexpected": 0,
        "max_actives": 1,
        "unflushed_publishers": [],
        "error": "",
        "publish_stall_max_s": 1.0,
        "publish_stall_p99_s": 0.01,
        "stalls": [{"p": "pub-1", "start": 1.0, "s": 1.0}],
        "active_timeline": [[0.0, 3.0, {"broker-a": "ACTIVE", "broker-b": "STANDBY"}]],
        "duration_s": 3.0,
    }
    return base | overrides


def test_violations_name_each_broken_promise_and_the_html_stands_alone() -> None:
    assert violations(_schedule()) == []
    assert violations(_schedule(lost=3, max_actives=2, unflushed_publishers=["pub-2"])) == [
        "lost=3",
        "max_actives=2",
        "publishing stopped: pub-2 not acknowledged at the end",
    ]
    good = _schedule(violations=[])
    page = html_report({"started": "now", "failed": 0, "parameters": {}, "machine": {}, "schedules": [good]})
    assert "<svg" in page
    assert "<script" not in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


@contextlib.asynccontextmanager
async def _proxied_echo(got: list[bytes] | None = None) -> AsyncIterator[LinkProxy]:
    """A LinkProxy in front of an echo server (which records what it gets in ``got``)."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            if got is not None:
                got.append(data)
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = LinkProxy(f"127.0.0.1:{port}")
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()
        server.close()
        await server.wait_closed()


async def test_the_proxy_forwards_both_ways_and_a_cut_drops_connections_until_healed() -> None:
    async with _proxied_echo() as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"ping"

        proxy.cut()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the open connection is closed
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # new ones are dropped
        writer.close()

        proxy.heal()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"pong")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"pong"
        writer.close()


async def test_a_muted_proxy_delivers_what_callers_send_and_drops_every_answer() -> None:
    """A lost answer: the far side gets the call and acts on it, the caller hears nothing."""
    got: list[bytes] = []
    async with _proxied_echo(got) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        proxy.mute()
        writer.write(b"grant")
        while b"".join(got) != b"grant":  # noqa: ASYNC110 - bounded by the test's timeout
            await asyncio.sleep(0.01)
        writer.write(b"more")
        while b"".join(got) != b"grantmore":  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        proxy.heal()  # the muted connection closes: its stream lost bytes
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"pong")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"pong"
        writer.close()

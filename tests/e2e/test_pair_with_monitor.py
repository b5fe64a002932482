"""The whole delivery path with real processes: two brokers, the monitor, a publisher, a normal
and a slow subscriber. The monitor finds the slow one, moves it to the standby and back; the
active dies mid-stream; each subscriber receives every message exactly once, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import Publisher
from sokutatsu.monitor.v1 import monitor_pb2
from tests.broker.fix_broker import Pair, until
from tests.broker.test_pair import Consumer, _async, _publish, consuming
from tests.monitor.fix_monitor import MonitorProcess

pytestmark = pytest.mark.timeout(240)
SLOW = monitor_pb2.SWITCHOVER_REASON_SLOW
RECOVERED = monitor_pb2.SWITCHOVER_REASON_RECOVERED
FAILOVER = monitor_pb2.SWITCHOVER_REASON_FAILOVER


def _moves(status: monitor_pb2.MonitorStatus, subscriber_id: str) -> list[monitor_pb2.Switchover]:
    return sorted(
        (s for s in status.recent_switchovers if s.subscriber_id == subscriber_id and not s.error),
        key=lambda s: s.steps[0].started_unix_nano if s.steps else 0,
    )


async def test_the_slow_subscriber_is_moved_to_the_standby_and_back_without_flapping(
    pair_factory: Callable[..., Awaitable[Pair]], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    pair = await pair_factory(monitored="true")
    monitor = monitor_factory(
        (pair.active, pair.standby),
        migrate_back_seconds="1",
        min_move_seconds="2",
        slow_threshold_min="1500",
    )
    monitor.start()
    total = 30_000
    normal = Consumer(pair, "normal", total)
    # A 96 KiB budget holds about 2,600 of these (small) messages: the threshold is near its floor.
    slow = Consumer(pair, "slow", total, budget=96 * 2**10)
    async with consuming(normal, slow):
        await asyncio.wait_for(asyncio.gather(normal.sub.connected.wait(), slow.sub.connected.wait()), 10)
        slow.delay = 0.002
        publishing = asyncio.create_task(_publish(pair, "feed", total, pace=0.01))
        await monitor.until(lambda s: bool(_moves(s, "slow")), "the monitor to move the slow subscriber")
        await _until(lambda: slow.sub.broker_id == "broker-b", "the slow subscriber to reach the standby")
        normal_then = len(normal.got)
        slow.delay = 0.0
        await monitor.until(lambda s: len(_moves(s, "slow")) >= 2, "the recovered subscriber to move back")
        await publishing
    normal.check({"feed": total})
    slow.check({"feed": total})
    assert len(normal.got) > normal_then
    assert normal.brokers == ["broker-a"]
    assert slow.brokers == ["broker-a", "broker-b", "broker-a"]
    moves = _moves(await monitor.status(recent=100), "slow")
    assert [m.reason for m in moves] == [SLOW, RECOVERED]
    first = moves[0]
    assert (first.from_broker_id, first.to_broker_id) == ("broker-a", "broker-b")
    assert [t.step for t in first.steps] == [
        monitor_pb2.SWITCHOVER_STEP_POSITION,
        monitor_pb2.SWITCHOVER_STEP_ACCEPT,
        monitor_pb2.SWITCHOVER_STEP_REDIRECT,
        monitor_pb2.SWITCHOVER_STEP_RELEASE,
    ]
    assert first.depth > first.threshold > 0
    assert not _moves(await monitor.status(recent=100), "normal")


async def test_kill9_of_the_active_under_the_monitor_loses_nothing(
    pair_factory: Callable[..., Awaitable[Pair]], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    pair = await pair_factory(monitored="true")
    monitor = monitor_factory((pair.active, pair.standby))
    monitor.start()
    total = 12_000
    a, b = Consumer(pair, "desk-1", total), Consumer(pair, "desk-2", total)
    async with consuming(a, b):
        await asyncio.wait_for(asyncio.gather(a.sub.connected.wait(), b.sub.connected.wait()), 10)
        publishing = asyncio.create_task(_publish(pair, "feed", total, pace=0.005))
        await _until(lambda: len(a.got) > 4000, "delivery to get going")
        pair.active.kill9()
        await publishing
    for c in (a, b):
        c.check({"feed": total})
        assert c.brokers == ["broker-a", "broker-b"]
    status = await monitor.until(
        lambda s: any(x.reason == FAILOVER for x in s.recent_switchovers), "the monitor to record the failover"
    )
    assert {(x.broker_id, x.role) for x in status.brokers if x.serving} == {("broker-b", broker_pb2.BROKER_ROLE_ACTIVE)}
    assert {x.broker_id for x in status.assignments if x.subscriber_id in ("desk-1", "desk-2")} == {"broker-b"}


async def _until(predicate: Callable[[], bool], what: str) -> None:
    await until(lambda: _async(predicate()), what)


async def test_a_publisher_of_another_topic_does_not_hold_a_switchover(
    pair_factory: Callable[..., Awaitable[Pair]], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    """A queue made after another topic's publisher published must not take a floor for it: the
    subscriber never acknowledges that publisher, and step 2 would wait for it forever."""
    pair = await pair_factory(monitored="true")
    monitor = monitor_factory((pair.active, pair.standby), auto_switch="false")
    monitor.start()
    async with Publisher(pair.addresses, "other-feed", ack_timeout=60) as other:
        for i in range(50):
            other.publish_nowait("other-topic", "K", f"other-feed:{i + 1}".encode())
        await other.flush()
    total = 400
    desk = Consumer(pair, "desk", total)
    gate = asyncio.Event()
    async with consuming(desk):
        await asyncio.wait_for(desk.sub.connected.wait(), 10)
        publishing = asyncio.create_task(_publish(pair, "feed", total, gate=gate, gate_at=total // 2))
        await _until(lambda: len(desk.got) == total // 2, "the desk to have the first half")
        await monitor.until(
            lambda s: any(a.subscriber_id == "desk" for a in s.assignments), "the monitor to see the desk"
        )
        moved = await monitor.switchover("desk", to_broker_id="broker-b")
        assert not moved.error, moved.error
        await _until(lambda: desk.sub.broker_id == "broker-b", "the desk to reach broker-b")
        gate.set()
        await publishing
    desk.check({"feed": total})
    assert desk.brokers == ["broker-a", "broker-b"]

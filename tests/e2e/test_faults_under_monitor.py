"""Faults around the monitor, with real processes: the monitor itself dies while a subscriber is
on the standby, and a broker dies in the middle of a switchover. Whatever happens, each
subscriber receives every message exactly once, in order, and ends on a broker that is alive."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from grpc import aio

from sokutatsu.monitor.v1 import monitor_pb2
from tests.broker.fix_broker import Pair
from tests.broker.test_pair import TOPIC, Consumer, _publish, consuming
from tests.e2e.test_pair_with_monitor import FAILOVER, RECOVERED, _moves, _until
from tests.monitor.fix_monitor import MonitorProcess

pytestmark = pytest.mark.timeout(240)


async def test_with_the_monitor_down_the_brokers_keep_delivering_as_assigned_and_a_new_monitor_carries_on(
    pair_factory: Callable[..., Awaitable[Pair]], monitor_factory: Callable[..., MonitorProcess]
) -> None:
    pair = await pair_factory(monitored="true")
    settings = {"migrate_back_seconds": "1", "min_move_seconds": "2", "slow_threshold_min": "1500"}
    monitor = monitor_factory((pair.active, pair.standby), **settings)
    monitor.start()
    total, gate_at = 24_000, 16_000
    gate = asyncio.Event()
    normal = Consumer(pair, "normal", total)
    slow = Consumer(pair, "slow", total, budget=96 * 2**10)
    async with consuming(normal, slow):
        await asyncio.wait_for(asyncio.gather(normal.sub.connected.wait(), slow.sub.connected.wait()), 10)
        slow.delay = 0.002
        publishing = asyncio.create_task(_publish(pair, "feed", total, pace=0.01, gate=gate, gate_at=gate_at))
        await monitor.until(lambda s: bool(_moves(s, "slow")), "the monitor to move the slow subscriber")
        await _until(lambda: slow.sub.broker_id == "broker-b", "the slow subscriber to reach the standby")

        monitor.kill9()
        # No monitor: the standby goes on serving the slow subscriber, the active the normal one.
        normal_then, slow_then = len(normal.got), len(slow.got)
        slow.delay = 0.0
        await _until(lambda: len(slow.got) >= min(slow_then + 2000, gate_at), "delivery without the monitor")
        await _until(lambda: len(normal.got) >= gate_at, "the normal subscriber to get what was published")
        assert len(normal.got) > normal_then
        assert (normal.sub.broker_id, slow.sub.broker_id) == ("broker-a", "broker-b")

        # A new monitor rebuilds the view from the brokers, then moves the recovered one back.
        monitor.start()
        # (Each broker's statistics arrive on their own stream: until both have, the view is partial.)
        await monitor.until(
            lambda s: (
                {(a.subscriber_id, a.broker_id) for a in s.assignments}
                >= {("slow", "broker-b"), ("normal", "broker-a")}
            ),
            "the restarted monitor to see the slow subscriber on the standby and the normal one on the active",
        )
        await monitor.until(lambda s: bool(_moves(s, "slow")), "the recovered subscriber to move back")
        gate.set()
        await publishing
    normal.check({"feed": total})
    slow.check({"feed": total})
    assert normal.brokers == ["broker-a"]
    assert slow.brokers == ["broker-a", "broker-b", "broker-a"]
    [back] = _moves(await monitor.status(recent=100), "slow")
    assert back.reason == RECOVERED
    assert (back.from_broker_id, back.to_broker_id) == ("broker-b", "broker-a")
    assert len(back.steps) == 4


@pytest.mark.parametrize("victim", ["taking", "serving"])
async def test_a_broker_dying_during_a_switchover_leaves_the_subscriber_on_the_survivor_with_nothing_lost(
    pair_factory: Callable[..., Awaitable[Pair]], monitor_factory: Callable[..., MonitorProcess], victim: str
) -> None:
    """The victim is frozen (SIGSTOP) just before the request, so a step hangs on it, then killed."""
    pair = await pair_factory(monitored="true")
    monitor = monitor_factory((pair.active, pair.standby), auto_switch="false")
    monitor.start()
    await monitor.until(lambda s: sum(b.serving for b in s.brokers) == 2, "both brokers")
    total = 12_000
    moving, staying = Consumer(pair, "desk-1", total), Consumer(pair, "desk-2", total)
    dying, dying_id, survivor = (
        (pair.standby, "broker-b", "broker-a") if victim == "taking" else (pair.active, "broker-a", "broker-b")
    )
    async with consuming(moving, staying):
        await asyncio.wait_for(asyncio.gather(moving.sub.connected.wait(), staying.sub.connected.wait()), 10)
        publishing = asyncio.create_task(_publish(pair, "feed", total, pace=0.01))
        await _until(lambda: len(moving.got) > 3000, "delivery to get going")

        dying.freeze()
        request = asyncio.create_task(monitor.switchover("desk-1", TOPIC, to_broker_id="broker-b"))
        await monitor.until(
            lambda s: any(r.subscriber_id == "desk-1" and not r.finished for r in s.recent_switchovers),
            "the switchover to be under way",
        )
        dying.kill9()
        try:
            record = await request
        except aio.AioRpcError as exc:  # refused once the monitor saw the broker go: also a fine end
            error = exc.details() or ""
        else:
            error = record.error
        # It failed, and says on which broker: e.g. "step 2 (accept) on broker-b failed: UNAVAILABLE ...".
        assert dying_id in error, error
        await publishing
    for c in (moving, staying):
        c.check({"feed": total})
        assert c.sub.broker_id == survivor
    status = await monitor.until(
        lambda s: {(a.subscriber_id, a.broker_id) for a in s.assignments} >= {("desk-1", survivor)},
        "the monitor to place the subscriber on the survivor",
    )
    if victim == "serving":
        assert any(r.reason == FAILOVER for r in status.recent_switchovers)
        assert moving.brokers == ["broker-a", "broker-b"]
    else:
        assert moving.brokers == ["broker-a"]
    assert monitor_pb2.SWITCHOVER_REASON_MANUAL in {r.reason for r in status.recent_switchovers}

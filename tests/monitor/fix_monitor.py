"""Real monitor processes (and the broker pair they watch) for tests.

``monitor_factory(pair, **settings)`` makes a :class:`MonitorProcess` watching a pair
(``start()`` it; settings are ``SOKUTATSU_MONITOR_*`` without the prefix, e.g.
``failover_after_seconds="0.5"``); ``broker_pair()`` starts broker-a (active) and broker-b
(standby, peer broker-a) on free ports. Every process is stopped at the end of the test.

    async def test_x(broker_pair, monitor_factory):
        a, b = broker_pair()
        monitor = monitor_factory((a, b))
        monitor.start()
        status = await monitor.until(lambda s: all(b.serving for b in s.brokers), "both brokers seen")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from grpc import aio

from sokutatsu.harness import ServiceProcess
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc
from tests.broker.fix_broker import BrokerProcess

# Only stops a hung test; nothing asserts on durations.
UNTIL_LIMIT_SECONDS = 30.0

# Quicker than the defaults, so tests wait less; the logic is the same.
TEST_SETTINGS = {
    "SOKUTATSU_MONITOR_STATS_INTERVAL_MS": "50",
    "SOKUTATSU_MONITOR_FAILOVER_AFTER_SECONDS": "0.5",
}


def brokers_setting(pair: tuple[BrokerProcess, BrokerProcess], ids: tuple[str, str] = ("broker-a", "broker-b")) -> str:
    """``SOKUTATSU_MONITOR_BROKERS`` for two started brokers."""
    return ",".join(f"{broker_id}={broker.address}" for broker_id, broker in zip(ids, pair, strict=True))


class MonitorProcess(ServiceProcess):
    """A monitor on a free port, with the test settings; killed and started again."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        defaults = {"SOKUTATSU_MONITOR_LISTEN": "127.0.0.1:0", "SOKUTATSU_GRACE_SECONDS": "1", **TEST_SETTINGS}
        super().__init__("sokutatsu.monitor", folder, {**defaults, **(env or {})}, name="monitor")

    def log(self) -> str:
        return self.output()

    # ---------------------------------------------------------------- calls --
    async def status(self, recent: int = 0) -> monitor_pb2.MonitorStatus:
        async with aio.insecure_channel(self.address) as channel:
            reply: monitor_pb2.MonitorStatus = await monitor_pb2_grpc.MonitorStub(channel).GetStatus(
                monitor_pb2.GetStatusRequest(recent_switchovers=recent), timeout=10
            )
            return reply

    async def switchover(self, subscriber_id: str, topic: str = "", to_broker_id: str = "") -> monitor_pb2.Switchover:
        async with aio.insecure_channel(self.address) as channel:
            reply: monitor_pb2.Switchover = await monitor_pb2_grpc.MonitorStub(channel).RequestSwitchover(
                monitor_pb2.RequestSwitchoverRequest(
                    subscriber_id=subscriber_id, topic=topic, to_broker_id=to_broker_id
                ),
                timeout=30,
            )
            return reply

    async def assignment(self, subscriber_id: str, topic: str = "") -> monitor_pb2.Assignment:
        async with aio.insecure_channel(self.address) as channel:
            reply: monitor_pb2.Assignment = await monitor_pb2_grpc.MonitorStub(channel).GetAssignment(
                monitor_pb2.GetAssignmentRequest(subscriber_id=subscriber_id, topic=topic), timeout=10
            )
            return reply

    async def until(
        self,
        predicate: Callable[[monitor_pb2.MonitorStatus], bool],
        what: str,
        limit: float = UNTIL_LIMIT_SECONDS,
    ) -> monitor_pb2.MonitorStatus:
        """Poll GetStatus until ``predicate`` holds; return that status (the bound only stops a hung test)."""
        deadline = time.monotonic() + limit
        last = None
        while time.monotonic() < deadline:
            last = await self.status()
            if predicate(last):
                return last
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}; last status:\n{last}\nmonitor log:\n{self.log()}")


@pytest.fixture
def monitor_factory(tmp_path: Path) -> Iterator[Callable[..., MonitorProcess]]:
    """``monitor_factory(pair, **settings)`` (not started); ``pair=None`` leaves BROKERS to ``settings``."""
    made: list[MonitorProcess] = []

    def make(pair: tuple[BrokerProcess, BrokerProcess] | None = None, **settings: str) -> MonitorProcess:
        folder = tmp_path / f"monitor{len(made)}"
        folder.mkdir()
        env = {f"SOKUTATSU_MONITOR_{k.upper()}": v for k, v in settings.items()}
        if pair is not None:
            env.setdefault("SOKUTATSU_MONITOR_BROKERS", brokers_setting(pair))
        monitor = MonitorProcess(folder=folder, env=env)
        made.append(monitor)
        return monitor

    yield make
    for monitor in made:
        monitor.stop()


@pytest.fixture
def broker_pair(
    broker_factory: Callable[..., BrokerProcess],
) -> Callable[..., tuple[BrokerProcess, BrokerProcess]]:
    """``broker_pair(**settings)``: broker-a (active) and broker-b (standby, told broker-a's address), started."""

    def start(**settings: str) -> tuple[BrokerProcess, BrokerProcess]:
        a = broker_factory(instance="broker-a", role="active", **settings)
        a.start()
        b = broker_factory(instance="broker-b", role="standby", peer=a.address, **settings)
        b.start()
        return a, b

    return start


__all__ = ["MonitorProcess", "broker_pair", "brokers_setting", "monitor_factory"]

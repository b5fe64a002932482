"""Monitor processes: one on a free port watching a broker pair, and the calls a caller waits on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

from sokutatsu.core.tls import open_channel
from sokutatsu.harness.broker import PAIR, BrokerProcess
from sokutatsu.harness.process import START_LIMIT_SECONDS, HarnessError, ServiceProcess, settings
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc

PREFIX = "SOKUTATSU_MONITOR_"


def brokers_setting(brokers: Sequence[BrokerProcess], ids: Sequence[str] = PAIR) -> str:
    """``SOKUTATSU_MONITOR_BROKERS`` for started brokers: ``broker-a=host:port,broker-b=host:port``."""
    return ",".join(f"{broker_id}={broker.address}" for broker_id, broker in zip(ids, brokers, strict=True))


class MonitorProcess(ServiceProcess):
    """A monitor on a free port; killed and started again. ``env`` adds to (or overrides) that."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None, *, name: str = "monitor") -> None:
        defaults = {f"{PREFIX}LISTEN": "127.0.0.1:0", "SOKUTATSU_GRACE_SECONDS": "1"}
        super().__init__("sokutatsu.monitor", folder, {**defaults, **(env or {})}, name)

    @classmethod
    def watching(cls, folder: Path, pair: Sequence[BrokerProcess] | None, /, **values: str) -> Self:
        """A monitor (not started) of these started brokers (``None``: ``brokers=`` among ``values``),
        with these ``SOKUTATSU_MONITOR_*`` settings (without the prefix)."""
        env = settings(PREFIX, **values)
        if pair is not None:
            env.setdefault(f"{PREFIX}BROKERS", brokers_setting(pair))
        return cls(folder, env)

    def log(self) -> str:
        return self.output()

    # ---------------------------------------------------------------- calls --
    async def status(self, recent: int = 0) -> monitor_pb2.MonitorStatus:
        async with open_channel(self.address) as channel:
            reply: monitor_pb2.MonitorStatus = await monitor_pb2_grpc.MonitorStub(channel).GetStatus(
                monitor_pb2.GetStatusRequest(recent_switchovers=recent), timeout=10
            )
            return reply

    async def switchover(self, subscriber_id: str, topic: str = "", to_broker_id: str = "") -> monitor_pb2.Switchover:
        async with open_channel(self.address) as channel:
            reply: monitor_pb2.Switchover = await monitor_pb2_grpc.MonitorStub(channel).RequestSwitchover(
                monitor_pb2.RequestSwitchoverRequest(
                    subscriber_id=subscriber_id, topic=topic, to_broker_id=to_broker_id
                ),
                timeout=30,
            )
            return reply

    async def assignment(self, subscriber_id: str, topic: str = "") -> monitor_pb2.Assignment:
        async with open_channel(self.address) as channel:
            reply: monitor_pb2.Assignment = await monitor_pb2_grpc.MonitorStub(channel).GetAssignment(
                monitor_pb2.GetAssignmentRequest(subscriber_id=subscriber_id, topic=topic), timeout=10
            )
            return reply

    async def until(
        self,
        predicate: Callable[[monitor_pb2.MonitorStatus], bool],
        what: str,
        limit: float = START_LIMIT_SECONDS,
    ) -> monitor_pb2.MonitorStatus:
        """Poll GetStatus until ``predicate`` holds; that status (:class:`HarnessError` with the last
        status and the monitor's log after ``limit``, which only stops a hung wait)."""
        deadline = time.monotonic() + limit
        last = None
        while time.monotonic() < deadline:
            last = await self.status()
            if predicate(last):
                return last
            await asyncio.sleep(0.02)
        raise HarnessError(f"timed out waiting for {what}; last status:\n{last}\nmonitor log:\n{self.log()}")

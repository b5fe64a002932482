"""Broker processes: one on a free port with its state folder, and the active/standby pair.

A pair on port 0 finds itself as ``sokutatsu up`` wires it: the standby is told the active's
address, the active learns the standby's from its first watermark frame. :meth:`Pair.wait_paired`
returns once each broker hears the other and holds what the other holds (``caught_up``: until
then a switchover to it is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.core.tls import open_channel
from sokutatsu.harness.process import START_LIMIT_SECONDS, ServiceProcess, settings, until

PREFIX = "SOKUTATSU_BROKER_"
PAIR = ("broker-a", "broker-b")


class BrokerProcess(ServiceProcess):
    """A broker on a free port with its state under ``folder/state``; killed, paused and started
    again on the same state. ``env`` adds to (or overrides) those settings."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None, *, name: str = "broker") -> None:
        defaults = settings(PREFIX, listen="127.0.0.1:0", state_dir=str(folder / "state"))
        super().__init__("sokutatsu.broker", folder, {**defaults, "SOKUTATSU_GRACE_SECONDS": "1", **(env or {})}, name)

    @classmethod
    def with_settings(cls, folder: Path, **values: str) -> Self:
        """``with_settings(folder, queue_budget="64KiB")``: ``SOKUTATSU_BROKER_*`` without the prefix."""
        return cls(folder, settings(PREFIX, **values))

    @property
    def state_dir(self) -> Path:
        return Path(self.env[f"{PREFIX}STATE_DIR"])

    def log(self) -> str:
        return self.output()

    async def stats(self) -> broker_pb2.BrokerStats:
        return await stats(self.address)


async def stats(address: str) -> broker_pb2.BrokerStats:
    """The broker's ``GetStats`` (its subscribers, its peer link, whether it is caught up)."""
    async with open_channel(address) as channel:
        result: broker_pb2.BrokerStats = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
            broker_pb2.GetStatsRequest(), timeout=10
        )
        return result


@dataclass
class Pair:
    """Two brokers that know each other: ``active`` (broker-a) and ``standby`` (broker-b)."""

    active: BrokerProcess
    standby: BrokerProcess

    @classmethod
    def of(cls, active: BrokerProcess, standby: BrokerProcess) -> Pair:
        """Two brokers (not started) made a pair: their instance names and roles."""
        active.env.update(settings(PREFIX, instance=PAIR[0], role="active"))
        standby.env.update(settings(PREFIX, instance=PAIR[1], role="standby"))
        return cls(active, standby)

    @classmethod
    def in_folder(cls, folder: Path, **values: str) -> Pair:
        """broker-a and broker-b under ``folder`` (not started), both with these ``SOKUTATSU_BROKER_*``
        settings (without the prefix)."""
        return cls.of(*(BrokerProcess(folder / name, settings(PREFIX, **values), name=name) for name in PAIR))

    @property
    def brokers(self) -> tuple[BrokerProcess, BrokerProcess]:
        return self.active, self.standby

    @property
    def addresses(self) -> list[str]:
        return [self.active.address, self.standby.address]

    def start(self) -> Pair:
        """The active, then the standby told the active's address (also for its later starts)."""
        self.active.start()
        self.standby.env[f"{PREFIX}PEER"] = self.active.address
        self.standby.start()
        return self

    async def paired(self) -> bool:
        """Whether each broker hears the other and is caught up."""
        replies = [await stats(address) for address in self.addresses]
        return all(s.peer_up and s.caught_up for s in replies)

    async def wait_paired(self, limit: float = START_LIMIT_SECONDS) -> Pair:
        await until(self.paired, "the brokers of the pair to hear each other and be caught up", limit=limit)
        return self

    def stop(self) -> None:
        for broker in reversed(self.brokers):
            broker.stop()

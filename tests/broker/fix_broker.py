"""Real broker processes for tests: start on a free port, kill -9, restart on the same state folder."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.core.health import wait_serving
from sokutatsu.harness import ServiceProcess


class BrokerProcess(ServiceProcess):
    """A broker on a free port with its state under ``folder/state``; killed, paused and started
    again on the same state."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        defaults = {
            "SOKUTATSU_BROKER_LISTEN": "127.0.0.1:0",
            "SOKUTATSU_BROKER_STATE_DIR": str(folder / "state"),
            "SOKUTATSU_GRACE_SECONDS": "1",
        }
        super().__init__("sokutatsu.broker", folder, {**defaults, **(env or {})}, name="broker")

    @property
    def state_dir(self) -> Path:
        return self.folder / "state"

    def log(self) -> str:
        return self.output()


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Make brokers with settings, e.g. ``broker_factory(queue_budget="64KiB")`` (not started)."""
    started: list[BrokerProcess] = []

    class Factory(BrokerProcess):
        def __init__(self, **env: str) -> None:
            folder = tmp_path / f"broker{len(started)}"
            folder.mkdir()
            super().__init__(folder=folder, env={f"SOKUTATSU_BROKER_{k.upper()}": v for k, v in env.items()})
            started.append(self)

    yield Factory
    for broker in started:
        broker.stop()


@pytest.fixture
def broker(broker_factory: Callable[..., BrokerProcess]) -> BrokerProcess:
    b = broker_factory()
    b.start()
    return b


@dataclass
class Pair:
    """Two brokers that know each other: ``active`` (broker-a) and ``standby`` (broker-b)."""

    active: BrokerProcess
    standby: BrokerProcess

    @property
    def addresses(self) -> list[str]:
        return [self.active.address, self.standby.address]


@pytest.fixture
def pair_factory(broker_factory: Callable[..., BrokerProcess]) -> Callable[..., Awaitable[Pair]]:
    """Start a pair with extra settings for both; wait until each hears the other and has
    the other's holdings (``caught_up``: until then a switchover to it is refused).

    The standby is told the active's address; the active learns the standby's from its
    first watermark frame (the way a pair on port 0 finds itself).
    """

    async def make(**settings: str) -> Pair:
        settings.setdefault("peer_timeout_ms", "500")
        a = broker_factory(instance="broker-a", role="active", **settings)
        a.start()
        b = broker_factory(instance="broker-b", role="standby", peer=a.address, **settings)
        b.start()
        pair = Pair(a, b)

        async def heard() -> bool:
            return all(s.peer_up and s.caught_up for s in [await stats(a.address), await stats(b.address)])

        await until(heard, "the brokers of the pair to hear each other and be caught up")
        return pair

    return make


async def stats(address: str) -> broker_pb2.BrokerStats:
    async with aio.insecure_channel(address) as channel:
        result: broker_pb2.BrokerStats = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
            broker_pb2.GetStatsRequest(), timeout=10
        )
        return result


async def subscriber_stats(address: str, subscriber_id: str) -> broker_pb2.SubscriberStats:
    for sub in (await stats(address)).subscribers:
        if sub.subscriber_id == subscriber_id:
            return sub
    raise AssertionError(f"no subscriber {subscriber_id!r} at {address}")


async def until(predicate_coro: object, what: str, limit: float = 30.0) -> None:
    """Poll an async predicate until true; a generous bound only stops a hung test."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if await predicate_coro():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


__all__ = [
    "BrokerProcess",
    "Pair",
    "broker",
    "broker_factory",
    "pair_factory",
    "stats",
    "subscriber_stats",
    "until",
    "wait_serving",
]

"""Real broker processes for tests (``sokutatsu.harness.broker``): start on a free port, kill -9,
restart on the same state folder; a pair waited for until paired. The fixtures stop them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.health import wait_serving
from sokutatsu.harness import until
from sokutatsu.harness.broker import BrokerProcess, Pair, stats


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Make brokers with settings, e.g. ``broker_factory(queue_budget="64KiB")`` (not started)."""
    made: list[BrokerProcess] = []

    def make(**values: str) -> BrokerProcess:
        folder = tmp_path / f"broker{len(made)}"
        folder.mkdir()
        made.append(BrokerProcess.with_settings(folder, **values))
        return made[-1]

    yield make
    for broker in made:
        broker.stop()


@pytest.fixture
def broker(broker_factory: Callable[..., BrokerProcess]) -> BrokerProcess:
    b = broker_factory()
    b.start()
    return b


@pytest.fixture
def pair_factory(broker_factory: Callable[..., BrokerProcess]) -> Callable[..., Awaitable[Pair]]:
    """Start a pair with extra settings for both (``peer_timeout_ms`` 500 unless given); wait until
    each hears the other and has the other's holdings (:meth:`Pair.wait_paired`)."""

    async def make(**values: str) -> Pair:
        values.setdefault("peer_timeout_ms", "500")
        pair = Pair.of(broker_factory(**values), broker_factory(**values))
        return await pair.start().wait_paired()

    return make


async def subscriber_stats(address: str, subscriber_id: str) -> broker_pb2.SubscriberStats:
    for sub in (await stats(address)).subscribers:
        if sub.subscriber_id == subscriber_id:
            return sub
    raise AssertionError(f"no subscriber {subscriber_id!r} at {address}")


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

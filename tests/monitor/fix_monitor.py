"""Real monitor processes (and the broker pair they watch) for tests: ``sokutatsu.harness.monitor``
with the tests' quicker settings.

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

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sokutatsu.harness import monitor, settings
from sokutatsu.harness.broker import BrokerProcess, Pair
from sokutatsu.harness.monitor import brokers_setting
from sokutatsu.harness.process import START_LIMIT_SECONDS as UNTIL_LIMIT_SECONDS

# Quicker than the defaults, so tests wait less; the logic is the same.
TEST_SETTINGS = settings(monitor.PREFIX, stats_interval_ms="50", failover_after_seconds="0.5")


class MonitorProcess(monitor.MonitorProcess):
    """The harness's monitor with the tests' quicker settings (``env`` overrides them)."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None, *, name: str = "monitor") -> None:
        super().__init__(folder, {**TEST_SETTINGS, **(env or {})}, name=name)


@pytest.fixture
def monitor_factory(tmp_path: Path) -> Iterator[Callable[..., MonitorProcess]]:
    """``monitor_factory(pair, **settings)`` (not started); ``pair=None`` leaves BROKERS to ``settings``."""
    made: list[MonitorProcess] = []

    def make(pair: tuple[BrokerProcess, BrokerProcess] | None = None, **values: str) -> MonitorProcess:
        folder = tmp_path / f"monitor{len(made)}"
        folder.mkdir()
        made.append(MonitorProcess.watching(folder, pair, **values))
        return made[-1]

    yield make
    for process in made:
        process.stop()


@pytest.fixture
def broker_pair(
    broker_factory: Callable[..., BrokerProcess],
) -> Callable[..., tuple[BrokerProcess, BrokerProcess]]:
    """``broker_pair(**settings)``: broker-a (active) and broker-b (standby, told broker-a's address),
    started (not waited for until paired: a monitor test watches that happen)."""

    def start(**values: str) -> tuple[BrokerProcess, BrokerProcess]:
        return Pair.of(broker_factory(**values), broker_factory(**values)).start().brokers

    return start


__all__ = ["UNTIL_LIMIT_SECONDS", "MonitorProcess", "broker_pair", "brokers_setting", "monitor_factory"]

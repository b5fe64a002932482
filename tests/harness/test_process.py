"""The one service-process harness (``sokutatsu.harness``) the tests, benchmarks, demo, launcher
and fault schedules share: a real broker process started, paused, killed, started again on the
same folder, and stopped; a service that cannot start is reported with its log."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from sokutatsu.core.health import check
from sokutatsu.harness import HarnessError, ServiceProcess


def _broker(folder: Path) -> ServiceProcess:
    return ServiceProcess(
        "sokutatsu.broker",
        folder,
        {
            "SOKUTATSU_BROKER_LISTEN": "127.0.0.1:0",
            "SOKUTATSU_BROKER_STATE_DIR": str(folder / "state"),
            "SOKUTATSU_GRACE_SECONDS": "1",
        },
    )


async def test_a_service_is_started_paused_killed_restarted_and_stopped(tmp_path: Path) -> None:
    broker = _broker(tmp_path / "b")
    try:
        first = broker.start()
        assert broker.alive()
        assert await check(first, rpc_timeout=5) == "SERVING"

        broker.freeze()
        assert await check(first, rpc_timeout=0.5) != "SERVING"  # paused: it answers nothing
        broker.thaw()
        assert await check(first, rpc_timeout=5) == "SERVING"

        broker.kill9()
        assert broker.exit_code() == -signal.SIGKILL
        second = broker.start()  # the same folder, a new log
        assert await check(second, rpc_timeout=5) == "SERVING"
        assert [p.name for p in broker.logs] == ["broker-1.log", "broker-2.log"]
        assert broker.stop() == 0  # SIGTERM: a graceful stop
        assert not broker.alive()
    finally:
        broker.stop(limit=5)


def test_a_paused_service_is_stopped_too(tmp_path: Path) -> None:
    broker = _broker(tmp_path / "b")
    broker.start()
    broker.freeze()
    assert broker.stop() == 0  # SIGCONT before SIGTERM: it stops gracefully, not by the bound's SIGKILL


def test_a_service_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    broker = ServiceProcess("sokutatsu.broker", tmp_path / "b", {"SOKUTATSU_BROKER_LISTEN": "not an address"})
    with pytest.raises(HarnessError) as failed:
        broker.start()
    assert "exited with 2 before serving" in str(failed.value)
    assert "SOKUTATSU_BROKER_LISTEN" in str(failed.value)  # the service's own line, from its log
    assert not broker.alive()

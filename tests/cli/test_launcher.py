"""`sokutatsu up` as a user runs it: a real process tree on an embedded PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sokutatsu.core.health import check

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STARTUP_LIMIT_SECONDS = 120.0
SERVICE_NAMES = {"seq-a", "seq-b", "broker-a", "broker-b", "monitor", "queuedb-1", "queuedb-2"}


def _sokutatsu(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sokutatsu.cli", *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_up_serves_every_service_and_sigterm_stops_all(pg_tmp_folder: Path) -> None:
    state = pg_tmp_folder / "state"
    env = {"SOKUTATSU_STATE_DIR": str(state), "SOKUTATSU_GRACE_SECONDS": "2"}
    launcher = _sokutatsu("up", "--ports", "auto", env={**env, "SOKUTATSU_PG_DSN": ""})
    endpoints_file = state / "endpoints.json"
    deadline = time.monotonic() + STARTUP_LIMIT_SECONDS
    while not endpoints_file.exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            out, err = launcher.communicate()
            raise AssertionError(f"launcher did not come up: {out}\n{err}")
        time.sleep(0.1)
    endpoints = json.loads(endpoints_file.read_text())
    assert {e["name"] for e in endpoints} == SERVICE_NAMES

    async def statuses() -> list[str]:
        return [await check(e["address"]) for e in endpoints]

    assert asyncio.run(statuses()) == ["SERVING"] * len(endpoints)
    postmaster = state / "postgres" / "postmaster.pid"
    assert postmaster.exists(), "the embedded cluster lives in the state folder"

    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    assert "Sokutatsu endpoints" in out
    for name in SERVICE_NAMES:
        assert name in out
    assert not [e["name"] for e in endpoints if _alive(e["pid"])], "every service process is gone"
    assert not postmaster.exists(), "PostgreSQL is stopped"
    for e in endpoints:
        log = Path(e["log"]).read_text()
        assert "stopped" in log, log


def test_demo_brings_everything_up_and_down(pg_tmp_folder: Path) -> None:
    state = pg_tmp_folder / "state"
    demo = _sokutatsu("demo", env={"SOKUTATSU_STATE_DIR": str(state), "SOKUTATSU_PG_DSN": ""})
    out, err = demo.communicate(timeout=300)
    assert demo.returncode == 0, err
    assert "all 7 services report SERVING" in out
    assert not (state / "postgres" / "postmaster.pid").exists()


def test_a_service_failing_at_start_stops_the_rest(pg_dsn: str, tmp_path: Path) -> None:
    env = {
        "SOKUTATSU_STATE_DIR": str(tmp_path / "state"),
        "SOKUTATSU_PG_DSN": pg_dsn,
        "SOKUTATSU_QUEUEDB_DB_CHECK_SECONDS": "never",
    }
    launcher = _sokutatsu("up", "--ports", "auto", env=env)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 1
    assert "queuedb-1 exited with status 2" in err
    assert "SOKUTATSU_QUEUEDB_DB_CHECK_SECONDS" in err
    assert "Traceback" not in err
    assert "stopped monitor, broker-b, broker-a, seq-b, seq-a" in out.replace("queuedb-1, ", "")


def test_launcher_refuses_bad_settings_with_status_2(tmp_path: Path) -> None:
    launcher = _sokutatsu("up", env={"SOKUTATSU_STATE_DIR": str(tmp_path), "SOKUTATSU_PG_PORT": "five"})
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 2
    assert err.strip().splitlines() == [
        "sokutatsu: error: SOKUTATSU_PG_PORT='five': expected a whole number "
        "(Port of the embedded cluster; 0 = a free port at each start.)"
    ]


def test_busy_fixed_port_names_the_service_and_the_way_out(pg_dsn: str, tmp_path: Path) -> None:
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", 7101))
        except OSError:
            pytest.skip("port 7101 is taken by something else on this machine")
        holder.listen()
        launcher = _sokutatsu("up", env={"SOKUTATSU_STATE_DIR": str(tmp_path / "state"), "SOKUTATSU_PG_DSN": pg_dsn})
        _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("sokutatsu: error: seq-a exited with status 1: ")
    assert "127.0.0.1:7101: the port is already in use" in lines[0]
    assert "--ports auto" in lines[0]

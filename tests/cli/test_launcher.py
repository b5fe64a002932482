"""`sokutatsu up` as a user runs it: a real process tree on an embedded PostgreSQL.

Every launcher a test starts goes through the ``launch`` fixture, which stops
it (SIGTERM, then SIGKILL) and anything it left behind (services, the embedded
PostgreSQL), whatever the test's outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

from sokutatsu.client import OrderedPublisher, OrderedSubscriber
from sokutatsu.core.dsn import PostgresError
from sokutatsu.core.embedded_pg import SUPERUSER, EmbeddedPostgres
from sokutatsu.core.health import wait_serving
from sokutatsu.core.pg_auth import PASSFILE_NAME, read_passfile
from tests.helpers import pid_alive

# Bounds that only stop a hung test; nothing asserts on durations. Their sum stays
# under E2E_TIMEOUT_SECONDS, the pytest-timeout of these tests (the default 120 s is
# too short for a whole suite on a loaded machine).
STARTUP_LIMIT_SECONDS = 120.0
STOP_LIMIT_SECONDS = 60.0
SERVING_LIMIT_SECONDS = 30.0
E2E_TIMEOUT_SECONDS = 360

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(E2E_TIMEOUT_SECONDS)]

SERVICE_NAMES = {"seq-a", "seq-b", "broker-a", "broker-b", "monitor", "queuedb-1", "queuedb-2", "transfer-1"}


def _alive(pid: int) -> bool:
    return pid_alive(pid)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Launcher:
    """One ``python -m sokutatsu.cli ...`` process."""

    process: subprocess.Popen[str]
    state: Path
    out: str = ""
    err: str = ""
    finished: bool = field(default=False)

    @property
    def endpoints_file(self) -> Path:
        return self.state / "endpoints.json"

    def finish(self, limit: float = STARTUP_LIMIT_SECONDS + STOP_LIMIT_SECONDS) -> tuple[str, str]:
        """Wait for it to exit by itself; (stdout, stderr). Killed (and the test fails) past ``limit``."""
        try:
            self.out, self.err = self.process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.out, self.err = self.process.communicate()
            self.finished = True
            raise AssertionError(f"the launcher did not exit within {limit:g}s:\n{self.out}\n{self.err}") from None
        self.finished = True
        return self.out, self.err

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> tuple[str, str]:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.finish(STOP_LIMIT_SECONDS)

    def wait_up(self) -> list[dict[str, Any]]:
        """The endpoints, once every service is SERVING (the launcher writes the file then)."""
        deadline = time.monotonic() + STARTUP_LIMIT_SECONDS
        while not self.endpoints_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                out, err = self.stop()
                raise AssertionError(f"the launcher did not come up:\n{out}\n{err}")
            time.sleep(0.1)
        endpoints: list[dict[str, Any]] = json.loads(self.endpoints_file.read_text())
        return endpoints

    def clean_up(self) -> None:
        """Stop the launcher (SIGTERM, then SIGKILL) and whatever it may have left running."""
        if not self.finished:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.communicate(timeout=STOP_LIMIT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.communicate()
            self.finished = True
        for announce in (self.state / "run").glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = int(json.loads(announce.read_text())["pid"])
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        # An embedded cluster left running is adopted and stopped, as the next launcher would.
        if _postmaster_pid(self.state / "postgres") is not None:
            with contextlib.suppress(PostgresError), EmbeddedPostgres(self.state / "postgres"):
                pass


Launch = Callable[..., Launcher]


@pytest.fixture
def launch() -> Iterator[Launch]:
    started: list[Launcher] = []

    def start(*args: str, state: Path, env: dict[str, str]) -> Launcher:
        process = subprocess.Popen(
            [sys.executable, "-m", "sokutatsu.cli", *args],
            env={**os.environ, "SOKUTATSU_STATE_DIR": str(state), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        launcher = Launcher(process=process, state=state.resolve())
        started.append(launcher)
        return launcher

    try:
        yield start
    finally:
        for launcher in started:
            launcher.clean_up()


async def _all_serving(endpoints: list[dict[str, Any]]) -> None:
    for e in endpoints:
        await wait_serving(e["address"], within=SERVING_LIMIT_SECONDS)


def test_up_serves_every_service_and_sigterm_stops_all(launch: Launch, pg_tmp_folder: Path) -> None:
    state = pg_tmp_folder / "state"
    env = {"SOKUTATSU_GRACE_SECONDS": "2", "SOKUTATSU_PG_DSN": ""}
    launcher = launch("up", "--ports", "auto", state=state, env=env)
    endpoints = launcher.wait_up()
    assert {e["name"] for e in endpoints} == SERVICE_NAMES
    asyncio.run(_all_serving(endpoints))
    postmaster = launcher.state / "postgres" / "postmaster.pid"
    assert postmaster.exists(), "the embedded cluster lives in the state folder"

    environ = {e["name"]: _environ(e["pid"]) for e in endpoints}
    assert {e["SOKUTATSU_PARENT_PID"] for e in environ.values()} == {str(launcher.process.pid)}
    for broker, role in (("broker-a", "active"), ("broker-b", "standby")):
        assert environ[broker]["SOKUTATSU_BROKER_ROLE"] == role
        assert environ[broker]["SOKUTATSU_BROKER_STATE_DIR"] == str(launcher.state / broker), "a folder of its own"

    # PostgreSQL takes passwords only; the services and a person get the password from the passfile.
    passfile = launcher.state / "postgres" / PASSFILE_NAME
    password = read_passfile(passfile)[SUPERUSER]
    node_dsn = conninfo_to_dict(environ["queuedb-1"]["SOKUTATSU_QUEUEDB_DSN"])
    assert node_dsn["passfile"] == str(passfile)
    assert "password" not in node_dsn
    assert not [n for n, env in environ.items() if password in "".join(env.values())], "no password in any environment"
    psql = subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", "queuedb", "psql", "-tA", "-c", "select current_user"],
        env={**os.environ, "SOKUTATSU_STATE_DIR": str(state), "SOKUTATSU_PG_DSN": ""},
        capture_output=True,
        text=True,
        timeout=SERVING_LIMIT_SECONDS,
        check=False,
    )
    assert (psql.returncode, psql.stdout) == (0, f"{SUPERUSER}\n"), psql.stderr

    out, err = launcher.stop(signal.SIGTERM)
    assert launcher.process.returncode == 0, err
    assert err == ""
    connect = next((ln for ln in out.splitlines() if ln.startswith("PostgreSQL: ")), "")
    assert "sokutatsu queuedb psql" in connect
    assert f"passfile={passfile}" in connect, "the printed DSN names the passfile"
    assert password not in out
    assert "Sokutatsu endpoints" in out
    for name in SERVICE_NAMES:
        assert name in out
    assert not [e["name"] for e in endpoints if _alive(e["pid"])], "every service process is gone"
    assert not postmaster.exists(), "PostgreSQL is stopped"
    for e in endpoints:
        log = Path(e["log"]).read_text()
        assert "stopped" in log, log


def test_up_orders_what_two_domains_publish_the_same_for_every_subscriber(
    launch: Launch, pg_dsn: str, tmp_path: Path
) -> None:
    """The sequencer group `sokutatsu up` starts stamps (it used to answer UNAVAILABLE forever:
    no leader, peers or brokers), and ordered subscribers that subscribed before the first
    publish receive every message in one total order."""
    launcher = launch("up", "--ports", "auto", state=tmp_path / "state", env={"SOKUTATSU_PG_DSN": pg_dsn})
    endpoints = {e["name"]: e["address"] for e in launcher.wait_up()}
    stamps, received = asyncio.run(_ordered_round_trip(endpoints))
    assert len(received) == 3
    assert received[0] == received[1] == received[2], "the subscribers disagree on the order"
    assert sorted(received[0]) == sorted(stamps), "a message was lost or duplicated"
    assert {domain for domain, _ in stamps} == {"a", "b"}
    for domain in ("a", "b"):  # each domain's numbers in their order
        seqs = [seq for d, seq in received[0] if d == domain]
        assert seqs == sorted(seqs)
    _, err = launcher.stop(signal.SIGTERM)
    assert launcher.process.returncode == 0, err


async def _ordered_round_trip(endpoints: dict[str, str]) -> tuple[list[tuple[str, int]], list[list[tuple[str, int]]]]:
    """Three ordered subscribers first, then two publishers per domain; what each subscriber got."""
    brokers = [endpoints["broker-a"], endpoints["broker-b"]]
    subscribers = [OrderedSubscriber(brokers, f"reader-{i}", "ordered") for i in range(3)]
    for sub in subscribers:
        await sub.start()
    per_publisher = 100
    publishers = [
        OrderedPublisher(endpoints[f"seq-{domain}"], brokers, "ordered", domain=domain, client_id=f"{domain}{i}")
        for domain in ("a", "b")
        for i in range(2)
    ]
    try:
        for pub in publishers:
            await pub.start()
        futures = [
            pub.publish_nowait("k", f"{pub.client_id}:{n}".encode()) for n in range(per_publisher) for pub in publishers
        ]
        done = await asyncio.wait_for(asyncio.gather(*futures), SERVING_LIMIT_SECONDS)
        stamps = [(s.domain, s.seq) for s in done]

        async def read(sub: OrderedSubscriber) -> list[tuple[str, int]]:
            got: list[tuple[str, int]] = []
            async for message in sub:
                got.append((message.stamp.domain, message.stamp.seq))
                if len(got) == len(stamps):
                    return got
            return got

        received = await asyncio.wait_for(asyncio.gather(*(read(s) for s in subscribers)), SERVING_LIMIT_SECONDS)
    finally:
        for pub in publishers:
            await pub.close()
        for sub in subscribers:
            await sub.close()
    return stamps, list(received)


def test_up_check_brings_everything_up_and_down(launch: Launch, pg_tmp_folder: Path) -> None:
    """On its own embedded PostgreSQL. (The demo's scenario is tests/cli/test_demo.py's.)"""
    state = pg_tmp_folder / "state"
    check = launch("up", "--ports", "auto", "--check", state=state, env={"SOKUTATSU_PG_DSN": ""})
    out, err = check.finish()
    assert check.process.returncode == 0, err
    assert err == ""
    assert "all 8 services report SERVING" in out
    assert not (state / "postgres" / "postmaster.pid").exists()


def test_sigterm_while_postgres_starts_leaves_nothing_running(launch: Launch, pg_tmp_folder: Path) -> None:
    state = pg_tmp_folder / "state"
    launcher = launch("up", "--ports", "auto", state=state, env={"SOKUTATSU_PG_DSN": ""})
    data = launcher.state / "postgres"
    deadline = time.monotonic() + STARTUP_LIMIT_SECONDS
    # Aim at the PostgreSQL start: the postmaster has written its pid file, pg_ctl still waits for it.
    while _postmaster_pid(data) is None and launcher.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    postmaster = _postmaster_pid(data)
    out, err = launcher.stop(signal.SIGTERM)
    # Wherever the signal landed, one line (or none, if everything was already up) and nothing left running.
    if launcher.process.returncode == 128 + signal.SIGTERM:
        assert err == "sokutatsu: interrupted by SIGTERM while starting; everything started was stopped\n"
    else:
        assert launcher.process.returncode == 0, err
        assert err == ""
    assert postmaster is None or not _alive(postmaster), "the postmaster is stopped"
    assert not (data / "postmaster.pid").exists()
    assert "Traceback" not in out


def test_a_second_launcher_on_the_same_state_folder_is_refused(
    launch: Launch, pg_dsn: str, pg_tmp_folder: Path
) -> None:
    state = pg_tmp_folder / "state"
    first = launch("up", "--ports", "auto", state=state, env={"SOKUTATSU_PG_DSN": pg_dsn})
    endpoints = first.wait_up()
    second = launch("up", "--ports", "auto", state=state, env={"SOKUTATSU_PG_DSN": pg_dsn})
    _, err = second.finish()
    assert second.process.returncode == 1
    assert err == (
        f"sokutatsu: error: another sokutatsu (pid {first.process.pid}) is already running on the state folder "
        f"{first.state}: stop it first, or set SOKUTATSU_STATE_DIR to another folder\n"
    )
    assert json.loads(first.endpoints_file.read_text()) == endpoints, "the first one's run files are untouched"
    asyncio.run(_all_serving(endpoints))
    _, err = first.stop()
    assert first.process.returncode == 0, err


def test_services_stop_by_themselves_when_the_launcher_is_killed(
    launch: Launch, pg_dsn: str, pg_tmp_folder: Path
) -> None:
    launcher = launch("up", "--ports", "auto", state=pg_tmp_folder / "state", env={"SOKUTATSU_PG_DSN": pg_dsn})
    endpoints = launcher.wait_up()
    launcher.stop(signal.SIGKILL)
    deadline = time.monotonic() + STOP_LIMIT_SECONDS
    while [e for e in endpoints if _alive(e["pid"])] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [e["name"] for e in endpoints if _alive(e["pid"])], "SOKUTATSU_PARENT_PID: services follow the launcher"


def test_a_service_failing_at_start_stops_the_rest(launch: Launch, pg_dsn: str, tmp_path: Path) -> None:
    env = {"SOKUTATSU_PG_DSN": pg_dsn, "SOKUTATSU_QUEUEDB_DB_CHECK_SECONDS": "never"}
    launcher = launch("up", "--ports", "auto", state=tmp_path / "state", env=env)
    out, err = launcher.finish()
    assert launcher.process.returncode == 1
    assert err.count("\n") == 1, err
    assert err.startswith(
        "sokutatsu: error: queuedb-1 exited with status 2: "
        "sokutatsu-queuedb: error: SOKUTATSU_QUEUEDB_DB_CHECK_SECONDS='never': expected a number"
    )
    assert "stopped monitor, broker-b, broker-a" in out.replace("queuedb-1, ", "")


def test_launcher_refuses_bad_settings_with_status_2(launch: Launch, tmp_path: Path) -> None:
    launcher = launch("up", state=tmp_path, env={"SOKUTATSU_PG_PORT": "five"})
    _, err = launcher.finish()
    assert launcher.process.returncode == 2
    assert err == (
        "sokutatsu: error: SOKUTATSU_PG_PORT='five': expected a whole number "
        "(Port of the embedded cluster; 0 = a free port at each start.)\n"
    )


def test_launcher_refuses_an_unknown_sokutatsu_variable(launch: Launch, tmp_path: Path) -> None:
    launcher = launch("up", state=tmp_path, env={"SOKUTATSU_STATEDIR": str(tmp_path)})
    _, err = launcher.finish()
    assert launcher.process.returncode == 2
    assert err == "sokutatsu: error: SOKUTATSU_STATEDIR: unknown variable; did you mean SOKUTATSU_STATE_DIR?\n"


@pytest.mark.parametrize(
    "dsn",
    ["postgresql://someone:s3cret@127.0.0.1:{port}/postgres", "host=127.0.0.1 password=s3cret not-a-dsn"],
)
def test_an_unusable_pg_dsn_is_one_line(launch: Launch, tmp_path: Path, dsn: str) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {"SOKUTATSU_PG_DSN": dsn.format(port=port)}
    launcher = launch("up", "--ports", "auto", state=tmp_path / "state", env=env)
    out, err = launcher.finish()
    assert launcher.process.returncode == 1
    assert err.count("\n") == 1, err
    assert err.startswith("sokutatsu: error: cannot connect to PostgreSQL at ")
    assert "s3cret" not in err
    assert "SERVING" not in out, "no service is started without its database"


def test_busy_fixed_port_names_the_service_and_the_way_out(launch: Launch, pg_dsn: str, tmp_path: Path) -> None:
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", 7101))
        except OSError:
            pytest.skip("port 7101 is taken by something else on this machine")
        holder.listen()
        launcher = launch("up", state=tmp_path / "state", env={"SOKUTATSU_PG_DSN": pg_dsn})
        _, err = launcher.finish()
    assert launcher.process.returncode == 1
    log = launcher.state / "logs" / "seq-a.log"
    assert err == (
        "sokutatsu: error: seq-a exited with status 1: sokutatsu-sequencer: error: cannot listen on "
        "127.0.0.1:7101: the port is already in use (set SOKUTATSU_SEQUENCER_LISTEN to another host:port); "
        f"free the port or run `sokutatsu up --ports auto` (log: {log})\n"
    )

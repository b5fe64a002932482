from __future__ import annotations

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from sokutatsu.core.dsn import PostgresError, create_database, database_dsn, redact_dsn
from sokutatsu.core.embedded_pg import EmbeddedPostgres, PostgresSettings, find_bindir, free_port, provide_postgres
from tests.fix_pg import PgServer, docker_engine_problem
from tests.helpers import pid_alive


def test_start_connect_stop_and_restart_keeps_data(pg_tmp_folder: Path) -> None:
    data = pg_tmp_folder / "data"
    with EmbeddedPostgres(data) as pg, psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (v text)")
        conn.execute("INSERT INTO kept VALUES ('survives a restart')")
        assert conn.execute("SHOW max_prepared_transactions").fetchone() == ("64",)
    assert not (data / "postmaster.pid").exists(), "the server should be stopped"
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(pg.dsn, connect_timeout=2)

    with EmbeddedPostgres(data) as again, psycopg.connect(again.dsn) as conn:
        assert conn.execute("SELECT v FROM kept").fetchall() == [("survives a restart",)]


def test_listens_on_loopback_only(pg_tmp_folder: Path) -> None:
    with EmbeddedPostgres(pg_tmp_folder / "data") as pg, psycopg.connect(pg.dsn) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone() == ("127.0.0.1",)


def test_create_database_is_idempotent(pg_dsn: str) -> None:
    create_database(pg_dsn, "sokutatsu_test_db")
    create_database(pg_dsn, "sokutatsu_test_db")
    with psycopg.connect(database_dsn(pg_dsn, "sokutatsu_test_db")) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("sokutatsu_test_db",)


def test_missing_binaries_give_one_actionable_line(tmp_path: Path) -> None:
    with pytest.raises(PostgresError) as info:
        find_bindir(tmp_path / "no-postgres-here")
    assert "SOKUTATSU_PG_BINDIR" in str(info.value)
    assert "\n" not in str(info.value)


def test_refuses_a_folder_that_is_not_a_cluster(pg_tmp_folder: Path) -> None:
    data = pg_tmp_folder / "data"
    data.mkdir()
    (data / "notes.txt").write_text("someone's files")
    if os.geteuid() == 0:
        os.chown(data, pwd.getpwnam("postgres").pw_uid, -1)
    with pytest.raises(PostgresError, match="not a PostgreSQL data folder"):
        EmbeddedPostgres(data).start()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a folder owned by another user")
def test_refuses_a_folder_owned_by_someone_else(pg_tmp_folder: Path) -> None:
    data = pg_tmp_folder / "data"
    data.mkdir()
    (data / "PG_VERSION").write_text("15\n")
    os.chown(data, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(PostgresError, match="belongs to nobody"):
        EmbeddedPostgres(data).start()


def test_external_dsn_starts_nothing(tmp_path: Path) -> None:
    settings = PostgresSettings(dsn="postgresql://someone@127.0.0.1:1/db")
    with provide_postgres(tmp_path, settings) as dsn:
        assert dsn == settings.dsn
    assert not (tmp_path / "postgres").exists()


def test_testcontainers_postgres(pg_server: PgServer) -> None:
    """With a Docker engine (and no SOKUTATSU_PG_DSN), the session's PostgreSQL is a testcontainers container."""
    problem = docker_engine_problem()
    if problem is not None or os.environ.get("SOKUTATSU_PG_DSN"):
        pytest.skip(problem or "SOKUTATSU_PG_DSN is set")
    assert pg_server.source == "testcontainers"
    with psycopg.connect(pg_server.dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


# ------------------------------------------- ownership, interruption, errors --

# Bounds that only stop a hung test; nothing asserts on durations.
LIMIT_SECONDS = 30.0
START_THEN_CRASH = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from sokutatsu.core.embedded_pg import EmbeddedPostgres\n"
    "pg = EmbeddedPostgres(Path(sys.argv[1]))\n"
    "pg.start()\n"
    "print(pg.port, flush=True)\n"
    "os._exit(0)  # a crash: no stop\n"
)
START_THEN_STOP = (
    "import sys\n"
    "from pathlib import Path\n"
    "from sokutatsu.core.embedded_pg import EmbeddedPostgres\n"
    "pg = EmbeddedPostgres(Path(sys.argv[1]))\n"
    "pg.start()\n"
    "pg.stop()\n"
)


def _postmaster_alive(data: Path) -> bool:
    """Whether the postmaster named in ``data``'s pid file is a live process."""
    try:
        pid = int((data / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return False
    return pid_alive(pid)


def _stop_any_server(data: Path) -> None:
    """Test clean-up: a server left on ``data`` is adopted and stopped, as the next run would."""
    if (data / "postmaster.pid").exists():
        with contextlib.suppress(PostgresError), EmbeddedPostgres(data):
            pass


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_second_instance_on_the_same_folder_is_refused(pg_tmp_folder: Path) -> None:
    data = pg_tmp_folder / "data"
    with EmbeddedPostgres(data) as first:
        with pytest.raises(PostgresError) as info:
            EmbeddedPostgres(data).start()
        assert str(info.value).startswith(f"data folder {data} is in use by another sokutatsu process")
        assert "\n" not in str(info.value)
        with psycopg.connect(first.dsn, connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,), "the first one's server keeps running"


def test_a_server_left_by_a_crashed_run_is_adopted_and_stopped(pg_tmp_folder: Path) -> None:
    data = pg_tmp_folder / "data"
    try:
        crashed = subprocess.run(
            [sys.executable, "-c", START_THEN_CRASH, str(data)],
            capture_output=True,
            text=True,
            timeout=LIMIT_SECONDS,
            check=False,
        )
        assert crashed.returncode == 0, crashed.stderr
        assert _postmaster_alive(data), "the crashed run left its server running"
        pg = EmbeddedPostgres(data)
        pg.start()
        assert pg.port == int(crashed.stdout.split()[-1]), "the leftover server is reused"
        with psycopg.connect(pg.dsn, connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        pg.stop()
        assert not _postmaster_alive(data), "an adopted server is stopped at the end"
    finally:
        _stop_any_server(data)


def test_an_interrupted_first_start_leaves_nothing_behind(pg_tmp_folder: Path) -> None:
    """SIGINT while initdb (or the start after it) runs: no half-made cluster, no server; the next start works."""
    data = pg_tmp_folder / "data"
    child = subprocess.Popen(
        [sys.executable, "-c", START_THEN_STOP, str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + LIMIT_SECONDS
        # Aim at initdb: its hidden folder has PG_VERSION early on.
        while child.poll() is None and time.monotonic() < deadline:
            if list(pg_tmp_folder.glob(".data.initdb-*/data/PG_VERSION")):
                break
            time.sleep(0.005)
        child.send_signal(signal.SIGINT)
        child.wait(timeout=LIMIT_SECONDS)
        assert not _postmaster_alive(data)
        assert not list(pg_tmp_folder.glob(".data.initdb-*"))
        if data.exists():
            assert "Added by sokutatsu" in (data / "postgresql.conf").read_text(), "only whole clusters appear"
        with EmbeddedPostgres(data) as pg, psycopg.connect(pg.dsn, connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        _stop_any_server(data)


def test_a_leftover_of_an_interrupted_initdb_is_removed(pg_tmp_folder: Path) -> None:
    leftover = pg_tmp_folder / ".data.initdb-crashed"
    leftover.mkdir()
    (leftover / "PG_VERSION").write_text("15\n")
    with EmbeddedPostgres(pg_tmp_folder / "data") as pg, psycopg.connect(pg.dsn, connect_timeout=10) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert not leftover.exists()


def test_start_errors_come_from_this_attempt_not_from_older_log_lines(pg_tmp_folder: Path) -> None:
    data = pg_tmp_folder / "data"
    with EmbeddedPostgres(data):
        pass
    with (data / "server.log").open("a") as log:
        log.write("2020-01-01 00:00:00 UTC [1] FATAL:  an old failure of an earlier run\n")
    # An invalid setting makes this start fail with errors of its own.
    with (data / "postgresql.conf").open("a") as conf:
        conf.write("max_connections = 'lots'\n")
    with pytest.raises(PostgresError) as info:
        EmbeddedPostgres(data).start()
    message = str(info.value)
    assert message.startswith(f"PostgreSQL did not start on {data}: ")
    assert "contains errors" in message
    assert "old failure" not in message
    assert not _postmaster_alive(data)


def test_a_busy_fixed_port_is_named(pg_tmp_folder: Path) -> None:
    data = pg_tmp_folder / "data"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PostgresError) as info:
            EmbeddedPostgres(data, port=port).start()
    assert str(info.value) == (
        f"PostgreSQL cannot listen on 127.0.0.1:{port}: the port is already in use "
        "(set SOKUTATSU_PG_PORT to another port, or 0 for a free one)"
    )
    assert not _postmaster_alive(data)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://someone:s3cret@127.0.0.1:{port}/db",
        "host=127.0.0.1 port={port} user=someone password=s3cret dbname=db",
        "postgresql://someone:s3cret@127.0.0.1:notaport/db",
        "host=127.0.0.1 password=s3cret nonsense",
    ],
)
def test_an_unusable_server_is_one_line_without_the_password(dsn: str) -> None:
    with pytest.raises(PostgresError) as info:
        create_database(dsn.format(port=_closed_port()), "sokutatsu_nowhere")
    message = str(info.value)
    assert message.startswith("cannot connect to PostgreSQL at ")
    assert "s3cret" not in message
    assert "\n" not in message


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    """Outgoing connections take their source ports from the ephemeral range; a port picked
    below it cannot be taken by one between free_port() and the service's bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low <= 2048:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("dsn", "shown", "host_port"),
    [
        ("postgresql://sokutatsu:secret@127.0.0.1:5433/node1", "127.0.0.1:5433/node1", "127.0.0.1:5433"),
        ("user=sokutatsu password=secret dbname=node1 host=db port=5432", "db:5432/node1", "db:5432"),
        ("host=a,b port=1,2 dbname=z user=u", "a:1,b:2/z", "a:1,b:2"),
        ("postgresql:///node1?sslpassword=secret", "localhost:5432/node1", "localhost:5432"),
        ("password=secret garbage", "<unparsable DSN>", "<unparsable DSN>"),
    ],
)
def test_a_dsn_is_shown_as_where_it_points_never_its_user_or_password(dsn: str, shown: str, host_port: str) -> None:
    """Issue #20: a status said ``user=sokutatsu dbname=... host=... port=...``; the one redaction helper
    shows host:port and the database only."""
    assert redact_dsn(dsn) == shown
    assert redact_dsn(dsn, database=False) == host_port

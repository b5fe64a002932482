"""`sokutatsu queuedb psql`: psql on the state folder's PostgreSQL, the password from the passfile.

Real processes on a real embedded cluster; the launcher's own use of it is in test_launcher.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from sokutatsu.cli.queuedb_command import psql_invocation
from sokutatsu.core.embedded_pg import SUPERUSER, EmbeddedPostgres, default_data_dir
from sokutatsu.core.pg_auth import generate_password, read_passfile

LIMIT_SECONDS = 60.0  # only stops a hung test


def _psql(state: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", "queuedb", "psql", *args],
        env={**os.environ, "SOKUTATSU_STATE_DIR": str(state), "SOKUTATSU_PG_DSN": "", **env},
        capture_output=True,
        text=True,
        timeout=LIMIT_SECONDS,
        check=False,
    )


def test_psql_logs_in_as_the_superuser_of_the_running_cluster(
    pg_tmp_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = pg_tmp_folder / "state"
    monkeypatch.setenv("SOKUTATSU_STATE_DIR", str(state))
    monkeypatch.setenv("SOKUTATSU_PG_DSN", "")
    with EmbeddedPostgres(default_data_dir(state)) as pg:
        done = _psql(state, "-tA", "-c", "select current_user")
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"{SUPERUSER}\n"
        other = _psql(state, "--db", "template1", "-tA", "-c", "select current_database()")
        assert other.stdout == "template1\n", other.stderr
        password = read_passfile(pg.passfile)[SUPERUSER]
        argv, _ = psql_invocation("postgres", [])
        assert not [a for a in argv if password in a], "the password is not in psql's arguments"


def test_psql_without_a_running_cluster_says_what_to_do(pg_tmp_folder: Path) -> None:
    state = pg_tmp_folder / "state"
    done = _psql(state, "-c", "select 1")
    assert done.returncode == 1
    assert done.stderr.startswith(f"sokutatsu: error: no PostgreSQL is running on {state.resolve() / 'postgres'}: ")
    assert "sokutatsu up" in done.stderr
    assert done.stderr.count("\n") == 1


@pytest.fixture
def role_with_password(pg_dsn: str) -> Iterator[tuple[str, str]]:
    """A login role of the session's PostgreSQL and its password; dropped afterwards."""
    name, password = "t_psql_login", generate_password()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(name), sql.Literal(password)))
    yield name, password
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def test_psql_on_sokutatsu_pg_dsn_passes_its_password_outside_the_arguments(
    pg_dsn: str, role_with_password: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, password = role_with_password
    empty = tmp_path / "empty.pgpass"
    empty.touch(mode=0o600)
    dsn = make_conninfo(pg_dsn, user=name, password=password, passfile=str(empty))
    monkeypatch.setenv("SOKUTATSU_PG_DSN", dsn)
    argv, env = psql_invocation("postgres", ["-c", "select 1"])
    assert not [a for a in argv if password in a]
    assert env["PGPASSWORD"] == password
    done = _psql(tmp_path / "state", "-tA", "-c", "select current_user", SOKUTATSU_PG_DSN=dsn)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{name}\n"

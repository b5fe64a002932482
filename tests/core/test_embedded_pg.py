from __future__ import annotations

import os
import pwd
from pathlib import Path

import psycopg
import pytest

from sokutatsu.core.embedded_pg import (
    EmbeddedPostgres,
    PostgresError,
    PostgresSettings,
    create_database,
    database_dsn,
    find_bindir,
    provide_postgres,
)
from tests.fix_pg import docker_engine_problem


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


def test_testcontainers_postgres(pg_dsn: str) -> None:
    """With a Docker engine, the session's PostgreSQL is a testcontainers container."""
    problem = docker_engine_problem()
    if problem is not None or os.environ.get("SOKUTATSU_PG_DSN"):
        pytest.skip(problem or "SOKUTATSU_PG_DSN is set")
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)

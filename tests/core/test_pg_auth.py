"""The embedded cluster takes password logins only (issue #20 item 7, docs/security.md "PostgreSQL access").

Real clusters: a login without the password, or with a wrong one, is refused; the generated
password (in the data folder's passfile, mode 0600) works and is reused by a restart; a folder
made with ``trust`` by an older sokutatsu is moved to passwords.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sokutatsu.core.embedded_pg import SERVER_CONF, SUPERUSER, EmbeddedPostgres
from sokutatsu.core.pg_auth import PASSFILE_NAME, generate_password, read_passfile, write_passfile


def _without_password(dsn: str, tmp_path: Path) -> str:
    """``dsn`` with an empty passfile instead of the cluster's (and so no ~/.pgpass either)."""
    empty = tmp_path / "empty.pgpass"
    empty.touch(mode=0o600)
    return make_conninfo(dsn, passfile=str(empty))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_only_the_generated_password_logs_in(pg_tmp_folder: Path, tmp_path: Path) -> None:
    data = pg_tmp_folder / "data"
    with EmbeddedPostgres(data) as pg:
        assert "password" not in conninfo_to_dict(pg.dsn), "the DSN names the passfile, it holds no password"
        with pytest.raises(psycopg.OperationalError, match="no password supplied"):
            psycopg.connect(_without_password(pg.dsn, tmp_path), connect_timeout=10)
        with pytest.raises(psycopg.OperationalError, match=f'password authentication failed for user "{SUPERUSER}"'):
            psycopg.connect(
                make_conninfo(_without_password(pg.dsn, tmp_path), password=generate_password()), connect_timeout=10
            )
        password = read_passfile(pg.passfile)[SUPERUSER]
        given = make_conninfo(_without_password(pg.dsn, tmp_path), password=password)
        with psycopg.connect(given, connect_timeout=10) as conn:
            assert conn.execute("SELECT current_user").fetchone() == (SUPERUSER,)
            stored = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = current_user").fetchone()
            assert stored is not None
            assert str(stored[0]).startswith("SCRAM-SHA-256$"), "the server keeps a verifier, not the password"
            rules = conn.execute("SELECT DISTINCT auth_method FROM pg_hba_file_rules").fetchall()
            assert rules == [("scram-sha-256",)], "no trust (nor any other method) for anyone"


def test_the_passfile_is_private_and_a_restart_reuses_it(pg_tmp_folder: Path) -> None:
    data = pg_tmp_folder / "data"
    with EmbeddedPostgres(data) as pg, psycopg.connect(pg.dsn, connect_timeout=10) as conn:
        conn.execute("SELECT 1")
    passfile = data / PASSFILE_NAME
    assert pg.passfile == passfile
    assert _mode(passfile) == 0o600
    first = passfile.read_text()
    passfile.chmod(0o644)  # libpq ignores a readable passfile: the next start makes it private again
    with EmbeddedPostgres(data) as again, psycopg.connect(again.dsn, connect_timeout=10) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (SUPERUSER,)
    assert passfile.read_text() == first, "the same password after a restart"
    assert _mode(passfile) == 0o600


def _old_trust_cluster(data: Path) -> None:
    """A data folder as the sokutatsu before issue #20 made it: initdb --auth=trust, no password."""
    data.mkdir()
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(data, entry.pw_uid, entry.pw_gid)
    maker = EmbeddedPostgres(data)
    # The exact old initdb, as the postgres user when root.
    maker._run(
        "initdb", "-D", str(data), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-instructions"
    )
    with (data / "postgresql.conf").open("a") as conf:
        conf.write(SERVER_CONF)
    maker._run(
        "postgres",
        "--single",
        "-D",
        str(data),
        "postgres",
        stdin_text="CREATE TABLE kept AS SELECT 'from before' AS v;\n",
    )


def test_a_cluster_made_with_trust_is_moved_to_passwords(pg_tmp_folder: Path, tmp_path: Path) -> None:
    data = pg_tmp_folder / "data"
    _old_trust_cluster(data)
    assert "trust" in (data / "pg_hba.conf").read_text()
    assert not (data / PASSFILE_NAME).exists()
    with EmbeddedPostgres(data) as pg:
        with pytest.raises(psycopg.OperationalError, match="no password supplied"):
            psycopg.connect(_without_password(pg.dsn, tmp_path), connect_timeout=10)
        with psycopg.connect(pg.dsn, connect_timeout=10) as conn:
            assert conn.execute("SELECT current_user").fetchone() == (SUPERUSER,)
            assert conn.execute("SELECT v FROM kept").fetchall() == [("from before",)], "its data is kept"
    assert _mode(data / PASSFILE_NAME) == 0o600
    hba = [ln for ln in (data / "pg_hba.conf").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert hba
    assert all(ln.split()[-1] == "scram-sha-256" for ln in hba)


def test_a_deleted_passfile_gets_a_new_password(pg_tmp_folder: Path, tmp_path: Path) -> None:
    data = pg_tmp_folder / "data"
    with EmbeddedPostgres(data) as pg:
        old = read_passfile(pg.passfile)[SUPERUSER]
    (data / PASSFILE_NAME).unlink()
    with EmbeddedPostgres(data) as pg:
        new = read_passfile(pg.passfile)[SUPERUSER]
        assert new != old
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            psycopg.connect(make_conninfo(_without_password(pg.dsn, tmp_path), password=old), connect_timeout=10)
        with psycopg.connect(pg.dsn, connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_passfile_fields_are_escaped_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "x.pgpass"
    write_passfile(path, {"plain": "p1", "odd:user": "a:b\\c"})
    assert read_passfile(path) == {"plain": "p1", "odd:user": "a:b\\c"}
    assert _mode(path) == 0o600

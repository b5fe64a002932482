"""PostgreSQL for the test session (a pytest plugin, see conftest.py)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from sokutatsu.core.embedded_pg import EmbeddedPostgres


def docker_engine_problem() -> str | None:
    """None when a Docker engine answers ``/_ping``; otherwise why not (checked without the docker library)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://"):
        path = host.removeprefix("unix://")
        if not Path(path).exists():
            return f"no Docker engine ({path} does not exist)"
        family, address = socket.AF_UNIX, path
    elif host.startswith("tcp://"):
        name, _, port = host.removeprefix("tcp://").partition(":")
        family, address = socket.AF_INET, (name, int(port or 2375))  # type: ignore[assignment]
    else:
        return f"DOCKER_HOST={host} is not a unix:// or tcp:// address"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(3)
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            reply = sock.recv(64)
    except OSError as exc:
        return f"no Docker engine answers at {host} ({exc.strerror or exc})"
    return None if b" 200 " in reply else f"Docker at {host} answered {reply[:32]!r}"


def _server_version(dsn: str) -> str:
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"


@dataclass(frozen=True)
class PgServer:
    """The session's PostgreSQL: a superuser DSN and where the server came from."""

    dsn: str
    # "SOKUTATSU_PG_DSN", "testcontainers" or "embedded".
    source: str


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A PostgreSQL this session may create databases in (see the module docstring of conftest.py)."""
    if dsn := os.environ.get("SOKUTATSU_PG_DSN"):
        yield PgServer(dsn, "SOKUTATSU_PG_DSN")
        return
    if docker_engine_problem() is None:
        from testcontainers.postgres import PostgresContainer  # noqa: PLC0415

        with PostgresContainer("postgres:15", driver=None) as container:
            yield PgServer(container.get_connection_url(), "testcontainers")
        return
    # Under /tmp: when this runs as root, the cluster runs as postgres and must reach it.
    folder = Path(tempfile.mkdtemp(prefix="sokutatsu-test-pg-"))
    folder.chmod(0o755)
    try:
        with EmbeddedPostgres(folder / "data") as pg:
            yield PgServer(pg.dsn, "embedded")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_dsn(pg_server: PgServer) -> str:
    """A superuser DSN on the session's PostgreSQL."""
    return pg_server.dsn


@pytest.fixture(scope="session")
def pg_version(pg_dsn: str) -> str:
    return _server_version(pg_dsn)


@pytest.fixture
def pg_tmp_folder() -> Iterator[Path]:
    """An empty folder under /tmp that the postgres user can reach."""
    folder = Path(tempfile.mkdtemp(prefix="sokutatsu-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> list[str]:
    source = "SOKUTATSU_PG_DSN" if os.environ.get("SOKUTATSU_PG_DSN") else None
    if source is None:
        problem = docker_engine_problem()
        source = "testcontainers" if problem is None else f"embedded cluster ({problem})"
    return [f"PostgreSQL: {source}"]

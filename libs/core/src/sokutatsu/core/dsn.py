"""PostgreSQL connection strings: shown without secrets, checked, pointed at another database.

A DSN is shown one way only, :func:`redact_dsn` (``host:port/dbname``), in logs, errors and gRPC
statuses alike; a driver error through :func:`error_line`, its password masked (issue #20).
"""

from __future__ import annotations

import contextlib
import re

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sokutatsu.core.errors import StartupError

CONNECT_TIMEOUT_SECONDS = 10


class PostgresError(StartupError):
    """The embedded cluster cannot be found, prepared, started or stopped, or a server cannot be used."""


def dsn_without_password(dsn: str) -> str:
    """``dsn`` as a conninfo string a person can paste into psql, its password left out (a passfile it
    names stays): for the launcher's hint; logs and statuses show :func:`redact_dsn`."""
    params = conninfo_to_dict(dsn)
    shown = {k: str(v) for k, v in params.items() if k != "password" and v is not None}
    # Where first, as a person writes a DSN (libpq's own order puts user and passfile first).
    first = {k: shown.pop(k) for k in ("host", "hostaddr", "port", "user", "dbname") if k in shown}
    return make_conninfo("", **first, **shown)


def redact_dsn(dsn: str, *, database: bool = True) -> str:
    """Where ``dsn`` points, for messages: ``host:port/dbname`` (``host:port`` with ``database=False``),
    several hosts comma-separated. Never the user, the password or any other parameter: this is the
    one way a DSN is shown, in logs, errors and gRPC statuses alike (issue #20)."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "<unparsable DSN>"
    hosts = str(params.get("host") or params.get("hostaddr") or "localhost").split(",")
    ports = str(params.get("port") or "5432").split(",")
    if len(ports) < len(hosts):
        ports += [ports[-1]] * (len(hosts) - len(ports))
    shown = ",".join(f"{host}:{port}" for host, port in zip(hosts, ports, strict=False))
    name = params.get("dbname")
    return f"{shown}/{name}" if database and name else shown


def _secrets(dsn: str) -> list[str]:
    """Passwords that may appear in ``dsn``, parsable or not."""
    found = re.findall(r"://[^:/@\s]*:([^@\s]+)@", dsn) + re.findall(r"password\s*=\s*'?([^'\s]+)", dsn)
    with contextlib.suppress(psycopg.Error):
        password = conninfo_to_dict(dsn).get("password")
        if password:
            found.append(str(password))
    return [s for s in found if s]


def error_line(exc: BaseException, dsn: str) -> str:
    """The first line of a driver error, with any password of ``dsn`` masked."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    for secret in _secrets(dsn):
        text = text.replace(secret, "***")
    return text


def create_database(dsn: str, name: str) -> None:
    """Create database ``name`` on the server at ``dsn`` unless it exists; PostgresError (one line) if not possible."""
    where = redact_dsn(dsn)
    try:
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    except psycopg.Error as exc:
        raise PostgresError(f"cannot connect to PostgreSQL at {where}: {error_line(exc, dsn)}") from None
    try:
        with conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.errors.DuplicateDatabase:
        return  # created meanwhile by someone else
    except psycopg.Error as exc:
        raise PostgresError(f"cannot create database {name} on PostgreSQL at {where}: {error_line(exc, dsn)}") from None


def check_dsn(dsn: str) -> None:
    """PostgresError (one line, without the password) when libpq cannot parse ``dsn``."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        raise PostgresError(f"unusable PostgreSQL DSN {redact_dsn(dsn)}: {error_line(exc, dsn)}") from None


def database_dsn(dsn: str, name: str) -> str:
    """``dsn`` pointing at database ``name`` instead."""
    try:
        return make_conninfo(dsn, dbname=name)
    except psycopg.Error as exc:
        raise PostgresError(f"unusable PostgreSQL DSN {redact_dsn(dsn)}: {error_line(exc, dsn)}") from None

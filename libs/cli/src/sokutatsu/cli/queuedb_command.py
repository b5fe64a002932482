"""``sokutatsu queuedb migrate`` and ``sokutatsu queuedb psql``.

``migrate`` applies the queue-db schema to an application's database by hand. The queue-db
service applies the migrations at start; an application that enqueues with the SDK into its
own database, without running the service there, applies them with this (or with
``sokutatsu.queuedb.schema.migrate`` from its own deployment code).

``psql`` opens psql on the PostgreSQL of the state folder (the embedded cluster a running
``sokutatsu up`` started, or ``SOKUTATSU_PG_DSN``) as its superuser, the password read from the
cluster's passfile: it never appears in psql's arguments (docs/security.md, "PostgreSQL access").
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Annotated

import psycopg
import typer
from psycopg.conninfo import conninfo_to_dict
from rich.console import Console

from sokutatsu.cli.settings import LauncherSettings
from sokutatsu.core.dsn import PostgresError, database_dsn, dsn_without_password, error_line, redact_dsn
from sokutatsu.core.embedded_pg import PostgresSettings, default_data_dir, find_bindir, running_cluster_dsn
from sokutatsu.core.settings import SettingsError, load
from sokutatsu.queuedb.schema import current_version, latest_version, migrate

console = Console(soft_wrap=True)  # a DSN line must not break where a script greps it
err = Console(stderr=True, highlight=False, soft_wrap=True)


def queuedb_migrate(
    dsn: Annotated[
        str,
        typer.Option(
            "--dsn",
            envvar="SOKUTATSU_QUEUEDB_DSN",
            help="PostgreSQL connection string of the database (default: $SOKUTATSU_QUEUEDB_DSN).",
        ),
    ],
) -> None:
    """Apply the queue-db schema migrations this version ships that the database lacks."""
    where = redact_dsn(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            before = current_version(conn)
            applied = migrate(conn)
    except psycopg.Error as exc:
        console.print(f"[red]cannot migrate {where}: {error_line(exc, dsn)}[/red]")
        raise typer.Exit(1) from None
    if applied:
        console.print(f"{where}: schema version {before} -> {latest_version()} (applied {applied})")
    else:
        console.print(f"{where}: schema already at version {before}; nothing to do")


def _psql_binary(pg: PostgresSettings) -> str:
    """psql beside the server binaries, else on PATH."""
    try:
        beside = find_bindir(pg.bindir) / "psql"
    except PostgresError:
        beside = None
    if beside is not None and beside.is_file():
        return str(beside)
    found = shutil.which("psql")
    if found is None:
        raise PostgresError("psql not found: install the PostgreSQL client (Debian: apt-get install postgresql-client)")
    return found


def psql_invocation(database: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """psql's argv and environment for the PostgreSQL of the state folder; no password in either argv or a DSN.

    The embedded cluster's password comes from its passfile (named in the DSN); a password in
    ``SOKUTATSU_PG_DSN`` goes to psql through ``PGPASSWORD``."""
    pg = load(PostgresSettings)
    env = dict(os.environ)
    if pg.dsn:
        dsn = database_dsn(pg.dsn, database)
        password = conninfo_to_dict(dsn).get("password")
        if password:
            env["PGPASSWORD"] = str(password)
        dsn = dsn_without_password(dsn)
    else:
        state_dir = load(LauncherSettings).state_dir
        dsn = running_cluster_dsn(pg.data or default_data_dir(state_dir), database)
        env["PGPASSFILE"] = str(conninfo_to_dict(dsn)["passfile"])
    return [_psql_binary(pg), dsn, *args], env


def queuedb_psql(
    ctx: typer.Context,
    database: Annotated[
        str, typer.Option("--database", "--db", help="Database to open (the suite's: sokutatsu_node1, ...).")
    ] = "postgres",
) -> None:
    """Open psql on the suite's PostgreSQL as its superuser (the password comes from the passfile).

    Needs a running `sokutatsu up` on the same state folder (SOKUTATSU_STATE_DIR; the demo's is
    <state dir>/demo), or SOKUTATSU_PG_DSN. Other arguments go to psql: sokutatsu queuedb psql -c 'select 1'.
    """
    try:
        argv, env = psql_invocation(database, list(ctx.args))
    except SettingsError as exc:
        err.print(f"sokutatsu: error: {exc}", markup=False)
        raise typer.Exit(2) from None
    except PostgresError as exc:
        err.print(f"sokutatsu: error: {exc}", markup=False)
        raise typer.Exit(1) from None
    sys.stdout.flush()
    os.execve(argv[0], argv, env)  # noqa: S606 - psql, found above, replaces this process

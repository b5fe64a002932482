"""``sokutatsu queuedb migrate``: apply the queue-db schema to an application's database by hand.

The queue-db service applies the migrations at start; an application that enqueues with the
SDK into its own database, without running the service there, applies them with this (or
with ``sokutatsu.queuedb.schema.migrate`` from its own deployment code).
"""

from __future__ import annotations

from typing import Annotated

import psycopg
import typer
from rich.console import Console

from sokutatsu.core.embedded_pg import error_line, redact_dsn
from sokutatsu.queuedb.schema import current_version, latest_version, migrate

console = Console(soft_wrap=True)  # a DSN line must not break where a script greps it


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

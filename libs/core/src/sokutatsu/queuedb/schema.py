"""Versioned SQL migrations of the queue-db schema (``sokutatsu`` schema in the application's database).

Migrations are the numbered ``migrations/NNNN_name.sql`` files of this package, applied in
order, each in its own transaction together with its row in ``sokutatsu.schema_migrations``,
under an advisory lock so that several processes starting at once apply each one once.
Then ``roles.sql`` grants the least-privilege roles what they need (every table, so a later
migration's tables too). ``sokutatsu queuedb migrate`` applies them by hand, as the schema's
owner; the queue-db service applies them at start when the database is behind (and leaves a
current one alone, so it can run as a role that may not change the schema).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg

# pg_advisory_xact_lock key: "sokutatsu" folded into 63 bits, fixed so every version agrees.
_LOCK_KEY = 0x736F6B7574617473
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """Every migration shipped with this version, in order."""
    found = []
    for entry in resources.files("sokutatsu.queuedb").joinpath("migrations").iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"queue-db migrations are not numbered 1..n: {[m.version for m in found]}")
    return found


def latest_version() -> int:
    return len(migrations())


_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS sokutatsu;
CREATE TABLE IF NOT EXISTS sokutatsu.schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


def migrate(conn: psycopg.Connection[Any]) -> list[int]:
    """Apply the migrations ``conn``'s database lacks; return the versions applied.

    ``conn`` must not be inside a transaction; it is left in the same state."""
    applied: list[int] = []
    for migration in migrations():
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            conn.execute(_BOOTSTRAP)
            row = conn.execute(
                "SELECT 1 FROM sokutatsu.schema_migrations WHERE version = %s", (migration.version,)
            ).fetchone()
            if row is not None:
                continue
            conn.execute(migration.sql.encode())
            conn.execute(
                "INSERT INTO sokutatsu.schema_migrations (version, name) VALUES (%s, %s)",
                (migration.version, migration.name),
            )
            applied.append(migration.version)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        conn.execute(ROLES_SQL.encode())
    return applied


ROLES_SQL = resources.files("sokutatsu.queuedb").joinpath("roles.sql").read_text()
# The roles roles.sql grants: an application's enqueues, and the queue-db processes.
ENQUEUE_ROLE = "sokutatsu_enqueue"
SERVICE_ROLE = "sokutatsu_queue_service"


def current_version(conn: psycopg.Connection[Any]) -> int:
    """The highest migration applied to ``conn``'s database (0: none)."""
    row = conn.execute("SELECT to_regclass('sokutatsu.schema_migrations') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    row = conn.execute("SELECT coalesce(max(version), 0) FROM sokutatsu.schema_migrations").fetchone()
    return int(row[0]) if row else 0

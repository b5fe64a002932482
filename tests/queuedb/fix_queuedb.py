"""Fresh databases on the session's PostgreSQL, one per queue-db node a test needs, migrated."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from sokutatsu.core.embedded_pg import create_database, database_dsn
from sokutatsu.queuedb.schema import migrate

NodeDatabase = Callable[[], str]


@pytest.fixture
def node_database(pg_dsn: str) -> Iterator[NodeDatabase]:
    """``node_database()``: the DSN of a new database with the queue-db schema; dropped afterwards."""
    made: list[str] = []

    def make() -> str:
        name = f"qdb_{uuid.uuid4().hex[:12]}"
        create_database(pg_dsn, name)
        made.append(name)
        dsn = database_dsn(pg_dsn, name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
        return dsn

    yield make
    for name in made:
        # Prepared transactions a test left (2PC) keep a database from being dropped.
        with psycopg.connect(database_dsn(pg_dsn, name), autocommit=True) as conn:
            for (gid,) in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            ).fetchall():
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in made:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

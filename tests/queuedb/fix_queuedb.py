"""Fresh databases on the session's PostgreSQL, one per queue-db node a test needs, migrated."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

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
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in made:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

"""Fresh databases on the session's PostgreSQL, one per queue-db node a test needs, migrated; and the
nodes' processes (``sokutatsu.harness.queuedb``), started, killed and started again."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from sokutatsu.core.dsn import PostgresError, create_database, database_dsn
from sokutatsu.core.embedded_pg import EmbeddedPostgres, free_port
from sokutatsu.harness.process import children
from sokutatsu.harness.queuedb import Node, QueueDbNode, transfer_nodes
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


@pytest.fixture
def queuedb_node(node_database: NodeDatabase, tmp_path: Path) -> Iterator[Callable[..., QueueDbNode]]:
    """``queuedb_node(max_batch="20", ...)``: a started queue-db service on a new database, with those
    ``SOKUTATSU_QUEUEDB_*`` settings. Each must stop cleanly (SIGTERM, status 0) with no traceback
    in its log: an unexpected exception in a handler is logged with one (and answered INTERNAL)."""
    made: list[QueueDbNode] = []

    def make(**settings: str) -> QueueDbNode:
        env = {f"SOKUTATSU_QUEUEDB_{name.upper()}": value for name, value in settings.items()}
        node = QueueDbNode(tmp_path / f"queuedb{len(made)}", node_database(), env)
        made.append(node)
        node.start()
        return node

    yield make
    for node in made:
        code = node.stop()
        assert code == 0, f"queue-db exited with {code}:\n{node.tail()}"
        assert "Traceback" not in node.output(), node.output()


def queue_bodies(dsn: str, queue: str = "inbox") -> list[bytes]:
    """The bodies ``queue`` holds in ``dsn``'s database, in its order (``inbox``: where node2 receives)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT body FROM sokutatsu.messages WHERE queue = %s ORDER BY seq", (queue,)).fetchall()
    return [bytes(r[0]) for r in rows]


@dataclass
class Cluster:
    """One node's own PostgreSQL on a fixed port, so its DSN holds across crashes."""

    pg: EmbeddedPostgres
    crashes: int = 0

    @property
    def dsn(self) -> str:
        return self.pg.dsn

    def kill9(self) -> None:
        """SIGKILL the postmaster and all its children at once (an OS-level crash of the server)."""
        pid = int((self.pg.data_dir / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)  # no new backend from here on: the list below is complete
        victims = [pid, *children(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):  # a backend that ended meanwhile
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30  # only stops a hung test
        while any(_alive(v) for v in victims):
            assert time.monotonic() < deadline, f"PostgreSQL processes {victims} outlived SIGKILL"
            time.sleep(0.02)
        self.crashes += 1
        self.pg.stop()  # releases the folder (the server is gone)

    def freeze_wal_writer(self) -> None:
        """SIGSTOP the WAL writer until the next :meth:`kill9`: a commit made without waiting for the
        flush then stays in PostgreSQL's WAL buffers, and a SIGKILL of the server really loses it.
        (With the writer running, even at ``wal_writer_delay = 10s`` it may write that commit out at
        any moment after it, and SIGKILL loses nothing the kernel already holds.)"""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'").fetchone()
        assert row is not None, "this PostgreSQL runs no WAL writer"
        os.kill(int(row[0]), signal.SIGSTOP)

    def restart(self) -> None:
        try:
            self.pg.start()
        except PostgresError as exc:
            raise AssertionError(f"{exc}:\n{self.pg.log_file.read_text()[-3000:]}") from None


def _alive(pid: int) -> bool:
    """Until reaped: PostgreSQL takes a lock file whose process is a zombie for a live postmaster."""
    return Path(f"/proc/{pid}").exists()


def own_cluster(folder: Path, name: str, settings: Mapping[str, str] | None = None) -> Cluster:
    """A new PostgreSQL cluster of its own in ``folder``/``name`` (with ``settings``), migrated, started."""
    pg = EmbeddedPostgres(folder / name, port=free_port())
    pg.start()
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        for setting, value in (settings or {}).items():
            conn.execute(f"ALTER SYSTEM SET {setting} = '{value}'")
        conn.execute("SELECT pg_reload_conf()")
        migrate(conn)
    return Cluster(pg)


__all__ = [
    "Cluster",
    "Node",
    "NodeDatabase",
    "QueueDbNode",
    "node_database",
    "own_cluster",
    "queue_bodies",
    "queuedb_node",
    "transfer_nodes",
]

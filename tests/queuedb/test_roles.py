"""Queue-db through least-privilege PostgreSQL roles (docs/queue-db.md, "Database roles").

The schema's owner migrates; an application enqueues as a member of ``sokutatsu_enqueue``;
the queue-db service and the transfer daemon run as members of ``sokutatsu_queue_service``.
The service and the daemon do their whole job that way (1PC and 2PC transfer, lease, ack),
and neither role can change the schema or reach what it does not need.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from grpc import aio
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

from sokutatsu.core.dsn import create_database, database_dsn
from sokutatsu.harness import HarnessError
from sokutatsu.queuedb.enqueue import Message, enqueue, enqueue_batch
from sokutatsu.queuedb.schema import ENQUEUE_ROLE, SERVICE_ROLE, migrate
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from tests.helpers import start_service
from tests.queuedb.fix_queuedb import Node, NodeDatabase, queue_bodies, transfer_nodes

pytestmark = pytest.mark.timeout(300)

Login = Callable[[str, str], str]


@pytest.fixture
def login(pg_dsn: str) -> Iterator[Login]:
    """``login(dsn, group)``: ``dsn`` as a new login role that is a member of ``group`` only."""
    made: list[str] = []

    def make(dsn: str, group: str) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        password = uuid.uuid4().hex
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                    sql.Identifier(name), sql.Literal(password), sql.Identifier(group)
                )
            )
        made.append(name)
        return make_conninfo(dsn, user=name, password=password)

    yield make
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in made:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


async def _until(check: Callable[[], bool], what: str, nodes: tuple[Node, ...]) -> None:
    for _ in range(2400):  # only stops a hung test; nothing is timed
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}\n" + "\n".join(n.tail() for n in nodes))


@pytest.mark.parametrize("mode", ["1pc", "2pc"])
async def test_the_service_and_the_transfer_daemon_do_their_job_as_the_service_role(
    node_database: NodeDatabase, login: Login, tmp_path: Path, mode: str
) -> None:
    owner1, owner2 = node_database(), node_database()
    with psycopg.connect(owner1, autocommit=True) as conn:
        conn.execute("INSERT INTO sokutatsu.queues (name, to_node, to_queue) VALUES ('orders', 'node2', 'inbox')")
    app1 = login(owner1, ENQUEUE_ROLE)
    svc1, svc2 = login(owner1, SERVICE_ROLE), login(owner2, SERVICE_ROLE)
    receiver, daemon = transfer_nodes(svc1, svc2, tmp_path, SOKUTATSU_TRANSFER_MODE=mode)
    receiver.start()
    daemon.start()
    try:
        committed: list[bytes] = []
        with psycopg.connect(app1) as conn:
            for n in range(20):
                bodies = [f"order-{n}-{i}".encode() for i in range(10)]
                enqueue_batch(conn, "orders", [Message(b) for b in bodies])
                if n % 5 == 4:
                    conn.rollback()
                else:
                    conn.commit()
                    committed.extend(bodies)
            enqueue(conn, "orders", b"order-last")
            conn.commit()
            committed.append(b"order-last")
        await _until(lambda: len(queue_bodies(owner2, "inbox")) >= len(committed), "the transfer", (receiver, daemon))
        assert queue_bodies(owner2, "inbox") == committed

        # The receiving node's service leases and acknowledges as the service role too.
        async with aio.insecure_channel(receiver.address) as channel:
            stub = queuedb_pb2_grpc.QueueServiceStub(channel)
            got = await stub.Dequeue(queuedb_pb2.DequeueRequest(queue="inbox", max_messages=50), timeout=30)
            assert [m.body for m in got.messages] == committed[:50]
            acked = await stub.Ack(
                queuedb_pb2.AckRequest(queue="inbox", lease_ids=[m.lease_id for m in got.messages]), timeout=30
            )
            assert list(acked.expired) == []
        assert queue_bodies(owner2, "inbox") == committed[50:]
    finally:
        daemon.stop()
        receiver.stop()


def _refused(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn) as conn, pytest.raises(errors.InsufficientPrivilege):
        conn.execute(statement.encode())


def test_neither_role_can_change_the_schema_or_reach_what_it_does_not_need(
    node_database: NodeDatabase, login: Login
) -> None:
    owner = node_database()
    with psycopg.connect(owner, autocommit=True) as conn:
        conn.execute("INSERT INTO sokutatsu.queues (name) VALUES ('orders')")
    service, app = login(owner, SERVICE_ROLE), login(owner, ENQUEUE_ROLE)
    for statement in (
        "DROP TABLE sokutatsu.messages",
        "TRUNCATE sokutatsu.messages",
        "ALTER TABLE sokutatsu.messages ADD COLUMN x int",
        "CREATE TABLE sokutatsu.extra (x int)",
        "DELETE FROM sokutatsu.schema_migrations",
        "INSERT INTO sokutatsu.schema_migrations (version, name) VALUES (999, 'x')",
    ):
        _refused(service, statement)
    with psycopg.connect(app) as conn:
        (seq,) = enqueue_batch(conn, "orders", [Message(b"secret")])
        conn.commit()
    assert seq > 0
    for statement in (
        "SELECT body FROM sokutatsu.messages",
        "SELECT * FROM sokutatsu.outbox",
        "UPDATE sokutatsu.messages SET body = 'x'",
        "DELETE FROM sokutatsu.messages",
        "INSERT INTO sokutatsu.queues (name) VALUES ('mine')",
        "TRUNCATE sokutatsu.messages",
        "CREATE TABLE sokutatsu.extra (x int)",
    ):
        _refused(app, statement)
    assert queue_bodies(owner, "orders") == [b"secret"]


def test_a_service_role_on_a_database_that_is_behind_says_who_must_migrate(
    pg_dsn: str, node_database: NodeDatabase, login: Login, tmp_path: Path
) -> None:
    node_database()  # a migration on the cluster makes the (cluster-wide) roles
    name = f"qdb_{uuid.uuid4().hex[:12]}"
    create_database(pg_dsn, name)
    try:
        service = login(database_dsn(pg_dsn, name), SERVICE_ROLE)
        with pytest.raises(HarnessError) as exited:
            start_service(
                "sokutatsu.queuedb",
                {"SOKUTATSU_QUEUEDB_LISTEN": "127.0.0.1:0", "SOKUTATSU_QUEUEDB_DSN": service},
                tmp_path,
            )
        message = str(exited.value)
        assert "exited with 1" in message
        assert "cannot apply the queue-db schema migrations" in message
        assert "sokutatsu queuedb migrate" in message
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_the_roles_exist_after_a_migration_and_a_second_one_changes_nothing(node_database: NodeDatabase) -> None:
    owner = node_database()
    with psycopg.connect(owner, autocommit=True) as conn:
        assert migrate(conn) == []
        roles = {r for (r,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'sokutatsu_%'")}
        assert {ENQUEUE_ROLE, SERVICE_ROLE} <= roles
        can = conn.execute(
            "SELECT has_table_privilege(%s, 'sokutatsu.messages', 'DELETE'),"
            " has_table_privilege(%s, 'sokutatsu.messages', 'DELETE')",
            (SERVICE_ROLE, ENQUEUE_ROLE),
        ).fetchone()
        assert can == (True, False)

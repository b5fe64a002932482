"""Enqueue in the application's own transaction, on a real PostgreSQL: commit keeps, rollback removes,
batches keep their order, the schema migrates once, unknown queues and oversized bodies are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from sokutatsu.core.dsn import create_database, database_dsn
from sokutatsu.queuedb.enqueue import (
    MAX_BODY_BYTES,
    Message,
    QueueNotFound,
    enqueue,
    enqueue_async,
    enqueue_batch,
    enqueue_batch_async,
)
from sokutatsu.queuedb.schema import current_version, latest_version, migrate
from tests.helpers import raw_spans
from tests.queuedb.fix_queuedb import NodeDatabase


def _create(dsn: str, name: str, to_node: str = "", immediate: bool = True) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO sokutatsu.queues (name, to_node, immediate) VALUES (%s, %s, %s)", (name, to_node, immediate)
        )


def _bodies(dsn: str, table: str = "messages") -> list[bytes]:
    with psycopg.connect(dsn) as conn:
        order = "seq" if table == "messages" else "id"
        return [bytes(r[0]) for r in conn.execute(f"SELECT body FROM sokutatsu.{table} ORDER BY {order}")]  # noqa: S608


def test_the_business_update_and_the_message_commit_or_roll_back_together(node_database: NodeDatabase) -> None:
    dsn = node_database()
    _create(dsn, "orders")
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE stock (item text PRIMARY KEY, n int)")
        conn.execute("INSERT INTO stock VALUES ('apple', 10)")
        conn.commit()
        conn.execute("UPDATE stock SET n = n - 1 WHERE item = 'apple'")
        enqueue(conn, "orders", b"rolled back")
        conn.rollback()
        conn.execute("UPDATE stock SET n = n - 1 WHERE item = 'apple'")
        first = enqueue(conn, "orders", b"kept", {"trace": "t1"}, key="apple")
        conn.commit()
        row = conn.execute("SELECT n FROM stock").fetchone()
        headers = conn.execute("SELECT headers, key FROM sokutatsu.messages WHERE seq = %s", (first,)).fetchone()
    assert row == (9,)
    assert _bodies(dsn) == [b"kept"]
    assert headers == ({"trace": "t1"}, "apple")


def test_a_batch_is_one_statement_in_order(node_database: NodeDatabase) -> None:
    dsn = node_database()
    _create(dsn, "orders")
    with psycopg.connect(dsn) as conn:
        seqs = enqueue_batch(conn, "orders", [Message(f"m{i}".encode(), key=f"k{i}") for i in range(500)])
        conn.commit()
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == 500
    assert _bodies(dsn) == [f"m{i}".encode() for i in range(500)]


async def test_async_twins_and_forwarding_queues_fill_the_outbox_and_notify_on_commit(
    node_database: NodeDatabase,
) -> None:
    dsn = node_database()
    _create(dsn, "to-node2", to_node="node2")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listener:
        await listener.execute("LISTEN sokutatsu_transfer")
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await enqueue_async(conn, "to-node2", b"a")
            await enqueue_batch_async(conn, "to-node2", [Message(b"b"), Message(b"c")])
            await conn.commit()
        notes = [note.payload async for note in listener.notifies(timeout=10, stop_after=1)]
    assert notes == ["node2"]
    assert _bodies(dsn, "outbox") == [b"a", b"b", b"c"]
    assert _bodies(dsn) == []


def test_unknown_queues_and_oversized_bodies_are_refused(node_database: NodeDatabase) -> None:
    dsn = node_database()
    _create(dsn, "orders")
    with psycopg.connect(dsn) as conn:
        with pytest.raises(QueueNotFound, match="'nowhere' does not exist"):
            enqueue(conn, "nowhere", b"x")
        conn.rollback()
        with pytest.raises(ValueError, match="over the"):
            enqueue(conn, "orders", b"x" * (MAX_BODY_BYTES + 1))
        with pytest.raises(ValueError, match="at least one"):
            enqueue_batch(conn, "orders", [])


def test_migrations_apply_once(node_database: NodeDatabase) -> None:
    dsn = node_database()  # already migrated by the fixture
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert current_version(conn) == latest_version() >= 1
        assert migrate(conn) == []


def test_the_migrate_command_brings_an_application_database_to_the_latest_version(pg_dsn: str) -> None:
    name = f"app_{uuid.uuid4().hex[:10]}"
    create_database(pg_dsn, name)
    dsn = database_dsn(pg_dsn, name)
    try:
        first, again = (
            subprocess.run(
                [sys.executable, "-m", "sokutatsu.cli", "queuedb", "migrate", "--dsn", dsn],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            for _ in range(2)
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            version = current_version(conn)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"schema version 0 -> {latest_version()}" in first.stdout
    assert again.returncode == 0
    assert "nothing to do" in again.stdout
    assert version == latest_version()
    bad = subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", "queuedb", "migrate", "--dsn", "host=127.0.0.1 port=1 dbname=x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 1
    assert "cannot migrate" in bad.stdout


TRACED_APP = """
import json, os, sys
from pathlib import Path
import psycopg
from opentelemetry import trace
from sokutatsu.core.telemetry import setup_telemetry
from sokutatsu.queuedb.enqueue import Message, QueueNotFound, enqueue, enqueue_batch

telemetry = setup_telemetry("shop", "app", Path(os.environ["SOKUTATSU_TRACE_DIR"]))
with psycopg.connect(sys.argv[1]) as conn, trace.get_tracer("shop").start_as_current_span("checkout") as checkout:
    one = enqueue(conn, "orders", b"one", {"desk": "fx"})
    given = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    batch = enqueue_batch(conn, "orders", [Message(b"two"), Message(b"three", given)])
    conn.commit()
    enqueue(conn, "orders", b"rolled back")
    conn.rollback()
    try:
        enqueue(conn, "nowhere", b"x")
    except QueueNotFound:
        conn.rollback()
    context = checkout.get_span_context()
telemetry.shutdown()
ids = {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}
print(json.dumps({"one": one, "batch": batch, **ids}))
"""


def test_enqueues_are_traced_as_send_spans_under_the_callers_span_and_messages_carry_their_context(
    node_database: NodeDatabase, tmp_path: Path
) -> None:
    """An application process with an OpenTelemetry SDK (its own process: the test session has none)."""
    dsn = node_database()
    _create(dsn, "orders")
    traces = tmp_path / "traces"
    run = subprocess.run(
        [sys.executable, "-c", TRACED_APP, dsn],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "SOKUTATSU_TRACE_DIR": str(traces)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    app = json.loads(run.stdout)
    spans = [s for s in raw_spans(traces) if s["name"].startswith("send ")]
    by_queue: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_queue.setdefault(span["attributes"]["messaging.destination.name"], []).append(span)
    orders = sorted(by_queue["orders"], key=lambda s: int(s["startTimeUnixNano"]))
    assert [s["attributes"]["messaging.batch.message_count"] for s in orders] == [1, 2, 1]
    assert all(s["parentSpanId"] == app["span_id"] and s["traceId"] == app["trace_id"] for s in spans)
    assert (
        orders[0]["attributes"]["sokutatsu.queuedb.first_id"],
        orders[1]["attributes"]["sokutatsu.queuedb.last_id"],
    ) == (
        app["one"],
        app["batch"][-1],
    )
    # The unknown queue's span failed, and says so.
    (nowhere,) = by_queue["nowhere"]
    assert nowhere["status"].get("code") == 2
    # Each committed message carries its send span's context, unless the caller gave one.
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT body, headers FROM sokutatsu.messages ORDER BY seq").fetchall()
    expected = [
        (b"one", f"00-{app['trace_id']}-{orders[0]['spanId']}"),
        (b"two", f"00-{app['trace_id']}-{orders[1]['spanId']}"),
        (b"three", "00-" + "1" * 32 + "-" + "2" * 16),
    ]
    # (The flags after the ids: sampled, and the SDK's random-trace-id bit.)
    assert [(bytes(body), headers["traceparent"].rsplit("-", 1)[0]) for body, headers in rows] == expected
    assert rows[0][1]["desk"] == "fx"

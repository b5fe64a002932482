"""The queue-db part of ``sokutatsu demo`` (seed 004's transfer, exactly once).

An order-entry application on node 1 writes each order to its own table and enqueues an
order event in the same transaction (:func:`sokutatsu.queuedb.enqueue.enqueue_batch_async`);
one transaction in six is rolled back. The queue forwards to node 2, where a consumer
dequeues and acknowledges through queue-db's gRPC API. The transfer daemon is set up to kill
itself (SIGKILL) after node 2 committed a batch and before node 1 marked it sent
(:data:`~sokutatsu.demo.suite.TRANSFER_CRASH`); the demo sees it die, starts it again,
and its recovery settles that batch. At the end the events node 2 delivered are compared
with the orders committed on node 1: each once, none of the rolled-back ones.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from sokutatsu.core.tls import open_channel
from sokutatsu.demo.suite import TRANSFER_CRASH, DemoSuite
from sokutatsu.queuedb.enqueue import Message, enqueue_batch_async
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc

Progress = Callable[[str], None]
QUEUE = "order-events"
# The receiving node's name in the transfer daemon's peers (the launcher's topology).
RECEIVER = "queuedb-2"
SETTLE_LIMIT_SECONDS = 60.0


@dataclass(frozen=True)
class QueueConfig:
    orders: int  # committed orders to reach


@dataclass
class QueueResult:
    committed: int
    rolled_back: int
    received: int
    lost: int
    duplicates: int
    rolled_back_arrived: int
    business_rows: int  # node 1's orders table: must equal committed
    crashes: list[str] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # from the daemon's traces, after the stop


async def run_queue(cfg: QueueConfig, suite: DemoSuite, stop: asyncio.Event, progress: Progress) -> QueueResult:
    async with (
        open_channel(suite.address("queuedb-1")) as ch1,
        open_channel(suite.address("queuedb-2")) as ch2,
    ):
        q1, q2 = queuedb_pb2_grpc.QueueServiceStub(ch1), queuedb_pb2_grpc.QueueServiceStub(ch2)
        await q2.CreateQueue(queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name=QUEUE)), timeout=10)
        rule = queuedb_pb2.TransferRule(to_node=RECEIVER, to_queue=QUEUE, immediate=True)
        await q1.CreateQueue(
            queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name=QUEUE, transfer=rule)), timeout=10
        )
        progress(
            f"queue: order entry on queuedb-1 commits each order with its event on {QUEUE!r}; "
            f"transfer-1 forwards to queuedb-2 (set to crash at {TRANSFER_CRASH})"
        )
        received: list[int] = []
        done = asyncio.Event()
        consumer = asyncio.create_task(_consume(q2, received, done))
        crashes: list[str] = []
        watcher = asyncio.create_task(_restart_when_killed(suite, stop, crashes, progress))
        try:
            committed, rolled_back = await _order_entry(suite.node_dsn(1), cfg.orders)
            progress(f"queue: {len(committed):,} orders committed ({len(rolled_back)} rolled back); draining")
            await _settle(q1, lambda: set(received) >= committed and not watcher_busy(watcher, crashes))
        finally:
            done.set()
            await consumer
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    business = await _business_rows(suite.node_dsn(1))
    counts = Counter(received)
    return QueueResult(
        committed=len(committed),
        rolled_back=len(rolled_back),
        received=len(counts),
        lost=len(committed - counts.keys()),
        duplicates=sum(n - 1 for n in counts.values()),
        rolled_back_arrived=len(rolled_back & counts.keys()),
        business_rows=business,
        crashes=crashes,
    )


def watcher_busy(watcher: asyncio.Task[None], crashes: list[str]) -> bool:
    """A crash seen but the daemon not yet back: wait for it."""
    return bool(crashes) and not crashes[-1].endswith("restarted") and not watcher.done()


async def _order_entry(dsn: str, target: int) -> tuple[set[int], set[int]]:
    """The application: transactions of 1-20 orders, each row and its event together; 1 in 6 rolled back."""
    rng = random.Random(3)  # noqa: S311 - reproducible orders, not security
    committed: set[int] = set()
    rolled_back: set[int] = set()
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS demo_orders (id bigserial PRIMARY KEY, symbol text, side text, qty int)"
        )
        await conn.commit()
        while len(committed) < target:
            ids, events = [], []
            for _ in range(rng.randrange(1, 21)):
                symbol, side, qty = f"{rng.randrange(1300, 10000)}.T", rng.choice(("BUY", "SELL")), rng.randrange(1, 30)
                cursor = await conn.execute(
                    "INSERT INTO demo_orders (symbol, side, qty) VALUES (%s, %s, %s) RETURNING id",
                    (symbol, side, qty * 100),
                )
                row = await cursor.fetchone()
                assert row is not None  # noqa: S101 - RETURNING gives a row
                ids.append(int(row[0]))
                body = {"order": int(row[0]), "symbol": symbol, "side": side, "qty": qty * 100}
                events.append(Message(json.dumps(body).encode(), key=symbol))
            await enqueue_batch_async(conn, QUEUE, events)
            if rng.random() < 1 / 6:
                await conn.rollback()
                rolled_back.update(ids)
            else:
                await conn.commit()
                committed.update(ids)
            await asyncio.sleep(rng.random() * 0.01)
    return committed, rolled_back


async def _business_rows(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cursor = await conn.execute("SELECT count(*) FROM demo_orders")
        row = await cursor.fetchone()
    return int(row[0]) if row else -1


async def _consume(q2: queuedb_pb2_grpc.QueueServiceAsyncStub, received: list[int], done: asyncio.Event) -> None:
    """Node 2's consumer: dequeue, record each event's order id, acknowledge."""
    while not done.is_set():
        answer = await q2.Dequeue(
            queuedb_pb2.DequeueRequest(queue=QUEUE, max_messages=500, visibility_timeout_ms=30_000, wait_ms=200),
            timeout=30,
        )
        if not answer.messages:
            continue
        received.extend(json.loads(m.body)["order"] for m in answer.messages)
        await q2.Ack(queuedb_pb2.AckRequest(queue=QUEUE, lease_ids=[m.lease_id for m in answer.messages]), timeout=30)


async def _restart_when_killed(suite: DemoSuite, stop: asyncio.Event, crashes: list[str], progress: Progress) -> None:
    """When the transfer daemon dies, say how, and start it again (once: the new one has no crash point)."""
    process = suite.running("transfer-1").process
    while process.poll() is None:  # noqa: ASYNC110 - polling a child process
        await asyncio.sleep(0.05)
    how = "SIGKILL" if process.returncode == -9 else f"exit status {process.returncode}"
    crashes.append(f"transfer-1 died ({how})")
    progress(f"queue: transfer-1 died ({how}) after node 2 committed a batch, before node 1 marked it sent; restarting")
    new = await suite.restart("transfer-1", stop)
    crashes[-1] += ", restarted"
    progress(f"queue: transfer-1 running again (pid {new.pid}); it recovers from node 2's last received id")


async def _settle(q1: queuedb_pb2_grpc.QueueServiceAsyncStub, arrived: Callable[[], bool]) -> None:
    """Until every committed event arrived and node 1's outbox is empty (or the limit: then the audit says what)."""
    deadline = time.monotonic() + SETTLE_LIMIT_SECONDS
    while time.monotonic() < deadline:
        stats = await q1.GetQueueStats(queuedb_pb2.GetQueueStatsRequest(queue=QUEUE), timeout=10)
        if arrived() and stats.transfer_pending == 0 and stats.transfer_sending == 0:
            return
        await asyncio.sleep(0.1)


def recoveries(trace_dir: Path) -> list[dict[str, Any]]:
    """The transfer daemon's ``transfer.recover`` spans (docs/tracing.md): each (re)connection's attributes."""
    found: list[dict[str, Any]] = []
    for path in sorted(trace_dir.glob("transfer-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                request = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the SIGKILL
            for resource in request.get("resourceSpans", []):
                for scope in resource.get("scopeSpans", []):
                    found.extend(
                        {a["key"]: _value(a["value"]) for a in span.get("attributes", [])}
                        for span in scope.get("spans", [])
                        if span.get("name") == "transfer.recover"
                    )
    return found


def _value(value: dict[str, Any]) -> Any:
    for kind in ("intValue", "stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return int(value[kind]) if kind == "intValue" else value[kind]
    return None

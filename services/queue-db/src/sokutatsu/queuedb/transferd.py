"""The transfer daemon: moves forwarding queues' messages to other nodes, exactly once, with the
one-phase protocol of seed 004 (§3.3.3 Fig. 3 and §3.3.4), batched.

Per receiving node, in a loop:

1. **assign** (one local transaction): a batch already *sending* (a row in
   ``transfer_batches``, not confirmed) is resent as it is; otherwise the next messages
   become a batch with dense transfer ids after the cursor ``transfer_out.last_sent_id``,
   which moves with them: one batch row, no update per message. Commit (durably), then send;
2. **deliver**: the receiver stores the batch and its recovery row in one transaction
   and answers with its ``last_received_id`` and ``durable_id`` (the two differ when it
   stored sender-durable messages without the flush, seed 001: see docs/queue-db.md);
3. **mark sent** (one local transaction): the batches the receiver has flushed and their
   messages are deleted, and a ``NOTIFY`` names the ids an ``Enqueue`` call waits for.
   This commit need not be durable: if it is lost, step 0 repeats it. Batches acknowledged
   but not flushed there stay until a later answer, or ``GetRecoveryState`` (which flushes
   before it answers), covers them;

0. **recover**, on every (re)connection: ask the receiver's ``last_received_id``; sending
   messages at or below it are marked sent without resending (seed case 2-2), the rest are
   resent by step 1 (case 2-1). If the receiver holds more than this node ever assigned
   (this node lost the end of its log), the cursor moves up so no id is used twice.

One daemon per (node, receiver) at a time: a session advisory lock per receiver; a second
daemon waits for it. Triggers (seed §3.3.1): ``NOTIFY`` from immediate enqueues wakes the
daemon after the enqueuing transaction commits; otherwise every ``POLL_MS`` it checks the
deferred queues' thresholds (``min_batch`` messages waiting or the oldest ``max_age_ms`` old).

Run it as ``python -m sokutatsu.queuedb.transferd`` (serves gRPC health only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import grpc
import psycopg
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from psycopg import sql
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

from sokutatsu.client._retry import broken_write
from sokutatsu.core.dsn import PostgresError, check_dsn, error_line
from sokutatsu.core.runtime_settings import ServiceSettings
from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.core.settings import SettingsError, choice, named_addresses, parse_address, parse_name, setting, whole
from sokutatsu.core.tls import open_channel
from sokutatsu.queuedb.enqueue import CONFIRMED_CHANNEL, FLUSH_RECEIVER, FLUSH_SENDER, TRANSFER_CHANNEL
from sokutatsu.queuedb.faults import CrashPoints
from sokutatsu.queuedb.receiver import gid_prefix
from sokutatsu.queuedb.settings import parse_crash_at
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc

log = logging.getLogger("sokutatsu.queuedb.transfer")
_tracer = trace.get_tracer("sokutatsu.queuedb.transfer")

RPC_TIMEOUT = 30.0
# The sender's own prepared transaction is named after the batch's gid plus this: prepared
# transaction names are unique per PostgreSQL cluster, and two nodes may share one.
LOCAL_SUFFIX = "/sender"
# Largest batch on the wire, bodies included (gRPC frames are limited to 16 MiB).
MAX_BATCH_BYTES = 8 * 2**20
# How often the health channel to a receiver that is down tries to connect (gRPC's default back-off
# grows to 120 s), and the longest wait between failed sessions.
RECONNECT_MS = 100
MAX_BACKOFF = 5.0
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MS),
]


@dataclass(frozen=True)
class Peer:
    node: str
    address: str


def parse_peers(raw: str) -> tuple[Peer, ...]:
    return tuple(Peer(node, address) for node, address in named_addresses(raw, "node"))


@dataclass(frozen=True)
class TransferSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_TRANSFER_"

    listen: str = setting("LISTEN", "127.0.0.1:7411", "host:port for gRPC health (port 0 = any).", parse_address)
    instance: str = setting("INSTANCE", "transfer-1", "Name of this daemon in logs and traces.", parse_name)
    node: str = setting(
        "NODE", "node1", "The sending node's name: receivers keep their recovery row under it.", parse_name
    )
    dsn: str = setting("DSN", "", "PostgreSQL connection string of this node's database (required).")
    peers: tuple[Peer, ...] = setting(
        "PEERS", (), "Receiving nodes as node=host:port of their queue-db service, comma-separated.", parse_peers
    )
    batch: int = setting("BATCH", 1000, "Most messages per transfer batch.", whole(1, 100_000, "messages"))
    pipeline: int = setting(
        "PIPELINE",
        4,
        "1pc: batches in flight to a receiver before the first is confirmed (the receiver's recovery row "
        "keeps them exactly once); 1 sends one at a time.",
        whole(1, 64, "batches"),
    )
    poll_ms: int = setting(
        "POLL_MS",
        200,
        "How often deferred queues' thresholds are checked (immediate queues wake the daemon at once).",
        whole(10, 3_600_000, "milliseconds"),
    )
    mode: str = setting(
        "MODE",
        "1pc",
        "1pc: the one-phase protocol with the receiver's recovery table (seed 004); 2pc: the same batches "
        "with PostgreSQL two-phase commit on both nodes (the baseline it is measured against).",
        choice("1pc", "2pc"),
    )
    crash_at: str = setting(
        "CRASH_AT",
        "",
        "Fault injection for tests: SIGKILL this process the n-th time it reaches a step, as step@n "
        "(1pc: sender:assigned, sender:acked, sender:marked; 2pc: sender:prepared, sender:both-prepared, "
        "sender:committed, sender:finished). Empty in production.",
        parse_crash_at,
    )


# The batches still sending (resent after a reconnection), their messages in transfer id order.
_PICK = """
SELECT o.id, o.queue, o.to_queue, o.body, o.headers, o.key, (extract(epoch FROM o.enqueued_at) * 1e9)::bigint,
       b.first_id + t.n - 1, o.flush
FROM sokutatsu.transfer_batches AS b,
     unnest(b.outbox_ids) WITH ORDINALITY AS t(id, n)
JOIN sokutatsu.outbox o ON o.id = t.id
WHERE b.to_node = %(node)s
ORDER BY b.first_id, t.n
"""
# Messages not in a batch yet, oldest first.
_PICK_NEW = """
SELECT o.id, o.queue, o.to_queue, o.body, o.headers, o.key, (extract(epoch FROM o.enqueued_at) * 1e9)::bigint,
       NULL::bigint, o.flush
FROM sokutatsu.outbox o
WHERE o.to_node = %(node)s
  -- (a hashed subplan: one pass over the batches in flight, not one array search per row)
  AND o.id NOT IN (SELECT unnest(b.outbox_ids) FROM sokutatsu.transfer_batches b WHERE b.to_node = %(node)s)
ORDER BY o.id
LIMIT %(limit)s
FOR UPDATE OF o
"""
# The batches the receiver confirmed, and their messages: gone; and a NOTIFY (on commit) naming
# the receiver and the ids of the messages an Enqueue call waits for (flush = receiver only), in
# chunks that fit a NOTIFY payload (8,000 bytes). Answers how many messages went.
_SENT = """
WITH done AS (
    DELETE FROM sokutatsu.transfer_batches WHERE to_node = %(node)s AND last_id <= %(flushed)s RETURNING outbox_ids
),
gone AS (
    DELETE FROM sokutatsu.outbox WHERE id IN (SELECT unnest(outbox_ids) FROM done) RETURNING id, flush
),
awaited AS (
    SELECT id, (row_number() OVER (ORDER BY id) - 1) / 300 AS chunk FROM gone WHERE flush = %(receiver)s
),
payloads AS (
    SELECT %(node)s || ':' || string_agg(id::text, ',' ORDER BY id) AS payload FROM awaited GROUP BY chunk
    UNION ALL
    SELECT %(node)s || ':' WHERE EXISTS (SELECT 1 FROM gone) AND NOT EXISTS (SELECT 1 FROM awaited)
)
SELECT (SELECT count(*) FROM gone), (SELECT count(pg_notify(%(channel)s, payload)) FROM payloads)
"""
_DEFERRED_DUE = """
SELECT coalesce(bool_or(
           q.name IS NULL OR q.immediate
           OR (q.min_batch = 0 AND q.max_age_ms = 0)
           OR (q.min_batch > 0 AND c.n >= q.min_batch)
           OR (q.max_age_ms > 0 AND c.oldest <= now() - q.max_age_ms * interval '1 millisecond')
       ), false)
FROM (SELECT queue, count(*) AS n, min(enqueued_at) AS oldest
      FROM sokutatsu.outbox
      WHERE to_node = %(node)s
        -- not in a batch yet (sent batches the receiver has not flushed stay until it has)
        AND id NOT IN (SELECT unnest(b.outbox_ids) FROM sokutatsu.transfer_batches b WHERE b.to_node = %(node)s)
      GROUP BY queue) AS c
LEFT JOIN sokutatsu.queues q ON q.name = c.queue
"""


class PeerLink:
    """The sending side towards one receiving node."""

    def __init__(self, settings: TransferSettings, peer: Peer, crash: CrashPoints) -> None:
        self.settings = settings
        self.peer = peer
        self.crash = crash
        self.wake = asyncio.Event()
        # Since when the receiver holds acknowledged messages it may not have flushed (sender-durable
        # ones, stored without waiting for the flush); None when it has flushed all it acknowledged.
        self._unflushed_since: float | None = None
        self._acked = 0  # the receiver's last_received_id in its latest answer
        self._failures = 0  # sessions failed in a row since the last one that recovered

    @property
    def _link_attributes(self) -> dict[str, str]:
        """Every transfer span's: which link, which protocol."""
        return {
            "sokutatsu.transfer.from_node": self.settings.node,
            "sokutatsu.transfer.to_node": self.peer.node,
            "sokutatsu.transfer.mode": self.settings.mode,
        }

    @property
    def _poll(self) -> float:
        return self.settings.poll_ms / 1000

    async def run(self) -> None:
        """Sessions, one after another, for as long as the daemon runs.

        After a session fails it watches the receiver's health (a health ``Watch`` on a channel
        that retries its connection every ``RECONNECT_MS``): a receiver seen down is sent to again
        as soon as it answers ``SERVING``, never after a back-off grown during its outage. Failures
        in a row with the receiver serving all along (this node's database down, a receiver that
        refuses) back off exponentially, to ``MAX_BACKOFF``.
        """
        async with open_channel(self.peer.address, cluster=True, options=_RECONNECT_OPTIONS) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    await self._session()
                except Exception as exc:
                    if not _transient(exc):
                        raise
                    self._failures += 1
                    log.warning("transfer to %s: %s; retrying", self.peer.node, _said(exc, self.settings.dsn))
                else:
                    return
                if await self._until_serving(channel, health):
                    self._failures = 1  # it was down and is back: go now
                if self._failures > 1:
                    await asyncio.sleep(min(MAX_BACKOFF, 0.05 * 2 ** (self._failures - 2)))

    async def _until_serving(self, channel: aio.Channel, health: health_pb2_grpc.HealthStub) -> bool:
        """Until the receiver's health answers ``SERVING``; whether it was seen down first (not
        connected, or another status). A receiver seen down is watched for as long as it takes
        (each watch bounded by ``MAX_BACKOFF``, then renewed); one that serves but gives no answer
        in time (or has no health service) is left to the next session's own failure."""
        down = channel.get_state() != grpc.ChannelConnectivity.READY
        while True:
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True, timeout=MAX_BACKOFF)
            try:
                async for answer in watch:
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return down
                    down = True
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    return False  # no health service: the next session's own failure says why
            finally:
                watch.cancel()
            if channel.get_state() != grpc.ChannelConnectivity.READY:
                down = True
            if not down:
                return False

    async def _session(self) -> None:
        async with (
            await psycopg.AsyncConnection.connect(self.settings.dsn, autocommit=True, connect_timeout=5) as conn,
            open_channel(self.peer.address, cluster=True) as channel,
        ):
            # One sender per receiver: a second daemon waits here until this one is gone.
            await conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (f"sokutatsu.transfer.{self.peer.node}",))
            stub: queuedb_pb2_grpc.TransferAsyncStub = queuedb_pb2_grpc.TransferStub(channel)
            if self.settings.mode == "2pc":
                await self._session_2pc(conn, stub)
                return
            await self._recover(conn, stub)
            self._failures = 0  # connected and recovered: the next failure retries as soon as the receiver serves
            await self._pipeline(conn, stub)

    async def _pipeline(self, conn: psycopg.AsyncConnection[Any], stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        """Up to ``PIPELINE`` batches in flight on one stream; each answer marks its batches sent."""
        call = stub.DeliverStream()
        in_flight: deque[int] = deque()  # the last transfer id of each batch sent, in order
        spans: deque[trace.Span] = deque()  # each batch's span, in the same order
        try:
            await self._stream(conn, stub, call, in_flight, spans)
        finally:
            for span in spans:  # sent, never confirmed in this session: the next one resends them
                span.set_status(trace.Status(trace.StatusCode.ERROR, "unconfirmed: the session ended"))
                span.end()

    def _batch_span(self, batch: queuedb_pb2.TransferBatch, resent: bool) -> trace.Span:
        return _tracer.start_span(
            f"transfer {self.peer.node}",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                **self._link_attributes,
                "sokutatsu.transfer.first_id": batch.messages[0].transfer_id,
                "sokutatsu.transfer.last_id": batch.messages[-1].transfer_id,
                "sokutatsu.transfer.resent": resent,
                "messaging.batch.message_count": len(batch.messages),
            },
        )

    async def _stream(
        self,
        conn: psycopg.AsyncConnection[Any],
        stub: queuedb_pb2_grpc.TransferAsyncStub,
        call: Any,
        in_flight: deque[int],
        spans: deque[trace.Span],
    ) -> None:
        for batch in await self._sending(conn):  # what the last session left unconfirmed (seed case 2-1)
            spans.append(self._batch_span(batch, resent=True))
            await _write(call, batch)
            in_flight.append(batch.messages[-1].transfer_id)
        while True:
            while len(in_flight) < self.settings.pipeline:
                batch = await self._assign(conn)
                if not batch.messages:
                    break
                spans.append(self._batch_span(batch, resent=False))
                await _write(call, batch)
                in_flight.append(batch.messages[-1].transfer_id)
            if not in_flight:
                if self._unflushed_since is None:
                    await self._wait_for_work(conn)
                elif not await self._wait_for_work(conn, once=True):
                    # Idle with messages the receiver holds but may not have flushed: ask it to flush.
                    await self._flushed(conn, stub)
                continue
            ack = await asyncio.wait_for(call.read(), RPC_TIMEOUT)
            if ack is aio.EOF:
                raise ConnectionError(f"the transfer stream to {self.peer.node} ended")
            assert isinstance(ack, queuedb_pb2.TransferAck)  # noqa: S101 - typed by the stub
            self.crash.reach("sender:acked")
            # Only what the receiver has flushed is forgotten here; sender-durable messages it stored
            # without the flush stay (still "sending") until a later answer covers them.
            await self._mark_sent(conn, ack.durable_id)
            self._acked = ack.last_received_id
            if ack.last_received_id <= ack.durable_id:
                self._unflushed_since = None
            elif self._unflushed_since is None:
                self._unflushed_since = time.monotonic()
            while in_flight and in_flight[0] <= ack.last_received_id:
                in_flight.popleft()
                span = spans.popleft()
                span.set_attribute("sokutatsu.transfer.duplicates", ack.duplicates)
                span.end()
            self.crash.reach("sender:marked")
            if self._unflushed_since is not None and time.monotonic() - self._unflushed_since > self._poll:
                # Only sender-durable batches for a while: have the receiver flush, so the outbox stays short.
                await self._flushed(conn, stub)

    async def _flushed(self, conn: psycopg.AsyncConnection[Any], stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        """Have the receiver flush what it holds (GetRecoveryState answers after a flush); forget that here."""
        state = await stub.GetRecoveryState(
            queuedb_pb2.GetRecoveryStateRequest(sender_node=self.settings.node), timeout=RPC_TIMEOUT
        )
        await self._mark_sent(conn, state.last_received_id)
        if state.last_received_id < self._acked:
            # It acknowledged more than it now holds: its database restarted and lost batches it had
            # stored without the flush. A new session resends them (recovery, seed case 2-1).
            raise ConnectionError(
                f"{self.peer.node} holds up to id {state.last_received_id} after acknowledging {self._acked}"
            )
        self._unflushed_since = None

    async def _recover(self, conn: psycopg.AsyncConnection[Any], stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        with _tracer.start_as_current_span(
            "transfer.recover",
            attributes=self._link_attributes,
        ) as span:
            received, done, last_sent = await self._recover_1pc(conn, stub)
            span.set_attribute("sokutatsu.transfer.receiver_last_id", received)
            span.set_attribute("sokutatsu.transfer.marked_sent", done)
            span.set_attribute("sokutatsu.transfer.last_assigned_id", last_sent)

    async def _recover_1pc(
        self, conn: psycopg.AsyncConnection[Any], stub: queuedb_pb2_grpc.TransferAsyncStub
    ) -> tuple[int, int, int]:
        """Seed 004 §3.3.4; (the receiver's last id, messages marked sent, the last id assigned here)."""
        state = await stub.GetRecoveryState(
            queuedb_pb2.GetRecoveryStateRequest(sender_node=self.settings.node), timeout=RPC_TIMEOUT
        )
        received = state.last_received_id  # flushed there before the answer
        self._acked = received
        async with conn.transaction():
            last_sent = await self._cursor(conn)
            done = await self._forget(conn, received)
            if received > last_sent:
                log.warning(
                    "transfer to %s: the receiver holds up to id %d but this node assigned only up to %d "
                    "(its log lost the end); continuing after %d",
                    self.peer.node,
                    received,
                    last_sent,
                    received,
                )
                await conn.execute(
                    "UPDATE sokutatsu.transfer_out SET last_sent_id = %s WHERE to_node = %s",
                    (received, self.peer.node),
                )
        self._unflushed_since = None
        log.info(
            "transfer to %s: receiver holds up to id %d; %d sending messages it has were marked sent",
            self.peer.node,
            received,
            done,
        )
        return received, done, last_sent

    async def _cursor(self, conn: psycopg.AsyncConnection[Any]) -> int:
        await conn.execute(
            "INSERT INTO sokutatsu.transfer_out (to_node) VALUES (%s) ON CONFLICT DO NOTHING", (self.peer.node,)
        )
        cursor = await conn.execute(
            "SELECT last_sent_id FROM sokutatsu.transfer_out WHERE to_node = %s FOR UPDATE", (self.peer.node,)
        )
        row = await cursor.fetchone()
        return int(row[0]) if row else 0

    async def _sending(self, conn: psycopg.AsyncConnection[Any]) -> list[queuedb_pb2.TransferBatch]:
        """The batches assigned and not confirmed, in order, as they were first sent."""
        rows = await (await conn.execute(_PICK, {"node": self.peer.node})).fetchall()
        batches: list[list[tuple[Any, ...]]] = []
        for row in rows:
            if batches and batches[-1][-1][7] + 1 == row[7]:
                batches[-1].append(row)
            else:
                batches.append([row])
        return [_batch(self.settings.node, b) for b in batches]

    async def _assign(self, conn: psycopg.AsyncConnection[Any]) -> queuedb_pb2.TransferBatch:
        """The next messages not in a batch become one: dense transfer ids after the cursor."""
        params = {"node": self.peer.node, "limit": self.settings.batch}
        rows: list[tuple[Any, ...]] = []
        async with conn.transaction():
            last = await self._cursor(conn)
            picked = _within_bytes(await (await conn.execute(_PICK_NEW, params)).fetchall())
            if picked:
                # One row marks the whole batch sending (seed 004's flag), not an update per message.
                first, final = last + 1, last + len(picked)
                await conn.execute(
                    "INSERT INTO sokutatsu.transfer_batches (to_node, first_id, last_id, outbox_ids) "
                    "VALUES (%s, %s, %s, %b::bigint[])",  # binary: see receiver._STORE
                    (self.peer.node, first, final, [r[0] for r in picked]),
                )
                await conn.execute(
                    "UPDATE sokutatsu.transfer_out SET last_sent_id = %s WHERE to_node = %s",
                    (final, self.peer.node),
                )
                rows = [(*r[:7], first + i, r[8]) for i, r in enumerate(picked)]
        if rows:
            self.crash.reach("sender:assigned")
        return _batch(self.settings.node, rows)

    async def _mark_sent(self, conn: psycopg.AsyncConnection[Any], flushed: int) -> None:
        """Forget the batches at or below ``flushed`` (the receiver has them on disk)."""
        async with conn.transaction():
            # Not durable: a lost deletion is redone by recovery (the receiver has these).
            await conn.execute("SET LOCAL synchronous_commit = off")
            await self._forget(conn, flushed)

    async def _forget(self, conn: psycopg.AsyncConnection[Any], flushed: int) -> int:
        """Delete the batches at or below ``flushed`` and their messages; how many messages. The
        queue-db API's receiver-durable Enqueue calls wait for the NOTIFY this sends on commit."""
        params = {"node": self.peer.node, "flushed": flushed, "receiver": FLUSH_RECEIVER, "channel": CONFIRMED_CHANNEL}
        row = await (await conn.execute(_SENT, params)).fetchone()
        return int(row[0]) if row else 0

    async def _wait_for_work(self, conn: psycopg.AsyncConnection[Any], *, once: bool = False) -> bool:
        """Until a NOTIFY names this receiver, or a deferred queue's threshold is reached (True);
        ``once``: give up after one ``POLL_MS`` without either (False)."""
        poll = self._poll
        while True:
            self.wake.clear()  # before looking: a NOTIFY during the query must still wake the wait
            cursor = await conn.execute(_DEFERRED_DUE, {"node": self.peer.node})
            row = await cursor.fetchone()
            if row and row[0]:
                return True
            try:
                await asyncio.wait_for(self.wake.wait(), poll)
            except TimeoutError:
                if once:
                    return False
                continue
            return True

    # ------------------------------------------------- two-phase commit baseline --
    @property
    def _gids(self) -> str:
        return f"{gid_prefix(self.settings.node)}{self.peer.node}:"

    async def _session_2pc(self, conn: psycopg.AsyncConnection[Any], stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        """Per batch: prepare here (rows deleted, decision row written), prepare there, COMMIT PREPARED
        here (the decision), COMMIT PREPARED there."""
        await self._recover_2pc(conn, stub)
        self._failures = 0
        while True:
            prepared = await self._prepare_local(conn)
            if prepared is None:
                await self._wait_for_work(conn)
                continue
            gid, batch = prepared
            with _tracer.start_as_current_span(
                f"transfer {self.peer.node}",
                kind=trace.SpanKind.PRODUCER,
                attributes={
                    **self._link_attributes,
                    "sokutatsu.transfer.gid": gid,
                    "messaging.batch.message_count": len(batch.messages),
                },
            ):
                await self._commit_both(conn, stub, gid, batch)

    async def _commit_both(
        self,
        conn: psycopg.AsyncConnection[Any],
        stub: queuedb_pb2_grpc.TransferAsyncStub,
        gid: str,
        batch: queuedb_pb2.TransferBatch,
    ) -> None:
        """One batch prepared here: prepare there, commit here (the decision), commit there."""
        self.crash.reach("sender:prepared")
        await stub.PrepareBatch(queuedb_pb2.PrepareBatchRequest(batch=batch, gid=gid), timeout=RPC_TIMEOUT)
        self.crash.reach("sender:both-prepared")
        await conn.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid + LOCAL_SUFFIX)))
        self.crash.reach("sender:committed")
        finished = await stub.FinishPrepared(
            queuedb_pb2.FinishPreparedRequest(gid=gid, commit=True), timeout=RPC_TIMEOUT
        )
        if not finished.found:
            # Prepared there a moment ago and committed here: only a hand-made ROLLBACK PREPARED gets here.
            log.error(
                "2pc transfer to %s: batch %s was prepared there but is gone; its messages are lost",
                self.peer.node,
                gid,
            )
        self.crash.reach("sender:finished")
        async with conn.transaction():
            # Not durable: a decision row left behind after a crash is only removed by the next recovery.
            await conn.execute("SET LOCAL synchronous_commit = off")
            await conn.execute("DELETE FROM sokutatsu.twopc_decisions WHERE gid = %s", (gid,))

    async def _prepare_local(self, conn: psycopg.AsyncConnection[Any]) -> tuple[str, queuedb_pb2.TransferBatch] | None:
        await conn.execute("BEGIN")
        try:
            rows = await (
                await conn.execute(_PICK_NEW, {"node": self.peer.node, "limit": self.settings.batch})
            ).fetchall()
            rows = _within_bytes(rows)
            if not rows:
                await conn.execute("ROLLBACK")
                return None
            gid = f"{self._gids}{rows[0][0]}-{time.time_ns()}"
            await conn.execute("DELETE FROM sokutatsu.outbox WHERE id = ANY(%b::bigint[])", ([r[0] for r in rows],))
            await conn.execute(
                "INSERT INTO sokutatsu.twopc_decisions (gid, to_node) VALUES (%s, %s)", (gid, self.peer.node)
            )
            await conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid + LOCAL_SUFFIX)))
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                await conn.execute("ROLLBACK")
            raise
        return gid, _batch(self.settings.node, [(*r[:7], r[0], r[8]) for r in rows])

    async def _recover_2pc(self, conn: psycopg.AsyncConnection[Any], stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        with _tracer.start_as_current_span(
            "transfer.recover",
            attributes=self._link_attributes,
        ) as span:
            aborted, finished = await self._recover_prepared(conn, stub)
            span.set_attribute("sokutatsu.transfer.aborted", aborted)
            span.set_attribute("sokutatsu.transfer.finished", finished)

    async def _recover_prepared(
        self, conn: psycopg.AsyncConnection[Any], stub: queuedb_pb2_grpc.TransferAsyncStub
    ) -> tuple[int, int]:
        """Presumed abort: a batch is committed where its decision row is committed, else rolled back;
        (batches aborted here, batches finished there)."""
        listed = await stub.ListPrepared(
            queuedb_pb2.ListPreparedRequest(sender_node=self.settings.node), timeout=RPC_TIMEOUT
        )
        remote = [g for g in listed.gids if g.startswith(self._gids)]
        local = {
            r[0].removesuffix(LOCAL_SUFFIX)
            for r in await (
                await conn.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s)",
                    (self._gids,),
                )
            ).fetchall()
        }
        decided = {
            r[0]
            for r in await (
                await conn.execute("SELECT gid FROM sokutatsu.twopc_decisions WHERE to_node = %s", (self.peer.node,))
            ).fetchall()
        }
        for gid in local:  # prepared here, never decided: abort (its rows go back to the outbox)
            await conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid + LOCAL_SUFFIX)))
        for gid in remote:
            commit = gid in decided
            await stub.FinishPrepared(queuedb_pb2.FinishPreparedRequest(gid=gid, commit=commit), timeout=RPC_TIMEOUT)
        await conn.execute("DELETE FROM sokutatsu.twopc_decisions WHERE to_node = %s", (self.peer.node,))
        log.info(
            "2pc transfer to %s: recovery aborted %d batches prepared here, finished %d prepared there",
            self.peer.node,
            len(local),
            len(remote),
        )
        return len(local), len(remote)


def _batch(sender: str, rows: Sequence[tuple[Any, ...]]) -> queuedb_pb2.TransferBatch:
    return queuedb_pb2.TransferBatch(
        sender_node=sender,
        messages=[
            queuedb_pb2.TransferredMessage(
                transfer_id=r[7],
                queue=r[2],
                body=bytes(r[3]),
                headers=r[4] or {},
                key=r[5],
                enqueued_unix_nano=r[6] or 0,
                durability=queuedb_pb2.DURABILITY_SENDER if r[8] == FLUSH_SENDER else queuedb_pb2.DURABILITY_RECEIVER,
            )
            for r in rows
        ],
    )


async def _write(call: Any, batch: queuedb_pb2.TransferBatch) -> None:
    try:
        await call.write(batch)
    except asyncio.InvalidStateError:
        # grpc.aio's way of saying the stream already ended (the receiver went away).
        raise ConnectionError("the transfer stream ended while writing") from None


def _within_bytes(rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The longest prefix of ``rows`` whose bodies fit one frame (at least one row)."""
    out: list[tuple[Any, ...]] = []
    size = 0
    for row in rows:
        size += len(row[3]) + 256
        if out and size > MAX_BATCH_BYTES:
            break
        out.append(row)
    return out


def _said(error: BaseException | None, dsn: str) -> str:
    """An error for the log: a database error's first line with any password of ``dsn`` masked."""
    if isinstance(error, psycopg.Error):
        return error_line(error, dsn)
    return str(error)


def _transient(error: BaseException) -> bool:
    if isinstance(error, aio.AioRpcError):
        # A write on a stream whose receiver just died can surface as INTERNAL (grpc/grpc#36066).
        return broken_write(error) or error.code() in {
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.FAILED_PRECONDITION,  # a gap: recovery on the next session settles it
            grpc.StatusCode.CANCELLED,
        }
    return isinstance(error, psycopg.OperationalError | OSError)


async def listen(dsn: str, links: dict[str, PeerLink]) -> None:
    """Wake the link a NOTIFY names (sent by immediate enqueues when they commit)."""
    async for attempt in AsyncRetrying(retry=retry_if_exception(_transient), wait=wait_exponential(0.05, max=5)):
        with attempt:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                await conn.execute(f"LISTEN {TRANSFER_CHANNEL}")
                for link in links.values():
                    link.wake.set()  # anything that came while not listening
                async for note in conn.notifies():
                    woken = links.get(note.payload)
                    if woken is not None:
                        woken.wake.set()


def build(settings: TransferSettings) -> Register:
    if not settings.dsn:
        raise SettingsError(f"{TransferSettings.env_prefix}DSN is not set: give this node's PostgreSQL DSN")
    try:
        check_dsn(settings.dsn)
    except PostgresError as exc:  # before any connection: libpq's parse errors quote the DSN, password too
        raise SettingsError(f"{TransferSettings.env_prefix}DSN: {exc}") from None
    if not settings.peers:
        raise SettingsError(f"{TransferSettings.env_prefix}PEERS is empty: name the receiving nodes, node=host:port")

    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        crash = CrashPoints(settings.crash_at)
        links = {peer.node: PeerLink(settings, peer, crash) for peer in settings.peers}
        context.start_background(listen(settings.dsn, links), "listen")
        for node, link in links.items():
            context.start_background(link.run(), f"transfer-{node}")
        log.info("transfer from %s to %s (pid %d)", settings.node, ", ".join(links), os.getpid())
        return []

    return register


def main() -> NoReturn:
    run_service("transfer", TransferSettings, build)


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    main()

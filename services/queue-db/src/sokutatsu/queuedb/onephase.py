"""The one-phase protocol of seed 004 (§3.3.3 Fig. 3 and §3.3.4), batched: the sender's side.

Per receiving node, in a loop:

1. **assign** (one local transaction): a batch already *sending* (a row in
   ``transfer_batches``, not confirmed) is resent as it is; otherwise the next messages
   become a batch with dense transfer ids after the cursor ``transfer_out.last_sent_id``,
   which moves with them: one batch row, no update per message. Commit (durably), then send;
2. **deliver**: the receiver stores the batch and its recovery row in one transaction
   and answers (:mod:`.recovery`);
3. **mark sent** (one local transaction): the batches the receiver has flushed and their
   messages are deleted, and a ``NOTIFY`` names the ids an ``Enqueue`` call waits for.
   This commit need not be durable: if it is lost, step 0 repeats it. Batches acknowledged
   but not flushed there stay until a later answer, or ``GetRecoveryState`` (which flushes
   before it answers), covers them;

0. **recover**, on every (re)connection (:func:`.recovery.recover`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from grpc import aio
from opentelemetry import trace

from sokutatsu.queuedb import recovery, store
from sokutatsu.queuedb.faults import CrashPoints
from sokutatsu.queuedb.sender import RPC_TIMEOUT, Link, batch, tracer
from sokutatsu.queuedb.settings import Peer, TransferSettings
from sokutatsu.queuedb.store import transfer
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc


class OnePhase(Link):
    """The one-phase protocol's sessions towards one receiving node."""

    def __init__(self, settings: TransferSettings, peer: Peer, crash: CrashPoints) -> None:
        super().__init__(settings, peer, crash)
        # Since when the receiver holds acknowledged messages it may not have flushed (sender-durable
        # ones, stored without waiting for the flush); None when it has flushed all it acknowledged.
        self._unflushed_since: float | None = None
        self._acked = 0  # the receiver's last_received_id in its latest answer

    async def recover(self, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        with self.recover_span() as span:
            received, done, last_sent = await recovery.recover(self, conn, stub)
            self._acked = received
            self._unflushed_since = None
            span.set_attribute("sokutatsu.transfer.receiver_last_id", received)
            span.set_attribute("sokutatsu.transfer.marked_sent", done)
            span.set_attribute("sokutatsu.transfer.last_assigned_id", last_sent)

    async def send(self, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
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

    def _batch_span(self, sent: queuedb_pb2.TransferBatch, resent: bool) -> trace.Span:
        return tracer.start_span(
            f"transfer {self.peer.node}",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                **self.link_attributes,
                "sokutatsu.transfer.first_id": sent.messages[0].transfer_id,
                "sokutatsu.transfer.last_id": sent.messages[-1].transfer_id,
                "sokutatsu.transfer.resent": resent,
                "messaging.batch.message_count": len(sent.messages),
            },
        )

    async def _stream(
        self,
        conn: store.Conn,
        stub: queuedb_pb2_grpc.TransferAsyncStub,
        call: Any,
        in_flight: deque[int],
        spans: deque[trace.Span],
    ) -> None:
        for sent in await self._sending(conn):  # what the last session left unconfirmed (seed case 2-1)
            spans.append(self._batch_span(sent, resent=True))
            await _write(call, sent)
            in_flight.append(sent.messages[-1].transfer_id)
        while True:
            while len(in_flight) < self.settings.pipeline:
                sent = await self._assign(conn)
                if not sent.messages:
                    break
                spans.append(self._batch_span(sent, resent=False))
                await _write(call, sent)
                in_flight.append(sent.messages[-1].transfer_id)
            if not in_flight:
                if self._unflushed_since is None:
                    await self.wait_for_work(conn)
                elif not await self.wait_for_work(conn, once=True):
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
            if self._unflushed_since is not None and time.monotonic() - self._unflushed_since > self.poll:
                # Only sender-durable batches for a while: have the receiver flush, so the outbox stays short.
                await self._flushed(conn, stub)

    async def _flushed(self, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        """Have the receiver flush what it holds (GetRecoveryState answers after a flush); forget that here."""
        received = await recovery.last_received(self, stub)
        await self._mark_sent(conn, received)
        if received < self._acked:
            # It acknowledged more than it now holds: its database restarted and lost batches it had
            # stored without the flush. A new session resends them (recovery, seed case 2-1).
            raise ConnectionError(f"{self.peer.node} holds up to id {received} after acknowledging {self._acked}")
        self._unflushed_since = None

    async def _sending(self, conn: store.Conn) -> list[queuedb_pb2.TransferBatch]:
        """The batches assigned and not confirmed, in order, as they were first sent."""
        rows = await transfer.sending(conn, self.peer.node)
        batches: list[list[tuple[Any, ...]]] = []
        for row in rows:
            if batches and batches[-1][-1][7] + 1 == row[7]:
                batches[-1].append(row)
            else:
                batches.append([row])
        return [batch(self.settings.node, b) for b in batches]

    async def _assign(self, conn: store.Conn) -> queuedb_pb2.TransferBatch:
        """The next messages not in a batch become one: dense transfer ids after the cursor."""
        node = self.peer.node
        rows: list[tuple[Any, ...]] = []
        async with conn.transaction():
            last = await transfer.cursor(conn, node)
            picked = await self.pick(conn)
            if picked:
                # One row marks the whole batch sending (seed 004's flag), not an update per message.
                first, final = last + 1, last + len(picked)
                await transfer.add_batch(conn, node, first, final, [r[0] for r in picked])
                await transfer.move_cursor(conn, node, final)
                rows = [(*r[:7], first + i, r[8]) for i, r in enumerate(picked)]
        if rows:
            self.crash.reach("sender:assigned")
        return batch(self.settings.node, rows)

    async def _mark_sent(self, conn: store.Conn, flushed: int) -> None:
        """Forget the batches at or below ``flushed`` (the receiver has them on disk)."""
        async with conn.transaction():
            # Not durable: a lost deletion is redone by recovery (the receiver has these).
            await store.commit_lazily(conn)
            await transfer.forget_sent(conn, self.peer.node, flushed)


async def _write(call: Any, sent: queuedb_pb2.TransferBatch) -> None:
    try:
        await call.write(sent)
    except asyncio.InvalidStateError:
        # grpc.aio's way of saying the stream already ended (the receiver went away).
        raise ConnectionError("the transfer stream ended while writing") from None

"""The receiving side of the one-phase transfer (seed 004 §3.3.3, Fig. 3, right column).

``Deliver`` stores a batch and moves the recovery row ``(sender, last_received_id)`` in one
local transaction, commits, and only then answers. So the row always says exactly what
this node holds from the sender: a sender that lost the answer asks ``GetRecoveryState``
on reconnect and resends only what is above it (seed §3.3.4). A batch, or part of one,
at or below the row is a replay: ignored and counted. A batch that starts above the row
plus one would leave a hole: refused with FAILED_PRECONDITION.

A receiving queue that does not exist yet is created (local, no forwarding rule): a
transfer must never stall on a queue nobody has created on this node. Every name a request
gives (``sender_node``, each message's ``queue``) must pass the rule ``CreateQueue`` applies
(:func:`~sokutatsu.queuedb.text.valid_name`), checked before any SQL: so the receiver creates
only queues ``CreateQueue`` could have created, and a name PostgreSQL could not index is
``INVALID_ARGUMENT``, never a database error.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from grpc import aio
from psycopg import sql

from sokutatsu.core.errors import FailedPrecondition, InvalidArgument, echo
from sokutatsu.queuedb.db import Database
from sokutatsu.queuedb.faults import CrashPoints
from sokutatsu.queuedb.limits import cap, known_enum
from sokutatsu.queuedb.text import refuse_nul, valid_name
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc

# Receiving queues are created in a transaction of their own, committed before the batch's:
# a row inserted by a prepared (2PC) transaction would block every later batch for that queue.
_CREATE_QUEUES = """
INSERT INTO sokutatsu.queues (name)
SELECT DISTINCT q FROM unnest(%s::text[]) AS q
ON CONFLICT (name) DO NOTHING
"""
# The arrays go in binary format (``%b``): in text format psycopg escapes every element in
# Python, 10 ms of CPU for a batch of 1,000 (1.6 ms in binary).
_STORE = """
INSERT INTO sokutatsu.messages (queue, body, headers, key, enqueued_at)
SELECT m.queue, m.body, m.headers, m.key, coalesce(to_timestamp(m.ns / 1e9), now())
FROM unnest(%(queues)b::text[], %(bodies)b::bytea[], %(headers)b::jsonb[], %(keys)b::text[], %(ns)b::bigint[])
     WITH ORDINALITY AS m(queue, body, headers, key, ns, n)
ORDER BY m.n
"""


def _headers(message: queuedb_pb2.TransferredMessage) -> str | None:
    if not message.headers:
        return None
    return json.dumps(dict(message.headers))


class TransferReceiver(queuedb_pb2_grpc.TransferServicer):
    def __init__(self, db: Database, max_batch: int, crash: CrashPoints) -> None:
        self.db = db
        self.max_batch = max_batch
        self.crash = crash
        self._known_queues: set[str] = set()
        # Per sender, the highest transfer id stored by a flushed commit (or flushed since).
        # Unknown after a restart: 0 until the next flushed commit, which covers everything before it.
        self._durable: dict[str, int] = {}

    async def Deliver(
        self, request: queuedb_pb2.TransferBatch, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.TransferAck:
        return await self._deliver(request)

    async def DeliverStream(
        self, request_iterator: AsyncIterator[queuedb_pb2.TransferBatch], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[queuedb_pb2.TransferAck]:
        """Batches in arrival order, one answer each: a sender keeps several in flight."""
        async for batch in request_iterator:
            yield await self._deliver(batch)

    async def _deliver(self, request: queuedb_pb2.TransferBatch) -> queuedb_pb2.TransferAck:
        refuse_nul(request)
        sender = _sender(request.sender_node, "TransferBatch.sender_node")
        messages = list(request.messages)
        cap("TransferBatch.messages", len(messages), self.max_batch, "MAX_BATCH", "messages")
        _check_messages(messages)
        for before, after in itertools.pairwise(messages):
            if after.transfer_id != before.transfer_id + 1:
                raise InvalidArgument(
                    f"transfer ids in a batch must be dense and increasing; {before.transfer_id} is followed "
                    f"by {after.transfer_id}"
                )
        # The sender made a message durable itself (seed 001): this side need not wait for the flush.
        # A flushed commit also flushes every commit before it (one WAL), earlier lazy batches too.
        durable = any(m.durability != queuedb_pb2.DURABILITY_SENDER for m in messages)
        await self._create_queues(messages)
        async with self.db.transaction(durable=durable) as conn:
            await conn.execute(
                "INSERT INTO sokutatsu.transfer_in (from_node) VALUES (%s) ON CONFLICT DO NOTHING", (sender,)
            )
            cursor = await conn.execute(
                "SELECT last_received_id FROM sokutatsu.transfer_in WHERE from_node = %s FOR UPDATE", (sender,)
            )
            row = await cursor.fetchone()
            last: int = row[0] if row else 0
            new = [m for m in messages if m.transfer_id > last]
            if new and new[0].transfer_id != last + 1:
                raise FailedPrecondition(
                    f"this node holds transfer ids from {echo(sender)} up to {last}; a batch starting at "
                    f"{new[0].transfer_id} would leave a gap (ask GetRecoveryState and resend from {last + 1})"
                )
            if new:
                await conn.execute(_STORE, _rows(new))
                last = new[-1].transfer_id
                await conn.execute(
                    "UPDATE sokutatsu.transfer_in SET last_received_id = %s WHERE from_node = %s", (last, sender)
                )
                self.crash.reach("receiver:stored")
        self.crash.reach("receiver:committed")
        if durable:
            self._durable[sender] = max(self._durable.get(sender, 0), last)
        return queuedb_pb2.TransferAck(
            last_received_id=last, duplicates=len(messages) - len(new), durable_id=self._durable.get(sender, 0)
        )

    async def _create_queues(self, messages: list[queuedb_pb2.TransferredMessage]) -> None:
        """Create the receiving queues this process has not seen yet (queues are never deleted
        by the API, so a name once known needs no transaction per batch)."""
        names = sorted({m.queue for m in messages} - self._known_queues)
        if names:
            async with self.db.transaction() as conn:
                await conn.execute(_CREATE_QUEUES, (names,))
            self._known_queues.update(names)

    async def GetRecoveryState(
        self, request: queuedb_pb2.GetRecoveryStateRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.RecoveryState:
        refuse_nul(request)
        _sender(request.sender_node, "GetRecoveryStateRequest.sender_node")
        # A write committed with the flush: everything committed before it, sender-durable batches
        # stored without the flush included, is on disk before the answer (the sender forgets what
        # is at or below it).
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "UPDATE sokutatsu.transfer_in SET last_received_id = last_received_id WHERE from_node = %s "
                "RETURNING last_received_id",
                (request.sender_node,),
            )
            row = await cursor.fetchone()
        last = int(row[0]) if row else 0
        self._durable[request.sender_node] = max(self._durable.get(request.sender_node, 0), last)
        return queuedb_pb2.RecoveryState(sender_node=request.sender_node, last_received_id=last)

    # ------------------------------------------------- two-phase commit baseline --
    async def PrepareBatch(
        self, request: queuedb_pb2.PrepareBatchRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.PrepareBatchResponse:
        """Store the batch in a transaction and ``PREPARE TRANSACTION`` it under the sender's gid."""
        refuse_nul(request)
        batch = request.batch
        gid = _check_gid(request.gid, _sender(batch.sender_node, "PrepareBatchRequest.batch.sender_node"))
        messages = list(batch.messages)
        if not messages:
            raise InvalidArgument("PrepareBatchRequest.batch.messages is empty: a prepared batch carries messages")
        cap("PrepareBatchRequest.batch.messages", len(messages), self.max_batch, "MAX_BATCH", "messages")
        _check_messages(messages)
        await self._create_queues(messages)
        try:
            async with self.db.transaction() as conn:
                await conn.execute(_STORE, _rows(messages))
                await conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        except psycopg.errors.DuplicateObject:
            # Prepared before (a resent request): the first one stands, if it is this node's.
            async with self.db.transaction() as conn:
                cursor = await conn.execute(
                    "SELECT 1 FROM pg_prepared_xacts WHERE gid = %s AND database = current_database()", (gid,)
                )
                if await cursor.fetchone() is None:
                    raise FailedPrecondition(
                        f"gid {echo(gid)} is taken by a prepared transaction of another database on this node's "
                        "PostgreSQL; gids must be unique per cluster"
                    ) from None
            return queuedb_pb2.PrepareBatchResponse()
        except psycopg.errors.ObjectNotInPrerequisiteState as exc:
            raise FailedPrecondition(
                f"this node's PostgreSQL refuses PREPARE TRANSACTION ({exc}); set max_prepared_transactions > 0"
            ) from None
        self.crash.reach("receiver:prepared")
        return queuedb_pb2.PrepareBatchResponse()

    async def FinishPrepared(
        self, request: queuedb_pb2.FinishPreparedRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.FinishPreparedResponse:
        refuse_nul(request)
        gid = _check_gid(request.gid, "")
        verb = "COMMIT PREPARED" if request.commit else "ROLLBACK PREPARED"
        async with self.db.transaction() as conn:
            await conn.set_autocommit(True)
            try:
                await conn.execute(sql.SQL(verb + " {}").format(sql.Literal(gid)))
            except psycopg.errors.UndefinedObject:
                return queuedb_pb2.FinishPreparedResponse(found=False)
            finally:
                await conn.set_autocommit(False)
        return queuedb_pb2.FinishPreparedResponse(found=True)

    async def ListPrepared(
        self, request: queuedb_pb2.ListPreparedRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.ListPreparedResponse:
        refuse_nul(request)
        sender = request.sender_node and _sender(request.sender_node, "ListPreparedRequest.sender_node")
        prefix = gid_prefix(sender) if sender else GID_PREFIX
        async with self.db.transaction() as conn:
            cursor = await conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s) "
                "ORDER BY prepared",
                (prefix,),
            )
            rows = await cursor.fetchall()
        return queuedb_pb2.ListPreparedResponse(gids=[r[0] for r in rows])


GID_PREFIX = "sokutatsu:"


def gid_prefix(sender: str) -> str:
    """Every gid of ``sender``'s prepared batches starts with this."""
    return f"{GID_PREFIX}{sender}:"


def _check_gid(gid: str, sender: str) -> str:
    if not gid.startswith(gid_prefix(sender) if sender else GID_PREFIX) or len(gid) > 200:
        raise InvalidArgument(
            f"gid {echo(gid)} is not a Sokutatsu transfer gid ({echo(gid_prefix(sender or 'sender'))}…)"
        )
    return gid


_MAX_BIGINT = 2**63 - 1
_DURABILITY = queuedb_pb2.Durability.DESCRIPTOR


def _sender(name: str, field: str) -> str:
    if not name:
        raise InvalidArgument(f"{field} is empty: name the sending node")
    return valid_name(name, field)


def _check_messages(messages: list[queuedb_pb2.TransferredMessage]) -> None:
    """Each message's queue name (the CreateQueue rule), durability (a known value), transfer id and
    enqueue time (stored as PostgreSQL bigint: refuse what does not fit). On the hot path (a batch of
    1,000: 1.2 ms on the 2-core bench machine, 0.8 ms for the bigint check alone before issue #20):
    the refusal's words are made only for a message that fails."""
    names: set[str] = set()
    durabilities = _DURABILITY.values_by_number
    for index, message in enumerate(messages):
        if message.queue not in names:
            valid_name(message.queue, f"messages[{index}].queue")
            names.add(message.queue)
        if message.durability not in durabilities:
            known_enum(f"messages[{index}].durability", message.durability, _DURABILITY)
        if message.transfer_id > _MAX_BIGINT or message.enqueued_unix_nano > _MAX_BIGINT:
            for field in ("transfer_id", "enqueued_unix_nano"):
                value = getattr(message, field)
                if value > _MAX_BIGINT:
                    raise InvalidArgument(
                        f"messages[{index}].{field} of {value} is over the limit of {_MAX_BIGINT} (a PostgreSQL bigint)"
                    )


def _rows(messages: list[queuedb_pb2.TransferredMessage]) -> dict[str, list[Any]]:
    return {
        "queues": [m.queue for m in messages],
        "bodies": [m.body for m in messages],
        "headers": [_headers(m) for m in messages],
        "keys": [m.key for m in messages],
        "ns": [m.enqueued_unix_nano or None for m in messages],
    }

"""QueueService: remote clients create queues, enqueue, lease, ack and nack over gRPC.

Queues and messages live in the node's database (``sokutatsu.queues``, ``sokutatsu.messages``).
A message is ready when its ``visible_at`` has passed. ``Dequeue`` leases the oldest ready
messages of a queue in ``seq`` order with one statement: rows other consumers are leasing at
that moment are skipped (``FOR UPDATE SKIP LOCKED``), and each row taken gets a new
``lease_id``, ``visible_at = now() + visibility timeout`` and one more delivery. ``Ack``
deletes a leased message, ``Nack`` makes it visible again, both only while its lease holds;
a message whose lease expired is ready again with its old ``seq``, so it comes back first.

A queue with a transfer rule forwards: ``Enqueue`` puts its messages in the outbox for the
transfer daemon (through the same SDK call applications use), and it cannot be dequeued here.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from grpc import aio

from sokutatsu.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, echo
from sokutatsu.queuedb.alternate import Turns, enqueue_alternating
from sokutatsu.queuedb.arrivals import Ticket
from sokutatsu.queuedb.db import Database
from sokutatsu.queuedb.enqueue import FLUSH_BOTH, Message, QueueNotFound, record_ids, send_span
from sokutatsu.queuedb.group_commit import AckWork, EnqueueWork, Groups
from sokutatsu.queuedb.limits import cap, check_rule
from sokutatsu.queuedb.settings import QueueDbSettings
from sokutatsu.queuedb.store import queues
from sokutatsu.queuedb.text import refuse_nul, valid_name
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from sokutatsu.queuedb.wake import Waker

# How often a waiting Dequeue looks again.
POLL_SECONDS = 0.05
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_DURABILITY = {"both": queuedb_pb2.REMOTE_DURABILITY_BOTH, "alternate": queuedb_pb2.REMOTE_DURABILITY_ALTERNATE}


def _unix_nano(moment: datetime | None) -> int:
    if moment is None:
        return 0
    return (moment - _EPOCH) // timedelta(microseconds=1) * 1000


def _queue_message(queue: str, row: tuple[Any, ...]) -> queuedb_pb2.QueueMessage:
    _, _, seq, body, headers, key, enqueued_at, delivery_count, lease_id = row
    return queuedb_pb2.QueueMessage(
        queue=queue,
        seq=seq,
        body=bytes(body),
        headers={str(k): str(v) for k, v in (headers or {}).items()},
        key=key,
        enqueued_unix_nano=_unix_nano(enqueued_at),
        delivery_count=delivery_count,
        lease_id=str(lease_id),
    )


def _queue(row: tuple[Any, ...]) -> queuedb_pb2.Queue:
    name, to_node, to_queue, immediate, min_batch, max_age_ms, durability = row
    queue = queuedb_pb2.Queue(name=name)
    if to_node:
        queue.transfer.CopyFrom(
            queuedb_pb2.TransferRule(
                to_node=to_node,
                to_queue=to_queue,
                immediate=immediate,
                min_batch=min_batch,
                max_age_ms=max_age_ms,
                durability=_DURABILITY[durability],
            )
        )
    return queue


def _durability(rule: queuedb_pb2.TransferRule) -> str:
    """The durability column's value for a rule (unspecified = both)."""
    return "alternate" if rule.durability == queuedb_pb2.REMOTE_DURABILITY_ALTERNATE else "both"


def _required(value: str, field: str) -> str:
    """A queue name a request gives: present, and one CreateQueue could have made (so a name no
    queue can have, a megabyte long, never reaches PostgreSQL: issue #20's large-frame probe took
    this node from 222 to 474 MiB RSS through libpq's buffers)."""
    if not value:
        raise InvalidArgument(f"{field} is empty: name the queue")
    return valid_name(value, field)


def _not_found(queue: str) -> NotFound:
    return NotFound(
        f"queue {echo(queue)} does not exist on this node; create it with CreateQueue (ListQueues shows them)"
    )


def _difference(have: queuedb_pb2.Queue, want: queuedb_pb2.Queue) -> str:
    """How an existing queue's settings differ from the ones asked for ("" = the same queue).
    An empty to_queue means the queue's own name, so the two compare equal."""
    old, new = have.transfer, want.transfer

    def where(rule: queuedb_pb2.TransferRule) -> str:
        return f"forwarding to node {echo(rule.to_node)}" if rule.to_node else "local"

    if old.to_node != new.to_node:
        return f"it is {where(old)} (asked: {where(new)})"
    if not old.to_node:
        return ""
    pairs = [
        ("to_queue", old.to_queue or have.name, new.to_queue or want.name),
        ("immediate", old.immediate, new.immediate),
        ("min_batch", old.min_batch, new.min_batch),
        ("max_age_ms", old.max_age_ms, new.max_age_ms),
        ("durability", _durability(old), _durability(new)),
    ]
    return ", ".join(f"{field} is {echo(a)} (asked: {echo(b)})" for field, a, b in pairs if a != b)


@dataclass(frozen=True)
class _Forwarding:
    node: str
    immediate: bool
    alternate: bool  # alternating durability (seed 001) for Enqueue calls


def _nothing() -> None:
    pass


def _parse_lease(lease: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(lease)
    except ValueError:
        return None


class QueueServicer(queuedb_pb2_grpc.QueueServiceServicer):
    def __init__(self, db: Database, settings: QueueDbSettings, turns: Turns, waker: Waker, groups: Groups) -> None:
        self.db = db
        self.groups = groups
        self.settings = settings
        self.turns = turns
        self.waker = waker
        # Forwarding queues' rules (None: a local queue). Read once per queue: the API never changes
        # or deletes a queue (CreateQueue refuses other settings for an existing one).
        self._rules: dict[str, _Forwarding | None] = {}

    async def CreateQueue(
        self, request: queuedb_pb2.CreateQueueRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.CreateQueueResponse:
        refuse_nul(request)
        wanted = request.queue
        name = valid_name(_required(wanted.name, "Queue.name"), "queue name")
        check_rule(wanted, self.settings)
        rule = wanted.transfer
        # A local queue keeps the column defaults for the rule (immediate is meaningless there).
        values = (
            name,
            rule.to_node,
            rule.to_queue,
            rule.immediate or not rule.to_node,
            rule.min_batch,
            rule.max_age_ms,
            _durability(rule),
        )
        async with self.db.transaction() as conn:
            row = await queues.insert_queue(conn, values)
            if row is None:  # it exists: answer with it if it is the same queue
                row = await queues.select_queue(conn, name)
        if row is None:  # inserted by another call and gone since: there is no DeleteQueue, so never
            raise _not_found(name)
        queue = _queue(row)
        difference = _difference(queue, wanted)
        if difference:
            raise AlreadyExists(
                f"queue {echo(name)} already exists with other settings: {difference}; "
                "use another name, or ask with the settings GetQueue shows"
            )
        return queuedb_pb2.CreateQueueResponse(queue=queue)

    async def GetQueue(
        self, request: queuedb_pb2.GetQueueRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.Queue:
        refuse_nul(request)
        name = _required(request.name, "GetQueueRequest.name")
        async with self.db.transaction() as conn:
            row = await queues.select_queue(conn, name)
        if row is None:
            raise _not_found(name)
        return _queue(row)

    async def ListQueues(
        self, request: queuedb_pb2.ListQueuesRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.ListQueuesResponse:
        async with self.db.transaction() as conn:
            rows = await queues.list_queues(conn)
        return queuedb_pb2.ListQueuesResponse(queues=[_queue(row) for row in rows])

    async def GetQueueStats(
        self, request: queuedb_pb2.GetQueueStatsRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.QueueStats:
        refuse_nul(request)
        name = _required(request.queue, "GetQueueStatsRequest.queue")
        async with self.db.transaction() as conn:
            row = await queues.queue_stats(conn, name)
        if row is None:
            raise _not_found(name)
        ready, leased, pending, sending, oldest = row
        return queuedb_pb2.QueueStats(
            queue=name,
            ready=ready,
            leased=leased,
            transfer_pending=pending,
            transfer_sending=sending,
            oldest_ready_unix_nano=_unix_nano(oldest),
        )

    async def Enqueue(
        self, request: queuedb_pb2.EnqueueRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.EnqueueResponse:
        ticket = self.groups.arrivals.ticket()  # on its way to a group (a group waits for it)
        try:
            return await self._enqueue(request, ticket)
        finally:
            ticket.close()

    async def _enqueue(self, request: queuedb_pb2.EnqueueRequest, ticket: Ticket) -> queuedb_pb2.EnqueueResponse:
        refuse_nul(request)
        name = _required(request.queue, "EnqueueRequest.queue")
        count, limit, largest = len(request.messages), self.settings.max_batch, self.settings.max_body_bytes
        if count == 0:
            raise InvalidArgument("EnqueueRequest.messages is empty: give at least one message")
        cap("EnqueueRequest.messages", count, limit, "MAX_BATCH", "messages")
        for index, message in enumerate(request.messages):
            if len(message.body) > largest:
                raise InvalidArgument(
                    f"EnqueueRequest.messages[{index}].body of {len(message.body):,} bytes is over the maximum of "
                    f"{largest:,} bytes (SOKUTATSU_QUEUEDB_MAX_BODY_BYTES); send large payloads elsewhere and "
                    "enqueue a reference"
                )
        batch = [Message(bytes(m.body), dict(m.headers) or None, m.key) for m in request.messages]
        # Checked above: from here on, only the database can refuse the call (group_commit, invariant 3).
        with send_span(name, batch) as (written, span):
            try:
                rule = await self._forwarding(name)
                if rule is None:  # local, or not there when looked up: the statement finds out (and notifies)
                    work = EnqueueWork(name, written, FLUSH_BOTH, immediate=None)
                    seqs: list[int] = await self.groups.durable.submit(work, ticket)
                else:
                    # The daemon is woken after the commit, not by a NOTIFY in the transaction (see Waker).
                    wake = functools.partial(self.waker.wake, rule.node) if rule.immediate else None
                    if rule.alternate:
                        seqs = await enqueue_alternating(
                            self.groups, self.turns, name, rule.node, written, wake or _nothing, ticket
                        )
                    else:
                        work = EnqueueWork(name, written, FLUSH_BOTH, after_commit=wake)
                        seqs = await self.groups.durable.submit(work, ticket)
            except QueueNotFound:
                raise _not_found(name) from None
            record_ids(span, seqs)
        return queuedb_pb2.EnqueueResponse(seqs=seqs)

    async def _forwarding(self, queue: str) -> _Forwarding | None:
        """``queue``'s transfer rule, or None when it is local (or does not exist: the enqueue says so)."""
        if queue not in self._rules:
            async with self.db.transaction() as conn:
                row = await queues.transfer_rule(conn, queue)
            if row is None:
                return None  # not cached: the queue may be created later
            self._rules[queue] = _Forwarding(row[0], row[1], row[2] == "alternate") if row[0] else None
        return self._rules[queue]

    async def Dequeue(
        self, request: queuedb_pb2.DequeueRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.DequeueResponse:
        refuse_nul(request)
        name = _required(request.queue, "DequeueRequest.queue")
        settings = self.settings
        wait_ms = cap("DequeueRequest.wait_ms", request.wait_ms, settings.max_wait_ms, "MAX_WAIT_MS")
        timeout_ms = cap(
            "DequeueRequest.visibility_timeout_ms",
            request.visibility_timeout_ms,
            settings.max_visibility_timeout_ms,
            "MAX_VISIBILITY_TIMEOUT_MS",
        )
        limit = cap("DequeueRequest.max_messages", request.max_messages, settings.max_batch, "MAX_BATCH") or 1
        timeout_ms = timeout_ms or settings.visibility_timeout_ms
        deadline = asyncio.get_running_loop().time() + wait_ms / 1000
        while True:
            # A lease lost in an OS crash only makes its message ready again early: commit without the flush.
            async with self.db.transaction(durable=False) as conn:
                rows = await queues.lease(conn, name, limit, timeout_ms)
            if not rows:
                raise _not_found(name)
            to_node, to_queue = rows[0][0], rows[0][1]
            if to_node:
                raise FailedPrecondition(
                    f"queue {echo(name)} forwards its messages to node {echo(to_node)} (queue {echo(to_queue)} there); "
                    "dequeue them on that node"
                )
            messages = [_queue_message(name, row) for row in rows if row[2] is not None]
            remaining = deadline - asyncio.get_running_loop().time()
            if messages or remaining <= 0:
                return queuedb_pb2.DequeueResponse(messages=messages)
            await asyncio.sleep(min(POLL_SECONDS, remaining))

    async def Ack(
        self, request: queuedb_pb2.AckRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.AckResponse:
        ticket = self.groups.arrivals.ticket()
        try:
            return await self._ack(request, ticket)
        finally:
            ticket.close()

    async def _ack(self, request: queuedb_pb2.AckRequest, ticket: Ticket) -> queuedb_pb2.AckResponse:
        refuse_nul(request)
        name = _required(request.queue, "AckRequest.queue")
        leases = self._leases(request.lease_ids, "Ack")
        try:
            held: set[uuid.UUID] = await self.groups.durable.submit(AckWork(name, leases.good), ticket)
        except QueueNotFound:
            raise _not_found(name) from None
        return queuedb_pb2.AckResponse(expired=leases.expired(held))

    async def Nack(
        self, request: queuedb_pb2.NackRequest, context: aio.ServicerContext[Any, Any]
    ) -> queuedb_pb2.NackResponse:
        refuse_nul(request)
        name = _required(request.queue, "NackRequest.queue")
        delay_ms = cap("NackRequest.delay_ms", request.delay_ms, self.settings.max_nack_delay_ms, "MAX_NACK_DELAY_MS")
        leases = self._leases(request.lease_ids, "Nack")
        async with self.db.transaction() as conn:
            row = await queues.nack(conn, name, leases.good, delay_ms)
        if row is None or row[0] == 0:
            raise _not_found(name)
        return queuedb_pb2.NackResponse(expired=leases.expired(set(row[1])))

    def _leases(self, lease_ids: Iterable[str], rpc: str) -> _Leases:
        raw = list(lease_ids)
        cap(f"{rpc}Request.lease_ids", len(raw), self.settings.max_batch, "MAX_BATCH", "lease ids")
        return _Leases(raw, [_parse_lease(lease) for lease in raw])


@dataclass(frozen=True)
class _Leases:
    """An Ack's or Nack's lease ids as given, and parsed (None: malformed, never an error)."""

    raw: list[str]
    parsed: list[uuid.UUID | None]

    @property
    def good(self) -> list[uuid.UUID]:
        return list(dict.fromkeys(p for p in self.parsed if p is not None))

    def expired(self, held: set[uuid.UUID]) -> list[str]:
        """In request order, the ids whose lease did not hold: expired, unknown, of another queue, or malformed."""
        return [lease for lease, p in zip(self.raw, self.parsed, strict=True) if p not in held]

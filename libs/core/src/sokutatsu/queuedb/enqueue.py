"""Enqueue inside the application's own transaction (seed 004's 仮想キュー).

``enqueue(conn, "orders", body)`` runs one statement on the caller's psycopg connection,
inside whatever transaction the caller has open: the message commits or rolls back with
the caller's business update. Nothing is sent anywhere: a queue with a transfer rule gets
its message in the outbox, and the transfer daemon moves it after the commit (woken at
once by ``NOTIFY`` for an immediate queue; NOTIFY is delivered only on commit).

Traced (docs/tracing.md) when an OpenTelemetry SDK tracer provider is installed: a
``send {queue}`` PRODUCER span per call, a child of the caller's current span, and each
message's headers carry its context as ``traceparent`` (unless the caller set one).

Both functions have an ``async`` twin taking a ``psycopg.AsyncConnection``. A message to a
local queue is one round trip (a plain ``INSERT ... SELECT``), a batch too (arrays unnested
server-side, in order); a single message to a forwarding queue takes two.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from sokutatsu.client._tracing import SYSTEM, TRACEPARENT, tracing_on

# The channel the transfer daemon listens on; the payload is the receiving node's name.
TRANSFER_CHANNEL = "sokutatsu_transfer"
# The channel the transfer daemon notifies when the receiver confirmed (flushed) messages and they
# left the outbox; the payload is "node:id,id,..." with the ids of the FLUSH_RECEIVER ones.
CONFIRMED_CHANNEL = "sokutatsu_transfer_confirmed"

# outbox.flush, where a forwarded message is flushed to disk (seed 001's alternating durability):
FLUSH_BOTH = 0  # on this node at enqueue, and on the receiving node when it arrives
FLUSH_SENDER = 1  # on this node only: the receiver stores it without waiting for its flush
FLUSH_RECEIVER = 2  # on the receiving node only: the caller waits for its confirmation
# Largest body accepted (the gRPC API refuses larger ones with INVALID_ARGUMENT too).
MAX_BODY_BYTES = 16 * 2**20


class QueueNotFound(LookupError):
    """The queue does not exist in this database (create it with the queue-db API or CLI)."""


@dataclass(frozen=True)
class Message:
    body: bytes
    headers: Mapping[str, str] | None = None
    key: str = ""


# One statement: look the queue up, insert into messages (local) or outbox (forwarding),
# notify the daemon for an immediate queue (or when the caller asks), and say which.
# Rows are inserted in array order (WITH ORDINALITY ... ORDER BY), so seq/id follow it.
# The arrays go in binary format (``%b``): psycopg's text format escapes every element in
# Python, several times the statement's own cost for a batch of 1,000.
_ENQUEUE = """
WITH q AS (
    SELECT name, to_node, coalesce(nullif(to_queue, ''), name) AS to_queue, immediate
    FROM sokutatsu.queues WHERE name = %(queue)s
),
m AS (
    SELECT body, headers, key, n
    FROM unnest(%(bodies)b::bytea[], %(headers)b::jsonb[], %(keys)b::text[]) WITH ORDINALITY AS m(body, headers, key, n)
),
local AS (
    INSERT INTO sokutatsu.messages (queue, body, headers, key)
    SELECT q.name, m.body, m.headers, m.key FROM q, m WHERE q.to_node = '' ORDER BY m.n
    RETURNING seq
),
forward AS (
    INSERT INTO sokutatsu.outbox (queue, to_node, to_queue, body, headers, key, flush)
    SELECT q.name, q.to_node, q.to_queue, m.body, m.headers, m.key, %(flush)s::smallint
    FROM q, m WHERE q.to_node <> '' ORDER BY m.n
    RETURNING id
),
wake AS (
    SELECT pg_notify(%(channel)s, q.to_node) FROM q
    WHERE q.to_node <> '' AND coalesce(%(immediate)s::boolean, q.immediate)
)
SELECT (SELECT count(*) FROM q),
       (SELECT coalesce(array_agg(seq ORDER BY seq), '{}') FROM local),
       (SELECT coalesce(array_agg(id ORDER BY id), '{}') FROM forward),
       (SELECT count(*) FROM wake)
"""


# One message into a local queue, the common case: a plain INSERT ... SELECT (the queue's row
# checked in the same statement). No row back: the queue forwards, or does not exist; then
# _ENQUEUE runs. The CTE statement costs about 30 % more per message than this one.
_ENQUEUE_LOCAL = """
INSERT INTO sokutatsu.messages (queue, body, headers, key)
SELECT name, %(body)s::bytea, %(headers)s::jsonb, %(key)s::text
FROM sokutatsu.queues WHERE name = %(queue)s AND to_node = ''
RETURNING seq
"""


@contextlib.contextmanager
def _traced(queue: str, messages: Sequence[Message]) -> Iterator[tuple[Sequence[Message], Span | None]]:
    """The messages as they are to be written, and the ``send {queue}`` span while tracing is on."""
    if not tracing_on():
        yield messages, None
        return
    tracer = trace.get_tracer("sokutatsu.queuedb")
    attributes: dict[str, str | int] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": queue,
        "messaging.batch.message_count": len(messages),
        "messaging.message.body.size": sum(len(m.body) for m in messages),
        "db.system": "postgresql",
    }
    with tracer.start_as_current_span(f"send {queue}", kind=SpanKind.PRODUCER, attributes=attributes) as span:
        context = span.get_span_context()
        header = f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
        yield (
            [
                m
                if m.headers and TRACEPARENT in m.headers
                else replace(m, headers={**(m.headers or {}), TRACEPARENT: header})
                for m in messages
            ],
            span,
        )


def _ids(span: Span | None, ids: list[int]) -> list[int]:
    """Record the ids the enqueue got on its span."""
    if span is not None and ids:
        span.set_attribute("sokutatsu.queuedb.first_id", ids[0])
        span.set_attribute("sokutatsu.queuedb.last_id", ids[-1])
    return ids


def _params(
    queue: str, messages: Sequence[Message], immediate: bool | None, flush: int = FLUSH_BOTH
) -> dict[str, object]:
    if not messages:
        raise ValueError("nothing to enqueue: give at least one message")
    for message in messages:
        if len(message.body) > MAX_BODY_BYTES:
            raise ValueError(f"a message body of {len(message.body):,} bytes is over the {MAX_BODY_BYTES:,}-byte limit")
    return {
        "queue": queue,
        "bodies": [m.body for m in messages],
        "headers": [json.dumps(dict(m.headers)) if m.headers else None for m in messages],
        "keys": [m.key for m in messages],
        "channel": TRANSFER_CHANNEL,
        "immediate": immediate,
        "flush": flush,
    }


def _one(queue: str, message: Message) -> dict[str, object]:
    if len(message.body) > MAX_BODY_BYTES:
        raise ValueError(f"a message body of {len(message.body):,} bytes is over the {MAX_BODY_BYTES:,}-byte limit")
    return {
        "queue": queue,
        "body": message.body,
        "headers": json.dumps(dict(message.headers)) if message.headers else None,
        "key": message.key,
    }


def _result(queue: str, row: tuple[Any, ...] | None) -> list[int]:
    if row is None or row[0] == 0:
        raise QueueNotFound(f"queue {queue!r} does not exist in this database")
    local: list[int] = row[1]
    forward: list[int] = row[2]
    return local or forward


def enqueue(
    conn: psycopg.Connection[Any],
    queue: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    key: str = "",
    *,
    immediate: bool | None = None,
) -> int:
    """Enqueue one message in ``conn``'s current transaction; return its id (its ``seq`` in a
    local queue, its outbox id in a forwarding one). ``immediate``: wake the transfer daemon on
    commit (True), leave it to the queue's deferred thresholds (False), or as the queue says (None)."""
    with _traced(queue, [Message(body, headers, key)]) as ([message], span):
        row = conn.execute(_ENQUEUE_LOCAL, _one(queue, message)).fetchone()
        if row is None:
            row = conn.execute(_ENQUEUE, _params(queue, [message], immediate)).fetchone()
            return _ids(span, _result(queue, row))[0]
        return _ids(span, [int(row[0])])[0]


def enqueue_batch(
    conn: psycopg.Connection[Any], queue: str, messages: Sequence[Message], *, immediate: bool | None = None
) -> list[int]:
    """Enqueue ``messages`` in order, in one round trip, in ``conn``'s current transaction."""
    with _traced(queue, messages) as (written, span):
        row = conn.execute(_ENQUEUE, _params(queue, written, immediate)).fetchone()
        return _ids(span, _result(queue, row))


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    queue: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    key: str = "",
    *,
    immediate: bool | None = None,
) -> int:
    """:func:`enqueue` on an ``AsyncConnection``."""
    with _traced(queue, [Message(body, headers, key)]) as ([message], span):
        cursor = await conn.execute(_ENQUEUE_LOCAL, _one(queue, message))
        row = await cursor.fetchone()
        if row is None:
            cursor = await conn.execute(_ENQUEUE, _params(queue, [message], immediate))
            return _ids(span, _result(queue, await cursor.fetchone()))[0]
        return _ids(span, [int(row[0])])[0]


# -- for the queue-db service's group commit (sokutatsu.queuedb.group_commit) --------------------------
# Several callers' batches into one queue go as one _ENQUEUE statement: their messages one after
# another, so each caller's ids are a contiguous slice of the statement's ids, in its order.
ENQUEUE_STATEMENT = _ENQUEUE
send_span = _traced  # the ``send {queue}`` span of one caller's messages, and them as they are to be written
record_ids = _ids


def merged_params(
    queue: str, batches: Sequence[Sequence[Message]], flush: int, immediate: bool | None = False
) -> dict[str, object]:
    """_ENQUEUE's parameters for ``batches`` (each one caller's, in order), one after another;
    ``immediate=False``: no in-transaction NOTIFY (the service wakes the daemon after the commit)."""
    return _params(queue, [m for batch in batches for m in batch], immediate, flush)


def split_ids(queue: str, row: tuple[Any, ...] | None, sizes: Sequence[int]) -> list[list[int]]:
    """Each batch's ids from _ENQUEUE's row for :func:`merged_params`: ``sizes[i]`` ids for batch i,
    in order. Rows are inserted in array order, so the sorted ids follow it. ``QueueNotFound`` when
    the queue does not exist."""
    ids = _result(queue, row)
    if len(ids) != sum(sizes):
        raise RuntimeError(f"the enqueue statement gave {len(ids)} ids for {sum(sizes)} messages")
    out, start = [], 0
    for size in sizes:
        out.append(ids[start : start + size])
        start += size
    return out


async def enqueue_batch_async(
    conn: psycopg.AsyncConnection[Any],
    queue: str,
    messages: Sequence[Message],
    *,
    immediate: bool | None = None,
    flush: int = FLUSH_BOTH,
) -> list[int]:
    """:func:`enqueue_batch` on an ``AsyncConnection``. ``flush`` (forwarding queues only): where
    the messages are made durable, ``FLUSH_*``; the queue-db API's alternating durability sets it,
    and then commits accordingly (an application's own transaction keeps the default)."""
    with _traced(queue, messages) as (written, span):
        cursor = await conn.execute(_ENQUEUE, _params(queue, written, immediate, flush))
        return _ids(span, _result(queue, await cursor.fetchone()))

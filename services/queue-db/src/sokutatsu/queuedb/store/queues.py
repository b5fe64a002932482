"""Queues, messages and leases: the statements of ``QueueService`` (:mod:`sokutatsu.queuedb.queues`
says what they do) and of group commit's ``Ack``."""

from __future__ import annotations

import uuid

from sokutatsu.queuedb.store import Conn, Row, fetch_all, fetch_one

_STATS = """
WITH outbox_rows AS (
    -- Batches in flight as one hashed set, not an array search per row (as the daemon does).
    SELECT o.id IN (SELECT unnest(outbox_ids) FROM sokutatsu.transfer_batches) AS in_flight
    FROM sokutatsu.outbox o WHERE o.queue = %(queue)s
)
SELECT
    (SELECT count(*) FROM sokutatsu.messages WHERE queue = q.name AND visible_at <= now()),
    (SELECT count(*) FROM sokutatsu.messages WHERE queue = q.name AND visible_at > now() AND lease_id IS NOT NULL),
    (SELECT count(*) FILTER (WHERE NOT in_flight) FROM outbox_rows),
    (SELECT count(*) FILTER (WHERE in_flight) FROM outbox_rows),
    (SELECT min(enqueued_at) FROM sokutatsu.messages WHERE queue = q.name AND visible_at <= now())
FROM sokutatsu.queues q WHERE q.name = %(queue)s
"""

# One statement: find the queue, take its oldest ready rows nobody else is leasing, lease them.
# No row at all: no such queue. One row with a NULL seq: the queue exists, nothing was leased
# (none ready, or the queue forwards and to_node says where).
_LEASE = """
WITH q AS (
    SELECT name, to_node, coalesce(nullif(to_queue, ''), name) AS to_queue
    FROM sokutatsu.queues WHERE name = %(queue)s
),
picked AS (
    SELECT m.seq FROM sokutatsu.messages m
    WHERE m.queue = %(queue)s AND m.visible_at <= now() AND EXISTS (SELECT 1 FROM q WHERE q.to_node = '')
    ORDER BY m.seq
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
leased AS (
    UPDATE sokutatsu.messages m
    SET lease_id = gen_random_uuid(),
        visible_at = now() + %(timeout_ms)s * interval '1 millisecond',
        delivery_count = m.delivery_count + 1
    FROM picked WHERE m.queue = %(queue)s AND m.seq = picked.seq
    RETURNING m.seq, m.body, m.headers, m.key, m.enqueued_at, m.delivery_count, m.lease_id
)
SELECT q.to_node, q.to_queue, l.seq, l.body, l.headers, l.key, l.enqueued_at, l.delivery_count, l.lease_id
FROM q LEFT JOIN leased l ON true
ORDER BY l.seq
"""

# Ack and Nack: the first column says whether the queue exists, the second which leases held (a lease
# holds while its row has it and its visible_at has not passed). Ack runs in group commit's pipeline.
ACK_STATEMENT = """
WITH q AS (SELECT name FROM sokutatsu.queues WHERE name = %(queue)s),
done AS (
    DELETE FROM sokutatsu.messages m USING q
    WHERE m.queue = q.name AND m.lease_id = ANY(%(leases)b::uuid[]) AND m.visible_at > now()
    RETURNING m.lease_id
)
SELECT (SELECT count(*) FROM q), (SELECT coalesce(array_agg(lease_id), '{}') FROM done)
"""
_NACK = """
WITH q AS (SELECT name FROM sokutatsu.queues WHERE name = %(queue)s),
done AS (
    UPDATE sokutatsu.messages m
    SET visible_at = now() + %(delay_ms)s * interval '1 millisecond', lease_id = NULL
    FROM q, unnest(%(leases)s::uuid[]) AS t(lease_id)
    WHERE m.queue = q.name AND m.lease_id = t.lease_id AND m.visible_at > now()
    RETURNING t.lease_id
)
SELECT (SELECT count(*) FROM q), (SELECT coalesce(array_agg(lease_id), '{}') FROM done)
"""

_COLUMNS = "name, to_node, to_queue, immediate, min_batch, max_age_ms, durability"
_INSERT_QUEUE = """
INSERT INTO sokutatsu.queues (name, to_node, to_queue, immediate, min_batch, max_age_ms, durability)
VALUES (%s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (name) DO NOTHING
RETURNING name, to_node, to_queue, immediate, min_batch, max_age_ms, durability
"""
_SELECT_QUEUE = f"SELECT {_COLUMNS} FROM sokutatsu.queues WHERE name = %s"  # noqa: S608 - constant columns
_LIST_QUEUES = f"SELECT {_COLUMNS} FROM sokutatsu.queues ORDER BY name"  # noqa: S608 - constant columns
_RULE = "SELECT to_node, immediate, durability FROM sokutatsu.queues WHERE name = %s"


async def insert_queue(conn: Conn, values: Row) -> Row | None:
    """The queue's row (columns as :data:`_COLUMNS`) if inserted now; None if it exists."""
    return await fetch_one(conn, _INSERT_QUEUE, values)


async def select_queue(conn: Conn, name: str) -> Row | None:
    return await fetch_one(conn, _SELECT_QUEUE, (name,))


async def list_queues(conn: Conn) -> list[Row]:
    return await fetch_all(conn, _LIST_QUEUES)


async def queue_stats(conn: Conn, name: str) -> Row | None:
    """(ready, leased, transfer pending, transfer sending, oldest ready), or None: no such queue."""
    return await fetch_one(conn, _STATS, {"queue": name})


async def transfer_rule(conn: Conn, name: str) -> Row | None:
    """(to_node, immediate, durability) of the queue, or None: no such queue."""
    return await fetch_one(conn, _RULE, (name,))


async def lease(conn: Conn, queue: str, limit: int, timeout_ms: int) -> list[Row]:
    """Lease up to ``limit`` ready messages of ``queue`` (rows as :data:`_LEASE` answers)."""
    params = {"queue": queue, "limit": limit, "timeout_ms": timeout_ms}
    return await fetch_all(conn, _LEASE, params)


async def nack(conn: Conn, queue: str, leases: list[uuid.UUID], delay_ms: int) -> Row | None:
    """Make the leased messages visible again after ``delay_ms``; (queue exists, leases that held)."""
    return await fetch_one(conn, _NACK, {"queue": queue, "leases": leases, "delay_ms": delay_ms})

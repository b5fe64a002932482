"""Transfer's tables: the sender's outbox, batches in flight and cursor, the receiver's recovery table
and store of a batch, the 2PC baseline's prepared transactions and decision rows, and the
notifications that wake the daemon and confirm receiver-durable messages.

A row of ``sokutatsu.transfer_batches`` is one batch *sending* (seed 004's flag, one row per batch,
not an update per message): its messages are the outbox rows ``outbox_ids``, with the dense transfer
ids ``first_id`` to ``last_id``. A message of the outbox that no batch lists is not assigned yet.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from psycopg import sql

from sokutatsu.queuedb.enqueue import CONFIRMED_CHANNEL, FLUSH_RECEIVER
from sokutatsu.queuedb.store import Conn, Row, fetch_all, fetch_one
from sokutatsu.queuedb.v1 import queuedb_pb2

# --------------------------------------------------------------------------------- sender --
# The batches still sending (resent after a reconnection), their messages in transfer id order.
# Columns, here and in _PICK_NEW: outbox id, queue, to_queue, body, headers, key, enqueued_at in
# ns, transfer id (NULL: not assigned yet), flush.
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
_NOTIFY = "SELECT pg_notify(%s, node) FROM unnest(%s::text[]) AS node"
_SENDER_FLUSH = "UPDATE sokutatsu.outbox SET flush = %s WHERE id = ANY(%s) RETURNING id"
_SET_CURSOR = "UPDATE sokutatsu.transfer_out SET last_sent_id = %s WHERE to_node = %s"


async def lock_link(conn: Conn, to_node: str) -> None:
    """Until this session holds the lock of the link to ``to_node`` (a session advisory lock)."""
    await conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (f"sokutatsu.transfer.{to_node}",))


async def listen(conn: Conn, channel: str) -> None:
    await conn.execute(f"LISTEN {channel}")


async def wake(conn: Conn, channel: str, nodes: list[str]) -> None:
    """A ``NOTIFY`` on ``channel`` naming each node (one statement, prepared)."""
    await conn.execute(_NOTIFY, (channel, nodes), prepare=True)


async def cursor(conn: Conn, to_node: str) -> int:
    """The last transfer id assigned towards ``to_node``, its row locked (made at 0 the first time)."""
    await conn.execute("INSERT INTO sokutatsu.transfer_out (to_node) VALUES (%s) ON CONFLICT DO NOTHING", (to_node,))
    row = await fetch_one(
        conn, "SELECT last_sent_id FROM sokutatsu.transfer_out WHERE to_node = %s FOR UPDATE", (to_node,)
    )
    return int(row[0]) if row else 0


async def move_cursor(conn: Conn, to_node: str, last: int) -> None:
    await conn.execute(_SET_CURSOR, (last, to_node))


async def sending(conn: Conn, to_node: str) -> list[Row]:
    """The messages of the batches sending, in transfer id order (columns as :data:`_PICK`)."""
    return await fetch_all(conn, _PICK, {"node": to_node})


async def pick_new(conn: Conn, to_node: str, limit: int) -> list[Row]:
    """Up to ``limit`` messages no batch lists yet, oldest first, locked."""
    return await fetch_all(conn, _PICK_NEW, {"node": to_node, "limit": limit})


async def add_batch(conn: Conn, to_node: str, first: int, last: int, outbox_ids: list[int]) -> None:
    """The messages ``outbox_ids`` are a batch sending with transfer ids ``first`` to ``last``."""
    await conn.execute(
        "INSERT INTO sokutatsu.transfer_batches (to_node, first_id, last_id, outbox_ids) "
        "VALUES (%s, %s, %s, %b::bigint[])",
        (to_node, first, last, outbox_ids),
    )


async def forget_sent(conn: Conn, to_node: str, flushed: int) -> int:
    """Delete the batches at or below ``flushed`` and their messages; how many messages. The
    queue-db API's receiver-durable Enqueue calls wait for the NOTIFY this sends on commit."""
    params = {"node": to_node, "flushed": flushed, "receiver": FLUSH_RECEIVER, "channel": CONFIRMED_CHANNEL}
    row = await fetch_one(conn, _SENT, params)
    return int(row[0]) if row else 0


async def deferred_due(conn: Conn, to_node: str) -> bool:
    """Whether a message not in a batch yet is due: its queue immediate (or gone), or its deferred
    queue's ``min_batch`` or ``max_age_ms`` reached."""
    row = await fetch_one(conn, _DEFERRED_DUE, {"node": to_node})
    return bool(row and row[0])


async def set_flush(conn: Conn, flush: int, outbox_ids: list[int]) -> set[int]:
    """Set the outbox rows' ``flush``; the ids of those still in the outbox."""
    rows = await fetch_all(conn, _SENDER_FLUSH, (flush, outbox_ids))
    return {int(r[0]) for r in rows}


# ------------------------------------------------------------------------------- receiver --
# Receiving queues are created in a transaction of their own, committed before the batch's:
# a row inserted by a prepared (2PC) transaction would block every later batch for that queue.
_CREATE_QUEUES = """
INSERT INTO sokutatsu.queues (name)
SELECT DISTINCT q FROM unnest(%s::text[]) AS q
ON CONFLICT (name) DO NOTHING
"""
# The arrays in binary format (invariant 2 of sokutatsu.queuedb.store).
_STORE = """
INSERT INTO sokutatsu.messages (queue, body, headers, key, enqueued_at)
SELECT m.queue, m.body, m.headers, m.key, coalesce(to_timestamp(m.ns / 1e9), now())
FROM unnest(%(queues)b::text[], %(bodies)b::bytea[], %(headers)b::jsonb[], %(keys)b::text[], %(ns)b::bigint[])
     WITH ORDINALITY AS m(queue, body, headers, key, ns, n)
ORDER BY m.n
"""


async def create_queues(conn: Conn, names: list[str]) -> None:
    """Local queues of these names, where there are none yet."""
    await conn.execute(_CREATE_QUEUES, (names,))


async def store_batch(conn: Conn, messages: Sequence[queuedb_pb2.TransferredMessage]) -> None:
    """The messages into their queues, in order (one statement)."""
    await conn.execute(
        _STORE,
        {
            "queues": [m.queue for m in messages],
            "bodies": [m.body for m in messages],
            "headers": [json.dumps(dict(m.headers)) if m.headers else None for m in messages],
            "keys": [m.key for m in messages],
            "ns": [m.enqueued_unix_nano or None for m in messages],
        },
    )


async def recovery_row(conn: Conn, sender: str) -> int:
    """The sender's ``last_received_id``, its row locked (made at 0 the first time)."""
    await conn.execute("INSERT INTO sokutatsu.transfer_in (from_node) VALUES (%s) ON CONFLICT DO NOTHING", (sender,))
    row = await fetch_one(
        conn, "SELECT last_received_id FROM sokutatsu.transfer_in WHERE from_node = %s FOR UPDATE", (sender,)
    )
    return row[0] if row else 0


async def move_recovery_row(conn: Conn, sender: str, last: int) -> None:
    await conn.execute("UPDATE sokutatsu.transfer_in SET last_received_id = %s WHERE from_node = %s", (last, sender))


async def touch_recovery_row(conn: Conn, sender: str) -> int:
    """The sender's ``last_received_id`` (0: no row), with a write: committed with the flush, the
    transaction flushes everything committed before it."""
    row = await fetch_one(
        conn,
        "UPDATE sokutatsu.transfer_in SET last_received_id = last_received_id WHERE from_node = %s "
        "RETURNING last_received_id",
        (sender,),
    )
    return int(row[0]) if row else 0


# ------------------------------------------------------------------- two-phase commit baseline --
async def prepare(conn: Conn, gid: str) -> None:
    """``PREPARE TRANSACTION`` the connection's transaction under ``gid``."""
    await conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))


async def finish(conn: Conn, gid: str, *, commit: bool) -> None:
    """``COMMIT PREPARED`` or ``ROLLBACK PREPARED`` (the connection in autocommit)."""
    verb = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
    await conn.execute(sql.SQL(verb + " {}").format(sql.Literal(gid)))


async def prepared(conn: Conn, prefix: str) -> list[str]:
    """This database's prepared transactions whose gid starts with ``prefix``, oldest first."""
    rows = await fetch_all(
        conn,
        "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s) "
        "ORDER BY prepared",
        (prefix,),
    )
    return [r[0] for r in rows]


async def prepared_here(conn: Conn, gid: str) -> bool:
    """Whether ``gid`` is a prepared transaction of this database (not another of the cluster)."""
    return (
        await fetch_one(
            conn, "SELECT 1 FROM pg_prepared_xacts WHERE gid = %s AND database = current_database()", (gid,)
        )
    ) is not None


async def take_outbox(conn: Conn, outbox_ids: list[int]) -> None:
    """Delete the outbox rows (the 2PC sender's, in the transaction it prepares)."""
    await conn.execute("DELETE FROM sokutatsu.outbox WHERE id = ANY(%b::bigint[])", (outbox_ids,))


async def decide(conn: Conn, gid: str, to_node: str) -> None:
    """The decision row: the batch ``gid`` commits where this row is committed (presumed abort)."""
    await conn.execute("INSERT INTO sokutatsu.twopc_decisions (gid, to_node) VALUES (%s, %s)", (gid, to_node))


async def decided(conn: Conn, to_node: str) -> set[str]:
    rows = await fetch_all(conn, "SELECT gid FROM sokutatsu.twopc_decisions WHERE to_node = %s", (to_node,))
    return {r[0] for r in rows}


async def drop_decision(conn: Conn, gid: str) -> None:
    await conn.execute("DELETE FROM sokutatsu.twopc_decisions WHERE gid = %s", (gid,))


async def drop_decisions(conn: Conn, to_node: str) -> None:
    await conn.execute("DELETE FROM sokutatsu.twopc_decisions WHERE to_node = %s", (to_node,))

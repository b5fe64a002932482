-- Sokutatsu queue-db, schema version 1: queues, messages, the transfer outbox and cursors.
--
-- Hot path: enqueue inserts one row (messages, or outbox for a queue that forwards);
-- transfer records a batch as one row (no update per message), and deletes its messages
-- with one DELETE once the receiver confirmed; the per-peer cursors are single rows. Rows are deleted, never
-- kept with a state flag, so the tables stay as small as their backlog; autovacuum is
-- made eager on them (see docs/queue-db.md, "Bloat").

CREATE SCHEMA IF NOT EXISTS sokutatsu;

CREATE TABLE sokutatsu.queues (
    name text PRIMARY KEY,
    -- Forwarding: empty to_node = local queue.
    to_node text NOT NULL DEFAULT '',
    to_queue text NOT NULL DEFAULT '',
    immediate boolean NOT NULL DEFAULT true,
    min_batch integer NOT NULL DEFAULT 0,
    max_age_ms integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Messages ready to lease (local queues, and what arrived from other nodes).
-- seq is the order within a queue (seed 004 §3.3.2: the DBMS's sequence). One index, the
-- primary key (queue, seq), serves dequeue; no foreign key to queues: enqueue checks the
-- queue in its own statement, and a key check would lock the queue's row in every
-- enqueuing transaction (concurrent enqueuers then share it through multixacts).
CREATE TABLE sokutatsu.messages (
    seq bigint GENERATED ALWAYS AS IDENTITY,
    queue text NOT NULL,
    body bytea NOT NULL,
    headers jsonb,
    key text NOT NULL DEFAULT '',
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    visible_at timestamptz NOT NULL DEFAULT '-infinity',
    lease_id uuid,
    delivery_count integer NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, seq)
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.05);
CREATE UNIQUE INDEX messages_by_lease ON sokutatsu.messages (lease_id) WHERE lease_id IS NOT NULL;

-- Messages waiting to be transferred to another node (seed 004's message management
-- table), in id order per receiving node; deleted once the receiver confirmed them.
CREATE TABLE sokutatsu.outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL,
    to_node text NOT NULL,
    to_queue text NOT NULL,
    body bytea NOT NULL,
    headers jsonb,
    key text NOT NULL DEFAULT '',
    enqueued_at timestamptz NOT NULL DEFAULT now()
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.05);
CREATE INDEX outbox_by_node ON sokutatsu.outbox (to_node, id);

-- The batch being sent to each receiving node (seed 004's "sending" flag, one row per batch
-- instead of one update per message): its dense transfer ids first_id..last_id are the
-- outbox rows outbox_ids, in that order. Deleted with its messages once confirmed.
CREATE TABLE sokutatsu.transfer_batches (
    to_node text NOT NULL,
    first_id bigint NOT NULL,
    last_id bigint NOT NULL,
    outbox_ids bigint[] NOT NULL,
    PRIMARY KEY (to_node, first_id)
);

-- Sender's cursor per receiving node: the highest transfer id assigned so far.
CREATE TABLE sokutatsu.transfer_out (
    to_node text PRIMARY KEY,
    last_sent_id bigint NOT NULL DEFAULT 0
);

-- Receiver's recovery table (seed 004 回復管理テーブル): the highest transfer id stored
-- from each sender, updated in the same transaction as the messages it covers.
CREATE TABLE sokutatsu.transfer_in (
    from_node text PRIMARY KEY,
    last_received_id bigint NOT NULL DEFAULT 0
);

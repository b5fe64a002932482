-- Sokutatsu queue-db, schema version 3: alternating durability (seed 001) for remote enqueue.
--
-- queues.durability: 'both' = every message is flushed on the sending node when it is
-- enqueued and on the receiving node when it arrives; 'alternate' = the queue-db API makes
-- every other Enqueue request durable only on the sender and the next only on the receiver
-- (see docs/queue-db.md, "Alternating durability").
ALTER TABLE sokutatsu.queues
    ADD COLUMN durability text NOT NULL DEFAULT 'both' CHECK (durability IN ('both', 'alternate'));

-- outbox.flush: where a forwarded message is flushed to disk. 0 = on both nodes; 1 = on the
-- sender only (the receiver stores it without waiting for its flush, and the sender keeps it
-- until the receiver's copy is flushed); 2 = on the receiver only (an Enqueue call waits for
-- the receiver's confirmation, which the transfer daemon announces by NOTIFY).
ALTER TABLE sokutatsu.outbox ADD COLUMN flush smallint NOT NULL DEFAULT 0 CHECK (flush IN (0, 1, 2));

-- Sokutatsu queue-db, schema version 2: the two-phase commit baseline's decision log.
--
-- A sender's prepared transaction inserts its gid here; COMMIT PREPARED makes the
-- decision durable. On recovery a receiver's prepared transaction is committed when its
-- gid is here and rolled back when it is not (presumed abort). Rows are deleted once the
-- receiver has committed too.
CREATE TABLE sokutatsu.twopc_decisions (
    gid text PRIMARY KEY,
    to_node text NOT NULL,
    decided_at timestamptz NOT NULL DEFAULT now()
);

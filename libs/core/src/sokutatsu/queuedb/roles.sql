-- Least-privilege roles of the queue-db schema (docs/queue-db.md, "Database roles").
-- Applied after the migrations by every migrate() (so tables added by later migrations are
-- covered), by the schema owner. Idempotent. Roles are cluster-wide and NOLOGIN: give a
-- login role membership (GRANT sokutatsu_queue_service TO node1_svc).
--   sokutatsu_enqueue        an application that enqueues in its own transaction: reads the
--                            queue definitions, inserts messages; cannot read, change or
--                            delete messages.
--   sokutatsu_queue_service  the queue-db service and the transfer daemon: reads and writes
--                            rows; no DDL, no TRUNCATE, owns nothing.
-- A migrating role without CREATEROLE (and no roles made by a DBA) skips the roles, with a
-- notice; the schema works as before for its owner.
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['sokutatsu_enqueue', 'sokutatsu_queue_service'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN insufficient_privilege THEN
                RAISE NOTICE 'role % not created (% lacks CREATEROLE): create it, then migrate again',
                    role_name, current_user;
            END;
        END IF;
    END LOOP;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'sokutatsu_enqueue') THEN
        GRANT USAGE ON SCHEMA sokutatsu TO sokutatsu_enqueue;
        GRANT SELECT ON sokutatsu.queues, sokutatsu.schema_migrations TO sokutatsu_enqueue;
        GRANT INSERT ON sokutatsu.messages, sokutatsu.outbox TO sokutatsu_enqueue;
        -- What enqueue's INSERT ... RETURNING reads back: the numbers, not the bodies.
        GRANT SELECT (seq) ON sokutatsu.messages TO sokutatsu_enqueue;
        GRANT SELECT (id) ON sokutatsu.outbox TO sokutatsu_enqueue;
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'sokutatsu_queue_service') THEN
        GRANT USAGE ON SCHEMA sokutatsu TO sokutatsu_queue_service;
        GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA sokutatsu TO sokutatsu_queue_service;
        REVOKE INSERT, UPDATE, DELETE ON sokutatsu.schema_migrations FROM sokutatsu_queue_service;
    END IF;
END
$$;

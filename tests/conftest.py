"""Test session: real PostgreSQL, real gRPC servers, real processes.

PostgreSQL comes from, in order: ``SOKUTATSU_PG_DSN``; a testcontainers
PostgreSQL container when a Docker engine answers; otherwise an embedded
cluster started by this session (system initdb/pg_ctl, as the postgres user
when root). See ``tests/fix_pg.py``.
"""

pytest_plugins = [
    "tests.fix_pg",
    "tests.broker.fix_broker",
    "tests.monitor.fix_monitor",
    "tests.sequencer.fix_sequencer",
    "tests.queuedb.fix_queuedb",
    "tests.security.fix_tls",
    "tests.security.fix_auth",
]

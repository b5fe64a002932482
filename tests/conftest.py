"""Test session: real PostgreSQL, real gRPC servers, real processes.

PostgreSQL comes from, in order: ``SOKUTATSU_PG_DSN``; a testcontainers
PostgreSQL container when a Docker engine answers; otherwise an embedded
cluster started by this session (system initdb/pg_ctl, as the postgres user
when root). See ``tests/fix_pg.py``.
"""

import os

# Tests run PostgreSQL's programs (as the postgres user when root: a plain fork, not vfork) while
# gRPC's threads are busy; gRPC's fork handlers then skip their preparation and can crash the child
# before it execs. Nothing here forks to go on using gRPC, so gRPC's fork support is off (before
# anything imports grpc; started services inherit it and never fork).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

pytest_plugins = [
    "tests.fix_pg",
    "tests.broker.fix_broker",
    "tests.monitor.fix_monitor",
    "tests.sequencer.fix_sequencer",
    "tests.queuedb.fix_queuedb",
]

"""The ``sokutatsu`` command line."""

import os

# The CLI runs PostgreSQL's programs (as the postgres user when root: a plain fork, not vfork)
# while gRPC's threads may be busy (benchmarks, the launcher); gRPC's fork handlers then skip
# their preparation and can crash the child before it execs. Nothing here forks to go on using
# gRPC, so gRPC's fork support is off unless the environment says otherwise (read when grpc loads).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

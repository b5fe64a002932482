import os

# gRPC's C core reads this when it loads; errors it would print are reported in one line of ours.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from sokutatsu.queuedb.server import main  # after the environment is set

main()

import sokutatsu.core.grpc_environment  # noqa: F401 - sets gRPC's environment: before anything loads grpc

# isort: split
from sokutatsu.queuedb.server import main

main()

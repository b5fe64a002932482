from sokutatsu.core.grpc_environment import apply

apply()  # gRPC's environment, before anything imports grpc

from sokutatsu.sequencer.server import main  # noqa: E402

main()

"""The environment gRPC's C core reads once, when it loads: every service's entry point imports this
module before anything imports grpc (``python -m sokutatsu.broker``, ``sokutatsu.monitor``,
``sokutatsu.sequencer``, ``sokutatsu.queuedb``, ``sokutatsu.queuedb.transferd`` and the broker's
delivery workers). Importing it sets each variable below unless the environment already has it: a value
given by whoever starts the service wins. It must not import grpc itself.

- ``GRPC_VERBOSITY=NONE``: errors gRPC would print are reported in one line of ours.
- ``GRPC_EXPERIMENTS=-event_engine_listener,-event_engine_client``: gRPC's sockets are served by its
  long-standing poller instead of the EventEngine, which grpcio turned on for Python in 2026. With the
  EventEngine each message read or written on a socket hops between gRPC's EventEngine threads and the
  asyncio loop; a minimal grpc.aio echo server at 560 request/response pairs a second used 145-207 µs of
  CPU per pair with it and 102-144 µs without, alternating in one session (grpcio 1.85), and the brokers
  under ``bench fanout`` about 7 % less (docs/broker.md, Fan-out). ``GRPC_EXPERIMENTS=`` (empty) keeps
  gRPC's own defaults.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "GRPC_VERBOSITY": "NONE",
    "GRPC_EXPERIMENTS": "-event_engine_listener,-event_engine_client",
}

for _name, _value in DEFAULTS.items():
    os.environ.setdefault(_name, _value)

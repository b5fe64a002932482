"""The environment gRPC's C core reads once, when grpc is imported: every service's entry point calls
:func:`apply` before anything imports grpc (``python -m sokutatsu.broker``, ``sokutatsu.monitor``,
``sokutatsu.sequencer``, ``sokutatsu.queuedb``, ``sokutatsu.queuedb.transferd``; the broker's delivery workers
inherit the broker's environment). It sets each variable below unless the environment already has it: a value
given by whoever starts the service wins. Importing this module changes nothing (the CLI and the benchmarks
read its tables), and it must not import grpc.

- ``GRPC_VERBOSITY=NONE``: errors gRPC would print are reported in one line of ours.
- ``GRPC_EXPERIMENTS=-event_engine_listener,-event_engine_client``: gRPC's sockets are served by its
  long-standing poller instead of the EventEngine, which grpcio turned on for Python in 2026 and which costs
  more CPU per message here: ``sokutatsu bench grpc-cost`` (a bare grpc.aio server, 560 request/response pairs a
  second, grpcio 1.85) measured 143-177 µs of CPU per pair with the EventEngine and 109-123 µs without
  (``bench/results/grpc-cost-2026-11-28T2254Z.md``); with it off and another change, both brokers under
  ``bench fanout`` used 0.90 to 1.00 times the CPU per delivery they used before
  (``bench/results/fanout-grpc-env-ab-2026-11-28.md``). Given empty, gRPC keeps its own defaults.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "GRPC_VERBOSITY": "NONE",
    "GRPC_EXPERIMENTS": "-event_engine_listener,-event_engine_client",
}
# What each means, for the configuration reference (``sokutatsu config``).
MEANINGS = {
    "GRPC_VERBOSITY": "gRPC's own logging (read by gRPC): NONE, as services set it, leaves errors to the service's "
    "one-line reports; ERROR, INFO or DEBUG to see gRPC's.",
    "GRPC_EXPERIMENTS": "gRPC's experiments (read by gRPC, comma-separated, - turns one off). The services turn off "
    "its EventEngine for sockets, which costs more CPU per message (bench grpc-cost; docs/broker.md, Fan-out); set "
    "it empty for gRPC's defaults; a value given replaces the services' whole list, so keep both names in it to "
    "add another. The SDK leaves an application's environment alone: set it there too for the same saving.",
}


def apply() -> None:
    """Set each of :data:`DEFAULTS` that the environment does not have (before grpc is imported)."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)

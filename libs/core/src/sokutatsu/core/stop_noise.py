"""grpcio's report of an RPC handler cancelled by the server's own stop, which is not an error.

When a service stops, a long-lived stream it serves (a pair's ``ReplicateWatermarks``, a
sequencer's ``WatchDistributions``) can still be open as the server stops, or open just then:
grpcio cancels its handler and its C layer logs ``Exception not handled by _handle_exceptions
in servicer method [...]`` with the ``CancelledError``, at ERROR, even though the service
asked for the stop. Operators read ERROR lines as faults, so :class:`CancelledAtStop` drops
exactly that record, and only once the service is stopping: any other exception, and a
cancellation while the service runs, is logged as before.
"""

from __future__ import annotations

import asyncio
import logging

# The logger grpcio's AsyncIO server reports unhandled handler exceptions on.
GRPC_LOGGER = "grpc._cython.cygrpc"


class CancelledAtStop(logging.Filter):
    def __init__(self, stopping: asyncio.Event) -> None:
        super().__init__()
        self.stopping = stopping

    def filter(self, record: logging.LogRecord) -> bool:
        cancelled = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
        return not (cancelled and self.stopping.is_set())


def drop_cancelled_at_stop(stopping: asyncio.Event) -> CancelledAtStop:
    """Install the filter on grpcio's logger for a service that sets ``stopping`` when it stops.

    It stays after the service returns (grpcio logs the cancelled handlers when the event loop
    closes); a later service in the same process (tests serve several) replaces the filters
    of services that stopped, so they stay bounded and silence no running service."""
    logger = logging.getLogger(GRPC_LOGGER)
    for old in list(logger.filters):
        if isinstance(old, CancelledAtStop) and old.stopping.is_set():
            logger.removeFilter(old)
    noise = CancelledAtStop(stopping)
    logger.addFilter(noise)
    return noise

"""Monitor process wiring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from grpc import aio

from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.monitor.monitor import Monitor
from sokutatsu.monitor.service import SERVICE, MonitorService
from sokutatsu.monitor.settings import MonitorSettings
from sokutatsu.monitor.v1 import monitor_pb2_grpc


def build(settings: MonitorSettings) -> Register:
    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        monitor = Monitor(settings)
        context.stack.push_async_callback(monitor.close)
        context.start_background(monitor.run(), "monitor")
        monitor_pb2_grpc.add_MonitorServicer_to_server(MonitorService(monitor), server)
        # A long-lived stream: no span of its own.
        context.untraced.add(f"/{SERVICE}/WatchAssignments")
        return [SERVICE]

    return register


def main() -> NoReturn:
    run_service("monitor", MonitorSettings, build)

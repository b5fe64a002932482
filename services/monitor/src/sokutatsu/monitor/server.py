"""Monitor process wiring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from grpc import aio

from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.core.unserved import add_unimplemented
from sokutatsu.monitor.settings import MonitorSettings
from sokutatsu.monitor.v1 import monitor_pb2

SERVICES = [monitor_pb2.DESCRIPTOR.services_by_name["Monitor"]]


def build(settings: MonitorSettings) -> Register:
    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        return add_unimplemented(server, SERVICES, "the monitor arrives with issue #4")

    return register


def main() -> NoReturn:
    run_service("monitor", MonitorSettings, build)

"""Broker process wiring."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NoReturn

from grpc import aio

from sokutatsu.broker.broker import Broker
from sokutatsu.broker.disk_worker import DiskWorker
from sokutatsu.broker.pair import join, stream_watermarks, watch_peer
from sokutatsu.broker.service import SERVICE, Admin, Control, DataPlane
from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.v1 import broker_pb2_grpc
from sokutatsu.core.server import Register, ServiceContext, run_service

RATES_INTERVAL_SECONDS = 1.0


def build(settings: BrokerSettings) -> Register:
    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        disk = DiskWorker()
        context.stack.callback(disk.close)
        context.start_background(disk.run(), "broker-disk")
        broker = Broker(settings, disk)
        broker.auth_refusals = context.auth_refusals
        await join(broker)
        await broker.open()
        context.stack.push_async_callback(broker.close)

        async def rates() -> None:
            while True:
                await asyncio.sleep(RATES_INTERVAL_SECONDS)
                broker.tick_rates()

        context.start_background(rates(), "broker-rates")
        context.start_background(stream_watermarks(broker, lambda: context.address), "broker-watermarks")
        context.start_background(watch_peer(broker), "broker-peer-watch")
        server.add_generic_rpc_handlers((DataPlane(broker).handler(),))
        context.untraced |= {
            f"/{SERVICE}/Publish",
            f"/{SERVICE}/Subscribe",
            "/sokutatsu.broker.v1.BrokerAdmin/WatchStats",
            "/sokutatsu.broker.v1.BrokerControl/ReplicateWatermarks",
        }
        broker_pb2_grpc.add_BrokerAdminServicer_to_server(Admin(broker), server)
        broker_pb2_grpc.add_BrokerControlServicer_to_server(Control(broker), server)
        return [SERVICE, "sokutatsu.broker.v1.BrokerAdmin", "sokutatsu.broker.v1.BrokerControl"]

    return register


def main() -> NoReturn:
    run_service("broker", BrokerSettings, build)

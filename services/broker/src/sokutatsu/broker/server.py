"""Broker process wiring."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NoReturn

from grpc import aio

from sokutatsu.broker.broker import Broker
from sokutatsu.broker.delivery_workers import Workers
from sokutatsu.broker.disk_worker import DiskWorker
from sokutatsu.broker.limits import Limits
from sokutatsu.broker.pair import install_probe, join, stream_watermarks, watch_peer
from sokutatsu.broker.service import SERVICE, Admin, Control, DataPlane
from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.v1 import broker_pb2_grpc
from sokutatsu.core.auth import server_policy
from sokutatsu.core.errors import StartupError
from sokutatsu.core.server import Register, ServiceContext, run_service

RATES_INTERVAL_SECONDS = 1.0
# Room in a publish frame for everything but one message's body (its key, headers, framing).
FRAME_OVERHEAD = 64 * 2**10


def build(settings: BrokerSettings) -> Register:
    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        limits = Limits(settings, context.runtime.max_frame_bytes, server_policy())
        if settings.max_body + FRAME_OVERHEAD > limits.max_frame_bytes:
            raise StartupError(
                f"SOKUTATSU_BROKER_MAX_BODY ({settings.max_body} bytes) does not fit in a frame of "
                f"SOKUTATSU_MAX_FRAME_BYTES ({limits.max_frame_bytes} bytes); raise the frame size or lower the body"
            )
        disk = DiskWorker()
        context.stack.callback(disk.close)
        context.start_background(disk.run(), "broker-disk")
        broker = Broker(settings, disk)
        broker.auth_refusals = context.auth_refusals
        await join(broker)
        install_probe(broker)
        await broker.open()
        context.stack.push_async_callback(broker.close)

        async def rates() -> None:
            while True:
                await asyncio.sleep(RATES_INTERVAL_SECONDS)
                broker.tick_rates()
                await broker.tick_retention()

        context.start_background(rates(), "broker-rates")
        # Ended before the server's grace period: a peer stopping at the same time would wait for it.
        context.start_background(
            stream_watermarks(broker, lambda: context.address), "broker-watermarks", stop_first=True
        )
        context.start_background(watch_peer(broker), "broker-peer-watch")
        plane = DataPlane(broker, limits)
        if settings.delivery_workers:
            plane.workers = await _start_workers(settings, plane, context)
        server.add_generic_rpc_handlers((plane.handler(),))
        context.untraced |= {
            f"/{SERVICE}/Publish",
            f"/{SERVICE}/Subscribe",
            f"/{SERVICE}/SubscribeMany",
            "/sokutatsu.broker.v1.BrokerAdmin/WatchStats",
            "/sokutatsu.broker.v1.BrokerControl/ReplicateWatermarks",
        }
        broker_pb2_grpc.add_BrokerAdminServicer_to_server(Admin(broker, limits, workers=plane.workers), server)
        broker_pb2_grpc.add_BrokerControlServicer_to_server(Control(broker, context.stopping), server)
        return [SERVICE, "sokutatsu.broker.v1.BrokerAdmin", "sokutatsu.broker.v1.BrokerControl"]

    return register


async def _start_workers(settings: BrokerSettings, plane: DataPlane, context: ServiceContext) -> Workers:
    """Start the delivery workers and wait until each serves (docs/broker.md, Delivery workers)."""
    host = settings.listen.rpartition(":")[0]
    # A broker on every interface: clients are moved to the host they reached, at the worker's port.
    named = "" if host in ("0.0.0.0", "[::]", "::", "") else host  # noqa: S104 - comparing, not binding
    workers = Workers(plane, settings.delivery_workers, settings.delivery_worker_listen or f"{host}:0", named)
    await workers.start()
    context.stack.push_async_callback(workers.close)
    # Stopped first: their clients' streams end with the broker's own, before its grace period.
    context.start_background(workers.run(), "delivery-workers", stop_first=True)
    await workers.wait_ready()
    return workers


def main() -> NoReturn:
    run_service("broker", BrokerSettings, build)

"""Broker process wiring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from grpc import aio

from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.core.unserved import add_unimplemented

SERVICES = [broker_pb2.DESCRIPTOR.services_by_name[n] for n in ("Broker", "BrokerAdmin", "BrokerControl")]


def build(settings: BrokerSettings) -> Register:
    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        return add_unimplemented(server, SERVICES, "publish/subscribe arrive with issue #3, the pair with #4")

    return register


def main() -> NoReturn:
    run_service("broker", BrokerSettings, build)

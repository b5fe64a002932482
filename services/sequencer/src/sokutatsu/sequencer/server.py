"""Sequencer process wiring."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import grpc
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.core.tls import open_channel
from sokutatsu.sequencer.sequencer import Sequencer
from sokutatsu.sequencer.service import SERVICE, SequencerService
from sokutatsu.sequencer.settings import SequencerSettings
from sokutatsu.sequencer.v1 import sequencer_pb2_grpc


async def create_total_order_topic(brokers: Sequence[str], topic: str) -> None:
    """Create ``topic`` as a total-order topic on every broker that answers (it may exist)."""
    for address in brokers:
        async with open_channel(address) as channel:
            stub = broker_pb2_grpc.BrokerAdminStub(channel)
            try:
                await stub.CreateTopic(
                    broker_pb2.CreateTopicRequest(topic=broker_pb2.Topic(name=topic, total_order=True)), timeout=5
                )
            except grpc.RpcError as error:
                if error.code() not in {grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAVAILABLE}:
                    raise


def build(settings: SequencerSettings) -> Register:
    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        sequencer = Sequencer(settings)
        if settings.leader and settings.brokers:
            await create_total_order_topic(settings.brokers, settings.topic)
        await sequencer.start()
        context.stack.push_async_callback(sequencer.close)
        if settings.leader:
            context.start_background(sequencer.run_leader(), "leader")
        context.start_background(sequencer.run_filler(), "filler")
        context.start_background(sequencer.run_orphan_filler(), "orphan-filler")
        sequencer_pb2_grpc.add_SequencerServicer_to_server(SequencerService(sequencer), server)
        # Long-lived streams: no span of their own.
        context.untraced.update({f"/{SERVICE}/Stamp", f"/{SERVICE}/WatchDistributions"})
        return [SERVICE]

    return register


def main() -> NoReturn:
    run_service("sequencer", SequencerSettings, build)

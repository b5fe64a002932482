"""The sequencer's gRPC servicer."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from sokutatsu.core.errors import InvalidArgument
from sokutatsu.sequencer.sequencer import Sequencer
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc

SERVICE = "sokutatsu.sequencer.v1.Sequencer"


class SequencerService(sequencer_pb2_grpc.SequencerServicer):
    def __init__(self, sequencer: Sequencer) -> None:
        self.sequencer = sequencer
        self._streams = itertools.count(1)

    async def Stamp(
        self, request_iterator: AsyncIterator[sequencer_pb2.StampRequest], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[sequencer_pb2.StampResponse]:
        sequencer = self.sequencer
        client = ""  # the stream's key: <client id>#<n>, so the end of an old stream of the client
        first = True  # does not orphan what its new stream claimed
        try:
            async for request in request_iterator:
                client = client or f"{request.client_id or context.peer()}#{next(self._streams)}"
                if request.claims:
                    sequencer.claim(request.claims, client)
                if request.published:
                    sequencer.settle(request.published)
                if first and request.client_id and (request.claims or request.published):
                    # The SDK begins a stream with all it holds: what it left out never reached it.
                    sequencer.disown_unclaimed(client)
                first = False
                if request.count == 0:
                    if not request.claims and not request.published:
                        raise InvalidArgument("a stamp request asks for at least 1 number")
                    continue
                stamped = sequencer.stamp(request.count, client, request.domain)
                yield sequencer_pb2.StampResponse(request_id=request.request_id, range=stamped)
        finally:
            if client:  # a stream that sent nothing held nothing (and must not touch the orphans)
                sequencer.stream_ended(client)

    async def WatchDistributions(
        self, request: sequencer_pb2.WatchDistributionsRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[sequencer_pb2.Distribution]:
        async for distribution in self.sequencer.watch():
            yield distribution

    async def InstallDistribution(
        self, request: sequencer_pb2.InstallDistributionRequest, context: aio.ServicerContext[Any, Any]
    ) -> sequencer_pb2.InstallDistributionResponse:
        if not request.HasField("distribution"):
            raise InvalidArgument("InstallDistribution needs a distribution")
        try:
            installed = await self.sequencer.install(request.distribution)
        except ValueError as error:
            raise InvalidArgument(str(error)) from None
        return sequencer_pb2.InstallDistributionResponse(installed_id=installed)

    async def GetSendRate(
        self, request: sequencer_pb2.GetSendRateRequest, context: aio.ServicerContext[Any, Any]
    ) -> sequencer_pb2.GetSendRateResponse:
        sequencer = self.sequencer
        return sequencer_pb2.GetSendRateResponse(
            domain=sequencer.domain,
            messages_per_second=sequencer.send_rate(),
            last_seq=sequencer.last_seq,
            epoch=sequencer.epoch,
        )

    async def GetStatus(
        self, request: sequencer_pb2.GetStatusRequest, context: aio.ServicerContext[Any, Any]
    ) -> sequencer_pb2.SequencerStatus:
        return self.sequencer.status()

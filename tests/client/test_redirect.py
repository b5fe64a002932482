"""The subscriber SDK says when it comes straight from a broker's redirect (``SubscribeOpen.redirected``).

A broker that took a subscriber at switchover step 2 and may lack messages after its position
sends one that came on its own back to its peer, and serves one its peer redirected to it
(docs/broker.md, Switchover): without the flag the two would send the subscriber to each other
for good. Two real gRPC servers speak the broker's Subscribe method here: "a" redirects every
open to "b", "b" answers ``subscribed`` and ends the stream, so the SDK goes back to "a".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import Subscriber
from tests.broker.fix_broker import until

SUBSCRIBE = "Subscribe"
SERVICE = "sokutatsu.broker.v1.Broker"


class Opens:
    """A Subscribe endpoint that records each open's ``redirected`` and answers with ``reply``."""

    def __init__(self, reply: broker_pb2.SubscribeResponse) -> None:
        self.reply = reply
        self.redirected: list[bool] = []

    async def subscribe(
        self, requests: AsyncIterator[broker_pb2.SubscribeRequest], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[broker_pb2.SubscribeResponse]:
        first = await anext(requests)
        self.redirected.append(first.open.redirected)
        yield self.reply

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                SUBSCRIBE: grpc.stream_stream_rpc_method_handler(
                    self.subscribe,
                    request_deserializer=broker_pb2.SubscribeRequest.FromString,
                    response_serializer=broker_pb2.SubscribeResponse.SerializeToString,
                )
            },
        )


async def _serve(opens: Opens) -> tuple[aio.Server, str]:
    server = aio.server()
    server.add_generic_rpc_handlers((opens.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_the_open_after_a_redirect_says_so_and_no_other_does() -> None:
    b = Opens(broker_pb2.SubscribeResponse(subscribed=broker_pb2.Subscribed(broker_id="b")))
    b_server, b_address = await _serve(b)
    a = Opens(broker_pb2.SubscribeResponse(redirect=broker_pb2.Redirect(target=b_address, reason="moved")))
    a_server, a_address = await _serve(a)
    try:
        async with Subscriber([a_address], "desk", "prices"):

            async def twice_round() -> bool:
                return len(a.redirected) >= 2 and len(b.redirected) >= 2

            await until(twice_round, "the SDK to go round a (redirected) and b (stream ended) twice")
    finally:
        await asyncio.gather(a_server.stop(None), b_server.stop(None))
    assert not any(a.redirected), a.redirected  # on its own: first, and after b ended the stream
    assert all(b.redirected), b.redirected  # each time straight from a's redirect

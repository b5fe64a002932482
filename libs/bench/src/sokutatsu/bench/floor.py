"""The floor of ``sokutatsu bench peers``' latency: a bare gRPC relay in Python.

    python -m sokutatsu.bench.floor

One process, grpc.aio on asyncio like the broker, two raw-bytes methods and nothing else:
``Send`` (a client stream; answers how many bodies it relayed when the stream ends) hands
every body to every ``Receive`` stream open at that moment. No protobuf, no storage, no
acknowledgement per message, no second broker. A message through it makes the same two
gRPC hops as one through a broker (publisher → server → consumer), so its latency is what
any Python gRPC broker pays before doing any work of its own on this machine.

It listens on ``SOKUTATSU_FLOOR_LISTEN`` (default ``127.0.0.1:0``) and writes
``{"address": "host:port"}`` to ``SOKUTATSU_ANNOUNCE_FILE`` when it serves, as the services do.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from sokutatsu.core.server import announce

SERVICE = "sokutatsu.bench.v1.Floor"
SEND = f"/{SERVICE}/Send"
RECEIVE = f"/{SERVICE}/Receive"


def _identity(raw: bytes) -> bytes:
    return raw


async def serve() -> None:
    receivers: set[asyncio.Queue[bytes]] = set()

    async def send(bodies: AsyncIterator[bytes], context: Any) -> bytes:
        count = 0
        async for body in bodies:
            count += 1
            for queue in receivers:
                queue.put_nowait(body)
        return str(count).encode()

    async def receive(request: bytes, context: Any) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        receivers.add(queue)
        await context.send_initial_metadata(())  # tells the consumer it is registered
        try:
            while True:
                yield await queue.get()
        finally:
            receivers.discard(queue)

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Send": grpc.stream_unary_rpc_method_handler(send, _identity, _identity),
            "Receive": grpc.unary_stream_rpc_method_handler(receive, _identity, _identity),
        },
    )
    server = aio.server()
    server.add_generic_rpc_handlers((handler,))
    listen = os.environ.get("SOKUTATSU_FLOOR_LISTEN", "127.0.0.1:0")
    port = server.add_insecure_port(listen)
    await server.start()
    announce_file = os.environ.get("SOKUTATSU_ANNOUNCE_FILE")
    if announce_file:
        announce(Path(announce_file), {"address": f"{listen.rsplit(':', 1)[0]}:{port}"})
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve())

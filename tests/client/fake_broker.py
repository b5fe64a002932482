"""A real gRPC server on 127.0.0.1:0 that serves one streaming method of the Broker service with a
test's own behaviour: for the SDK's reactions to answers a real broker gives rarely or only under
faults (a refusal at a given moment, a redirect, a stream left unanswered)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc import aio

SERVICE = "sokutatsu.broker.v1.Broker"


async def serve_stream(
    method: str, behaviour: Callable[..., Any], request_type: Any, response_type: Any
) -> tuple[aio.Server, str]:
    """Start a server whose ``Broker/<method>`` (a bidirectional stream) is ``behaviour``; its address."""
    server = aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        behaviour,
        request_deserializer=request_type.FromString,
        response_serializer=response_type.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {method: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"

"""Handlers for API services whose logic a later release fills in.

Every RPC of such a service answers ``UNIMPLEMENTED`` with a message naming
the method and what will bring it, so clients and reflection see the whole
API today and nobody mistakes a missing feature for a bug.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc import aio

from sokutatsu.core.errors import Unimplemented


def _handler(method: MethodDescriptor, message: str) -> grpc.RpcMethodHandler[Any, Any]:
    async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        raise Unimplemented(message)

    async def streaming(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        raise Unimplemented(message)
        yield  # pragma: no cover - makes this an async generator

    # Requests are not parsed: the call is refused before any is read.
    if method.server_streaming:
        if method.client_streaming:
            return grpc.stream_stream_rpc_method_handler(streaming)
        return grpc.unary_stream_rpc_method_handler(streaming)
    if method.client_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


def unimplemented_service(
    service: ServiceDescriptor,
    pending: str,
    served: Mapping[str, grpc.RpcMethodHandler[Any, Any]] | None = None,
) -> grpc.GenericRpcHandler:
    """A handler for ``service``: the methods in ``served`` as given, every other one UNIMPLEMENTED.

    ``pending`` says what is missing, e.g. ``"the broker logic arrives with issue #3"``.
    """
    served = served or {}
    unknown = set(served) - {m.name for m in service.methods}
    if unknown:
        raise ValueError(f"{service.full_name} has no methods {sorted(unknown)}")
    handlers = {
        method.name: served.get(method.name)
        or _handler(method, f"{service.full_name}/{method.name} is not served by this build yet: {pending}")
        for method in service.methods
    }
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def add_unimplemented(server: aio.Server, services: list[ServiceDescriptor], pending: str) -> list[str]:
    """Register :func:`unimplemented_service` for each of ``services``; return their names."""
    server.add_generic_rpc_handlers(tuple(unimplemented_service(s, pending) for s in services))
    return [s.full_name for s in services]

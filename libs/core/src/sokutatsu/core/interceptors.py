"""Server interceptor that maps domain errors to gRPC status codes.

It is the innermost interceptor, so the OpenTelemetry interceptor around it
records the final status. A :class:`~sokutatsu.core.errors.SokutatsuError`
becomes its ``code`` with its message; any other exception is logged with its
traceback and becomes ``INTERNAL`` with a message pointing at the log, so no
stack trace ever reaches a client.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from grpc import aio

from sokutatsu.core.errors import SokutatsuError

log = logging.getLogger(__name__)

_Behavior = Callable[..., Any]


async def _abort(context: aio.ServicerContext[Any, Any], exc: Exception, method: str) -> NoReturn:
    if isinstance(exc, SokutatsuError):
        log.debug("%s -> %s: %s", method, exc.code.name, exc)
        await context.abort(exc.code, str(exc))
    log.error("unexpected error in %s", method, exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL,
        f"internal error in {method}: {type(exc).__name__}; the service log has the details",
    )


def _guard(behavior: _Behavior, method: str) -> _Behavior:
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            try:
                async for item in behavior(request, context):
                    yield item
            except aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - every error must become a status
                await _abort(context, exc, method)

        return guarded_stream

    async def guarded(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        try:
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
        except aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error must become a status
            await _abort(context, exc, method)
        return result

    return guarded


class DomainErrorInterceptor(aio.ServerInterceptor):
    """Wraps every handler so domain errors become status codes."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard(handler.unary_unary, method), **kwargs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard(handler.unary_stream, method), **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_guard(handler.stream_unary, method), **kwargs)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_guard(handler.stream_stream, method), **kwargs)
        return handler

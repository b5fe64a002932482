"""Server interceptor that maps domain errors to gRPC status codes.

It is the innermost interceptor, so the OpenTelemetry interceptor around it
records the final status. A :class:`~sokutatsu.core.errors.SokutatsuError`
becomes its ``code`` with its message; any other exception is logged with its
traceback and becomes ``INTERNAL`` with a message pointing at the log, so no
stack trace ever reaches a client. A request (or a frame of a request stream)
whose bytes do not decode as the RPC's request message is ``INVALID_ARGUMENT``
(grpcio alone would answer ``UNKNOWN``, or ``INTERNAL`` inside a stream).

Every response stream leaves these interceptors as an async generator, also one a servicer
writes in grpcio's reader/writer style (a coroutine calling ``context.write``, as grpcio's
health ``Watch`` does): OpenTelemetry's server interceptor, outside them, iterates every
response stream with ``async for``, so it failed such a handler with ``UNKNOWN`` ('async for'
requires an object with __aiter__ method, got coroutine:
open-telemetry/opentelemetry-python-contrib#3066).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from sokutatsu.core.errors import InvalidArgument, SokutatsuError
from sokutatsu.core.request_budget import Oversize, RequestBudget

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


class Undecodable:
    """What the lenient deserializer gives for bytes that are not a valid request message; the guard
    refuses it (the auth interceptor, outside the guard, lets it through to be refused)."""

    def __init__(self, kind: str, error: str) -> None:
        self.kind = kind
        self.error = error

    def refusal(self) -> InvalidArgument:
        return InvalidArgument(
            f"the request could not be decoded as a {self.kind} ({self.error}); send a serialized {self.kind}"
        )


def _lenient(
    deserializer: Callable[[bytes], Any] | None, budget: RequestBudget | None
) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)  # Message.FromString is a classmethod
    kind = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request message")

    def parse(raw: bytes) -> Any:
        if budget is not None:
            over = budget.take(kind, len(raw))
            if over is not None:
                return over  # not parsed: the guard refuses it
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return Undecodable(kind, str(exc))

    return parse


async def _decoded(requests: AsyncIterator[Any], budget: RequestBudget | None) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, (Undecodable, Oversize)):
            raise request.refusal()
        yield request
        if budget is not None:
            budget.release()  # the handler asks for the next frame: it is done with this one


def _checked(request: Any, request_stream: bool, budget: RequestBudget | None) -> Any:
    """The request, refused if it did not decode or is over the budget; a request stream refuses
    each frame that did not or is."""
    if isinstance(request, (Undecodable, Oversize)):
        raise request.refusal()
    return _decoded(request, budget) if request_stream else request


def _entered(budget: RequestBudget | None, method: str, context: aio.ServicerContext[Any, Any]) -> None:
    """Count the call against its connection (refused when that is over its share)."""
    if budget is not None:
        over = budget.enter(f"request of {method}", context.peer())
        if over is not None:
            raise over.refusal()


def _guard(behavior: _Behavior, method: str, request_stream: bool, budget: RequestBudget | None) -> _Behavior:
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            try:
                request = _checked(request, request_stream, budget)
                _entered(budget, method, context)
                async for item in behavior(request, context):
                    yield item
            except aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - every error must become a status
                await _abort(context, exc, method)
            finally:
                if budget is not None and not request_stream:
                    budget.release()

        return guarded_stream

    async def guarded(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        try:
            request = _checked(request, request_stream, budget)
            _entered(budget, method, context)
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
        except aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error must become a status
            await _abort(context, exc, method)
        finally:
            if budget is not None and not request_stream:
                budget.release()
        return result

    return guarded


class DomainErrorInterceptor(aio.ServerInterceptor):
    """Wraps every handler so domain errors become status codes, and counts the request bytes it
    holds against ``budget`` (:mod:`sokutatsu.core.request_budget`), when given."""

    def __init__(self, budget: RequestBudget | None = None) -> None:
        self.budget = budget

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return rewrap(
            handler,
            lambda behavior, request_stream: _guard(behavior, handler_call_details.method, request_stream, self.budget),
            request_deserializer=_lenient(handler.request_deserializer, self.budget),
        )


def _as_generator(behavior: _Behavior) -> _Behavior:
    """A response stream's ``behavior`` as an async generator function: one written in the
    reader/writer style (a coroutine that calls ``context.write``) is awaited by a generator that
    yields nothing itself (grpcio lets a generator handler write through its context too)."""
    if inspect.isasyncgenfunction(behavior) or not inspect.iscoroutinefunction(behavior):
        return behavior  # a generator already, or a synchronous one grpcio runs in its executor

    async def written(request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        await behavior(request, context)
        return
        yield  # pragma: no cover - makes this an async generator

    return written


def rewrap(
    handler: grpc.RpcMethodHandler[Any, Any],
    wrap: Callable[[_Behavior, bool], _Behavior],
    *,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with its behaviour replaced by ``wrap(behaviour, request_stream)``, whatever
    its kind (the server interceptors' shared step); ``request_deserializer`` replaces its own.
    A response stream's behaviour is made an async generator first (:func:`_as_generator`)."""
    kwargs = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(_as_generator(handler.unary_stream), False), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, True), **kwargs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(wrap(_as_generator(handler.stream_stream), True), **kwargs)
    return handler

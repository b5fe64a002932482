"""The client side of auth: every call of a channel carries ``authorization: Bearer <token>``.

With TLS the token is call credentials composed with the channel's (gRPC sends them only over a
secure channel); on a plaintext loopback channel an interceptor adds the same metadata.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc import aio

# The headers a call of a given method gets (none: the call is left as it is).
Headers = Callable[[str], Sequence[tuple[str, str]]]


def _with_headers(details: aio.ClientCallDetails, headers: Headers) -> aio.ClientCallDetails:
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    added = headers(method)
    if not added:
        return details
    metadata = aio.Metadata(*(details.metadata or ()))
    for key, value in added:
        metadata.add(key, value)
    return aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class _Headers:
    """What every call gets. (grpc.aio files an interceptor under its first call kind
    only, so each kind needs a class of its own.)"""

    def __init__(self, headers: Headers) -> None:
        self.headers = headers


class _UnaryUnary(_Headers, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(_with_headers(client_call_details, self.headers), request)


class _UnaryStream(_Headers, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(_with_headers(client_call_details, self.headers), request)


class _StreamUnary(_Headers, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        client_call_details: aio.ClientCallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        return await continuation(_with_headers(client_call_details, self.headers), request_iterator)


class _StreamStream(_Headers, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        client_call_details: aio.ClientCallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        return await continuation(_with_headers(client_call_details, self.headers), request_iterator)


def header_interceptors(headers: Headers) -> list[aio.ClientInterceptor]:
    """Interceptors adding ``headers(method)`` to each call of a channel, whatever its kind (the bearer
    token here; the cluster secret on control calls, :mod:`sokutatsu.core.cluster`)."""
    return [_UnaryUnary(headers), _UnaryStream(headers), _StreamUnary(headers), _StreamStream(headers)]


def bearer_interceptors(token: str) -> list[aio.ClientInterceptor]:
    """Interceptors adding the token to every call of a plaintext channel."""
    header = (("authorization", f"Bearer {token}"),)
    return header_interceptors(lambda method: header)


def bearer_credentials(channel: grpc.ChannelCredentials, token: str) -> grpc.ChannelCredentials:
    """TLS channel credentials that also send the token on every call."""
    return grpc.composite_channel_credentials(channel, grpc.access_token_call_credentials(token))

"""The client side of auth: every call of a channel carries ``authorization: Bearer <token>``.

With TLS the token is call credentials composed with the channel's (gRPC sends them only over a
secure channel); on a plaintext loopback channel an interceptor adds the same metadata.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any

import grpc
from grpc import aio


def _with_token(details: aio.ClientCallDetails, header: tuple[str, str]) -> aio.ClientCallDetails:
    metadata = aio.Metadata(*(details.metadata or ()))
    metadata.add(*header)
    return aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class _Bearer:
    """The header every call gets. (grpc.aio files an interceptor under its first call kind
    only, so each kind needs a class of its own.)"""

    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header


class _BearerUnaryUnary(_Bearer, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self.header), request)


class _BearerUnaryStream(_Bearer, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self.header), request)


class _BearerStreamUnary(_Bearer, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        client_call_details: aio.ClientCallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        return await continuation(_with_token(client_call_details, self.header), request_iterator)


class _BearerStreamStream(_Bearer, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        client_call_details: aio.ClientCallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        return await continuation(_with_token(client_call_details, self.header), request_iterator)


def bearer_interceptors(token: str) -> list[aio.ClientInterceptor]:
    """Interceptors adding the token to every call of a plaintext channel."""
    header = ("authorization", f"Bearer {token}")
    return [
        _BearerUnaryUnary(header),
        _BearerUnaryStream(header),
        _BearerStreamUnary(header),
        _BearerStreamStream(header),
    ]


def bearer_credentials(channel: grpc.ChannelCredentials, token: str) -> grpc.ChannelCredentials:
    """TLS channel credentials that also send the token on every call."""
    return grpc.composite_channel_credentials(channel, grpc.access_token_call_credentials(token))

"""A synchronous grpcio channel whose control calls carry the cluster secret (the fuzz tests use
grpcio's synchronous client; the asyncio one is ``open_channel(address, cluster=True)``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc

from sokutatsu.core.auth_rules import is_control
from sokutatsu.core.cluster import control_metadata


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _Secret(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, header: tuple[tuple[str, str], ...]) -> None:
        self.header = header

    def _details(self, details: Any) -> _Details:
        metadata = list(details.metadata or ())
        if is_control(details.method):
            metadata.extend(self.header)
        return _Details(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Iterator[Any]) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Iterator[Any]) -> Any:
        return continuation(self._details(details), requests)


def cluster_channel(address: str, secret: str | None = None) -> grpc.Channel:
    """A plaintext channel to ``address`` sending ``secret`` (default: the session's) on control calls."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _Secret(control_metadata(secret)))

"""Errors the SDK raises to applications."""

from __future__ import annotations

import grpc


class ClientError(Exception):
    """Base of the SDK's errors."""


class BrokerError(ClientError):
    """The broker refused a request for good (not retryable); ``code`` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.detail = message


class BufferFull(ClientError):
    """``publish_nowait`` would exceed ``max_pending`` unacknowledged messages; await ``flush()``."""


class PublishTimeout(ClientError):
    """A message was not acknowledged in time; the message says why (e.g. a limit refusing it)."""


class GapError(ClientError):
    """Messages of a publisher were lost between two deliveries (e.g. a broker restarted without them)."""

    def __init__(self, publisher_id: str, first_missing: int, last_missing: int) -> None:
        super().__init__(
            f"messages {first_missing}..{last_missing} of publisher {publisher_id!r} matched this subscription "
            "but never arrived"
        )
        self.publisher_id = publisher_id
        self.first_missing = first_missing
        self.last_missing = last_missing


class Closed(ClientError):
    """The publisher or subscriber is closed."""

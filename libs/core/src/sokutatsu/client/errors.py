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
    """Messages of a publisher were lost between two deliveries (e.g. a broker restarted without them).

    When the subscription's retention discarded them, the broker says so: ``reason`` is
    ``"retention bytes"`` (over its maximum bytes on disk), ``"retention age"`` (older than its
    maximum age) or ``"retention bytes and age"``, and ``over_bytes`` / ``over_age`` count the
    messages discarded for each (``dropped`` is their sum). Otherwise ``reason`` is ``""``.
    """

    def __init__(
        self, publisher_id: str, first_missing: int, last_missing: int, *, over_bytes: int = 0, over_age: int = 0
    ) -> None:
        reasons = [name for name, count in (("bytes", over_bytes), ("age", over_age)) if count]
        self.reason = f"retention {' and '.join(reasons)}" if reasons else ""
        if reasons:
            text = (
                f"messages {first_missing}..{last_missing} of publisher {publisher_id!r} were discarded by this "
                f"subscription's retention: {over_bytes} over its maximum bytes on disk, {over_age} older than "
                "its maximum age"
            )
        else:
            text = (
                f"messages {first_missing}..{last_missing} of publisher {publisher_id!r} matched this subscription "
                "but never arrived"
            )
        super().__init__(text)
        self.publisher_id = publisher_id
        self.first_missing = first_missing
        self.last_missing = last_missing
        self.over_bytes = over_bytes
        self.over_age = over_age
        self.dropped = over_bytes + over_age


class Closed(ClientError):
    """The publisher or subscriber is closed."""

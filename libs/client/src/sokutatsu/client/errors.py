"""Every error the SDK raises to applications: one tree under :class:`ClientError`.

Each error says whether trying again may succeed (``retryable``): a broker or sequencer that
refused with a retryable gRPC status (``UNAVAILABLE``, ``RESOURCE_EXHAUSTED``), no broker
answering, a full buffer or a timeout may clear by themselves; bad input, a closed client,
lost messages and bad configuration do not.
"""

from __future__ import annotations

import grpc

# The status codes a client retries (the services' error tree maps to them; sokutatsu.core.errors).
RETRYABLE_CODES: frozenset[grpc.StatusCode] = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
)


class ClientError(Exception):
    """Base of the SDK's errors. ``retryable``: whether the same call may succeed later."""

    retryable: bool = False


class ConfigError(ClientError, ValueError):
    """The client's configuration is unusable (e.g. a TLS file that cannot be read); the message names it."""


class Unreachable(ClientError):
    """No broker (or sequencer) answered: ``start()`` gave up within its ``connect_timeout``."""

    retryable = True


class BrokerError(ClientError):
    """The broker refused a request; ``code`` is its gRPC status, ``detail`` its message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.detail = message
        self.retryable = code in RETRYABLE_CODES


class SequencerError(ClientError):
    """The sequencer refused a request for a reason retrying the stream cannot fix; ``code`` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.detail = message
        self.retryable = code in RETRYABLE_CODES


class BufferFull(ClientError):
    """``publish_nowait`` would exceed ``max_pending`` unacknowledged messages; await ``flush()``."""

    retryable = True


class PublishTimeout(ClientError):
    """A message was not acknowledged in time; the message says why (e.g. a limit refusing it).

    The message stays with the publisher, which keeps sending it: waiting again may succeed.
    """

    retryable = True


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


class OrderingError(ClientError):
    """A message cannot be placed in the total order (no stamp, an unknown distribution, a stale
    epoch, too much buffered): never a silent reorder."""


class Closed(ClientError):
    """The publisher or subscriber is closed."""

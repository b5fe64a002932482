"""The error tree shared by every service.

Service code raises these; one server interceptor (``interceptors.py``) turns
them into gRPC status codes with the error's message, so a caller always gets a
code it can branch on and a sentence it can act on. Clients retry only the
codes in ``RETRYABLE``.

A message that shows a value the client sent shows it through :func:`echo`, cut to
``ECHO_LIMIT`` characters with its length: the message travels in the status's metadata, and a
whole 1 MiB name would exceed gRPC's metadata limit, turning the refusal into
``RESOURCE_EXHAUSTED: received metadata size exceeds hard limit`` (issue #20).
"""

from __future__ import annotations

import grpc

from sokutatsu.client.errors import RETRYABLE_CODES


class SokutatsuError(Exception):
    """Base of every domain error. ``code`` is the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(SokutatsuError):
    """The request is malformed or names something impossible."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SokutatsuError):
    """The request names a topic, subscription, queue or lease that does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SokutatsuError):
    """Creating something that already exists with different settings."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(SokutatsuError):
    """A configured limit is reached; the message says which."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(SokutatsuError):
    """The system is not in a state where the request can run (e.g. wrong role)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(SokutatsuError):
    """A dependency is down or the service is stopping; retry later."""

    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(SokutatsuError):
    """The caller may not do this (a frame of a stream its grants do not cover)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(SokutatsuError):
    """The RPC exists in the API but this build does not serve it yet."""

    code = grpc.StatusCode.UNIMPLEMENTED


class StartupError(Exception):
    """A service cannot start; the message is one line for the operator."""


# What clients retry is the SDK's to say (sokutatsu.client.errors); the services' errors map onto it.
RETRYABLE: frozenset[grpc.StatusCode] = RETRYABLE_CODES


# The most characters (or bytes) of a client's value a message shows.
ECHO_LIMIT = 100


def echo(value: object) -> str:
    """``value``, as a message shows what a client sent: its ``repr``; a string (bytes) over
    ``ECHO_LIMIT`` characters (bytes) as the repr of its first ``ECHO_LIMIT``, then ``…`` and its
    length: ``'xxxx…xxxx'… (1048576 characters)``."""
    if not isinstance(value, str | bytes) or len(value) <= ECHO_LIMIT:
        return repr(value)
    unit = "characters" if isinstance(value, str) else "bytes"
    return f"{value[:ECHO_LIMIT]!r}… ({len(value)} {unit})"

"""The error tree shared by every service.

Service code raises these; one server interceptor (``interceptors.py``) turns
them into gRPC status codes with the error's message, so a caller always gets a
code it can branch on and a sentence it can act on. Clients retry only the
codes in ``RETRYABLE``.
"""

from __future__ import annotations

import grpc


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


class Unimplemented(SokutatsuError):
    """The RPC exists in the API but this build does not serve it yet."""

    code = grpc.StatusCode.UNIMPLEMENTED


class StartupError(Exception):
    """A service cannot start; the message is one line for the operator."""


RETRYABLE: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

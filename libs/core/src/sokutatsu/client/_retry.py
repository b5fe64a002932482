"""Reconnect backoff shared by the publisher and the subscriber (tenacity's jittered exponential wait)."""

from __future__ import annotations

import grpc
from grpc import aio
from tenacity import RetryCallState
from tenacity.wait import wait_exponential_jitter

from sokutatsu.core.errors import RETRYABLE

# Codes after which a stream is opened again; anything else is final.
RECONNECT_CODES = RETRYABLE | {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}
# What grpc.aio reports for a write on a stream whose connection just died (the real status,
# UNAVAILABLE, is overwritten: grpc/grpc#36066). A broker's own INTERNAL errors stay final.
_BROKEN_WRITE = "Internal error from Core"


def reconnectable(error: aio.AioRpcError) -> bool:
    """Whether a stream that failed with ``error`` should be opened again."""
    code = error.code()
    return code in RECONNECT_CODES or (code == grpc.StatusCode.INTERNAL and error.details() == _BROKEN_WRITE)


class Backoff:
    """Jittered exponential delays: 50 ms doubling up to 2 s; reset after a success."""

    def __init__(self, initial: float = 0.05, maximum: float = 2.0) -> None:
        self._wait = wait_exponential_jitter(multiplier=initial, max=maximum, jitter=initial)
        self._attempt = 0

    def reset(self) -> None:
        self._attempt = 0

    def next_delay(self) -> float:
        self._attempt += 1
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = self._attempt
        return float(self._wait(state))

"""Reconnect backoff shared by the publisher and the subscriber (tenacity's jittered exponential wait)."""

from __future__ import annotations

import asyncio
from typing import Any

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


def broken_write(error: aio.AioRpcError) -> bool:
    """Whether ``error`` is grpc.aio's report of a write on a stream whose connection died."""
    return error.code() == grpc.StatusCode.INTERNAL and error.details() == _BROKEN_WRITE


def reconnectable(error: aio.AioRpcError) -> bool:
    """Whether a stream that failed with ``error`` should be opened again."""
    return error.code() in RECONNECT_CODES or broken_write(error)


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


class StreamEnded(Exception):
    """The broker ended a stream with OK (e.g. a newer stream took over); the SDK opens a new one."""


async def raise_status(call: aio.StreamStreamCall[Any, Any]) -> None:
    """Raise an ended call's status as :class:`aio.AioRpcError` (nothing when it ended OK)."""
    code = await call.code()
    if code != grpc.StatusCode.OK:
        raise aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(), await call.details())


async def write_frame(call: aio.StreamStreamCall[Any, Any], frame: object) -> None:
    """Write one frame; a call that has already ended raises its status, as a read would.

    grpc.aio raises ``asyncio.InvalidStateError`` ("RPC already finished"), not the status,
    for a write after the call ended, e.g. when the broker died between two writes.
    """
    try:
        await call.write(frame)
    except asyncio.InvalidStateError:
        await raise_status(call)
        raise StreamEnded from None

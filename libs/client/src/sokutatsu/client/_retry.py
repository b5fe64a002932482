"""Reconnecting streams: which failures to retry, and the jittered exponential backoff between attempts.

(The services retry with tenacity; the SDK keeps its dependencies to gRPC and protobuf, and the
few lines of tenacity's ``wait_exponential_jitter`` it needs are below.)
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc
from grpc import aio

from sokutatsu.client.errors import RETRYABLE_CODES

# Codes after which a stream is opened again; anything else is final.
RECONNECT_CODES = RETRYABLE_CODES | {
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
}
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
        self.initial = initial
        self.maximum = maximum
        self._attempt = 0

    def reset(self) -> None:
        self._attempt = 0

    def next_delay(self) -> float:
        """``initial * 2 ** (n - 1)`` plus up to ``initial`` of jitter for the n-th attempt, at most ``maximum``."""
        self._attempt += 1
        exponent = min(self._attempt - 1, 60)  # 2 ** 60 seconds is past any maximum
        jitter = random.uniform(0, self.initial)  # noqa: S311 - spreading reconnects, not a secret
        delay: float = self.initial * 2**exponent + jitter
        return max(0.0, min(self.maximum, delay))


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
        await write_or_cancel(call, frame)
    except asyncio.InvalidStateError:
        await raise_status(call)
        raise StreamEnded from None


async def write_or_cancel(call: aio.StreamStreamCall[Any, Any], frame: object) -> None:
    """``call.write(frame)``, with this task's cancellation raised as one.

    grpc.aio swallows a cancellation that reaches a write while it awaits the call's interceptors (a
    channel with a token): it cancels their task, raises ``InvalidStateError`` and reports the call
    "Locally cancelled by application!". Before, a Publisher closed then took that for the broker's
    answer (start() said CANCELLED, not why the broker refused: a fresh-clone CI run). A cancellation
    is told by a request that came during the write: Python 3.11's TaskGroup leaves ``cancelling()``
    raised in a task whose child failed, so its value alone does not say (a review found the links
    of a publisher with a token dying after a broken stream when it did).
    """
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    try:
        await call.write(frame)
    except asyncio.InvalidStateError:
        if task is not None and task.cancelling() > before:
            raise asyncio.CancelledError from None
        raise

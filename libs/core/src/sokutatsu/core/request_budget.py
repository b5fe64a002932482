"""How many bytes of requests a service holds decoded at once, in all and per connection.

A request (or a frame of a request stream) is counted from the moment its bytes reach the
service's deserializer until the handler is done with it: a unary call's when it returns, a
stream's frame when the handler asks for the next frame (or ends). Over the service's
``SOKUTATSU_MAX_REQUEST_BYTES_IN_FLIGHT`` the deserializer refuses the bytes without parsing them,
and over ``SOKUTATSU_MAX_REQUEST_BYTES_PER_CONNECTION`` the handler refuses the call; both are
``RESOURCE_EXHAUSTED`` naming the setting (:class:`Oversize`). One request is always let in when
nothing else is held, so a limit never refuses a lone request the frame limit let through.

What this does not bound: the bytes gRPC itself buffers for calls whose message has not arrived
whole yet, at most ``MAX_REQUEST_BYTES`` per call (docs/security.md, Memory under large requests).

The calls are told apart by their asyncio task: grpcio's asyncio server decodes a unary request
in the task that then runs its handler, and a stream's frames in the task that reads them. A
task's bytes are released when it ends, whatever happens to the call.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from sokutatsu.core.errors import ResourceExhausted

log = logging.getLogger(__name__)

TOTAL_VAR = "SOKUTATSU_MAX_REQUEST_BYTES_IN_FLIGHT"
CONNECTION_VAR = "SOKUTATSU_MAX_REQUEST_BYTES_PER_CONNECTION"


@dataclass(frozen=True)
class Oversize:
    """What the deserializer gives for a request over the budget (the bytes are not parsed)."""

    kind: str
    size: int
    held: int
    limit: int
    setting: str

    def refusal(self) -> ResourceExhausted:
        return ResourceExhausted(
            f"this service already holds {self.held} bytes of requests being handled, and this {self.kind} of "
            f"{self.size} bytes would take it over its limit of {self.limit} ({self.setting}): retry later"
        )


class RequestBudget:
    """The service's count of request bytes held, by task and by connection."""

    def __init__(self, limit: int, per_connection: int) -> None:
        self.limit = limit
        self.per_connection = per_connection
        self.held = 0
        self.peak = 0
        self.refusals = 0
        self._by_task: dict[asyncio.Task[object], int] = {}
        self._peer_of: dict[asyncio.Task[object], str] = {}
        self._by_peer: dict[str, int] = {}
        self._watched: set[asyncio.Task[object]] = set()

    def _watch(self, task: asyncio.Task[object]) -> None:
        if task not in self._watched:
            self._watched.add(task)
            task.add_done_callback(self._done)

    @staticmethod
    def _task() -> asyncio.Task[object] | None:
        try:
            return asyncio.current_task()
        except RuntimeError:  # no running loop: nothing to count against
            return None

    def take(self, kind: str, size: int) -> Oversize | None:
        """Count ``size`` bytes for the current task; an :class:`Oversize` when over a limit."""
        task = self._task()
        if task is None:
            return None
        if self.held and self.held + size > self.limit:
            return self._refused(Oversize(kind, size, self.held, self.limit, TOTAL_VAR))
        peer = self._peer_of.get(task)
        if peer is not None:
            on_peer = self._by_peer.get(peer, 0)
            if on_peer and on_peer + size > self.per_connection:
                return self._refused(Oversize(kind, size, on_peer, self.per_connection, CONNECTION_VAR))
            self._by_peer[peer] = on_peer + size
        self._watch(task)
        self._by_task[task] = self._by_task.get(task, 0) + size
        self.held += size
        self.peak = max(self.peak, self.held)
        return None

    def enter(self, kind: str, peer: str) -> Oversize | None:
        """The current task's handler starts for a client at ``peer``: count what it holds against
        that connection (a unary request was decoded before the peer was known)."""
        task = self._task()
        if task is None:
            return None
        self._watch(task)
        self._peer_of[task] = peer
        size = self._by_task.get(task, 0)
        if not size:
            return None
        on_peer = self._by_peer.get(peer, 0)
        if on_peer and on_peer + size > self.per_connection:
            self.release()
            return self._refused(Oversize(kind, size, on_peer, self.per_connection, CONNECTION_VAR))
        self._by_peer[peer] = on_peer + size
        return None

    def release(self) -> None:
        """The current task is done with what it holds (a unary call, or a stream's last frame)."""
        task = self._task()
        if task is not None:
            self._release(task)

    def _release(self, task: asyncio.Task[object]) -> None:
        size = self._by_task.pop(task, 0)
        if not size:
            return
        self.held -= size
        peer = self._peer_of.get(task)
        if peer is not None:
            left = self._by_peer.get(peer, 0) - size
            if left > 0:
                self._by_peer[peer] = left
            else:
                self._by_peer.pop(peer, None)

    def _done(self, task: asyncio.Task[object]) -> None:
        self._release(task)
        self._peer_of.pop(task, None)
        self._watched.discard(task)

    def _refused(self, oversize: Oversize) -> Oversize:
        self.refusals += 1
        if self.refusals == 1 or self.refusals % 1000 == 0:
            log.warning("request budget: %s (refusals so far: %d)", oversize.refusal(), self.refusals)
        return oversize

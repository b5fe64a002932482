"""The publisher's messages between ``publish`` and the brokers' acknowledgements.

Owns the publisher's sequence (numbers dense from 1, continuing where the brokers' say it
stopped), the encoded messages kept for sending, what is acknowledged, the callers waiting
for an acknowledgement, and the publisher's failure. The links (:mod:`._link`) read the kept
messages and report what their broker holds; :meth:`Accumulator.advance` turns those reports
into acknowledgements. Invariants:

* ``pending[pending_start:]`` are the messages not yet acknowledged, in number order;
  ``pending[:pending_start]`` acknowledged ones a connected or opening link still has to send
  (at most ``max_pending`` of them);
* ``acked`` only grows, and every waiter for a number up to it is released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sokutatsu.client.errors import Closed, PublishTimeout


@dataclass(slots=True)
class Pending:
    seq: int
    topic: str
    element: bytes  # the encoded Message, framed as a PublishBatch element
    size: int


class LinkAcks(Protocol):
    """What :meth:`Accumulator.advance` reads of a broker link."""

    @property
    def connected(self) -> bool: ...
    @property
    def single_copy(self) -> bool: ...
    @property
    def acked_through(self) -> int: ...
    @property
    def opening_from(self) -> int: ...


class Accumulator:
    def __init__(self, max_pending: int, ack_timeout: float) -> None:
        self.max_pending = max_pending
        self.ack_timeout = ack_timeout
        self.pending: list[Pending] = []
        self.pending_start = 0
        self.next_seq = 1
        self.acked = 0
        self.failure: Exception | None = None
        self.closed = False
        # The broker's message for the last refusal (named when a wait times out).
        self.last_refusal = ""
        self._waiters: dict[int, asyncio.Future[None]] = {}

    @property
    def room(self) -> int:
        return self.max_pending - (len(self.pending) - self.pending_start)

    def continue_after(self, last: int) -> None:
        """Number the next message ``last + 1``: the brokers hold this publisher's numbers up to ``last``."""
        self.next_seq = last + 1
        self.acked = last

    def append(self, topic: str, element: bytes) -> None:
        """Keep one encoded message (numbered ``next_seq``, taken by the caller) for sending."""
        self.pending.append(Pending(self.next_seq, topic, element, len(element)))
        self.next_seq += 1

    def unsent_index(self, sent_through: int) -> int | None:
        """Index in ``pending`` of the message after ``sent_through`` (may be past the end); ``None``
        when that message is no longer kept (a link fell more than ``max_pending`` behind)."""
        pending = self.pending
        first_seq = pending[0].seq if pending else self.next_seq
        index = sent_through + 1 - first_seq
        return index if index >= 0 else None

    def first_unacked(self) -> int:
        return self.pending[self.pending_start].seq

    async def wait_acked(self, seq: int) -> None:
        """Wait until message ``seq`` is acknowledged (:class:`PublishTimeout` after ``ack_timeout``)."""
        if self.failure is not None:
            raise self.failure
        if seq <= self.acked:
            return
        waiter = self._waiters.get(seq)
        if waiter is None:
            waiter = self._waiters[seq] = asyncio.get_running_loop().create_future()
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns instead of raising when the task is
            # cancelled as the acknowledgement arrives, so a task cancelled in publish() went on
            # publishing (a fuzz canary's close hung on it in CI). asyncio.timeout re-raises it.
            async with asyncio.timeout(self.ack_timeout):
                await asyncio.shield(waiter)
        except TimeoutError:
            why = f": {self.last_refusal}" if self.last_refusal else ""
            raise PublishTimeout(f"message {seq} not acknowledged within {self.ack_timeout:g}s{why}") from None

    def advance(self, links: Sequence[LinkAcks]) -> None:
        """Acknowledge what every broker holds; with a broker down or stalled, what the brokers
        that say (``single_copy``) they do not hear their peer hold.

        A broker says ``single_copy`` only while its peer is silent to it for the peer timeout,
        not merely away from this client; its copy is then all the pair has, and waiting for the
        silent one (dead, or paused with its connection still open) would stop publishing. When
        the brokers cannot hear each other but both are up, both say so and both are counted.
        """
        counted = [link for link in links if link.connected and link.single_copy] or links
        acked = min(link.acked_through for link in counted)
        if acked <= self.acked:
            return
        self.acked = acked
        pending = self.pending
        start = self.pending_start
        while start < len(pending) and pending[start].seq <= acked:
            start += 1
        # Keep what a connected or opening link has not had acknowledged yet (a broker that came
        # back is sent everything after the number it holds), but no more than max_pending: a link
        # further behind is opened again (BrokerLink.send_loop) and its broker records the hole.
        keep = min(
            [acked]
            + [link.acked_through for link in links if link.connected]
            + [link.opening_from - 1 for link in links if link.opening_from]
        )
        keep = max(keep, acked - self.max_pending)
        drop = start - (acked - keep)
        if drop > 4096 and drop * 2 > len(pending):
            del pending[:drop]
            start -= drop
        self.pending_start = start
        for seq in [s for s in self._waiters if s <= acked]:
            waiter = self._waiters.pop(seq)
            if not waiter.done():
                waiter.set_result(None)

    def fail(self, error: Exception) -> None:
        """The publisher failed for good: every wait and later publish raises ``error`` (the first one)."""
        if self.failure is None:
            self.failure = error
            self._fail_waiters(error)

    def close(self) -> None:
        self.closed = True
        self._fail_waiters(Closed("publisher closed"))

    def _fail_waiters(self, error: Exception) -> None:
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
                waiter.exception()  # retrieved here so an unawaited one does not warn
        self._waiters.clear()

"""Alternating durability for the remote-enqueue path (seed 001, 2J-07 §3.2-3.3).

An ``Enqueue`` into a forwarding queue whose rule says ``REMOTE_DURABILITY_ALTERNATE`` is made
durable on one node only, the two nodes taking turns per request (per queue, in this process):

* odd requests, **sender-durable**: committed here with the flush and answered at once; the
  receiving node stores them without waiting for its flush, and the transfer daemon keeps them
  until the receiver reports them flushed (``TransferAck.durable_id``, or ``GetRecoveryState``,
  which flushes before it answers). A receiver crash that loses them makes the daemon resend.
* even requests, **receiver-durable**: committed here without waiting for the flush, then the
  call waits until the receiving node has stored them with the flush: the transfer daemon
  deletes them from the outbox then and names their ids in a ``NOTIFY`` that :class:`Turns`
  listens for. A crash here before that loses them, and their caller had no answer.
* the receiver does not confirm within ``ALTERNATE_WAIT_MS`` (unreachable, or slow): the
  waiting request is flushed here instead (one committed update with the flush), then
  answered; and every request to that node is sender-durable until a confirmation from it
  arrives or ``DOWN_SECONDS`` pass.

So nothing acknowledged to a client is ever lost, and each message costs one flush, not two.
A request whose messages left the outbox unconfirmed (only when the node's database restarted
while it waited) is answered UNAVAILABLE: it may have arrived, and the client was not told so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import psycopg
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from sokutatsu.core.errors import Unavailable
from sokutatsu.queuedb.arrivals import Ticket
from sokutatsu.queuedb.db import Database
from sokutatsu.queuedb.enqueue import CONFIRMED_CHANNEL, FLUSH_RECEIVER, FLUSH_SENDER, Message
from sokutatsu.queuedb.group_commit import EnqueueWork, Groups
from sokutatsu.queuedb.store import transfer

log = logging.getLogger(__name__)

# How long a receiving node that did not confirm in time gets only sender-durable requests
# (unless a confirmation from it arrives sooner).
DOWN_SECONDS = 5.0


class Turns:
    """Whose turn it is to flush, and the receiver-durable requests waiting for confirmation."""

    def __init__(self, db: Database, wait_ms: int) -> None:
        self.db = db
        self.wait = wait_ms / 1000
        self._counts: dict[str, int] = {}
        self._down_until: dict[str, float] = {}  # receiving node -> monotonic time
        self._waiting: dict[int, asyncio.Future[None]] = {}  # outbox id -> confirmed
        self._listening = asyncio.Event()

    def receiver_turn(self, queue: str, node: str) -> bool:
        """Whether this request is the receiver's to flush (every second one per queue, while ``node``
        confirms in time; the first is the sender's, as in the seed)."""
        count = self._counts.get(queue, 0) + 1
        self._counts[queue] = count
        if time.monotonic() < self._down_until.get(node, 0.0) or not self._listening.is_set():
            return False
        return count % 2 == 0

    def expect(self, ids: Sequence[int]) -> list[asyncio.Future[None]]:
        """Register before the commit: a confirmation may come right after it."""
        loop = asyncio.get_running_loop()
        futures = []
        for i in ids:
            future: asyncio.Future[None] = loop.create_future()
            self._waiting[i] = future
            futures.append(future)
        return futures

    def forget(self, ids: Sequence[int]) -> None:
        for i in ids:
            future = self._waiting.pop(i, None)
            if future is not None and not future.done():
                future.cancel()

    async def confirmed(self, node: str, ids: list[int], futures: list[asyncio.Future[None]]) -> None:
        """Until the receiver has flushed ``ids``; on no confirmation in time, flush them here."""
        try:
            _, pending = await asyncio.wait(futures, timeout=self.wait)
            if not pending:
                return
            self._down_until[node] = time.monotonic() + DOWN_SECONDS
            log.warning(
                "node %s did not confirm %d messages within %.0f ms: flushing them here, and every message "
                "to it for up to %.0f s",
                node,
                len(pending),
                self.wait * 1000,
                DOWN_SECONDS,
            )
            late = [i for i, f in zip(ids, futures, strict=True) if not f.done()]
            try:
                async with self.db.transaction() as conn:  # committed with the flush, the insert's WAL too
                    flushed = await transfer.set_flush(conn, FLUSH_SENDER, late)
            except Unavailable as exc:
                # The call's messages are committed here (unflushed): kept unless this node's database
                # crashed first. Its "retry later" would invite a second copy (a review found it said so).
                log.warning("flushing %d messages for node %s failed: %s", len(late), node, exc)
                raise Unavailable(
                    f"{self.db.where} could not flush the call's messages, which are committed on this node "
                    f"but neither confirmed by node {node} nor flushed: they may or may not be stored; check "
                    "before sending it again if doing it twice matters"
                ) from None
            gone = [f for i, f in zip(ids, futures, strict=True) if i in set(late) - flushed]
            if gone:
                # Left the outbox meanwhile: confirmed (the NOTIFY is on its way), or lost with a restart
                # of this node's database before the flush. Only the NOTIFY tells which.
                _, unknown = await asyncio.wait(gone, timeout=self.wait)
                if unknown:
                    raise Unavailable(
                        f"{len(unknown)} of the messages left the outbox without a confirmation from node {node} "
                        "(this node's database restarted, or its notifications were lost): they may or may not "
                        "have arrived; enqueue again if a duplicate is harmless, or check on that node"
                    )
        finally:
            self.forget(ids)

    def _confirm(self, payload: str) -> None:
        node, _, listed = payload.partition(":")
        self._down_until.pop(node, None)
        for raw in listed.split(","):
            if raw:
                future = self._waiting.pop(int(raw), None)
                if future is not None and not future.done():
                    future.set_result(None)

    async def listen(self) -> None:
        """Follow the transfer daemon's confirmations (a background task for the service's life)."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type((psycopg.OperationalError, OSError)),
            wait=wait_exponential(multiplier=0.05, max=5),
        )
        async for attempt in retrying:
            with attempt:
                try:
                    async with await psycopg.AsyncConnection.connect(
                        self.db.dsn, autocommit=True, connect_timeout=5
                    ) as conn:
                        await transfer.listen(conn, CONFIRMED_CHANNEL)
                        self._listening.set()
                        async for note in conn.notifies():
                            self._confirm(note.payload)
                finally:
                    # Not listening: no request may wait for a confirmation it could not hear.
                    self._listening.clear()


async def enqueue_alternating(  # noqa: PLR0917 - the request, and what to call after its commit
    groups: Groups,
    turns: Turns,
    queue: str,
    node: str,
    messages: Sequence[Message],
    committed: Callable[[], None],
    ticket: Ticket | None = None,
) -> list[int]:
    """One Enqueue request into a forwarding ``queue`` (to ``node``), flushed where the turn says;
    ``committed()`` once it is committed here (it wakes the transfer daemon). Each turn commits in
    a group of its own kind (sokutatsu.queuedb.group_commit): the sender's with the flush, the
    receiver's without."""
    if not turns.receiver_turn(queue, node):
        work = EnqueueWork(queue, messages, FLUSH_SENDER, after_commit=committed)
        ids: list[int] = await groups.durable.submit(work, ticket)
        return ids
    expected: list[int] = []
    futures: list[asyncio.Future[None]] = []

    def expect(ids: list[int]) -> None:
        # Before the COMMIT is sent: the confirmation may come right after it. (Again, should the
        # group be refused and this call run alone: then with its new ids.)
        turns.forget(expected)
        expected[:] = ids
        futures[:] = turns.expect(ids)

    try:
        ids = await groups.lazy.submit(
            EnqueueWork(queue, messages, FLUSH_RECEIVER, before_commit=expect, after_commit=committed), ticket
        )
    except BaseException:
        turns.forget(expected)
        raise
    await turns.confirmed(node, ids, futures)
    return ids

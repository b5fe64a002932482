"""Group commit: concurrent ``Enqueue`` and ``Ack`` calls share one transaction and one WAL flush.

A call does not open a transaction of its own: it puts its work (a :class:`EnqueueWork` or an
:class:`AckWork`) in a :class:`GroupCommit`'s queue and waits. The committer takes what has
arrived (up to ``max_calls`` calls and ``max_messages`` messages), after waiting up to
``window`` for the calls already inside the service on their way to a group, if there are any
(:mod:`~sokutatsu.queuedb.arrivals`: a lone call never waits), and runs it as one transaction on one pooled
connection in pipeline mode (``BEGIN``, one prepared statement per queue and kind for every
call of the group, ``COMMIT``: one round trip), then answers every call of the group. While a
group commits, the next one forms; ``in_flight`` groups may commit at once, each on its own
connection.

The invariants, kept here and nowhere else:

1. **No answer before durability.** A call's future is resolved only after the ``COMMIT`` of the
   transaction that holds its writes has returned; in a durable group (``synchronous_commit`` as
   the server has it, on by default) that is after the WAL flush. A non-durable group (the
   receiver's turn of alternating durability) commits without waiting for the flush, and its
   caller waits for the receiving node's confirmation instead (:mod:`sokutatsu.queuedb.alternate`).
   The two kinds of group never mix: each :class:`GroupCommit` has one durability.
2. **A call commits whole or not at all.** Each call's writes are rows of one statement of its
   group's transaction. A caller cancelled before its group is taken is left out; cancelled after,
   its writes commit (or not) with the group and nobody is told, as for any call cancelled in
   flight. The committer runs in its own task: a caller's cancellation never cancels a transaction.
3. **A caller's bad values fail only that caller.** The service checks a request's values before
   it joins a group. Should the database still refuse a statement of a group (it answered with an
   error: nothing of the group committed), the group's calls are run again one transaction each,
   and each gets its own outcome.
4. **A failed group fails every call in it.** When the database does not answer (the connection
   broke, the server went away, no connection within the pool's timeout), every call of the group
   gets ``UNAVAILABLE``; a ``COMMIT`` sent then may or may not have committed, so its calls are
   never run again here (that could store them twice), and the status says they may or may not be
   stored (``Database.status_of_a_commit``; no connection at all: nothing was sent, "retry later").
5. **One statement per queue and kind.** The calls of a group into one queue go as one statement:
   their messages one after another (each caller's ids are a contiguous slice, in its order), or
   their lease ids in one array. A lease id two calls of a group both give is acked for the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from sokutatsu.core.errors import Unavailable
from sokutatsu.queuedb.arrivals import Arrivals, Ticket
from sokutatsu.queuedb.db import POOL_TIMEOUT_SECONDS, Database, answered
from sokutatsu.queuedb.enqueue import ENQUEUE_STATEMENT, Message, QueueNotFound, merged_params, split_ids
from sokutatsu.queuedb.store import commit_lazily
from sokutatsu.queuedb.store.queues import ACK_STATEMENT

log = logging.getLogger(__name__)


@dataclass(eq=False)
class EnqueueWork:
    """One call's messages into ``queue``; the outcome is their ids (``QueueNotFound`` if none).

    ``before_commit(ids)`` runs in the committer once the ids are known and before the ``COMMIT``
    is sent (alternation registers for the receiver's confirmation there); ``after_commit()`` once
    committed (it wakes the transfer daemon). Neither may raise."""

    queue: str
    messages: Sequence[Message]
    flush: int
    before_commit: Callable[[list[int]], None] | None = None
    after_commit: Callable[[], None] | None = None
    # None: NOTIFY the daemon in the transaction if the queue is an immediate forwarding one (for a
    # queue the service found no rule for: created since); False: the caller wakes it after the commit.
    immediate: bool | None = False

    @property
    def size(self) -> int:
        return len(self.messages)


@dataclass(eq=False)
class AckWork:
    """One call's lease ids of ``queue``; the outcome is the set of those that held and were acked
    (``QueueNotFound`` when the queue does not exist)."""

    queue: str
    leases: Sequence[uuid.UUID]
    before_commit: None = None
    after_commit: Callable[[], None] | None = None

    @property
    def size(self) -> int:
        return max(1, len(self.leases))


Work = EnqueueWork | AckWork


@dataclass(eq=False)
class _Call:
    work: Work
    future: asyncio.Future[Any]


@dataclass
class GroupStats:
    groups: int = 0
    calls: int = 0
    retried_groups: int = 0  # groups run again call by call after the database refused a statement
    largest: int = 0


class _Refused(Exception):
    """The database answered a statement of the group with an error: nothing of it committed."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _Statement:
    """The calls of a group that run as one statement, and that statement."""

    calls: list[_Call]
    query: str
    params: dict[str, object]
    outcomes: list[Any] = field(default_factory=list)


def _statements(calls: Sequence[_Call]) -> list[_Statement]:
    """One statement per (kind, queue, flush), in the order of each key's first call."""
    keyed: dict[tuple[str, str, int, bool | None], list[_Call]] = {}
    for call in calls:
        work = call.work
        if isinstance(work, EnqueueWork):
            key = ("enqueue", work.queue, work.flush, work.immediate)
        else:
            key = ("ack", work.queue, 0, None)
        keyed.setdefault(key, []).append(call)
    out = []
    for (kind, queue, flush, immediate), members in keyed.items():
        if kind == "enqueue":
            batches = [c.work.messages for c in members if isinstance(c.work, EnqueueWork)]
            out.append(_Statement(members, ENQUEUE_STATEMENT, merged_params(queue, batches, flush, immediate)))
        else:
            leases = list(
                dict.fromkeys(lease for c in members if isinstance(c.work, AckWork) for lease in c.work.leases)
            )
            out.append(_Statement(members, ACK_STATEMENT, {"queue": queue, "leases": leases}))
    return out


def _outcomes(statement: _Statement, row: tuple[Any, ...] | None) -> list[Any]:
    """Each call's outcome (a value, or an exception to raise in its caller) from its statement's row."""
    first = statement.calls[0].work
    if isinstance(first, EnqueueWork):
        sizes = [c.work.size for c in statement.calls]
        try:
            return list(split_ids(first.queue, row, sizes))
        except QueueNotFound as exc:
            return [exc] * len(sizes)
    if row is None or row[0] == 0:
        return [QueueNotFound(f"queue {first.queue!r} does not exist in this database")] * len(statement.calls)
    left: set[uuid.UUID] = set(row[1])  # each acked lease goes to the first call that gave it
    out: list[Any] = []
    for call in statement.calls:
        assert isinstance(call.work, AckWork)  # noqa: S101 - one kind per statement
        mine = left.intersection(call.work.leases)
        left -= mine
        out.append(mine)
    return out


class GroupCommit:
    """Forms groups of calls and commits each as one transaction (the module's invariants)."""

    def __init__(  # noqa: PLR0917 - the pool and the knobs
        self,
        db: Database,
        durable: bool,
        window_s: float,
        max_calls: int,
        max_messages: int,
        in_flight: int,
        arrivals: Arrivals | None = None,
    ) -> None:
        self.db = db
        self.arrivals = arrivals or Arrivals()
        self.durable = durable
        self.window = window_s
        self.max_calls = max_calls
        self.max_messages = max_messages
        self.in_flight = in_flight
        self.stats = GroupStats()
        self._waiting: deque[_Call] = deque()
        self._arrived = asyncio.Event()
        self._running = True  # until run() ends: calls made before it starts wait for it

    async def submit(self, work: Work, ticket: Ticket | None = None) -> Any:
        """Run ``work`` in the next group; its outcome once the group has committed. ``ticket``:
        the call's, from :meth:`Arrivals.ticket`, closed as it joins."""
        if ticket is not None:
            ticket.close()
        if not self._running:
            raise Unavailable("the node is not taking calls (it is starting or stopping); retry")
        call = _Call(work, asyncio.get_running_loop().create_future())
        self._waiting.append(call)
        self._arrived.set()
        return await call.future  # cancelled: the future is cancelled, and its group leaves it out

    async def run(self) -> None:
        """Form and commit groups (a background task for the service's life)."""
        slots = asyncio.Semaphore(self.in_flight)
        try:
            async with asyncio.TaskGroup() as tasks:
                while True:
                    await slots.acquire()
                    try:
                        group = await self._next_group()
                    except BaseException:
                        slots.release()
                        raise
                    task = tasks.create_task(self._commit(group))
                    task.add_done_callback(lambda _: slots.release())
        finally:
            self._running = False
            stats = self.stats
            log.info(
                "group commit (%s): %d calls in %d groups, the largest %d; %d groups run again call by call",
                "flushed" if self.durable else "unflushed",
                stats.calls,
                stats.groups,
                stats.largest,
                stats.retried_groups,
            )
            stopped = Unavailable("the node is stopping: the call was not stored; retry on a running node")
            while self._waiting:
                _settle(self._waiting.popleft(), stopped)

    async def _next_group(self) -> list[_Call]:
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            await self._more()
            group: list[_Call] = []
            messages = 0
            while self._waiting and len(group) < self.max_calls:
                call = self._waiting[0]
                if call.future.done():  # its caller was cancelled before the group: left out
                    self._waiting.popleft()
                    continue
                if group and messages + call.work.size > self.max_messages:
                    break
                self._waiting.popleft()
                group.append(call)
                messages += call.work.size
            if group:
                return group

    async def _more(self) -> None:
        """Wait up to ``window`` for the calls on their way (PostgreSQL's ``commit_siblings``, counted
        exactly): none on their way, the group goes at once (a lone caller never waits)."""
        if self.window <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window
        while len(self._waiting) < self.max_calls and self.arrivals.coming > 0:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)

    async def _commit(self, group: list[_Call]) -> None:
        self.stats.groups += 1
        self.stats.calls += len(group)
        if len(group) > self.stats.largest:
            if len(group) >= 2 * max(1, self.stats.largest):
                log.info("group commit: %d calls in one transaction (the most so far)", len(group))
            self.stats.largest = len(group)
        try:
            try:
                outcomes = await self._transaction(group)
            except _Refused as refused:
                if len(group) == 1:
                    outcomes = [refused.error]
                else:
                    # Invariant 3: nothing committed; each call alone gets its own outcome.
                    self.stats.retried_groups += 1
                    log.info("a group of %d calls was refused (%s); running them one by one", len(group), refused)
                    outcomes = [await self._alone(call) for call in group]
            except Exception as exc:  # noqa: BLE001 - invariant 4: every call of the group gets it
                outcomes = [exc] * len(group)
        except BaseException:
            stopped = Unavailable("the node stopped while the call's group committed: it may or may not be stored")
            for call in group:
                _settle(call, stopped)
            raise
        for call, outcome in zip(group, outcomes, strict=True):
            if not isinstance(outcome, BaseException) and call.work.after_commit is not None:
                call.work.after_commit()
            _settle(call, outcome)

    async def _alone(self, call: _Call) -> Any:
        try:
            return (await self._transaction([call]))[0]
        except _Refused as refused:
            return refused.error
        except Exception as exc:  # noqa: BLE001 - this call's outcome
            return exc

    async def _transaction(self, calls: list[_Call]) -> list[Any]:
        """One transaction for ``calls``: each call's outcome, in order, once committed."""
        statements = _statements(calls)
        hooks = any(c.work.before_commit is not None and not c.future.done() for c in calls)
        try:
            async with self.db.pool.connection() as conn, conn.pipeline() as pipeline:
                if not self.durable:
                    await commit_lazily(conn, prepare=False)
                cursors = []
                for statement in statements:
                    cursor = conn.cursor(binary=True)
                    await cursor.execute(statement.query, statement.params, prepare=True)
                    cursors.append(cursor)
                if hooks:
                    # The ids before the COMMIT is sent: one more round trip, for receiver-turn groups only.
                    await pipeline.sync()
                    await _read(statements, cursors)
                    _before_commit(statements)
                # COMMIT as a statement of the pipeline, whose end syncs: one round trip for the group
                # (conn.commit() syncs too, and the pipeline's end then once more).
                await conn.execute(b"COMMIT", prepare=False)
            if not hooks:
                await _read(statements, cursors)
        except PoolTimeout:
            self.db.not_answering.set()
            raise Unavailable(
                f"{self.db.where} does not answer: no connection within {POOL_TIMEOUT_SECONDS:g} s; retry later"
            ) from None
        except psycopg.Error as exc:
            if answered(exc):
                raise _Refused(self.db.status(exc)) from None
            raise self.db.status_of_a_commit(exc) from None  # invariant 4
        by_call = {id(c): o for s in statements for c, o in zip(s.calls, s.outcomes, strict=True)}
        return [by_call[id(c)] for c in calls]


async def _read(statements: list[_Statement], cursors: list[psycopg.AsyncCursor[Any]]) -> None:
    for statement, cursor in zip(statements, cursors, strict=True):
        statement.outcomes = _outcomes(statement, await cursor.fetchone())


def _before_commit(statements: list[_Statement]) -> None:
    for statement in statements:
        for call, outcome in zip(statement.calls, statement.outcomes, strict=True):
            hook = call.work.before_commit
            if hook is not None and not call.future.done() and isinstance(outcome, list):
                hook(outcome)


def _settle(call: _Call, outcome: Any) -> None:
    if call.future.done():  # cancelled by its caller
        return
    if isinstance(outcome, BaseException):
        call.future.set_exception(outcome)
    else:
        call.future.set_result(outcome)


@dataclass
class Groups:
    """The node's two committers: durable groups (flushed before their calls are answered) and the
    receiver's-turn groups of alternating durability (committed without waiting for the flush)."""

    durable: GroupCommit
    lazy: GroupCommit
    arrivals: Arrivals

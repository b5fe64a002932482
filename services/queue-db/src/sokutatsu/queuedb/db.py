"""The node's connection pool, and database failures as gRPC statuses a caller can act on.

Which status a failure gets (issue #20): only a database that does not answer is ``UNAVAILABLE``
(clients retry it); a database short of a resource is ``RESOURCE_EXHAUSTED``; an error the request's
own values caused (SQLSTATE classes 22, data exception, and 54, program limit exceeded, such as
``index row requires 10016 bytes``) is ``INVALID_ARGUMENT``, since sending it again cannot help.
A status never shows the DSN: the node is named by its name and ``host:port``
(:func:`~sokutatsu.core.dsn.redact_dsn`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from sokutatsu.core.dsn import error_line, redact_dsn
from sokutatsu.core.errors import InvalidArgument, ResourceExhausted, Unavailable, echo
from sokutatsu.queuedb.store import commit_lazily

POOL_TIMEOUT_SECONDS = 10.0
# How long the pool keeps retrying one lost connection (psycopg_pool backs off 1, 2, 4 s ...; its
# default of 5 minutes leaves a pool waiting seconds to reconnect after a database outage). After
# it gives up, the next call that needs a connection makes one at once.
RECONNECT_GIVE_UP_SECONDS = 1.0
# SQLSTATE class 53: out of memory or disk, too many connections, max_prepared_transactions reached.
INSUFFICIENT_RESOURCES = "53"
# SQLSTATE classes a request's values cause: 22 data exception, 54 program limit exceeded.
CAUSED_BY_THE_REQUEST = ("22", "54")
# SQLSTATEs of a database that does not answer (besides no SQLSTATE at all: the connection broke):
# class 08 connection exception, 57014 a statement cancelled (statement_timeout), 57P01-57P03
# shutting down or not accepting connections yet, class 58 system error (I/O).
NOT_ANSWERING = ("08", "57014", "57P01", "57P02", "57P03", "58")
# Transient: the transaction lost a race (serialization failure, deadlock: class 40) or waited for a
# lock or an object in use (55P03, 55006). Nothing of it was committed; the same call again can succeed.
TRANSIENT = ("40", "55P03", "55006")


def answered(exc: psycopg.Error) -> bool:
    """Whether the database answered ``exc`` (a statement or the commit refused: the transaction did
    not commit), rather than the connection breaking or the server going away (a COMMIT sent then
    may or may not have committed)."""
    state = exc.sqlstate or ""
    return bool(state) and not state.startswith(NOT_ANSWERING)


class Database:
    def __init__(self, dsn: str, size: int, node: str = "") -> None:
        self.dsn = dsn
        # How a status names this database: the node and host:port, never the DSN.
        self.where = f"node {node}'s database at {redact_dsn(dsn, database=False)}" if node else "the node's database"
        # Set when a call finds the database not answering: the health watch checks at once.
        self.not_answering = asyncio.Event()
        self.pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            dsn,
            min_size=size,
            max_size=size,
            open=False,
            timeout=POOL_TIMEOUT_SECONDS,
            reconnect_timeout=RECONNECT_GIVE_UP_SECONDS,
            kwargs={"connect_timeout": 5},
        )

    async def open(self) -> None:
        await self.pool.open(wait=True, timeout=POOL_TIMEOUT_SECONDS)

    async def close(self) -> None:
        await self.pool.close()

    async def answers_again(self) -> None:
        """The database answers again after an outage: drop the pooled connections that broke in it."""
        await self.pool.check()

    @contextlib.asynccontextmanager
    async def transaction(self, *, durable: bool = True) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """One transaction: committed when the block ends, rolled back when it raises.

        ``durable=False`` commits without waiting for the WAL flush (``synchronous_commit = off``):
        for writes whose loss in an OS crash is repaired by the protocol (seed 001)."""
        try:
            async with self.pool.connection() as conn:
                if not durable:
                    await commit_lazily(conn)
                yield conn
        except PoolTimeout:
            self.not_answering.set()
            raise Unavailable(
                f"{self.where} does not answer: no connection within {POOL_TIMEOUT_SECONDS:g} s; retry later"
            ) from None
        except psycopg.Error as exc:
            raise self.status(exc) from None

    def status(self, exc: psycopg.Error) -> Exception:
        """The domain error for a driver error, or ``exc`` itself when it is none of the kinds above
        (a caller may handle it: PrepareBatch's ``DuplicateObject``, FinishPrepared's ``UndefinedObject``)."""
        state = exc.sqlstate or ""
        if state.startswith(INSUFFICIENT_RESOURCES):
            # It answers, but is short of something (max_prepared_transactions for PrepareBatch,
            # memory, disk): capacity, not an outage.
            line = error_line(exc, self.dsn)
            hint = f" ({exc.diag.message_hint})" if exc.diag.message_hint else ""
            if "prepared transactions" in line:
                hint += "; each prepared batch holds one until FinishPrepared ends it (ListPrepared lists them)"
            return ResourceExhausted(f"{self.where} is short of a resource: {line}{hint}")
        if state.startswith(CAUSED_BY_THE_REQUEST):
            # PostgreSQL's own sentence names the limit; the values are the request's (echo() bounds them).
            return InvalidArgument(
                f"{self.where} refuses a value of the request: {echo(exc.diag.message_primary or str(exc))} "
                f"(SQLSTATE {state}); sending it again cannot help"
            )
        if isinstance(exc, psycopg.OperationalError) and (not state or state.startswith(NOT_ANSWERING)):
            self.not_answering.set()
            return Unavailable(f"{self.where} does not answer ({_kind(exc)}); retry later")
        if state.startswith(TRANSIENT):
            return Unavailable(
                f"{self.where} gave up the call's transaction ({_kind(exc)}): nothing of it was kept; retry"
            )
        return exc

    def status_of_a_commit(self, exc: psycopg.Error) -> Exception:
        """``status`` of a failure of a transaction whose ``COMMIT`` may have been sent: when the
        database stopped answering then, it may or may not have committed, and the message says so
        (a caller that sends the call again may store it twice)."""
        error = self.status(exc)
        if isinstance(error, Unavailable) and not answered(exc):
            return Unavailable(
                f"{self.where} does not answer ({_kind(exc)}) and its COMMIT may have been sent: the call's "
                "writes (messages enqueued, leases acked) may or may not be stored; check before sending it "
                "again if doing it twice matters"
            )
        return error


def _kind(exc: psycopg.Error) -> str:
    """What went wrong, without the driver's text (which may name the user or the database)."""
    if exc.sqlstate:
        return f"SQLSTATE {exc.sqlstate}, {type(exc).__name__}"
    return "the connection failed or broke"

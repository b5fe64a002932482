"""Queue-db process wiring: migrate the node's database, open the pool, serve the queues and
the receiving side of transfer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import NoReturn

import psycopg
from grpc import aio
from grpc_health.v1 import health_pb2

from sokutatsu.core.dsn import error_line, redact_dsn
from sokutatsu.core.errors import StartupError
from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.core.settings import SettingsError
from sokutatsu.queuedb import database
from sokutatsu.queuedb.alternate import Turns
from sokutatsu.queuedb.arrivals import Arrivals
from sokutatsu.queuedb.db import Database
from sokutatsu.queuedb.faults import CrashPoints
from sokutatsu.queuedb.group_commit import GroupCommit, Groups
from sokutatsu.queuedb.queues import QueueServicer
from sokutatsu.queuedb.receiver import TransferReceiver
from sokutatsu.queuedb.schema import current_version, latest_version, migrate
from sokutatsu.queuedb.settings import QueueDbSettings, pool_connections
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from sokutatsu.queuedb.wake import Waker

log = logging.getLogger(__name__)

SERVICES = [queuedb_pb2.DESCRIPTOR.services_by_name[n].full_name for n in ("QueueService", "Transfer")]


def _migrate(dsn: str) -> list[int]:
    """Bring a database that is behind up to this version's schema; leave a current one alone
    (the node may run as a least-privilege role that cannot change it: docs/queue-db.md)."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=database.CONNECT_TIMEOUT_SECONDS) as conn:
        if current_version(conn) == latest_version():
            return []
        return migrate(conn)


def build(settings: QueueDbSettings) -> Register:
    if not settings.dsn:
        raise SettingsError(f"{QueueDbSettings.env_prefix}DSN is not set: give this node's PostgreSQL DSN")
    if settings.visibility_timeout_ms > settings.max_visibility_timeout_ms:
        prefix = QueueDbSettings.env_prefix
        raise SettingsError(
            f"{prefix}VISIBILITY_TIMEOUT_MS={settings.visibility_timeout_ms} is over "
            f"{prefix}MAX_VISIBILITY_TIMEOUT_MS={settings.max_visibility_timeout_ms}: the default a Dequeue gets "
            "must be one a client could ask for"
        )

    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        where = redact_dsn(settings.dsn)
        try:
            version = await database.server_version(settings.dsn)
        except psycopg.Error as exc:
            raise StartupError(
                f"cannot connect to PostgreSQL at {where}: {error_line(exc, settings.dsn)} "
                f"({QueueDbSettings.env_prefix}DSN)"
            ) from None
        try:
            applied = await asyncio.to_thread(_migrate, settings.dsn)
        except psycopg.Error as exc:
            raise StartupError(
                f"cannot apply the queue-db schema migrations in {where}: {error_line(exc, settings.dsn)} "
                "(a role that may change the schema must apply them: run `sokutatsu queuedb migrate` with the "
                "schema owner's DSN, docs/queue-db.md)"
            ) from None
        log.info(
            "node %s uses PostgreSQL %s at %s; schema migrations applied now: %s",
            settings.instance,
            version,
            redact_dsn(settings.dsn),
            applied or "none",
        )
        db = Database(settings.dsn, pool_connections(settings), settings.instance)
        await db.open()
        context.stack.push_async_callback(db.close)
        arrivals = Arrivals()
        durable, lazy = (
            GroupCommit(
                db,
                flushed,
                settings.group_commit_window_us / 1e6,
                settings.group_commit_max_calls,
                settings.group_commit_max_messages,
                settings.group_commit_in_flight,
                arrivals,
            )
            for flushed in (True, False)
        )
        groups = Groups(durable, lazy, arrivals)
        context.start_background(groups.durable.run(), "group-commit")
        context.start_background(groups.lazy.run(), "group-commit-unflushed")
        turns = Turns(db, settings.alternate_wait_ms)
        context.start_background(turns.listen(), "alternate-confirmations")
        waker = Waker(db)
        context.start_background(waker.run(), "transfer-waker")
        queuedb_pb2_grpc.add_QueueServiceServicer_to_server(QueueServicer(db, settings, turns, waker, groups), server)
        queuedb_pb2_grpc.add_TransferServicer_to_server(
            TransferReceiver(db, settings.max_batch, CrashPoints(settings.crash_at)), server
        )
        changes: asyncio.Queue[bool] = asyncio.Queue()

        async def follow_database() -> None:
            while True:
                up = await changes.get()
                if up:
                    await db.answers_again()
                status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in ["", *SERVICES]:
                    await context.health.set(name, status)

        context.start_background(
            database.watch(settings.dsn, settings.db_check_seconds, changes, db.not_answering), "db-watch"
        )
        context.start_background(follow_database(), "db-health")
        return SERVICES

    return register


def main() -> NoReturn:
    run_service("queuedb", QueueDbSettings, build)

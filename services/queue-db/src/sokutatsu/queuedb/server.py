"""Queue-db process wiring."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import NoReturn

import psycopg
from grpc import aio
from grpc_health.v1 import health_pb2

from sokutatsu.core.errors import StartupError
from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.core.settings import SettingsError
from sokutatsu.core.unserved import add_unimplemented
from sokutatsu.queuedb import database
from sokutatsu.queuedb.settings import QueueDbSettings
from sokutatsu.queuedb.v1 import queuedb_pb2

log = logging.getLogger(__name__)

SERVICES = [queuedb_pb2.DESCRIPTOR.services_by_name[n] for n in ("QueueService", "Transfer")]


def build(settings: QueueDbSettings) -> Register:
    if not settings.dsn:
        raise SettingsError(f"{QueueDbSettings.env_prefix}DSN is not set: give this node's PostgreSQL DSN")

    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        try:
            version = await database.server_version(settings.dsn)
        except psycopg.Error as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StartupError(
                f"cannot connect to PostgreSQL at {database.redact(settings.dsn)}: {reason} "
                f"({QueueDbSettings.env_prefix}DSN)"
            ) from None
        log.info("node %s uses PostgreSQL %s at %s", settings.instance, version, database.redact(settings.dsn))
        names = add_unimplemented(server, SERVICES, "queues and transfer arrive with issue #7")
        changes: asyncio.Queue[bool] = asyncio.Queue()

        async def follow_database() -> None:
            while True:
                up = await changes.get()
                status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in ["", *names]:
                    await context.health.set(name, status)

        context.start_background(database.watch(settings.dsn, settings.db_check_seconds, changes), "db-watch")
        context.start_background(follow_database(), "db-health")
        return names

    return register


def main() -> NoReturn:
    run_service("queuedb", QueueDbSettings, build)

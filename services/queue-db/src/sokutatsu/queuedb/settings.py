"""Queue-db settings (environment variables ``SOKUTATSU_QUEUEDB_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sokutatsu.core.runtime_settings import ServiceSettings
from sokutatsu.core.settings import parse_address, parse_name, parse_positive_float, setting


@dataclass(frozen=True)
class QueueDbSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_QUEUEDB_"

    listen: str = setting(
        "LISTEN", "127.0.0.1:7401", "host:port to serve gRPC on (port 0 = any free port).", parse_address
    )
    instance: str = setting("INSTANCE", "node1", "Node name; transfer peers know each other by it.", parse_name)
    dsn: str = setting(
        "DSN", "", "PostgreSQL connection string of this node's database (required), e.g. postgresql://u@host/db."
    )
    db_check_seconds: float = setting(
        "DB_CHECK_SECONDS",
        5.0,
        "How often the database is checked; while it does not answer, health reports NOT_SERVING.",
        parse_positive_float,
    )

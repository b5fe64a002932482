"""Queue-db settings (environment variables ``SOKUTATSU_QUEUEDB_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sokutatsu.core.runtime_settings import ServiceSettings
from sokutatsu.core.settings import SettingsError, parse_address, parse_name, parse_positive_float, setting, whole
from sokutatsu.queuedb.enqueue import MAX_BODY_BYTES


def parse_crash_at(raw: str) -> str:
    """``step@n`` (die at the n-th time the process reaches ``step``), or empty."""
    if raw:
        step, _, n = raw.partition("@")
        if not step or not n.isdigit() or int(n) < 1:
            raise SettingsError("expected step@n with n >= 1, e.g. sender:assigned@3")
    return raw


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
    pool_size: int = setting(
        "POOL_SIZE", 8, "Database connections the node keeps open for its RPCs.", whole(1, 1000, "connections")
    )
    visibility_timeout_ms: int = setting(
        "VISIBILITY_TIMEOUT_MS",
        30_000,
        "How long a dequeued message stays invisible to other consumers unless the request says otherwise; "
        "not acked by then, it is delivered again.",
        whole(1, 12 * 3_600_000, "milliseconds"),
    )
    max_body_bytes: int = setting(
        "MAX_BODY_BYTES",
        1_048_576,
        f"Largest message body the API accepts (INVALID_ARGUMENT above); at most {MAX_BODY_BYTES}.",
        whole(1, MAX_BODY_BYTES, "bytes"),
    )
    max_batch: int = setting(
        "MAX_BATCH",
        10_000,
        "Most messages one Enqueue, Dequeue or transfer batch may carry.",
        whole(1, 1_000_000, "messages"),
    )
    alternate_wait_ms: int = setting(
        "ALTERNATE_WAIT_MS",
        1_000,
        "Queues with alternating durability: how long an Enqueue whose turn is the receiver's waits for the "
        "receiving node to confirm it flushed the messages; then this node flushes them itself and answers, "
        "and flushes every request to that node itself for a while.",
        whole(1, 600_000, "milliseconds"),
    )
    crash_at: str = setting(
        "CRASH_AT",
        "",
        "Fault injection for tests: kill this process with SIGKILL the n-th time it reaches a step, as step@n "
        "(receiver steps: receiver:stored, receiver:committed). Empty in production.",
        parse_crash_at,
    )

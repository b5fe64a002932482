"""Settings every Sokutatsu process reads, whatever its service."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sokutatsu.core.settings import (
    Settings,
    parse_address,
    parse_log_level,
    parse_name,
    parse_optional_path,
    parse_positive_float,
    setting,
)


@dataclass(frozen=True)
class RuntimeSettings(Settings):
    """Logging, tracing and lifecycle settings shared by every service."""

    env_prefix: ClassVar[str] = "SOKUTATSU_"
    # Service-specific variables share this prefix, so unknown names are
    # checked by each service's own settings class instead.
    check_unknown: ClassVar[bool] = False

    log_level: str = setting("LOG_LEVEL", "INFO", "Log level: DEBUG, INFO, WARNING or ERROR.", parse_log_level)
    trace_dir: Path | None = setting(
        "TRACE_DIR",
        None,
        "Folder for OTLP/JSON-lines trace files (one file per process); unset = no trace files.",
        parse_optional_path,
    )
    grace_seconds: float = setting(
        "GRACE_SECONDS",
        5.0,
        "On SIGTERM/SIGINT, how long in-flight RPCs may take to finish before they are cancelled.",
        parse_positive_float,
    )
    announce_file: Path | None = setting(
        "ANNOUNCE_FILE",
        None,
        "When set, a service writes {service, instance, address, pid} as JSON here once it serves "
        "(lets a launcher use port 0).",
        parse_optional_path,
    )


@dataclass(frozen=True)
class ServiceSettings(Settings):
    """Fields every service has; each service subclasses it with its own prefix."""

    listen: str = setting(
        "LISTEN", "127.0.0.1:0", "host:port to serve gRPC on (port 0 = any free port).", parse_address
    )
    instance: str = setting(
        "INSTANCE", "default", "Name of this instance in logs, traces and the launcher's table.", parse_name
    )

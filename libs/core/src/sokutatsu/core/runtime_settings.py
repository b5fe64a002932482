"""Settings every Sokutatsu process reads, whatever its service."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sokutatsu.core.settings import (
    Settings,
    SettingsError,
    parse_address,
    parse_bool,
    parse_int,
    parse_log_level,
    parse_name,
    parse_optional_path,
    parse_positive_float,
    parse_size,
    setting,
)

# SOKUTATSU_MAX_FRAME_BYTES: its default and bounds. The floor keeps every frame the suite makes
# itself (1 MiB delivery and SDK batches, a 1 MiB body, a stats reply) well within it; the ceiling
# stays under gRPC's own maximum (2 GiB - 1).
DEFAULT_MAX_FRAME_BYTES = 16 * 2**20
MIN_MAX_FRAME_BYTES = 4 * 2**20
MAX_MAX_FRAME_BYTES = 1 * 2**30


# SOKUTATSU_<SERVICE>_MAX_REQUEST_BYTES: the largest request a service takes. Services whose requests
# are small (the monitor's and the sequencers' are names, ids and counts) take at most SMALL_REQUESTS.
SMALL_REQUESTS = 2 * 2**20
MIN_MAX_REQUEST_BYTES = 64 * 2**10


def parse_request_bytes(raw: str) -> int:
    value = parse_size(raw)
    if not MIN_MAX_REQUEST_BYTES <= value <= MAX_MAX_FRAME_BYTES:
        raise SettingsError("expected 64KiB to 1GiB")
    return value


def request_setting(default: int) -> int:
    """A service's ``MAX_REQUEST_BYTES`` setting (docs/security.md, Memory under large requests)."""
    small = " This service's requests are small, so HTTP/2 BDP probing is off too." if default <= SMALL_REQUESTS else ""
    value: int = setting(
        "MAX_REQUEST_BYTES",
        default,
        "Largest request message (or frame of a request stream) this service accepts, 64KiB to 1GiB; never more than "
        "SOKUTATSU_MAX_FRAME_BYTES. gRPC refuses a larger one with RESOURCE_EXHAUSTED from its length prefix, "
        "before reading it." + small,
        parse_request_bytes,
    )
    return value


def parse_frame_bytes(raw: str) -> int:
    value = parse_size(raw)
    if not MIN_MAX_FRAME_BYTES <= value <= MAX_MAX_FRAME_BYTES:
        raise SettingsError("expected 4MiB to 1GiB")
    return value


# The registry of the SOKUTATSU_* namespace. Core cannot import the services,
# so it lists what they own; tests/cli checks it against every settings class.
#
# Prefixes owned by one settings class each (the services', PostgreSQL's, TLS's and auth's):
# that class refuses unknown names under its prefix.
SERVICE_PREFIXES: tuple[str, ...] = (
    "SOKUTATSU_BROKER_",
    "SOKUTATSU_MONITOR_",
    "SOKUTATSU_SEQUENCER_",
    "SOKUTATSU_QUEUEDB_",
    "SOKUTATSU_TRANSFER_",
    "SOKUTATSU_PG_",
    "SOKUTATSU_TLS_",
    "SOKUTATSU_AUTH_",
    "SOKUTATSU_CLUSTER_",
)
# Names directly under SOKUTATSU_ read by a class other than RuntimeSettings (the launcher's).
LAUNCHER_NAMES: frozenset[str] = frozenset({"SOKUTATSU_STATE_DIR"})


@dataclass(frozen=True)
class RuntimeSettings(Settings):
    """Logging, tracing and lifecycle settings shared by every service.

    Every process loads this class, so it is the one that refuses a
    ``SOKUTATSU_*`` variable nobody reads (e.g. ``SOKUTATSU_GRACE_SECOND``);
    names under a service prefix are left to that service's class.
    """

    env_prefix: ClassVar[str] = "SOKUTATSU_"
    check_unknown: ClassVar[bool] = True
    names_elsewhere: ClassVar[frozenset[str]] = LAUNCHER_NAMES
    prefixes_elsewhere: ClassVar[tuple[str, ...]] = SERVICE_PREFIXES

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
    parent_pid: int = setting(
        "PARENT_PID", 0, "When set (by the launcher), the service stops when this process is gone.", parse_int
    )
    allow_plaintext: bool = setting(
        "ALLOW_PLAINTEXT",
        False,
        "Let a service without TLS (SOKUTATSU_TLS_CERT) listen on a non-loopback address, e.g. inside a "
        "private container network; without it such a service refuses to start (docs/security.md).",
        parse_bool,
    )
    max_frame_bytes: int = setting(
        "MAX_FRAME_BYTES",
        DEFAULT_MAX_FRAME_BYTES,
        "Largest gRPC message (frame) a service accepts or sends, from 4MiB to 1GiB, e.g. 16MiB. gRPC itself "
        "refuses a larger one before the service sees it: the call ends with RESOURCE_EXHAUSTED "
        "(docs/security.md, Limits per connection).",
        parse_frame_bytes,
    )
    max_request_bytes_in_flight: int = setting(
        "MAX_REQUEST_BYTES_IN_FLIGHT",
        256 * 2**20,
        "Most bytes of requests a service holds decoded at once, from a request's arrival until its handler is "
        "done with it (a stream's frame: until the next is asked for), e.g. 256MiB. Over it a request is refused "
        "with RESOURCE_EXHAUSTED before it is parsed; a lone request is always let in (docs/security.md, Memory "
        "under large requests).",
        parse_size,
    )
    max_request_bytes_per_connection: int = setting(
        "MAX_REQUEST_BYTES_PER_CONNECTION",
        64 * 2**20,
        "The same, for the calls of one client connection (its peer host:port), e.g. 64MiB: one connection cannot "
        "take the whole of MAX_REQUEST_BYTES_IN_FLIGHT.",
        parse_size,
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
    max_request_bytes: int = request_setting(DEFAULT_MAX_FRAME_BYTES)

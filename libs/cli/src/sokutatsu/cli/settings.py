"""Launcher settings and the list of every settings class of the suite."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.core.auth import AuthSettings
from sokutatsu.core.cluster import ClusterSettings
from sokutatsu.core.embedded_pg import PostgresSettings
from sokutatsu.core.runtime_settings import RuntimeSettings
from sokutatsu.core.settings import Settings, setting
from sokutatsu.core.tls import TlsSettings
from sokutatsu.monitor.settings import MonitorSettings
from sokutatsu.queuedb.settings import QueueDbSettings, TransferSettings
from sokutatsu.sequencer.settings import SequencerSettings


@dataclass(frozen=True)
class LauncherSettings(Settings):
    env_prefix: ClassVar[str] = "SOKUTATSU_"
    # RuntimeSettings refuses unknown SOKUTATSU_* names for every process; it knows
    # this class's names through LAUNCHER_NAMES (tests/cli/test_config.py keeps them in step).
    check_unknown: ClassVar[bool] = False

    state_dir: Path = setting(
        "STATE_DIR", Path(".sokutatsu"), "Folder for the launcher's logs, run files and embedded PostgreSQL.", Path
    )


# In the order the configuration reference lists them.
ALL_SETTINGS: list[tuple[str, type[Settings]]] = [
    ("Every process", RuntimeSettings),
    ("TLS (every service and client, docs/security.md)", TlsSettings),
    ("Authentication and authorisation (every service and client, docs/security.md)", AuthSettings),
    ("The cluster secret (every service; docs/security.md)", ClusterSettings),
    ("Launcher (sokutatsu up)", LauncherSettings),
    ("PostgreSQL (launcher and tests)", PostgresSettings),
    ("Broker", BrokerSettings),
    ("Monitor", MonitorSettings),
    ("Sequencer", SequencerSettings),
    ("Queue-db", QueueDbSettings),
    ("Queue-db transfer daemon", TransferSettings),
]

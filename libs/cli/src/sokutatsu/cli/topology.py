"""The suite's processes as the launcher runs them (the same topology as docker-compose.yml)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServiceProcess:
    """One service process: ``python -m <module>`` with its own environment."""

    name: str
    module: str
    # Variable prefix of the service's settings, e.g. SOKUTATSU_BROKER_.
    prefix: str
    fixed_port: int
    role: str
    env: dict[str, str] = field(default_factory=dict)
    # Database the process needs on the suite's PostgreSQL, if any.
    database: str | None = None


def suite() -> list[ServiceProcess]:
    """Every process of the suite, in start order (stopped in reverse)."""
    return [
        ServiceProcess("seq-a", "sokutatsu.sequencer", "SOKUTATSU_SEQUENCER_", 7101, "sequencer, domain a"),
        ServiceProcess("seq-b", "sokutatsu.sequencer", "SOKUTATSU_SEQUENCER_", 7102, "sequencer, domain b"),
        ServiceProcess("broker-a", "sokutatsu.broker", "SOKUTATSU_BROKER_", 7201, "broker (active)"),
        ServiceProcess("broker-b", "sokutatsu.broker", "SOKUTATSU_BROKER_", 7202, "broker (standby)"),
        ServiceProcess("monitor", "sokutatsu.monitor", "SOKUTATSU_MONITOR_", 7301, "monitor"),
        ServiceProcess(
            "queuedb-1",
            "sokutatsu.queuedb",
            "SOKUTATSU_QUEUEDB_",
            7401,
            "queue-db node 1",
            database="sokutatsu_node1",
        ),
        ServiceProcess(
            "queuedb-2",
            "sokutatsu.queuedb",
            "SOKUTATSU_QUEUEDB_",
            7402,
            "queue-db node 2",
            database="sokutatsu_node2",
        ),
    ]

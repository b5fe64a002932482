"""The suite's processes as the launcher runs them (the same topology as docker-compose.yml).

The two sequencers form one total-order group on the broker pair (docs/sequencer.md): seq-a
(domain a) is the leader, each names the other as its peer, both publish on the brokers, and
they start after the brokers, the leader last (its peer answers its first install at once).
seq-b names the leader, which starts after it: seq-a's port is chosen before anything starts
(``pinned``), also with ``--ports auto``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.embedded_pg import free_port
from sokutatsu.monitor.v1 import monitor_pb2
from sokutatsu.queuedb.v1 import queuedb_pb2
from sokutatsu.sequencer.v1 import sequencer_pb2


@dataclass(frozen=True)
class SuiteProcess:
    """How the suite runs one of its processes: ``python -m <module>`` with its own environment
    (a description; :class:`sokutatsu.cli.launcher.Suite` starts it)."""

    name: str
    module: str
    # Variable prefix of the service's settings, e.g. SOKUTATSU_BROKER_.
    prefix: str
    fixed_port: int
    role: str
    # Full names of the gRPC services it serves; each must report SERVING on health.
    services: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # Database the process needs on the suite's PostgreSQL, if any.
    database: str | None = None
    # Whether it keeps files: it gets <prefix>STATE_DIR=<state dir>/<name>, a folder of its own.
    keeps_state: bool = False
    # Variables naming other processes' addresses: "{broker-a}" becomes broker-a's host:port
    # (those processes start earlier), so the suite also runs on ports chosen at start.
    links: dict[str, str] = field(default_factory=dict)
    # As ``links``, but naming a process that may start later: it must be ``pinned``.
    peer_links: dict[str, str] = field(default_factory=dict)
    # Its port is chosen before any process starts (``fixed_port``, also with --ports auto), so
    # a process that starts earlier can name it in ``peer_links``.
    pinned: bool = False

    def linked_env(self, addresses: dict[str, str]) -> dict[str, str]:
        env = {}
        for name, template in {**self.links, **self.peer_links}.items():
            value = template
            for other, address in addresses.items():
                value = value.replace("{" + other + "}", address)
            if "{" in value:
                raise ValueError(f"{self.name}: {name}={template} names a process that is not running")
            env[name] = value
        return env


# The former name (not the harness's ServiceProcess, which runs a process), for who still imports it.
ServiceProcess = SuiteProcess


def _served(proto_module: Any) -> tuple[str, ...]:
    """Every service declared in a generated ``*_pb2`` module."""
    return tuple(s.full_name for s in proto_module.DESCRIPTOR.services_by_name.values())


def suite(*, auto_ports: bool = False) -> list[SuiteProcess]:
    """Every process of the suite, in start order (stopped in reverse).

    ``auto_ports``: the pinned processes get a free port now (the others get one at their start)."""
    sequencer = _served(sequencer_pb2)
    broker = _served(broker_pb2)
    queuedb = _served(queuedb_pb2)
    pair = {"SOKUTATSU_SEQUENCER_BROKERS": "{broker-a},{broker-b}"}
    processes = [
        SuiteProcess(
            "broker-a",
            "sokutatsu.broker",
            "SOKUTATSU_BROKER_",
            7201,
            "broker (active)",
            broker,
            # The monitor decides failovers: an active acknowledges alone only under its lease.
            env={"SOKUTATSU_BROKER_ROLE": "active", "SOKUTATSU_BROKER_MONITORED": "true"},
            keeps_state=True,
        ),
        SuiteProcess(
            "broker-b",
            "sokutatsu.broker",
            "SOKUTATSU_BROKER_",
            7202,
            "broker (standby)",
            broker,
            env={"SOKUTATSU_BROKER_ROLE": "standby", "SOKUTATSU_BROKER_MONITORED": "true"},
            keeps_state=True,
            # broker-a learns broker-b's address from broker-b's first watermark frame.
            links={"SOKUTATSU_BROKER_PEER": "{broker-a}"},
        ),
        SuiteProcess(
            "monitor",
            "sokutatsu.monitor",
            "SOKUTATSU_MONITOR_",
            7301,
            "monitor",
            _served(monitor_pb2),
            links={"SOKUTATSU_MONITOR_BROKERS": "broker-a={broker-a},broker-b={broker-b}"},
        ),
        SuiteProcess(
            "queuedb-1",
            "sokutatsu.queuedb",
            "SOKUTATSU_QUEUEDB_",
            7401,
            "queue-db node 1",
            queuedb,
            database="sokutatsu_node1",
            # The nodes its queues may forward to (TransferRule.to_node), as transfer-1 sends to them.
            env={"SOKUTATSU_QUEUEDB_PEERS": "queuedb-2"},
        ),
        SuiteProcess(
            "queuedb-2",
            "sokutatsu.queuedb",
            "SOKUTATSU_QUEUEDB_",
            7402,
            "queue-db node 2",
            queuedb,
            database="sokutatsu_node2",
        ),
        SuiteProcess(
            "transfer-1",
            "sokutatsu.queuedb.transferd",
            "SOKUTATSU_TRANSFER_",
            7411,
            "transfer daemon, queue-db node 1 -> node 2",
            database="sokutatsu_node1",
            # Queues on node 1 forward to node 2 with TransferRule.to_node = "queuedb-2".
            env={"SOKUTATSU_TRANSFER_NODE": "queuedb-1"},
            links={"SOKUTATSU_TRANSFER_PEERS": "queuedb-2={queuedb-2}"},
        ),
        SuiteProcess(
            "seq-b",
            "sokutatsu.sequencer",
            "SOKUTATSU_SEQUENCER_",
            7102,
            "sequencer, domain b",
            sequencer,
            env={"SOKUTATSU_SEQUENCER_DOMAIN": "b"},
            keeps_state=True,
            links=pair,
            peer_links={"SOKUTATSU_SEQUENCER_PEERS": "a={seq-a}"},
        ),
        SuiteProcess(
            "seq-a",
            "sokutatsu.sequencer",
            "SOKUTATSU_SEQUENCER_",
            7101,
            "sequencer, domain a (leader)",
            sequencer,
            env={
                "SOKUTATSU_SEQUENCER_DOMAIN": "a",
                "SOKUTATSU_SEQUENCER_LEADER": "true",
                # Subscribers attached before the first publish receive everything.
                "SOKUTATSU_SEQUENCER_FIRST_DISTRIBUTION": "on-demand",
            },
            keeps_state=True,
            links={**pair, "SOKUTATSU_SEQUENCER_PEERS": "b={seq-b}"},
            pinned=True,
        ),
    ]
    if auto_ports:
        processes = [replace(p, fixed_port=free_port()) if p.pinned else p for p in processes]
    return processes

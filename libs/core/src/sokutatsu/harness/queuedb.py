"""Queue-db processes: a node's service and its transfer daemon, on databases the caller made
(and migrated): the harness starts processes, it creates no database."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import psycopg

from sokutatsu.core.embedded_pg import free_port
from sokutatsu.harness.process import ServiceProcess, settings

SERVICE, DAEMON = "sokutatsu.queuedb", "sokutatsu.queuedb.transferd"
PREFIXES = {SERVICE: "SOKUTATSU_QUEUEDB_", DAEMON: "SOKUTATSU_TRANSFER_"}


class Node(ServiceProcess):
    """A queue-db service or transfer daemon: started, killed and started again, each start with
    its own log; ``start(crash_at=...)`` arms its fault injection (``CRASH_AT``) for that start."""

    def __init__(self, module: str, env: Mapping[str, str], folder: Path, *, name: str = "") -> None:
        super().__init__(module, folder, {"SOKUTATSU_GRACE_SECONDS": "1", **env}, name)

    @property
    def prefix(self) -> str:
        return PREFIXES[self.module]

    def start(self, crash_at: str = "", **env: str) -> str:
        return super().start(**{f"{self.prefix}CRASH_AT": crash_at, **env})


class QueueDbNode(Node):
    """A queue-db service on a database of its own (``dsn``), on ``listen`` (a free port by default)."""

    def __init__(
        self,
        folder: Path,
        dsn: str,
        env: Mapping[str, str] | None = None,
        *,
        listen: str = "127.0.0.1:0",
        name: str = "",
    ) -> None:
        base = settings(PREFIXES[SERVICE], listen=listen, dsn=dsn)
        super().__init__(SERVICE, {**base, **(env or {})}, folder, name=name)
        self.dsn = dsn

    def queues(self) -> list[str]:
        """The queues its database holds, by name."""
        with psycopg.connect(self.dsn) as conn:
            return [r[0] for r in conn.execute("SELECT name FROM sokutatsu.queues ORDER BY name").fetchall()]


def transfer_daemon(
    folder: Path, dsn: str, node: str, peers: str, env: Mapping[str, str] | None = None, *, name: str = ""
) -> Node:
    """Node ``node``'s transfer daemon on ``dsn`` sending to ``peers`` (``node2=host:port``), on a free port."""
    base = settings(PREFIXES[DAEMON], listen="127.0.0.1:0", node=node, dsn=dsn, peers=peers)
    return Node(DAEMON, {**base, **(env or {})}, folder, name=name)


def transfer_nodes(
    sender_dsn: str, receiver_dsn: str, folder: Path, *, both: Mapping[str, str] | None = None, **daemon_env: str
) -> tuple[QueueDbNode, Node]:
    """(node2's queue-db service on ``receiver_dsn``, node1's transfer daemon on ``sender_dsn``
    sending to it), not started. The receiver's port is chosen now, so a receiver killed comes
    back where the daemon looks for it. ``both``: settings of both processes (e.g. auth);
    ``daemon_env``: more ``SOKUTATSU_TRANSFER_*`` variables."""
    receiver_address = f"127.0.0.1:{free_port()}"
    receiver = QueueDbNode(
        folder, receiver_dsn, {"SOKUTATSU_QUEUEDB_INSTANCE": "node2", **(both or {})}, listen=receiver_address
    )
    daemon = transfer_daemon(
        folder,
        sender_dsn,
        "node1",
        f"node2={receiver_address}",
        {"SOKUTATSU_TRANSFER_POLL_MS": "50", **(both or {}), **daemon_env},
    )
    return receiver, daemon

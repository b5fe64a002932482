"""The suite as ``sokutatsu demo`` runs it: the launcher's processes, wired for the scenario.

The same processes as ``sokutatsu up`` (:func:`sokutatsu.cli.topology.suite`), with what the
scenario adds to their settings:

* the two sequencers (one total-order group on the broker pair, as the launcher wires them)
  order the topic "orders" and start after the rest: the demo's members subscribe before the
  first distribution is published (docs/sequencer.md);
* the monitor moves a subscriber back a few seconds after it recovered instead of the
  production defaults' 5 s dwell and 10 s between moves, so the demo shows both moves;
* queue-db uses databases of its own (``sokutatsu_demo_node1``/``2``, made afresh each run);
* the transfer daemon kills itself (SIGKILL) at one step of the transfer protocol
  (``SOKUTATSU_TRANSFER_CRASH_AT``, docs/queue-db.md), and :meth:`DemoSuite.restart` starts
  it again without that setting.

With ``--ports auto`` every process gets a free port chosen before the start.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psycopg
from psycopg import sql

from sokutatsu.cli.launcher import Running, Suite
from sokutatsu.cli.topology import SuiteProcess, suite
from sokutatsu.core.dsn import database_dsn
from sokutatsu.core.embedded_pg import free_port

ORDER_TOPIC = "orders"
NODE_DATABASES = {"sokutatsu_node1": "sokutatsu_demo_node1", "sokutatsu_node2": "sokutatsu_demo_node2"}
# The n-th confirmation the daemon receives kills it: after node 2 committed a batch, before
# node 1 marked it sent (the case recovery settles without sending it again).
TRANSFER_CRASH = "sender:acked@3"
MONITOR_SETTINGS = {
    "SOKUTATSU_MONITOR_MIGRATE_BACK_SECONDS": "2",
    "SOKUTATSU_MONITOR_MIN_MOVE_SECONDS": "3",
    # Above the SDK's in-flight window (1000), below the slow subscriber's budget.
    "SOKUTATSU_MONITOR_SLOW_THRESHOLD_MIN": "1200",
}
SEQUENCER_SETTINGS = {
    "SOKUTATSU_SEQUENCER_TOPIC": ORDER_TOPIC,
    "SOKUTATSU_SEQUENCER_DISTRIBUTION_INTERVAL_MS": "1000",
    "SOKUTATSU_SEQUENCER_FILL_AFTER_MS": "1000",
}
# State a previous run left, removed at the start (the PostgreSQL cluster stays).
_RUN_FOLDERS = ("seq-a", "seq-b", "broker-a", "broker-b", "run", "logs", "clients")


@dataclass(frozen=True)
class DemoTopology:
    """The demo's processes: ``first`` (brokers, monitor, queue-db), then ``ordering`` (sequencers)."""

    first: list[SuiteProcess]
    ordering: list[SuiteProcess]

    @property
    def transfer(self) -> SuiteProcess:
        return next(s for s in self.first if s.module == "sokutatsu.queuedb.transferd")


def demo_topology(auto_ports: bool) -> DemoTopology:
    specs = {s.name: s for s in suite()}
    if auto_ports:
        specs = {name: replace(s, fixed_port=free_port()) for name, s in specs.items()}

    def sequencer(name: str) -> SuiteProcess:
        spec = specs[name]
        return replace(spec, env={**spec.env, **SEQUENCER_SETTINGS})

    def node(spec: SuiteProcess) -> SuiteProcess:
        return replace(spec, database=NODE_DATABASES.get(spec.database or "", spec.database))

    first = [
        specs["broker-a"],
        specs["broker-b"],
        replace(specs["monitor"], env={**specs["monitor"].env, **MONITOR_SETTINGS}),
        node(specs["queuedb-1"]),
        node(specs["queuedb-2"]),
    ]
    transfer = node(specs["transfer-1"])
    first.append(replace(transfer, env={**transfer.env, "SOKUTATSU_TRANSFER_CRASH_AT": TRANSFER_CRASH}))
    # The leader last: its peer answers at once when it installs the first distribution.
    ordering = [sequencer("seq-b"), sequencer("seq-a")]
    known = {s.name for s in first + ordering}
    missing = set(specs) - known
    if missing:  # a process added to the topology must be placed here too
        raise RuntimeError(f"the demo does not know where to start {', '.join(sorted(missing))}")
    return DemoTopology(first, ordering)


def clear_previous_run(state_dir: Path) -> None:
    """Remove what a previous demo left in its state folder (never the PostgreSQL cluster)."""
    for name in _RUN_FOLDERS:
        shutil.rmtree(state_dir / name, ignore_errors=True)


def reset_databases(pg_dsn: str) -> None:
    """Drop the demo's queue-db databases (the launcher creates them again, empty)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in NODE_DATABASES.values():
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@dataclass
class DemoSuite:
    """The launcher's :class:`Suite` plus what the scenario asks of it."""

    suite: Suite
    topology: DemoTopology

    def address(self, name: str) -> str:
        return next(r.address for r in self.suite.running if r.spec.name == name)

    def running(self, name: str) -> Running:
        return next(r for r in self.suite.running if r.spec.name == name)

    @property
    def brokers(self) -> list[str]:
        return [self.address("broker-a"), self.address("broker-b")]

    def node_dsn(self, n: int) -> str:
        return database_dsn(self.suite.pg_dsn, NODE_DATABASES[f"sokutatsu_node{n}"])

    async def start(self, specs: list[SuiteProcess], stop: asyncio.Event, progress: Callable[[Running], None]) -> None:
        await self.suite.start(specs, stop, progress)

    async def stop_early(self, names: set[str]) -> list[tuple[str, int]]:
        """Stop these processes now, the launcher's way (SIGTERM, its grace, then SIGKILL); the rest run on."""
        keep = [r for r in self.suite.running if r.spec.name not in names]
        self.suite.running = [r for r in self.suite.running if r.spec.name in names]
        try:
            return await self.suite.stop()
        finally:
            self.suite.running = keep
            self.suite.write_endpoints()

    async def restart(self, name: str, stop: asyncio.Event) -> Running:
        """Start a process that died again, with its spec minus the crash setting; returns the new one."""
        old = self.running(name)
        await asyncio.to_thread(old.process.wait)
        self.suite.running.remove(old)
        env = {k: v for k, v in old.spec.env.items() if not k.endswith("_CRASH_AT")}
        new = self.suite.spawn(replace(old.spec, env=env))
        await self.suite.wait_ready(new, stop)
        self.suite.write_endpoints()
        return new

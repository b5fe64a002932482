"""``sokutatsu demo``: the suite on the embedded PostgreSQL, a scenario, its traces analysed.

1. The launcher starts PostgreSQL and every service (:mod:`sokutatsu.demo.suite`),
   each tracing to ``OUT/traces``.
2. Market data (:mod:`sokutatsu.demo.market`): a feed, filtered desks, one turning slow
   and moved by the monitor to the standby and back.
3. Total order (:mod:`sokutatsu.demo.order`): two domains, replicas that must agree.
4. Queue-db (:mod:`sokutatsu.demo.queuedb`): order events from node 1 to node 2 exactly
   once, through a crash of the transfer daemon.
5. Everything stops; ``sokutatsu analyze`` (the Spark job) reads the traces into
   ``OUT/report.html``; the summary (:mod:`sokutatsu.demo.summary`) says what was
   measured and whether every check passed (exit status 0) or not (1).

docs/demo.md explains the scenario and how to read the summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from sokutatsu.cli.launcher import Interrupted, Running, StopSignals, Suite, prepare_databases, state_lock
from sokutatsu.cli.settings import LauncherSettings
from sokutatsu.core.embedded_pg import PostgresSettings, provide_postgres
from sokutatsu.core.errors import StartupError
from sokutatsu.core.runtime_settings import RuntimeSettings
from sokutatsu.core.settings import SettingsError, load
from sokutatsu.core.telemetry import setup_telemetry
from sokutatsu.demo.market import DemoFailure, Desks, MarketConfig, market_desks, run_market
from sokutatsu.demo.order import OrderConfig, order_group, run_orders
from sokutatsu.demo.queuedb import QueueConfig, recoveries, run_queue
from sokutatsu.demo.suite import DemoSuite, clear_previous_run, demo_topology, reset_databases
from sokutatsu.demo.summary import Outcome, print_summary, write_summary

T = TypeVar("T")
console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@dataclass(frozen=True)
class DemoConfig:
    market: MarketConfig
    order: OrderConfig
    queue: QueueConfig


FULL = DemoConfig(
    market=MarketConfig(
        symbols=300,
        rate=1500,
        warm_seconds=8.0,
        hold_seconds=5.0,
        tail_seconds=5.0,
        move_limit_seconds=45.0,
        slow_budget=256 * 2**10,
        slow_rate=20.0,
    ),
    order=OrderConfig(members=3, orders_per_desk=1500),
    queue=QueueConfig(orders=2000),
)
QUICK = DemoConfig(
    market=MarketConfig(
        symbols=60,
        rate=800,
        warm_seconds=2.0,
        hold_seconds=1.0,
        tail_seconds=1.0,
        move_limit_seconds=45.0,
        slow_budget=128 * 2**10,
        slow_rate=20.0,
    ),
    order=OrderConfig(members=2, orders_per_desk=200),
    queue=QueueConfig(orders=300),
)


class Clock:
    """Progress lines, each with the seconds since the demo started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, text: str) -> None:
        console.print(f"[dim]{time.monotonic() - self.started:6.1f} s[/] ", end="")
        console.print(text, markup=False)


@dataclass(frozen=True)
class Paths:
    state_dir: Path  # <STATE_DIR>/demo: PostgreSQL, the services' state and logs
    out: Path  # traces/, the analysis, summary.json

    @property
    def traces(self) -> Path:
        return self.out / "traces"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"


def run_demo(cfg: DemoConfig, *, auto_ports: bool, out: Path | None, analyze: bool) -> int:
    """The whole demo; returns the exit status (0 = every check passed)."""
    clock = Clock()
    outcome = Outcome()
    with StopSignals() as signals:
        try:
            ran = _run_suite(cfg, auto_ports, out, outcome, signals, clock)
        except Interrupted:
            err.print(f"sokutatsu: interrupted by {signals.name}; everything started was stopped", markup=False)
            return 128 + (signals.received or signal.SIGTERM)
    if isinstance(ran, int):
        return ran
    # Everything is stopped: from here Ctrl-C is Python's KeyboardInterrupt again.
    if outcome.queue is not None:
        outcome.queue.recoveries = recoveries(ran.traces)
    outcome.analysis_skipped = not analyze
    if analyze:
        try:
            _analyze(ran, outcome, clock)
        except KeyboardInterrupt:
            err.print("sokutatsu: interrupted during the analysis; everything was stopped", markup=False)
            return 128 + signal.SIGINT
    outcome.seconds = time.monotonic() - clock.started
    console.print(f"logs: {ran.logs}   traces: {ran.traces}   summary: {ran.out / 'summary.json'}", markup=False)
    bad = print_summary(console, outcome)
    write_summary(ran.out / "summary.json", outcome, bad)
    return 1 if bad else 0


def _run_suite(  # noqa: PLR0917 - the command's options, passed through
    cfg: DemoConfig, auto_ports: bool, out: Path | None, outcome: Outcome, signals: StopSignals, clock: Clock
) -> Paths | int:
    """PostgreSQL, the suite, the scenario, everything stopped again; the run's paths, or an exit status."""
    try:
        launcher, runtime, pg = load(LauncherSettings), load(RuntimeSettings), load(PostgresSettings)
    except SettingsError as exc:
        signals.calm()
        err.print(f"sokutatsu: error: {exc}", markup=False)
        return 2
    state_dir = launcher.state_dir.resolve() / "demo"
    paths = Paths(state_dir, (out or state_dir / "out").resolve())
    pg_log = logging.getLogger("sokutatsu.core.embedded_pg")
    pg_log.setLevel(logging.INFO)
    pg_log.addHandler(logging.StreamHandler(sys.stdout))
    try:
        with state_lock(state_dir):
            clear_previous_run(state_dir)
            paths.traces.mkdir(parents=True, exist_ok=True)
            for old in paths.traces.glob("*.jsonl"):
                old.unlink()
            with provide_postgres(state_dir, pg) as dsn:
                topology = demo_topology(auto_ports)
                try:
                    reset_databases(dsn)
                    prepare_databases(dsn, topology.first)
                finally:
                    signals.calm()
                os.environ["SOKUTATSU_TRACE_DIR"] = str(paths.traces)  # every process of the run traces there
                suite = DemoSuite(Suite(state_dir, dsn, True, runtime.grace_seconds), topology)
                if asyncio.run(_run(cfg, suite, outcome, signals, clock)):
                    raise Interrupted
    except StartupError as exc:
        signals.calm()
        err.print(f"sokutatsu: error: {exc}", markup=False)
        return 1
    except PermissionError as exc:
        signals.calm()
        err.print(f"sokutatsu: error: cannot write {exc.filename}: permission denied", markup=False)
        return 1
    return paths


async def _run(cfg: DemoConfig, suite: DemoSuite, outcome: Outcome, signals: StopSignals, clock: Clock) -> bool:
    """Start, run the scenario, stop. Returns whether a signal cut it short."""
    stop = asyncio.Event()
    signals.attach(asyncio.get_running_loop(), stop)

    def serving(r: Running) -> None:
        clock(f"SERVING {r.spec.name:<10} {r.address:<16} {r.spec.role}")

    telemetry = setup_telemetry("demo", "clients", Path(os.environ["SOKUTATSU_TRACE_DIR"]))
    try:
        clock(f"starting the suite (state and logs in {suite.suite.state_dir})")
        await suite.start(suite.topology.first, stop, serving)
        # Every subscriber first: the group's members must see the first distribution, and the desks
        # must exist before the sequencers publish (see market_desks).
        async with (
            order_group(suite.brokers, cfg.order.members) as members,
            market_desks(cfg.market, suite.brokers, clock) as desks,
        ):
            await suite.start(suite.topology.ordering, stop, serving)
            problems = await suite.suite.unhealthy()  # every gRPC service of every process
            if problems:
                raise StartupError(f"not SERVING: {'; '.join(problems)}")  # noqa: TRY301 - reported like a start failure
            clock(f"all {len(suite.suite.running)} services report SERVING; the scenario starts")
            await _scenario(cfg, suite, Clients(members, desks), outcome, stop=stop, clock=clock)
    except Interrupted:
        return True
    except StartupError as exc:
        outcome.errors.append(str(exc))
    finally:
        telemetry.shutdown()
        results = await suite.suite.stop()
        signals.detach()
        outcome.stopped += results
        bad = [f"{name} ({code})" for name, code in outcome.stopped if code not in (0, None)]
        if bad:
            outcome.errors.append(f"did not stop cleanly: {', '.join(bad)}")
        clock("stopped " + ", ".join(name for name, _ in results))
    return stop.is_set()


@dataclass(frozen=True)
class Clients:
    """The client processes started before the sequencers."""

    members: list[asyncio.subprocess.Process]
    desks: Desks


async def _scenario(
    cfg: DemoConfig, suite: DemoSuite, clients: Clients, outcome: Outcome, *, stop: asyncio.Event, clock: Clock
) -> None:
    """The three parts in turn; a part that fails is recorded and the next one still runs."""
    sequencers = {"a": suite.address("seq-a"), "b": suite.address("seq-b")}
    monitor = suite.address("monitor")

    async def part(name: str, work: Awaitable[T]) -> T | None:
        result = await _unless_stopped(work, stop)
        if isinstance(result, BaseException):
            outcome.errors.append(f"{name}: {result}" if isinstance(result, DemoFailure) else f"{name}: {result!r}")
            clock(f"{name}: FAILED: {result}")
            return None
        return result

    outcome.market = await part("market", run_market(cfg.market, clients.desks, suite.brokers, monitor, clock))

    async def group_done() -> None:
        # Before the replicas finish: they then read the sequencers' last messages too (see demo_order_member).
        stopped = await suite.stop_early({"seq-a", "seq-b"})
        outcome.stopped += stopped
        clock(f"order: every replica has them; the group ends: stopped {', '.join(name for name, _ in stopped)}")

    outcome.order = await part(
        "order",
        run_orders(cfg.order, sequencers, suite.brokers, clients.members, progress=clock, before_collect=group_done),
    )
    outcome.queue = await part("queue", run_queue(cfg.queue, suite, stop, clock))


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | BaseException:
    """The work's result or what it raised; Interrupted when a signal came first."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Interrupted
    try:
        return task.result()
    except Exception as exc:  # noqa: BLE001 - recorded and reported in the summary
        return exc


def _analyze(paths: Paths, outcome: Outcome, clock: Clock) -> None:
    """``sokutatsu analyze`` on the run's traces, in this process (Spark starts here)."""
    from sokutatsu.analytics.job import analyze, spark_session  # noqa: PLC0415 - Spark only when analysing

    spark_log = paths.logs / "spark.log"
    clock(f"analyze: starting Spark (its JVM logs to {spark_log})")
    with _stderr_to(spark_log):  # the JVM inherits it: its warnings go to the log, not between the demo's lines
        spark = spark_session(short_job=True)  # a few thousand spans
    try:
        result = analyze(spark, str(paths.traces), paths.out, progress=lambda stage: clock(f"analyze: {stage}"))
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        outcome.errors.append(f"analyze: {exc}")
        return
    finally:
        spark.stop()
    outcome.report = result.report.resolve()
    outcome.spans = result.spans


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 points at ``path`` for the block (so do the processes started in it, for good)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with path.open("ab") as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)

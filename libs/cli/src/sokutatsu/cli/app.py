"""The ``sokutatsu`` command."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from sokutatsu.cli import (
    analyze_command,
    auth_command,
    certs,
    chaos,
    client_commands,
    plugins,
    queuedb_command,
    status_command,
)
from sokutatsu.cli.launcher import (
    Interrupted,
    Ports,
    Running,
    StopSignals,
    Suite,
    connect_hint,
    prepare_databases,
    state_lock,
)
from sokutatsu.cli.settings import ALL_SETTINGS, LauncherSettings
from sokutatsu.cli.topology import SuiteProcess, suite
from sokutatsu.core.cluster import cluster_secret_source, load_secret
from sokutatsu.core.embedded_pg import PostgresSettings, provide_postgres
from sokutatsu.core.errors import StartupError
from sokutatsu.core.grpc_environment import DEFAULTS, MEANINGS
from sokutatsu.core.runtime_settings import RuntimeSettings
from sokutatsu.core.settings import SettingsError, describe, load

app = typer.Typer(
    help="Sokutatsu: guaranteed, low-latency message middleware.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@dataclass(frozen=True)
class _Options:
    ports: Ports
    check_only: bool
    grace: float


def _fail(message: str, status: int = 1) -> NoReturn:
    err.print(f"sokutatsu: error: {message}", markup=False)
    raise typer.Exit(status)


def _interrupted(signals: StopSignals) -> int:
    """One line for a stop signal that came before the suite was up; the exit status (128 + signal)."""
    err.print(f"sokutatsu: interrupted by {signals.name} while starting; everything started was stopped", markup=False)
    return 128 + (signals.received or signal.SIGTERM)


def _endpoint_table(running: list[Running]) -> Table:
    table = Table(title="Sokutatsu endpoints", title_justify="left")
    for column in ("service", "role", "address", "pid"):
        table.add_column(column, no_wrap=True)
    for r in running:
        table.add_row(r.spec.name, r.spec.role, r.address, str(r.pid))
    return table


async def _run_suite(
    state_dir: Path,
    pg_dsn: str,
    specs: list[SuiteProcess],
    options: _Options,
    signals: StopSignals,
) -> int:
    stop = asyncio.Event()
    signals.attach(asyncio.get_running_loop(), stop)
    launched = Suite(state_dir, pg_dsn, fixed_ports=options.ports is Ports.fixed, grace_seconds=options.grace)
    status = 0
    try:
        await launched.start(specs, stop, lambda r: console.print(f"  [green]SERVING[/] {r.spec.name:<10} {r.address}"))
        console.print(_endpoint_table(launched.running))
        console.print(f"logs: {state_dir / 'logs'}   endpoints: {launched.endpoints_file}")
        if options.check_only:
            # A last sweep over every gRPC service of every process, not only the server as a whole.
            problems = await launched.unhealthy()
            if problems:
                err.print(f"sokutatsu: error: not SERVING: {'; '.join(problems)}", markup=False)
                status = 1
            else:
                console.print(f"all {len(launched.running)} services report SERVING; stopping")
        else:
            console.print("running; Ctrl-C or SIGTERM stops everything")
            while not stop.is_set():
                gone = launched.exited()
                if gone is not None:
                    err.print(
                        f"sokutatsu: error: {gone.spec.name} exited with status {gone.process.returncode} "
                        f"(log: {gone.log_path})",
                        markup=False,
                    )
                    status = 1
                    break
                await asyncio.sleep(0.2)
    except Interrupted:
        status = _interrupted(signals)
    except StartupError as exc:
        err.print(f"sokutatsu: error: {exc}", markup=False)
        status = 1
    finally:
        results = await launched.stop()
        signals.detach()
        bad = [f"{name} ({code})" for name, code in results if code not in (0, None)]
        if bad and status == 0:
            err.print(f"sokutatsu: error: did not stop cleanly: {', '.join(bad)}", markup=False)
            status = 1
        console.print("stopped " + ", ".join(name for name, _ in results) if results else "nothing was running")
    return status


def _up_locked(state_dir: Path, pg: PostgresSettings, options: _Options, signals: StopSignals) -> int:
    """Everything after the settings: lock, PostgreSQL, databases, the suite. Returns the exit status."""
    with state_lock(state_dir), provide_postgres(state_dir, pg) as dsn:
        try:
            console.print(connect_hint(dsn, external=bool(pg.dsn)), markup=False)
            specs = suite(auto_ports=options.ports is Ports.auto)
            # Before the event loop: blocking, and interruptible like the PostgreSQL start.
            prepare_databases(dsn, specs)
        finally:
            # From here on (the suite, then every clean-up) signals only ask the loop to stop.
            signals.calm()
        return asyncio.run(_run_suite(state_dir, dsn, specs, options, signals))


def _up(ports: Ports, check_only: bool) -> None:
    # From the first moment: a signal never leaves a traceback or a half-started suite behind.
    with StopSignals() as signals:
        try:
            status = _up_guarded(ports, check_only, signals)
        except Interrupted:
            status = _interrupted(signals)
    raise typer.Exit(status)


def _up_guarded(ports: Ports, check_only: bool, signals: StopSignals) -> int:
    try:
        launcher = load(LauncherSettings)
        runtime = load(RuntimeSettings)
        pg = load(PostgresSettings)
        # Taken from the environment, else the user's file, made now if missing: the services read it too.
        load_secret(create=True)
    except SettingsError as exc:
        signals.calm()
        _fail(str(exc), 2)
    console.print(f"cluster secret: {cluster_secret_source()} (the services' control RPCs need it; clients do not)")
    state_dir = launcher.state_dir.resolve()
    options = _Options(ports=ports, check_only=check_only, grace=runtime.grace_seconds)
    # The embedded cluster says where it lives and on which port.
    pg_log = logging.getLogger("sokutatsu.core.embedded_pg")
    pg_log.setLevel(logging.INFO)
    pg_log.addHandler(logging.StreamHandler(sys.stdout))
    try:
        return _up_locked(state_dir, pg, options, signals)
    except StartupError as exc:
        signals.calm()
        _fail(str(exc))
    except PermissionError as exc:
        signals.calm()
        _fail(f"cannot write {exc.filename}: permission denied (set SOKUTATSU_STATE_DIR to a folder you own)")


@app.command()
def up(
    ports: Annotated[
        Ports, typer.Option(help="fixed: the documented ports (7101...); auto: free ports.")
    ] = Ports.fixed,
    check: Annotated[bool, typer.Option("--check", help="Stop as soon as every service is SERVING.")] = False,
) -> None:
    """Start PostgreSQL and every service as local processes; Ctrl-C stops them all."""
    _up(ports, check)


plugins.add_command(app, "demo")


GRPC_TITLE = "gRPC's own environment (every service sets these unless they are given: core/grpc_environment.py)"


@app.command()
def config(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the reference as Markdown.")] = False,
) -> None:
    """List every setting (environment variable) with its default and meaning."""
    sections = [(title, [(k.env, k.default, k.doc) for k in describe(cls)]) for title, cls in ALL_SETTINGS]
    sections.append((GRPC_TITLE, [(name, value, MEANINGS[name]) for name, value in DEFAULTS.items()]))
    if markdown:
        lines = ["# Configuration reference", "", "Generated by `sokutatsu config --markdown`; do not edit.", ""]
        for title, rows in sections:
            lines += [f"## {title}", "", "| variable | default | meaning |", "|---|---|---|"]
            lines += [f"| `{env}` | `{default}` | {doc} |" for env, default, doc in rows]
            lines.append("")
        sys.stdout.write("\n".join(lines))
        return
    for title, rows in sections:
        table = Table(title=title, title_justify="left")
        for column in ("variable", "default", "meaning"):
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        console.print(table)


app.command()(client_commands.publish)
app.command()(client_commands.subscribe)
app.command()(status_command.status)
app.command()(analyze_command.analyze)
app.command()(certs.certs)
app.command("cluster-secret")(auth_command.cluster_secret)
app.command()(chaos.chaos)
auth_app = typer.Typer(help="Tokens and policy files for authentication (docs/security.md).", no_args_is_help=True)
auth_app.command("token")(auth_command.auth_token)
auth_app.command("check")(auth_command.auth_check)
app.add_typer(auth_app, name="auth")
metrics_app = typer.Typer(help="Metrics of running services, as tables.", no_args_is_help=True)
metrics_app.command("broker")(client_commands.metrics_broker)
metrics_app.command("process")(client_commands.metrics_process)
app.add_typer(metrics_app, name="metrics")
plugins.add_command(app, "bench")
queuedb_app = typer.Typer(help="Queue-db administration.", no_args_is_help=True)
queuedb_app.command("migrate")(queuedb_command.queuedb_migrate)
queuedb_app.command("psql", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    queuedb_command.queuedb_psql
)
app.add_typer(queuedb_app, name="queuedb")
plugins.add_command(app, "simulate")


def main() -> None:
    try:
        app()
    except SettingsError as exc:  # e.g. an unusable SOKUTATSU_TLS_* file, met by a client command
        err.print(f"sokutatsu: error: {exc}", markup=False)
        sys.exit(2)

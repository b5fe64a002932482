"""The ``sokutatsu`` command."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from sokutatsu.cli.launcher import Running, Suite
from sokutatsu.cli.settings import ALL_SETTINGS, LauncherSettings
from sokutatsu.cli.topology import suite
from sokutatsu.core.embedded_pg import PostgresSettings, provide_postgres
from sokutatsu.core.errors import StartupError
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


class Ports(StrEnum):
    fixed = "fixed"
    auto = "auto"


def _fail(message: str, status: int = 1) -> None:
    err.print(f"sokutatsu: error: {message}", markup=False)
    raise typer.Exit(status)


def _endpoint_table(running: list[Running]) -> Table:
    table = Table(title="Sokutatsu endpoints", title_justify="left")
    for column in ("service", "role", "address", "pid"):
        table.add_column(column, no_wrap=True)
    for r in running:
        table.add_row(r.spec.name, r.spec.role, r.address, str(r.pid))
    return table


async def _run_suite(state_dir: Path, pg_dsn: str, ports: Ports, grace: float, check_only: bool) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    launched = Suite(state_dir, pg_dsn, fixed_ports=ports is Ports.fixed, grace_seconds=grace)
    status = 0
    try:
        await launched.start(
            suite(), stop, lambda r: console.print(f"  [green]SERVING[/] {r.spec.name:<10} {r.address}")
        )
        console.print(_endpoint_table(launched.running))
        console.print(f"logs: {state_dir / 'logs'}   endpoints: {state_dir / 'endpoints.json'}")
        if check_only:
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
    except StartupError as exc:
        err.print(f"sokutatsu: error: {exc}", markup=False)
        status = 1
    finally:
        results = await launched.stop()
        bad = [f"{name} ({code})" for name, code in results if code not in (0, None)]
        if bad and status == 0:
            err.print(f"sokutatsu: error: did not stop cleanly: {', '.join(bad)}", markup=False)
            status = 1
        console.print("stopped " + ", ".join(name for name, _ in results) if results else "nothing was running")
    return status


def _up(ports: Ports, check_only: bool) -> None:
    try:
        launcher = load(LauncherSettings)
        runtime = load(RuntimeSettings)
        pg = load(PostgresSettings)
    except SettingsError as exc:
        _fail(str(exc), 2)
    state_dir = launcher.state_dir.resolve()
    # The embedded cluster says where it lives and on which port.
    pg_log = logging.getLogger("sokutatsu.core.embedded_pg")
    pg_log.setLevel(logging.INFO)
    pg_log.addHandler(logging.StreamHandler(sys.stdout))
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        with provide_postgres(state_dir, pg) as dsn:
            if pg.dsn:
                console.print("PostgreSQL: the server of SOKUTATSU_PG_DSN")
            status = asyncio.run(_run_suite(state_dir, dsn, ports, runtime.grace_seconds, check_only))
    except StartupError as exc:
        _fail(str(exc))
    except PermissionError as exc:
        _fail(f"cannot write {exc.filename}: permission denied (set SOKUTATSU_STATE_DIR to a folder you own)")
    raise typer.Exit(status)


@app.command()
def up(
    ports: Annotated[
        Ports, typer.Option(help="fixed: the documented ports (7101...); auto: free ports.")
    ] = Ports.fixed,
    check: Annotated[bool, typer.Option("--check", help="Stop as soon as every service is SERVING.")] = False,
) -> None:
    """Start PostgreSQL and every service as local processes; Ctrl-C stops them all."""
    _up(ports, check)


@app.command()
def demo(
    ports: Annotated[Ports, typer.Option(help="fixed: the documented ports; auto: free ports.")] = Ports.auto,
) -> None:
    """Bring the suite up, check every service is healthy, and stop it.

    Later releases run a market-data scenario here; this build checks the
    suite starts and stops cleanly.
    """
    _up(ports, check_only=True)


@app.command()
def config(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the reference as Markdown.")] = False,
) -> None:
    """List every setting (environment variable) with its default and meaning."""
    if markdown:
        lines = ["# Configuration reference", "", "Generated by `sokutatsu config --markdown`; do not edit.", ""]
        for title, cls in ALL_SETTINGS:
            lines += [f"## {title}", "", "| variable | default | meaning |", "|---|---|---|"]
            lines += [f"| `{k.env}` | `{k.default}` | {k.doc} |" for k in describe(cls)]
            lines.append("")
        sys.stdout.write("\n".join(lines))
        return
    for title, cls in ALL_SETTINGS:
        table = Table(title=title, title_justify="left")
        for column in ("variable", "default", "meaning"):
            table.add_column(column)
        for knob in describe(cls):
            table.add_row(knob.env, knob.default, knob.doc)
        console.print(table)


def main() -> None:
    app()

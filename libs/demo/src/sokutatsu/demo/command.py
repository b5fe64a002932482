"""``sokutatsu demo``, registered with the ``sokutatsu`` command through the ``sokutatsu.commands``
entry point of this distribution (sokutatsu-demo)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sokutatsu.cli.launcher import Ports


def demo(
    ports: Annotated[Ports, typer.Option(help="fixed: the documented ports; auto: free ports.")] = Ports.auto,
    quick: Annotated[
        bool, typer.Option("--quick", help="A reduced scenario: fewer symbols, ticks and orders, shorter phases.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Folder for the run's traces and report.html [default: <state dir>/demo/out]."),
    ] = None,
    analyze: Annotated[
        bool, typer.Option("--analyze/--no-analyze", help="Analyse the traces with Spark at the end.")
    ] = True,
) -> None:
    """Run the suite with a market-data scenario, analyse its traces, print what was measured.

    A feed and filtered subscribers on the broker pair (one turns slow: the monitor moves it to
    the standby and back), a total-order group across two domains, order events from queue-db
    node 1 to node 2 through a crash of the transfer daemon; then everything stops and
    `sokutatsu analyze` writes report.html. Exit status 1 when any check fails (docs/demo.md).
    """
    from sokutatsu.demo.scenario import FULL, QUICK, run_demo  # noqa: PLC0415 - the scenario only for this command

    raise typer.Exit(run_demo(QUICK if quick else FULL, auto_ports=ports is Ports.auto, out=out, analyze=analyze))

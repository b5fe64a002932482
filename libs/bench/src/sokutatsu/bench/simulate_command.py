"""``sokutatsu simulate atop``: seed 002's simulation (Figs 10 and 11) of extended ATOP."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from sokutatsu.bench.atop_run import AtopResult

console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def simulate_atop(  # noqa: PLR0917 - typer commands take one parameter per option
    figure: Annotated[int, typer.Option("--figure", help="10: dummies/s vs domains; 11: mean arrival time.")],
    markers: Annotated[
        bool, typer.Option("--markers", help="One skip marker of n slots instead of n dummy messages.")
    ] = False,
    quick: Annotated[bool, typer.Option("--quick", help="60 simulated seconds instead of 300.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the figure here (PNG).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Random seed: the same seed gives the same result.")] = 1,
    duration: Annotated[
        float | None, typer.Option("--duration", help="Simulated seconds of message generation (overrides --quick).")
    ] = None,
    check_interval: Annotated[
        float, typer.Option("--check-interval", help="Seconds between the sequencers' share checks.")
    ] = 0.1,
    observe_delay: Annotated[
        float,
        typer.Option("--observe-delay", help="Seconds before a sequencer sees another domain's stamps."),
    ] = 0.3,
) -> None:
    """Simulate extended ATOP (SimPy) with the seed's parameters: Fig. 10 or Fig. 11 of seed 002."""
    from sokutatsu.bench.atop_figures import (  # noqa: PLC0415
        FIGURES,
        FULL_DURATION,
        QUICK_DURATION,
        burst_label,
        run_figure,
        summary_rows,
    )
    from sokutatsu.cli.measure import write_json  # noqa: PLC0415 - only for this command

    if figure not in FIGURES:
        raise typer.BadParameter(f"the seed's simulation has Figs 10 and 11, not {figure}", param_hint="--figure")
    seconds = duration if duration is not None else QUICK_DURATION if quick else FULL_DURATION
    if seconds <= 0 or check_interval <= 0 or observe_delay < 0:
        raise typer.BadParameter("--duration and --check-interval must be positive, --observe-delay not negative")
    fillers = "skip markers" if markers else "dummies"
    console.print(f"simulate atop: Fig. {figure}, {seconds:g} simulated seconds, seed {seed}, {fillers}")

    def progress(r: AtopResult, wall: float) -> None:
        what = burst_label(r.burst_interval_s) if figure == 10 else f"service {r.service_time_ms:g} ms"
        console.print(
            f"  {what:<20} {r.domains:>3} domains: {r.dummies_per_s:7.1f} dummies/s "
            f"({r.filler_messages_per_s:.1f} sent), arrival {r.mean_arrival_ms:,.0f} ms ({wall:.1f} s)"
        )

    result = run_figure(
        figure,
        markers=markers,
        duration=seconds,
        seed=seed,
        check_interval=check_interval,
        observe_delay=observe_delay,
        progress=progress,
    )
    header, rows = summary_rows(result)
    table = Table(title=f"Fig. {figure} ({fillers})", title_justify="left")
    for column in header:
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if figure == 11:
        console.print("load: clients per domain x 2/s x service time; * = saturated (grows with --duration)")
    if plot is not None:
        from sokutatsu.bench.atop_plots import atop_plot  # noqa: PLC0415 - matplotlib only when asked

        result["plot"] = str(atop_plot(result, plot))
        console.print(f"plot: {plot}")
    write_json(json_path, result)
    if json_path:
        console.print(f"wrote {json_path}")
    bad = [name for name, ok in result["checks"].items() if not ok]
    if bad:
        err.print(f"sokutatsu: error: check failed: {', '.join(bad)}", markup=False)
        raise typer.Exit(1)


simulate_app = typer.Typer(help="Discrete-event simulations of the seeds' experiments.", no_args_is_help=True)
simulate_app.command("atop")(simulate_atop)

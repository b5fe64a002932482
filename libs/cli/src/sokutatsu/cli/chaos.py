"""``sokutatsu chaos``: fault schedules against the broker pair, checked (docs/chaos.md)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sokutatsu.cli import chaos_sequencers
from sokutatsu.cli.chaos_report import COLUMNS, html_report, row, write_json
from sokutatsu.cli.chaos_run import ChaosConfig, peer_link_supported, random_seeds, run_many
from sokutatsu.cli.measure import machine, settle_collector

console = Console(highlight=False, soft_wrap=True, width=160)


def build_report(
    started: str, cfg: ChaosConfig, seeds: list[int], schedules: list[dict[str, Any]], wall: float
) -> dict[str, Any]:
    return {
        "started": started,
        "machine": machine(),
        "parameters": {**cfg.as_dict(), "seeds": seeds, "link_via_proxy": peer_link_supported()},
        "wall_s": round(wall, 1),
        "failed": sum(1 for s in schedules if s["violations"]),
        "schedules": schedules,
    }


def summary_table(schedules: list[dict[str, Any]]) -> Table:
    table = Table(title="sokutatsu chaos", title_justify="left")
    for column in (*COLUMNS, "violations"):
        table.add_column(column)
    for s in schedules:
        table.add_row(*row(s), "; ".join(s["violations"]) or "none")
    return table


def _sequencer_chaos(  # noqa: PLR0917 - the command's options, passed on
    stamp: str, seeds: list[int], faults: int, longest: float, rate: float, out: Path, work: Path | None
) -> None:
    folder = (work or Path(".sokutatsu") / "chaos" / stamp).resolve()
    console.print(
        f"sokutatsu chaos --sequencers: seeds {seeds}, {faults} faults each (1-{longest:g} s), "
        f"{rate:g} msgs/s per publisher; logs under {folder}"
    )
    settle_collector()
    started = time.monotonic()
    results = chaos_sequencers.run_many(seeds, faults, longest, rate, folder, console.print)
    figures = chaos_sequencers.summary(results)
    report: dict[str, Any] = {
        "started": stamp,
        "machine": machine(),
        "parameters": {"seeds": seeds, "faults": faults, "longest_s": longest, "rate_per_publisher": rate},
        "wall_s": round(time.monotonic() - started, 1),
        "summary": figures,
        "schedules": results,
    }
    path = out / f"chaos-sequencers-{stamp}.json"
    write_json(path, report)
    for key, value in figures.items():
        console.print(f"  {key}: {value}", markup=False)
    console.print(f"report: {path}")
    raise typer.Exit(1 if figures["failed"] else 0)


def chaos(  # noqa: PLR0917 - typer commands take one parameter per option
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="How many schedules (seeds) to run.")] = 3,
    minutes: Annotated[
        float, typer.Option("--minutes", min=0.1, help="Length of each schedule's fault phase, in minutes.")
    ] = 1.0,
    first_seed: Annotated[
        int | None, typer.Option("--first-seed", help="Run seeds first-seed, first-seed+1, ... [default: random].")
    ] = None,
    seed: Annotated[
        list[int] | None, typer.Option("--seed", help="Run exactly this seed (repeatable; overrides --seeds).")
    ] = None,
    rate: Annotated[float, typer.Option("--rate", min=1, help="Messages per second per publisher.")] = 100.0,
    out: Annotated[Path, typer.Option("--out", help="Folder for chaos-<UTC time>.json and .html.")] = Path(
        "bench/results"
    ),
    work: Annotated[
        Path | None,
        typer.Option(
            "--work", help="Folder for each schedule's logs and histories [default: .sokutatsu/chaos/<time>]."
        ),
    ] = None,
    sequencers: Annotated[
        bool,
        typer.Option(
            "--sequencers",
            help="Fault a sequencer group instead of the broker pair: kills and pauses of the leader and "
            "non-leaders (docs/chaos.md, 'Sequencer faults').",
        ),
    ] = False,
    faults: Annotated[int, typer.Option("--faults", min=1, help="--sequencers: faults per schedule.")] = 2,
    longest: Annotated[
        float, typer.Option("--longest", min=1.0, help="--sequencers: longest outage or pause, in seconds.")
    ] = 30.0,
    delivery_workers: Annotated[
        int,
        typer.Option(
            "--delivery-workers",
            min=0,
            max=8,
            help="Delivery workers per broker (SOKUTATSU_BROKER_DELIVERY_WORKERS): the SubscribeMany lanes "
            "(prefix-a, keys-b and their companions) are then relayed by them through every fault.",
        ),
    ] = 0,
) -> None:
    """Run fault schedules (kill -9, pauses, link cuts, floods, migrations) against real processes and
    check the pair's promise: nothing acknowledged lost or doubled, per-publisher order, one active.
    With --sequencers: kills and pauses of a sequencer group, checking one identical order at every
    ordered subscriber and the stall after each restart. Exit status 1 when any schedule broke a promise."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%MZ")
    chosen = list(seed) if seed else random_seeds(seeds, first_seed)
    if sequencers:
        _sequencer_chaos(stamp, chosen, faults, longest, rate, out, work)
    cfg = ChaosConfig(seconds=minutes * 60.0, rate=rate, delivery_workers=delivery_workers)
    folder = (work or Path(".sokutatsu") / "chaos" / stamp).resolve()
    console.print(
        f"sokutatsu chaos: seeds {chosen}, {cfg.seconds:g} s of faults each, {cfg.rate:g} msgs/s per publisher, "
        f"{delivery_workers} delivery worker(s) per broker; "
        f"logs under {folder}"
    )
    if not peer_link_supported():
        console.print("warning: this broker has no SOKUTATSU_BROKER_PEER_LINK: link cuts reach nothing")
    settle_collector()
    started = time.monotonic()
    schedules = run_many(chosen, cfg, folder, console.print)
    report = build_report(stamp, cfg, chosen, schedules, time.monotonic() - started)
    json_path = out / f"chaos-{stamp}.json"
    write_json(json_path, report)
    json_path.with_suffix(".html").write_text(html_report(report))
    console.print(summary_table(schedules))
    for s in schedules:
        for line in s.get("evidence", [])[-10:]:
            console.print(f"  seed {s['seed']}: {line}", markup=False)
    console.print(f"report: {json_path} and {json_path.with_suffix('.html')}")
    raise typer.Exit(1 if report["failed"] else 0)

"""``sokutatsu bench ...``: the benchmarks, registered with the ``sokutatsu`` command through the
``sokutatsu.commands`` entry point of this distribution (sokutatsu-bench)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from sokutatsu.bench.analytics import bench_analytics
from sokutatsu.bench.soak import bench_soak

console = Console(highlight=False, soft_wrap=True)


def bench_throughput(
    quick: Annotated[bool, typer.Option("--quick", help="A smoke run of a few seconds.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result here.")] = None,
    tracing: Annotated[
        bool, typer.Option("--tracing", help="Run untraced, then traced to files in every process; compare.")
    ] = False,
) -> None:
    """1 publisher -> 1 subscriber, 1 KiB persistent acked messages: msgs/s, and p50/p99 at 5,000 msgs/s."""
    from sokutatsu.bench.throughput import FULL, QUICK, run, run_tracing_comparison  # noqa: PLC0415
    from sokutatsu.cli.measure import settle_collector, write_json  # noqa: PLC0415 - only for this command

    cfg = QUICK if quick else FULL
    if tracing:
        console.print(f"bench throughput ({'quick' if quick else 'full'}), untraced then traced to files")
        settle_collector()
        compared = asyncio.run(run_tracing_comparison(cfg))
        compared["mode"] = "quick" if quick else "full"
        for label in ("untraced", "traced"):
            one = compared[label]
            console.print(
                f"  {label:<9} {one['msgs_per_s']:>9,} msgs/s   at {one['rate']:,} msgs/s: p50 {one['p50_ms']} ms  "
                f"p99 {one['p99_ms']} ms   CPU steal {one['throughput']['cpu_steal_percent']}% / "
                f"{one['latency']['cpu_steal_percent']}%"
            )
        console.print(
            f"traced / untraced: {compared['traced_vs_untraced']}; "
            f"{compared['trace_files']['export_lines']:,} export lines, {compared['trace_files']['bytes']:,} bytes"
        )
        write_json(json_path, compared)
        return
    console.print(
        f"bench throughput ({'quick' if quick else 'full'}): {cfg.messages} messages flat out, "
        f"then {cfg.rate} msgs/s for {cfg.seconds:g}s; {cfg.size}-byte bodies, persistent, acknowledged"
    )
    settle_collector()
    result = asyncio.run(run(cfg))
    result["mode"] = "quick" if quick else "full"
    console.print(
        f"throughput {result['msgs_per_s']:,} msgs/s   latency at {result['rate']:,} msgs/s: "
        f"p50 {result['p50_ms']} ms  p99 {result['p99_ms']} ms  (max {result['latency']['max_ms']} ms)   "
        f"CPU steal {result['throughput']['cpu_steal_percent']}% / {result['latency']['cpu_steal_percent']}%"
    )
    write_json(json_path, result)
    if json_path:
        console.print(f"wrote {json_path}")
    print(json.dumps({k: result[k] for k in ("msgs_per_s", "p50_ms", "p99_ms", "rate", "size")}))  # noqa: T201


def bench_switchover(
    quick: Annotated[bool, typer.Option("--quick", help="10 switches instead of 60.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result here.")] = None,
) -> None:
    """Broker pair + monitor: switch a subscriber back and forth while messages flow; step timings."""
    from sokutatsu.bench.switchover import FULL, QUICK, measure  # noqa: PLC0415
    from sokutatsu.cli.measure import settle_collector, write_json  # noqa: PLC0415 - only for this command

    cfg = QUICK if quick else FULL
    console.print(
        f"bench switchover ({'quick' if quick else 'full'}): {cfg.switches} switches, one every {cfg.pause:g}s, "
        f"while {cfg.rate:,} msgs/s of {cfg.size} bytes flow to the pair"
    )
    settle_collector()
    result = asyncio.run(measure(cfg))
    result["mode"] = "quick" if quick else "full"
    steps = "  ".join(f"{k} {v} ms" for k, v in result["step_ms_p50"].items())
    console.print(
        f"{result['switches']} switches ({result['failed']} failed): p50 {result['switch_ms_p50']} ms  "
        f"p90 {result['switch_ms_p90']} ms  max {result['switch_ms_max']} ms   step medians: {steps}"
    )
    console.print(
        f"sent {result['sent']:,}  received {result['received']:,}  lost {result['lost']}  "
        f"duplicates {result['duplicates']}  in order {result['in_order']}  CPU steal {result['cpu_steal_percent']}%"
    )
    write_json(json_path, result)
    if json_path:
        console.print(f"wrote {json_path}")
    keys = ("switch_ms_p50", "switch_ms_max", "step_ms_p50", "lost", "duplicates")
    print(json.dumps({k: result[k] for k in keys}))  # noqa: T201
    if result["lost"] or result["duplicates"] or not result["in_order"] or result["failed"]:
        raise typer.Exit(1)


def bench_slow_subscriber(
    quick: Annotated[bool, typer.Option("--quick", help="Shorter phases, for a smoke run of about 3 minutes.")] = False,
    sizes: Annotated[
        str, typer.Option("--sizes", help="Message sizes in bytes, comma-separated.")
    ] = "4096,16384,65536,262144",
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result here.")] = None,
    plots: Annotated[
        Path | None, typer.Option("--plots", help="Folder for the PNG plots (Figs 5, 6 and 8 of seed 000).")
    ] = None,
) -> None:
    """Seed 000's experiment: a subscriber turns slow; flow-to-disk vs migrate, per message size."""
    import dataclasses  # noqa: PLC0415 - only for this command

    from sokutatsu.bench.slow import FULL, QUICK, measure  # noqa: PLC0415
    from sokutatsu.cli.measure import settle_collector, write_json  # noqa: PLC0415

    try:
        chosen = tuple(int(s) for s in sizes.split(",") if s.strip())
    except ValueError:
        raise typer.BadParameter(f"expected sizes in bytes such as 4096,65536, got {sizes!r}") from None
    if not chosen or any(not 64 <= s <= 2**20 for s in chosen):
        raise typer.BadParameter("each size must be 64 bytes to 1 MiB (the broker's default MAX_BODY)")
    cfg = dataclasses.replace(QUICK if quick else FULL, sizes=chosen)
    console.print(
        f"bench slow-subscriber ({'quick' if quick else 'full'}): sizes {', '.join(map(str, chosen))}; "
        + ", ".join(f"{s // 1024} KiB at {cfg.rate(s)} msgs/s" for s in chosen)
        + f"; slow-down after {cfg.before_seconds:g}s for {cfg.slow_seconds:g}s"
    )
    settle_collector()
    result = asyncio.run(measure(cfg))
    result["mode"] = "quick" if quick else "full"
    console.print(result["table"])
    if plots is not None:
        from sokutatsu.bench.plots import slow_subscriber_plots  # noqa: PLC0415

        result["plots"] = [str(p) for p in slow_subscriber_plots(result, plots)]
        console.print(f"plots: {', '.join(result['plots'])}")
    write_json(json_path, result)
    if json_path:
        console.print(f"wrote {json_path}")
    bad = sum(v for r in result["rows"] for m in r["audit"].values() for w in m.values() for v in w.values())
    keys = ("ftd_after_mean", "migrate_after_mean", "mean_ratio", "worst_ratio")
    print(json.dumps({r["size"]: {k: r[k] for k in keys} for r in result["rows"]}))  # noqa: T201
    if bad:
        raise typer.Exit(1)


def bench_sequencer(
    quick: Annotated[bool, typer.Option("--quick", help="Shorter runs, for a smoke run of about a minute.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result here.")] = None,
) -> None:
    """Sequencer: numbers stamped per second by range size; ordered delivery msgs/s across 3 domains."""
    from sokutatsu.bench.sequencer import FULL, QUICK, run  # noqa: PLC0415
    from sokutatsu.cli.measure import write_json  # noqa: PLC0415 - only for this command

    cfg = QUICK if quick else FULL
    console.print(
        f"bench sequencer ({'quick' if quick else 'full'}): stamp ranges of {', '.join(map(str, cfg.ranges))} "
        f"for {cfg.stamp_seconds:g}s each, {cfg.window} requests in flight; then 3 domains x {cfg.messages:,} "
        f"ordered messages of {cfg.size} bytes to {cfg.readers} ordered readers through the broker pair"
    )
    result = asyncio.run(run(cfg))
    result["mode"] = "quick" if quick else "full"
    for row in result["stamps"]["rows"]:
        console.print(
            f"  range {row['range']:>6,}{' fsync' if row['fsync'] else '      '}: {row['stamps_per_s']:>12,} stamps/s  "
            f"{row['requests_per_s']:>8,} requests/s   CPU steal {row['cpu_steal_percent']}%"
        )
    ordered = result["ordered"]
    console.print(
        f"ordered: {ordered['msgs_per_s']:,} msgs/s (per reader {ordered['per_reader_msgs_per_s']}), "
        f"same order {ordered['same_order']}, complete {ordered['complete']}, "
        f"skip slots seen {[f['skip_slots'] for f in ordered['fillers']]}, "
        f"CPU steal {ordered['cpu_steal_percent']}%"
    )
    write_json(json_path, result)
    if json_path:
        console.print(f"wrote {json_path}")
    print(json.dumps({k: result[k] for k in ("stamps_per_s", "ordered_msgs_per_s")}))  # noqa: T201
    if not (ordered["same_order"] and ordered["complete"]):
        raise typer.Exit(1)


def bench_peers(
    quick: Annotated[
        bool, typer.Option("--quick", help="Shorter scenarios, for a smoke run of a few minutes.")
    ] = False,
    systems: Annotated[
        str,
        typer.Option(
            "--systems",
            help="Which systems, comma-separated: sokutatsu, rabbitmq, nats. With sokutatsu, the latency "
            "scenario also measures one broker alone and a bare Python gRPC relay, as references.",
        ),
    ] = "sokutatsu,rabbitmq,nats",
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result here.")] = None,
) -> None:
    """Sokutatsu vs RabbitMQ vs NATS JetStream on this machine: throughput, latency, a slow consumer."""
    from sokutatsu.bench.peers import FULL, QUICK, SYSTEMS, measure  # noqa: PLC0415
    from sokutatsu.cli.measure import settle_collector, write_json  # noqa: PLC0415 - only for this command

    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SYSTEMS]
    if not chosen or unknown:
        raise typer.BadParameter(f"choose from {', '.join(SYSTEMS)}; got {systems!r}")
    cfg = QUICK if quick else FULL
    console.print(
        f"bench peers ({'quick' if quick else 'full'}): {', '.join(chosen)}; throughput {cfg.messages:,} msgs, "
        f"latency and slow consumer at {cfg.rate:,} msgs/s of 1 KiB"
    )
    settle_collector()  # the same for every system: each one's publisher runs in this process
    result = asyncio.run(measure(cfg, chosen, say=console.print))
    result["mode"] = "quick" if quick else "full"
    console.print(result["table"])
    console.print(json.dumps(result["ratios"]))
    write_json(json_path, result)
    if json_path:
        console.print(f"wrote {json_path}")
    measured = [f for f in result["systems"].values() if "skipped" not in f]
    if any("error" in s for f in measured for s in f.values() if isinstance(s, dict)):
        raise typer.Exit(1)


def bench_queuedb(
    quick: Annotated[bool, typer.Option("--quick", help="Shorter phases, for a smoke run of about a minute.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result here.")] = None,
    only: Annotated[
        str, typer.Option("--only", help="'remote': only the remote-enqueue section (callers, pgbench beside).")
    ] = "all",
) -> None:
    """Queue-db: enqueue vs raw insert, SDK enqueue and batches, transfer 1PC vs 2PC, remote enqueue."""
    import os  # noqa: PLC0415 - only for this command

    from sokutatsu.bench.queuedb import FULL, QUICK, run  # noqa: PLC0415
    from sokutatsu.cli.measure import write_json  # noqa: PLC0415

    if only not in ("all", "remote"):
        raise typer.BadParameter("--only takes 'all' or 'remote'")
    cfg = QUICK if quick else FULL
    server_dsn = os.environ.get("SOKUTATSU_PG_DSN") or None
    callers = ", ".join(str(c) for c in cfg.remote_callers)
    console.print(
        f"bench queue-db ({'quick' if quick else 'full'}"
        + (", remote enqueue only" if only == "remote" else "")
        + f") on {'SOKUTATSU_PG_DSN' if server_dsn else 'an embedded PostgreSQL cluster'}: {cfg.concurrency} "
        f"clients, {cfg.size}-byte bodies, {cfg.seconds}s per phase (raw insert, enqueue with pgbench, SDK enqueue, "
        f"batches of {cfg.batch:,}); then transfer of {cfg.transfer_messages:,} messages node1 -> node2, 1PC and 2PC; "
        f"then remote Enqueue calls from {callers} callers ({cfg.remote_messages:,} per run), durable on both and "
        "alternating, beside pgbench on node1's cluster"
    )
    result = asyncio.run(run(cfg, server_dsn, "SOKUTATSU_PG_DSN", only))
    result["mode"] = "quick" if quick else "full"
    phases = result["phases"]

    def line(label: str, value: int | None, unit: str, phase: str) -> None:
        console.print(f"  {label:<42} {value:>10,} {unit:<8} CPU steal {phases[phase]['cpu_steal_percent']}%")

    if only == "all":
        line("pgbench raw insert", result["pgbench_insert_tps"], "tx/s", "pgbench_insert")
        line("enqueue (pgbench, SDK SQL)", result["enqueue_tx_per_s"], "tx/s", "enqueue_pgbench")
        line("SDK enqueue_async", result["sdk_enqueue_tx_per_s"], "tx/s", "sdk_enqueue")
        line(f"SDK enqueue_batch ({cfg.batch:,})", result["enqueue_batch_msgs_per_s"], "msgs/s", "enqueue_batch")
        for key in [f"transfer_{m}{where}" for where in ("", "_small_batch", "_wan") for m in ("1pc", "2pc")]:
            transfer = phases[key]
            link = f", {transfer['link_one_way_ms']:g} ms link" if transfer["link_one_way_ms"] else ""
            line(f"transfer {key[9:12]}, batches of {transfer['batch']:,}{link}", transfer["msgs_per_s"], "msgs/s", key)
            console.print(
                f"    {transfer['received']:,} of {transfer['messages']:,} received in {transfer['seconds']}s after "
                f"the daemon's start-up of {transfer['daemon_start_s']}s ({transfer['msgs_per_s_from_launch']:,} "
                f"msgs/s with it), outbox left {transfer['outbox_left']}, complete {transfer['complete']}"
            )
    for key, phase in phases.items():
        if key.startswith("remote_pgbench_"):
            line(f"pgbench insert, node1's cluster, {phase['clients']} clients", phase["tx_per_s"], "tx/s", key)
        elif key.startswith("remote_"):
            line(
                f"remote enqueue, {phase['durability']}, {phase['callers']} callers",
                phase["calls_per_s"],
                "calls/s",
                key,
            )
            cpu = ", ".join(f"{k} {v}" for k, v in phase["cpu_us_per_call"].items())
            floor = phase["health_check_floor"]
            console.print(
                f"    {'' if phase['grouped'] else 'each call committed alone; '}latency ms {phase['latency_ms']}; "
                f"health-check floor {floor['calls_per_s']:,} calls/s, CPU µs per call {floor['cpu_us_per_call']}"
            )
            console.print(
                f"    WAL flushes per message: node1 {phase['node1_flushes_per_msg']}, node2 "
                f"{phase['node2_flushes_per_msg']}; CPU µs per call: {cpu} (all {phase['cpu_us_per_call_total']}); "
                f"{phase['received']:,} received, outbox left {phase['outbox_left']}, complete {phase['complete']}"
            )
    remote = result["remote_enqueue"]
    console.print(f"remote enqueue ratios: {remote['ratios']}")
    if only == "all":
        ratios = result["ratios"]
        console.print(
            f"ratios: enqueue/raw {ratios['enqueue_vs_raw']} (target >= {ratios['enqueue_vs_raw_target']}), "
            f"batch target {ratios['batch_target_msgs_per_s']:,} msgs/s met {ratios['batch_target_met']}, "
            f"1PC/2PC {ratios['onephase_vs_twophase']} (target >= {ratios['onephase_vs_twophase_target']}), "
            f"with batches of 10 {ratios['onephase_vs_twophase_small_batch']}, "
            f"between sites {ratios['onephase_vs_twophase_wan']}; "
            f"PostgreSQL {result['postgres']['version']} ({result['postgres']['source']})"
        )
    write_json(json_path, result)
    if json_path:
        console.print(f"wrote {json_path}")
    print(json.dumps(result["ratios"] if only == "all" else remote["ratios"]))  # noqa: T201
    if not (result["transfers_complete"] if only == "all" else remote["complete"]):
        raise typer.Exit(1)


def _lingers(linger_ms: str | None) -> tuple[float | None, ...]:
    """``--linger-ms`` of ``bench fanout``: (None,) for the SDK's default."""
    if linger_ms is None:
        return (None,)
    try:
        lingers = tuple(float(ms) for ms in linger_ms.split(","))
    except ValueError:
        raise typer.BadParameter(f"expected milliseconds such as 1,2, got {linger_ms!r}") from None
    if any(not 0 <= ms <= 1000 for ms in lingers) or len(set(lingers)) < len(lingers):
        raise typer.BadParameter(f"expected different milliseconds from 0 to 1000 such as 1,2, got {linger_ms!r}")
    return lingers


def bench_fanout(
    quick: Annotated[bool, typer.Option("--quick", help="N in 1 and 16, 3 s phases: a smoke run.")] = False,
    systems: Annotated[
        str,
        typer.Option(
            "--systems",
            help="Comma-separated: sokutatsu, nats-push, nats-pull, nats-push-r3 (a cluster of three nats-servers "
            "the bench starts, the stream on all three).",
        ),
    ] = "sokutatsu,nats-push,nats-pull",
    counts: Annotated[str | None, typer.Option("--counts", help="N values instead of the mode's, e.g. 16,64.")] = None,
    keys: Annotated[
        str, typer.Option("--keys", help="Which scenarios per N: both, every (every key) or filtered (1/16 of them).")
    ] = "both",
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Result file (default bench/results/fanout-<UTC time>.json).")
    ] = None,
    plots: Annotated[
        Path | None, typer.Option("--plots", help="Folder for the p99-against-N plot (default bench/results/plots).")
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option(
            "--profile", help="Record the active broker and its standby with py-spy at N=16 and 64 into this folder."
        ),
    ] = None,
    delivery_workers: Annotated[
        str,
        typer.Option(
            "--delivery-workers",
            help="Sokutatsu with these numbers of delivery workers per broker, one scenario each, e.g. 0,1,2.",
        ),
    ] = "0",
    linger_ms: Annotated[
        str | None,
        typer.Option(
            "--linger-ms",
            help="Sokutatsu with its publisher's linger at these values in ms, one scenario each, e.g. 1,2 "
            "(default: the SDK's).",
        ),
    ] = None,
) -> None:
    """One feed to N filtered or unfiltered subscribers: Sokutatsu vs NATS JetStream push and pull (issue 23)."""
    import dataclasses  # noqa: PLC0415 - only for this command
    import time  # noqa: PLC0415

    from sokutatsu.bench.fanout import FULL, QUICK, measure, p99_plot  # noqa: PLC0415
    from sokutatsu.bench.fanout_clients import SYSTEMS  # noqa: PLC0415
    from sokutatsu.cli.measure import settle_collector, write_json  # noqa: PLC0415

    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    if not chosen or any(s not in SYSTEMS for s in chosen):
        raise typer.BadParameter(f"choose from {', '.join(SYSTEMS)}; got {systems!r}")
    cfg = QUICK if quick else FULL
    if counts:
        try:
            cfg = dataclasses.replace(cfg, counts=tuple(int(n) for n in counts.split(",")))
        except ValueError:
            raise typer.BadParameter(f"expected N values such as 16,64, got {counts!r}") from None
    filters = {"both": (False, True), "every": (False,), "filtered": (True,)}.get(keys)
    if filters is None:
        raise typer.BadParameter(f"choose both, every or filtered; got {keys!r}")
    try:
        workers = tuple(int(k) for k in delivery_workers.split(","))
    except ValueError:
        raise typer.BadParameter(f"expected numbers of workers such as 0,1,2, got {delivery_workers!r}") from None
    if not workers or any(k < 0 for k in workers):
        raise typer.BadParameter(f"expected numbers of workers such as 0,1,2, got {delivery_workers!r}")
    cfg = dataclasses.replace(cfg, filters=filters, delivery_workers=workers, linger_ms=_lingers(linger_ms))
    stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    path = json_path or Path(f"bench/results/fanout-{stamp}{'-quick' if quick else ''}.json")
    plots = plots or Path(f"bench/results/plots{'-quick' if quick else ''}")
    console.print(
        f"bench fanout ({'quick' if quick else 'full'}): {', '.join(chosen)}; N in {', '.join(map(str, cfg.counts))}, "
        f"{ {'both': 'every key and 1/16 of the keys', 'every': 'every key', 'filtered': '1/16 of the keys'}[keys] }; "
        f"{cfg.rate:,} msgs/s of {cfg.size} B for {cfg.seconds:g}s each"
    )
    settle_collector()
    result = asyncio.run(
        measure(cfg, chosen, say=console.print, profile=(profile, (16, 64)) if profile is not None else None)
    )
    result["mode"] = "quick" if quick else "full"
    result["plot"] = str(p99_plot(result, plots / f"{path.stem}-p99.png"))
    console.print(result["table"])
    console.print(json.dumps(result["ratios"]))
    if profile is not None:
        from sokutatsu.bench.fanout_profile import compress, write_breakdown  # noqa: PLC0415

        compress(result["rows"])
        console.print(f"profiles: {write_breakdown(profile, cfg.seconds, result['rows'])}")
    write_json(path, result)
    path.with_suffix(".md").write_text(
        f"# bench fanout, {result['time_utc']} ({result['mode']})\n\n{result['setup']}\n\n{result['table']}\n\n"
        f"Plot: `{result['plot']}`. Machine: {result['machine']['cpus']} CPUs ({result['machine']['cpu_model']}).\n"
    )
    console.print(f"wrote {path}, {path.with_suffix('.md')} and {result['plot']}")
    if any("error" in r or not r["complete"] for r in result["rows"]):
        raise typer.Exit(1)


def bench_grpc_cost(
    quick: Annotated[bool, typer.Option("--quick", help="One turn of 3 s per variant: a smoke run.")] = False,
    rate: Annotated[int, typer.Option("--rate", help="Requests a second on the stream.")] = 560,
    rounds: Annotated[int | None, typer.Option("--rounds", help="Turns per variant (default 4; quick 1).")] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Result file (default bench/results/grpc-cost-<UTC time>.json).")
    ] = None,
) -> None:
    """A bare grpc.aio server's CPU per request/response pair, with the services' gRPC environment and gRPC's own."""
    import dataclasses  # noqa: PLC0415 - only for this command
    import time  # noqa: PLC0415

    from sokutatsu.bench.grpc_cost import QUICK, Config, markdown, run  # noqa: PLC0415
    from sokutatsu.cli.measure import machine, write_json  # noqa: PLC0415 - only for this command

    cfg = dataclasses.replace(QUICK if quick else Config(), rate=rate)
    if rounds is not None:
        cfg = dataclasses.replace(cfg, rounds=rounds)
    console.print(
        f"bench grpc-cost: {cfg.rate:,} requests/s of {cfg.size} B, {cfg.seconds:g} s per turn, {cfg.rounds} turn(s) "
        "per variant, alternating"
    )
    stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    path = json_path or Path(f"bench/results/grpc-cost-{stamp}{'-quick' if quick else ''}.json")
    result = asyncio.run(run(cfg))
    result["mode"] = "quick" if quick else "full"
    result["machine"] = machine()
    text = markdown(result)
    console.print(text)
    write_json(path, result)
    path.with_suffix(".md").write_text(
        text + f"Machine: {result['machine']['cpus']} CPUs ({result['machine']['cpu_model']}).\n"
    )
    console.print(f"wrote {path} and {path.with_suffix('.md')}")


bench_app = typer.Typer(help="Benchmarks that print figures and write JSON.", no_args_is_help=True)
bench_app.command("throughput")(bench_throughput)
bench_app.command("switchover")(bench_switchover)
bench_app.command("slow-subscriber")(bench_slow_subscriber)
bench_app.command("peers")(bench_peers)
bench_app.command("sequencer")(bench_sequencer)
bench_app.command("queue-db")(bench_queuedb)
bench_app.command("analytics")(bench_analytics)
bench_app.command("soak")(bench_soak)
bench_app.command("fanout")(bench_fanout)
bench_app.command("grpc-cost")(bench_grpc_cost)

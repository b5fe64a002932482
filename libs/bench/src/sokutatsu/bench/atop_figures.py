"""The seed's Figs 10 and 11 (seed 002 §4.2) as sweeps of :mod:`sokutatsu.bench.atop`.

* Fig. 10: dummy messages per second over the whole system against the number of
  domains, one line per burst frequency (none, 1 per 15 s, 1 per 7.5 s), service time
  1 ms. With skip markers, the marker messages per second and the slots they fill.
* Fig. 11: mean arrival time against the number of domains, one line per sequencer
  service time (1, 4, 10, 25 ms), without bursts (the seed does not say; see the doc).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sokutatsu.bench.atop import AtopParams
from sokutatsu.bench.atop_run import AtopResult, simulate

DOMAINS = (1, 2, 5, 10, 20, 100)
BURST_INTERVALS: tuple[float | None, ...] = (None, 15.0, 7.5)
SERVICE_TIMES = (0.001, 0.004, 0.010, 0.025)
FIG10_SERVICE_TIME = 0.001
FULL_DURATION = 300.0
QUICK_DURATION = 60.0
FIGURES = (10, 11)


def burst_label(interval: float | None) -> str:
    return "no bursts" if interval is None else f"1 per {interval:g} s"


def figure_params(
    figure: int,
    *,
    markers: bool,
    duration: float,
    seed: int,
    check_interval: float = 0.1,
    observe_delay: float = 0.3,
) -> list[AtopParams]:
    """Every configuration of one figure, in the order they are run and reported."""
    common: dict[str, Any] = {
        "markers": markers,
        "duration": duration,
        "seed": seed,
        "check_interval": check_interval,
        "observe_delay": observe_delay,
    }
    if figure == 10:
        return [
            AtopParams(domains=d, service_time=FIG10_SERVICE_TIME, burst_interval=b, **common)
            for b in BURST_INTERVALS
            for d in DOMAINS
        ]
    if figure == 11:
        return [AtopParams(domains=d, service_time=s, **common) for s in SERVICE_TIMES for d in DOMAINS]
    raise ValueError(f"the seed's simulation has Figs 10 and 11, not {figure}")


def model_description(params: AtopParams) -> dict[str, Any]:
    """The parameters every configuration of a figure shares."""
    return {
        "clients": params.clients,
        "mean_send_interval_s": params.mean_send_interval,
        "distribution_interval_s": params.distribution_interval,
        "intra_domain_delay_mean_s": params.intra_delay,
        "inter_domain_delay_mean_s": params.inter_delay,
        "delays": "exponential",
        "burst_fraction": params.burst_fraction,
        "burst_factor": params.burst_factor,
        "burst_duration_s": params.burst_duration,
        "check_interval_s": params.check_interval,
        "observe_delay_s": params.observe_delay,
        "min_ppm": params.min_ppm,
        "leader": "d000",
        "receivers": ["client 0 (domain d000)", f"client {params.clients - 1} (the last domain)"][: params.receivers],
        "fillers": "skip markers" if params.markers else "dummies",
    }


def run_figure(
    figure: int,
    *,
    markers: bool,
    duration: float,
    seed: int,
    check_interval: float = 0.1,
    observe_delay: float = 0.3,
    progress: Callable[[AtopResult, float], None] | None = None,
) -> dict[str, Any]:
    """Run every configuration of the figure; the JSON-ready result (no wall-clock figures in it)."""
    configs = figure_params(
        figure,
        markers=markers,
        duration=duration,
        seed=seed,
        check_interval=check_interval,
        observe_delay=observe_delay,
    )
    results: list[AtopResult] = []
    for params in configs:
        started = time.perf_counter()
        result = simulate(params)
        results.append(result)
        if progress is not None:
            progress(result, time.perf_counter() - started)
    return {
        "figure": figure,
        "seed": seed,
        "duration_s": duration,
        "markers": markers,
        "model": model_description(configs[0]),
        "checks": {
            "every_data_message_delivered_once": all(r.delivered_each_once for x in results for r in x.receivers),
            "receivers_agree_on_the_order": all(x.same_order for x in results),
        },
        "results": [r.to_dict() for r in results],
    }


def summary_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows for the console table and the doc."""
    rows: list[list[str]] = []
    if result["figure"] == 10:
        header = ["bursts", "domains", "data/s", "dummies/s", "sent/s", "deliv. ms", "p99 ms"]
        for r in result["results"]:
            receiver = r["receivers"][0]
            rows.append(
                [
                    burst_label(r["burst_interval_s"]),
                    str(r["domains"]),
                    f"{r['data_per_s']:.1f}",
                    f"{r['dummies_per_s']:.1f}",
                    f"{r['filler_messages_per_s']:.1f}",
                    f"{receiver['mean_delivery_ms']:.0f}",
                    f"{receiver['p99_delivery_ms']:.0f}",
                ]
            )
        return header, rows
    header = ["svc ms", "domains", "load", "arrival ms", "wait ms", "deliv. ms"]
    for r in result["results"]:
        load = f"{r['utilization']:.2f}" + ("*" if r["saturated"] else "")
        rows.append(
            [
                f"{r['service_time_ms']:g}",
                str(r["domains"]),
                load,
                f"{r['mean_arrival_ms']:.0f}",
                f"{r['mean_queue_wait_ms']:.1f}",
                f"{r['receivers'][0]['mean_delivery_ms']:.0f}",
            ]
        )
    return header, rows

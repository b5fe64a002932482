"""PNG plots of ``sokutatsu simulate atop``, in the layout of seed 002's Figs 10 and 11."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # after choosing the backend
from matplotlib.axes import Axes

from sokutatsu.bench.atop_figures import DOMAINS, burst_label


def _domain_axis(ax: Axes) -> None:
    ax.set_xscale("log")
    ax.set_xticks(list(DOMAINS), [str(d) for d in DOMAINS])
    ax.minorticks_off()
    ax.set_xlabel("number of domains (100 clients in all)")
    ax.grid(True, which="both", alpha=0.3)


def _bursts(interval: float | None) -> str:
    return "no bursts" if interval is None else f"bursts {burst_label(interval)}"


def _series(rows: list[dict[str, Any]], key: str, value: Any, field: str) -> tuple[list[int], list[float]]:
    chosen = [r for r in rows if r[key] == value]
    return [r["domains"] for r in chosen], [r[field] for r in chosen]


def _fig10(result: dict[str, Any], path: Path) -> None:
    rows = result["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for interval in dict.fromkeys(r["burst_interval_s"] for r in rows):
        xs, ys = _series(rows, "burst_interval_s", interval, "dummies_per_s")
        if result["markers"]:
            (line,) = ax.plot(xs, ys, "--", linewidth=1, label=f"slots filled, {_bursts(interval)}")
            xs, ys = _series(rows, "burst_interval_s", interval, "filler_messages_per_s")
            ax.plot(xs, ys, "o-", color=line.get_color(), label=f"skip markers, {_bursts(interval)}")
        else:
            ax.plot(xs, ys, "o-", label=_bursts(interval))
    _domain_axis(ax)
    what = "Skip markers (and slots filled)" if result["markers"] else "Dummy messages"
    ax.set_ylabel("messages per second, whole system")
    ax.set_title(f"{what} per second vs domains (cf. seed 002 Fig. 10)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fig11(result: dict[str, Any], path: Path) -> None:
    rows = result["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for service in dict.fromkeys(r["service_time_ms"] for r in rows):
        chosen = [r for r in rows if r["service_time_ms"] == service]
        xs = [r["domains"] for r in chosen]
        (line,) = left.plot(xs, [r["mean_arrival_ms"] for r in chosen], "o-", label=f"service {service:g} ms")
        for r in chosen:
            if r["saturated"]:
                left.plot([r["domains"]], [r["mean_arrival_ms"]], "x", color="black", markersize=9)
        delivery = [r["receivers"][0]["mean_delivery_ms"] for r in chosen]
        right.plot(xs, delivery, "o-", color=line.get_color(), label=f"service {service:g} ms")
    for ax in (left, right):
        _domain_axis(ax)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    left.set_title(
        "Mean arrival time, generation → reception (cf. Fig. 11)\nblack x: offered load ≥ 1 (saturated)", fontsize=10
    )
    right.set_title("Beyond the seed: mean total-order delivery latency\n(client 0's OrderedMerge)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def atop_plot(result: dict[str, Any], path: Path) -> Path:
    """Write the figure of ``result`` (a :func:`run_figure` result) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    (_fig10 if result["figure"] == 10 else _fig11)(result, path)
    return path

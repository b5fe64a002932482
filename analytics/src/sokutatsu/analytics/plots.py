"""PNG figures of the result tables (matplotlib, no display needed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib as mpl

mpl.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from pyspark.sql import Row

__all__ = ["audit_plot", "comparison_plot", "latency_plot", "sequencer_plot", "switchover_plot", "transfers_plot"]

_MAX_SERIES = 10  # lines per panel of the latency figure; the busiest subscribers are drawn
_MAX_BARS = 30  # rows of the switchover comparison drawn; the table has them all
_STEP_ORDER = ("position", "accept", "redirect", "release", "detect")


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def latency_plot(rows: list[Row], path: Path) -> None:
    """p50, p95 and p99 delivery latency per window, one line per subscriber and topic."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True, layout="constrained")
    series: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for row in rows:
        series[row["subscriber"], row["topic"]].append(row)
    if not series:
        for ax in axes:
            _empty(ax, "no process span links to a send span in these traces")
    else:
        origin = min(row["window_start_ns"] for row in rows)
        busiest = sorted(series, key=lambda key: -sum(r["messages"] for r in series[key]))[:_MAX_SERIES]
        for ax, column in zip(axes, ("p50_ms", "p95_ms", "p99_ms"), strict=True):
            for key in sorted(busiest):
                points = sorted(series[key], key=lambda r: r["window_start_ns"])
                ax.plot(
                    [(r["window_start_ns"] - origin) / 1e9 for r in points],
                    [r[column] for r in points],
                    marker=".",
                    label=f"{key[0]} · {key[1]}",
                )
            ax.set_ylabel(f"{column.removesuffix('_ms')} (ms)")
            ax.grid(visible=True, alpha=0.3)
        axes[-1].set_xlabel("window start (s from the first window)")
        axes[0].legend(fontsize="small", ncols=2, loc="upper right")
        shown = "" if len(series) <= _MAX_SERIES else f" (the {_MAX_SERIES} busiest of {len(series)})"
        axes[0].set_title(f"Delivery latency per subscriber and topic{shown}")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def switchover_plot(rows: list[Row], path: Path) -> None:
    """Stacked step durations per switchover, in start order (seed 000's Fig. 8)."""
    fig, ax = plt.subplots(figsize=(10, 5), layout="constrained")
    switchovers: dict[str, list[Row]] = {}
    for row in sorted(rows, key=lambda r: (r["start_ns"], r["span_id"])):
        switchovers.setdefault(row["span_id"], []).append(row)
    if not switchovers:
        _empty(ax, "no switchover spans in these traces")
    else:
        seen = {row["step"] for row in rows if row["step"] is not None}
        steps = [s for s in _STEP_ORDER if s in seen] + sorted(seen - set(_STEP_ORDER))
        positions = list(range(len(switchovers)))
        bottoms = [0.0] * len(switchovers)
        for step in steps:
            heights = [sum(r["step_ms"] for r in group if r["step"] == step) for group in switchovers.values()]
            ax.bar(positions, heights, bottom=bottoms, label=step)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        totals = [group[0]["total_ms"] for group in switchovers.values()]
        ax.scatter(positions, totals, marker="_", s=200, color="black", label="whole switchover", zorder=3)
        failed = [p for p, g in zip(positions, switchovers.values(), strict=True) if g[0]["status_code"] == "ERROR"]
        if failed:
            ax.scatter(failed, [totals[p] for p in failed], marker="x", color="red", label="failed", zorder=4)
        labels = [str(g[0]["switchover_id"] or "?") for g in switchovers.values()]
        if len(labels) <= 40:
            ax.set_xticks(positions, labels)
        ax.set_xlabel("switchover (id, in start order)")
        ax.set_ylabel("ms")
        ax.set_title("Switchover duration by step")
        ax.legend(fontsize="small")
        ax.grid(visible=True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def audit_plot(rows: list[Row], path: Path) -> None:
    """Lost, duplicated and unsent messages per subscriber and topic."""
    fig, ax = plt.subplots(figsize=(10, 5), layout="constrained")
    if not rows:
        _empty(ax, "no process spans with links in these traces")
    else:
        labels = [f"{r['subscriber']}\n{r['topic']}" for r in rows]
        width = 0.27
        for i, column in enumerate(("lost", "duplicates", "unsent")):
            positions = [k + (i - 1) * width for k in range(len(rows))]
            bars = ax.bar(positions, [r[column] for r in rows], width=width, label=column)
            ax.bar_label(bars, fontsize="x-small")
        ax.set_xticks(range(len(rows)), labels, fontsize="small")
        ax.set_ylabel("messages")
        sent = sum(r["sent"] for r in rows)
        processed = sum(r["processed"] for r in rows)
        ax.set_title(f"Loss/duplicate audit ({processed} messages processed against {sent} expected)")
        ax.legend(fontsize="small")
        ax.grid(visible=True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def comparison_plot(rows: list[Row], path: Path) -> None:
    """Each subscriber's mean and worst latency during and after a switchover, relative to before (Tables 6-7)."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 8), sharex=True, layout="constrained")
    shown = [r for r in rows if r["before_mean_ms"]][:_MAX_BARS]
    if not shown:
        for ax in axes:
            _empty(ax, "no switchover with messages published before it in these traces")
    else:
        # Switchover ids can be long (the monitor's are "sw-" and 12 hex digits): their tail tells them apart.
        labels = [f"{str(r['switchover_id'] or '?')[-6:]} {r['subscriber']} ({r['role']})" for r in shown]
        width = 0.4
        for ax, measure in zip(axes, ("mean", "worst"), strict=True):
            for i, phase in enumerate(("during", "after")):
                heights = [r[f"{phase}_{measure}"] or 0.0 for r in shown]
                positions = [k + (i - 0.5) * width for k in range(len(shown))]
                ax.bar(positions, heights, width=width, label=phase)
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_ylabel(f"{measure} / mean before")
            ax.grid(visible=True, axis="y", alpha=0.3)
            ax.legend(fontsize="small")
        axes[-1].set_xticks(range(len(shown)), labels, fontsize="x-small", rotation=30, ha="right")
        axes[-1].set_xlabel("switchover id (its end), subscriber (role)")
        more = "" if len(rows) <= _MAX_BARS else f" (the first {_MAX_BARS} of {len(rows)} rows)"
        axes[0].set_title(f"Latency during and after each switchover, relative to the mean before{more}")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _percentile_bars(ax: Axes, rows: list[Row], labels: list[str], title: str) -> None:
    width = 0.27
    for i, column in enumerate(("p50_ms", "p95_ms", "p99_ms")):
        positions = [k + (i - 1) * width for k in range(len(rows))]
        ax.bar(positions, [r[column] or 0.0 for r in rows], width=width, label=column.removesuffix("_ms"))
    ax.scatter(range(len(rows)), [r["max_ms"] or 0.0 for r in rows], marker="_", s=200, color="black", label="max")
    ax.set_xticks(range(len(rows)), labels, fontsize="small")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(visible=True, axis="y", alpha=0.3)


def transfers_plot(rows: list[Row], path: Path) -> None:
    """Per queue-db link and protocol: batch duration percentiles, and batches, resends and recoveries."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    if not rows:
        for ax in axes:
            _empty(ax, "no transfer daemon spans in these traces")
    else:
        labels = [f"{r['from_node']}\u2192{r['to_node']}\n{r['mode']}" for r in rows]
        _percentile_bars(axes[0], rows, labels, "Transfer batch duration (sending to the receiver's answer)")
        width = 0.2
        for i, column in enumerate(("batches", "resent_batches", "unconfirmed_batches", "recoveries")):
            positions = [k + (i - 1.5) * width for k in range(len(rows))]
            bars = axes[1].bar(positions, [r[column] for r in rows], width=width, label=column)
            axes[1].bar_label(bars, fontsize="x-small")
        axes[1].set_xticks(range(len(rows)), labels, fontsize="small")
        axes[1].set_title("Batches, resends and recoveries")
        axes[1].legend(fontsize="small")
        axes[1].grid(visible=True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sequencer_plot(rows: list[Row], path: Path) -> None:
    """Per sequencer domain: stamping latency percentiles, and the share of filler slots."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    if not rows:
        for ax in axes:
            _empty(ax, "no sequencer spans in these traces")
    else:
        labels = [str(r["domain"]) for r in rows]
        _percentile_bars(axes[0], rows, labels, "Stamping latency (ordered publishers' round trips)")
        shares = [100.0 * (r["filler_share"] or 0.0) for r in rows]
        bars = axes[1].bar(range(len(rows)), shares, color="tab:gray")
        axes[1].bar_label(
            bars,
            [f"{r['skip_markers']} skip, {r['dummy_fills']} dummy" for r in rows],
            fontsize="x-small",
        )
        axes[1].set_xticks(range(len(rows)), labels, fontsize="small")
        axes[1].set_ylabel("% of slots")
        axes[1].set_title("Filler slots (skip markers and dummies) per domain")
        axes[1].grid(visible=True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)

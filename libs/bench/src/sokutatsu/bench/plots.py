"""PNG plots of ``sokutatsu bench slow-subscriber``, in the layout of seed 000's Figs 5, 6 and 8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # after choosing the backend

STEPS = ("position", "accept", "redirect", "release")


def slow_subscriber_plots(result: dict[str, Any], folder: Path) -> list[Path]:
    """Write the figures into ``folder``; return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for row in result["rows"]:
        kib = row["size"] // 1024
        series = row["per_hundred"]
        # Fig. 5: the normal subscriber's latency per 100 messages, both modes (log scale).
        fig, ax = plt.subplots(figsize=(8, 4))
        for mode, style in (("flow-to-disk", "-"), ("migrate", "-")):
            xs = [i * 100 for i in range(len(series[mode]))]
            ax.plot(xs, series[mode], style, label=mode, linewidth=1)
        ax.axvline(row["slow_from_message"]["flow-to-disk"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_yscale("log")
        ax.set_xlabel("message number")
        ax.set_ylabel("latency / mean before slow-down")
        ax.set_title(f"Normal subscriber latency per 100 messages, {kib} KiB (cf. seed 000 Fig. 5)")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        path = folder / f"fig5-latency-{kib}k.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        # Fig. 6: migrate alone, linear scale.
        fig, ax = plt.subplots(figsize=(8, 4))
        xs = [i * 100 for i in range(len(series["migrate"]))]
        ax.plot(xs, series["migrate"], color="tab:orange", linewidth=1)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.axvline(row["slow_from_message"]["migrate"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("message number")
        ax.set_ylabel("latency / mean before slow-down")
        ax.set_title(f"Migrate: normal subscriber latency per 100 messages, {kib} KiB (cf. Fig. 6)")
        ax.grid(True, alpha=0.3)
        path = folder / f"fig6-migrate-{kib}k.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    # Fig. 8: switchover step breakdown per size.
    rows = [r for r in result["rows"] if r["switch_ms"].get("steps_ms")]
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['size'] // 1024} KiB" for r in rows]
        bottom = [0.0] * len(rows)
        for step in STEPS:
            values = [r["switch_ms"]["steps_ms"].get(step, 0.0) for r in rows]
            ax.bar(labels, values, bottom=bottom, label=step)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("ms")
        ax.set_title("Switchover step breakdown (cf. seed 000 Fig. 8)")
        ax.legend()
        path = folder / "fig8-switch-steps.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written

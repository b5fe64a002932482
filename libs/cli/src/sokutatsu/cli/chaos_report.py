"""The report of ``sokutatsu chaos``: the JSON, a self-contained HTML page (inline SVG, no links
or scripts) with a timeline of faults and publish stalls per schedule, and the summary table."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

COLUMNS = (
    "seed",
    "faults",
    "lost",
    "duplicates",
    "reordered",
    "gaps",
    "unexpected",
    "max_actives",
    "stall max s",
    "stall p99 s",
    "settle timeouts",
)
COLORS = {
    "kill": "#d62728",
    "pause": "#ff7f0e",
    "kill-monitor": "#8c564b",
    "pause-monitor": "#c49c94",
    "cut": "#9467bd",
    "cut-monitor": "#393b79",
    "mute-monitor": "#6b6ecf",
    "flood": "#17becf",
    "slow": "#7f7f7f",
    "recover": "#bcbd22",
    "reopen": "#2ca02c",
    "restart-publisher": "#e377c2",
}
ROLE_COLORS = {"ACTIVE": "#2ca02c", "STANDBY": "#aec7e8", "": "#f0f0f0"}


def row(s: dict[str, Any]) -> list[str]:
    return [
        str(s["seed"]),
        str(len(s["faults"])),
        str(s["lost"]),
        str(s["duplicates"]),
        str(s["reordered"]),
        str(s["gaps"]),
        str(s.get("unexpected", 0)),  # reports before the check have none
        str(s["max_actives"]),
        f"{s['publish_stall_max_s']:.2f}",
        f"{s['publish_stall_p99_s']:.3f}",
        str(s.get("settle_timeouts", 0)),
    ]


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


# ----------------------------------------------------------------------- html --
WIDTH, LEFT, LANE = 1000, 110, 18


def _x(t: float, length: float) -> float:
    return LEFT + (WIDTH - LEFT - 10) * max(0.0, t) / max(length, 1e-9)


def timeline_svg(s: dict[str, Any]) -> str:
    """Lanes: each broker's answered role; faults by kind; publish stalls of 0.1 s or more (height = length)."""
    length = max(
        [s.get("duration_s", 0.0)]
        + [f["t"] + f.get("duration", 0.0) for f in s["faults"]]
        + [st["start"] + st["s"] for st in s["stalls"]]
        + [1.0]
    )
    kinds = sorted({f["kind"] for f in s["faults"]}, key=list(COLORS).index)
    brokers = sorted({b for run in s["active_timeline"] for b in run[2]})
    lanes = [*brokers, *kinds, "stalls"]
    height = 30 + LANE * (len(lanes) + 3)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-size="11">']
    for i, lane in enumerate(lanes):
        y = 20 + i * LANE
        parts.append(f'<text x="4" y="{y + 12}">{html.escape(lane)}</text>')
        parts.append(f'<line x1="{LEFT}" y1="{y + LANE}" x2="{WIDTH - 10}" y2="{y + LANE}" stroke="#eee"/>')
    for start, end, roles in s["active_timeline"]:
        for b, role in roles.items():
            y = 20 + lanes.index(b) * LANE
            x0, x1 = _x(start, length), _x(end + 0.05, length)
            parts.append(
                f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 0.5):.1f}" height="{LANE - 6}" '
                f'fill="{ROLE_COLORS.get(role, "#ccc")}"><title>{html.escape(b)} {html.escape(role or "no answer")} '
                f"{start:.2f}-{end:.2f}s</title></rect>"
            )
    for f in s["faults"]:
        y = 20 + lanes.index(f["kind"]) * LANE
        x0 = _x(f["t"], length)
        x1 = _x(f["t"] + f.get("duration", 0.0), length)
        tip = html.escape(json.dumps({k: v for k, v in f.items() if k != "kind"}))
        parts.append(
            f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 2):.1f}" height="{LANE - 6}" '
            f'fill="{COLORS.get(f["kind"], "#333")}"><title>{html.escape(f["kind"])} {tip}</title></rect>'
        )
    y = 20 + lanes.index("stalls") * LANE
    longest = max([st["s"] for st in s["stalls"]] + [0.1])
    for st in s["stalls"]:
        x0, x1 = _x(st["start"], length), _x(st["start"] + st["s"], length)
        h = max(2.0, (LANE * 3 - 4) * st["s"] / longest)
        parts.append(
            f'<rect x="{x0:.1f}" y="{y + LANE * 3 - h:.1f}" width="{max(x1 - x0, 1):.1f}" height="{h:.1f}" '
            f'fill="#1f77b4" opacity="0.7"><title>{html.escape(st["p"])} stalled {st["s"]:.3f}s '
            f"at {st['start']:.2f}s</title></rect>"
        )
    axis_y = height - 8
    parts.extend(
        f'<text x="{_x(tick, length):.1f}" y="{axis_y}" text-anchor="middle">{tick}s</text>'
        for tick in range(0, int(length) + 1, max(1, int(length) // 10))
    )
    parts.append("</svg>")
    return "".join(parts)


def _table(rows: list[list[str]], header: tuple[str, ...] | list[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def html_report(report: dict[str, Any]) -> str:
    schedules = report["schedules"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>sokutatsu chaos</title><style>",
        "body{font-family:sans-serif;margin:20px} table{border-collapse:collapse;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right} .bad{color:#b00}",
        "</style></head><body>",
        f"<h1>sokutatsu chaos, {html.escape(report['started'])}</h1>",
        f"<p>{len(schedules)} schedules; violations in {report['failed']}. Parameters: "
        f"<code>{html.escape(json.dumps(report['parameters']))}</code></p>",
        f"<p>Machine: <code>{html.escape(json.dumps(report['machine']))}</code></p>",
        _table([row(s) for s in schedules], COLUMNS),
        "<p>Lanes: each broker's answer to GetRole (green ACTIVE, blue STANDBY, grey no answer); faults "
        "by kind (width = how long); publish stalls of 0.1 s or more (height = length). Hover for details.</p>",
    ]
    for s in schedules:
        bad = s["violations"]
        parts.append(f"<h2>seed {s['seed']}</h2>")
        if bad:
            parts.append(f"<p class='bad'>{html.escape('; '.join(bad))}</p>")
        parts.append(timeline_svg(s))
        parts.append(
            _table(
                [
                    [
                        f"{f['t']:.2f}",
                        f["kind"],
                        f["target"],
                        f"{f.get('duration', 0):.2f}",
                        f"{f.get('stall_after_s', 0):.3f}",
                    ]
                    for f in s["faults"]
                ],
                ["t s", "fault", "target", "duration s", "longest stall after s"],
            )
        )
    parts.append("</body></html>")
    return "\n".join(parts)

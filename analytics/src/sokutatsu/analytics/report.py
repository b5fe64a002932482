"""Writing the result tables (Parquet, CSV), their plots and ``report.html`` into a local folder.

The tables are aggregates, small enough to collect: the driver writes them, so the
folder is on the machine that runs ``sokutatsu analyze`` whatever the Spark master.
"""

from __future__ import annotations

import csv
import datetime
import html
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, Row
from pyspark.sql.types import BooleanType, DataType, DoubleType, IntegerType, LongType, StructType

from sokutatsu.analytics import plots

__all__ = ["Table", "write_report"]

_HTML_ROWS = 200  # rows of a table shown in report.html; the files have them all


@dataclass(frozen=True)
class Table:
    name: str  # file stem
    title: str
    frame: DataFrame  # for the schema
    rows: list[Row]  # collected


def _arrow_type(spark_type: DataType) -> pa.DataType:
    if isinstance(spark_type, LongType):
        return pa.int64()
    if isinstance(spark_type, IntegerType):
        return pa.int32()
    if isinstance(spark_type, DoubleType):
        return pa.float64()
    if isinstance(spark_type, BooleanType):
        return pa.bool_()
    return pa.string()


def _write_parquet(schema: StructType, rows: list[Row], path: Path) -> None:
    arrow_schema = pa.schema([pa.field(f.name, _arrow_type(f.dataType)) for f in schema.fields])
    columns = {f.name: [row[f.name] for row in rows] for f in schema.fields}
    pq.write_table(pa.Table.from_pydict(columns, schema=arrow_schema), path)


def _write_csv(columns: list[str], rows: list[Row], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([row[c] for c in columns] for row in rows)


def _cell(value: object, column: str) -> str:
    if value is None:
        return ""
    if column.endswith("_ns") and isinstance(value, int):  # epoch ns: shown as UTC time, kept as ns in the files
        moment = datetime.datetime.fromtimestamp(value / 1e9, datetime.UTC)
        return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    if isinstance(value, float):
        return f"{value:.3f}"
    return html.escape(str(value))


def _html_table(table: Table) -> str:
    columns = table.frame.columns
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "\n".join(
        "<tr>" + "".join(f"<td>{_cell(row[c], c)}</td>" for c in columns) + "</tr>" for row in table.rows[:_HTML_ROWS]
    )
    more = (
        f"<p class='note'>First {_HTML_ROWS} of {len(table.rows)} rows; all in the files.</p>"
        if len(table.rows) > _HTML_ROWS
        else ""
    )
    files = f"<a href='{table.name}.csv'>{table.name}.csv</a> · <a href='{table.name}.parquet'>{table.name}.parquet</a>"
    return (
        f"<p class='files'>{len(table.rows)} rows: {files}</p>\n"
        f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table></div>{more}"
    )


_EXPLANATIONS = {
    "delivery_latency": (
        "Per subscriber (messaging.consumer.group.name), topic and window of {window}s: each link of a"
        " <code>process</code> span (a run of messages from one <code>send</code> span) contributes its first"
        " message's receive time minus its publish time once per message of the run (sokutatsu.seq.last -"
        " sokutatsu.seq.first + 1), in the window of its receive time; max_ms is the largest latency of any run."
        " Links without those times (older traces) count the process span's start minus the send span's."
        " Exact percentiles. The clocks are the publisher's and the subscriber's: across machines, mind clock skew."
    ),
    "loss_audit": (
        "Per subscriber and topic it processed anything from: <b>sent</b> is every sequence number the topic's"
        " publishers sent (the union of the send spans' ranges), <b>processed</b> the messages the subscriber's"
        " links name (repeats counted); <b>lost</b> were sent and never processed, <b>duplicates</b> are"
        " processings beyond the first, <b>unsent</b> were processed but no send span in the traces covers them"
        " (a publisher's spans missing, or sampled out)."
    ),
    "dependency_graph": (
        "Each span joined to its parent: an edge from the parent's service.name to the child's where they differ,"
        " with the number of calls, the calls whose child span has status ERROR, and exact percentiles of the"
        " child spans' durations."
    ),
    "transfers": (
        "Per queue-db link (sending node, receiving node) and protocol: the transfer daemon's batches"
        " (<code>transfer {{node}}</code> spans, from sending a batch to the receiver's answer), their messages,"
        " the batches resent after a reconnection, the messages the receiver found it already had, the batches"
        " a session ended on before their answer, exact percentiles of the batches' durations, and the"
        " recoveries (<code>transfer.recover</code>: one per (re)connection) with what they settled: messages"
        " marked sent without resending (1PC), prepared batches aborted and finished (2PC)."
    ),
    "sequencer_domains": (
        "Per sequencer domain: the stamping latency the ordered publishers saw (<code>sequencer.stamp</code>"
        " spans, one per window of a publisher's requests, carrying each request's round trip from writing it"
        " to reading the stamped range; exact percentiles over the requests), the distinct distributions"
        " installed, the fillers (skip markers and dummy messages, seed \u00a73.3) in all and per second of"
        " the domain's traced period (first to last of its spans), and filler_share: the filler slots over"
        " all slots (stamped messages and fillers), the extended ATOP's overhead for a quiet domain."
    ),
    "sequencer_fills": (
        "Per sequencer domain and distribution: how many distributions it installed"
        " (<code>sequencer.install_distribution</code>), and the filler publishes"
        " (<code>sequencer.fill</code>: skip markers or dummy messages, seed \u00a73.3) and the slots they filled"
        " for the domain's share or to show a new distribution."
    ),
    "switchover_comparison": (
        "Seed 000's Tables 6 and 7 from the traces: for each switchover, every subscriber of its topic"
        " (<b>moved</b>: the one switched; <b>normal</b>: the others), with the messages by publish time in"
        " three phases: <b>before</b> the {phase}s before the switchover started, <b>during</b> it, <b>after</b>"
        " the {phase}s after it ended. before_mean_ms and before_worst_ms are in milliseconds; the other"
        " means and worsts are relative to before_mean_ms, as the seed reports them (1.0: as before the"
        " switchover). A run of messages counts once per message with its first message's latency; a phase's"
        " worst is the largest latency of its runs. The slow-down that caused a switchover is before it, so"
        " a moved subscriber's before is already slow."
    ),
    "switchover_steps": (
        "Every <code>switchover</code> span of the monitor and its <code>switchover.{{step}}</code> children, as"
        " in seed 000's Fig. 8: the bars stack the steps' durations, the black tick is the whole switchover"
        " (the gap between them is the monitor's own work between steps); a red cross marks a failed one."
    ),
}
_FIGURES = {
    "delivery_latency": "latency.png",
    "loss_audit": "audit.png",
    "switchover_steps": "switchover_steps.png",
    "switchover_comparison": "switchover_comparison.png",
    "transfers": "transfers.png",
    "sequencer_domains": "sequencer.png",
}

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 0.2em 0.5em; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; } .scroll { max-height: 28em; overflow: auto; }
img { max-width: 100%; border: 1px solid #eee; } .note, .files { color: #555; font-size: 0.9em; }
"""


def _html(
    tables: list[Table], *, window_seconds: float, phase_seconds: float, source: str, counts: Mapping[str, int]
) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    summary = (
        f"{counts['spans']} spans from {counts['lines']} lines of <code>{html.escape(source)}</code>;"
        f" {counts['malformed_lines']} malformed lines and {counts['incomplete_spans']} incomplete spans skipped."
    )
    sections = []
    for table in tables:
        figure = _FIGURES.get(table.name)
        image = f"<p><img src='{figure}' alt='{html.escape(table.title)}'></p>" if figure else ""
        explanation = _EXPLANATIONS[table.name].format(window=f"{window_seconds:g}", phase=f"{phase_seconds:g}")
        sections.append(
            f"<h2 id='{table.name}'>{html.escape(table.title.capitalize())}</h2>\n"
            f"<p>{explanation}</p>\n{image}\n{_html_table(table)}"
        )
    contents = " · ".join(f"<a href='#{t.name}'>{html.escape(t.title)}</a>" for t in tables)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>Sokutatsu trace analysis</title><style>{_STYLE}</style></head><body>\n"
        f"<h1>Sokutatsu trace analysis</h1>\n<p>{summary} Written {now} by <code>sokutatsu analyze</code>;"
        " span conventions: docs/tracing.md.</p>\n"
        f"<p>{contents}</p>\n" + "\n".join(sections) + "\n</body></html>\n"
    )


def write_report(
    tables: list[Table],
    out: Path,
    *,
    window_seconds: float,
    phase_seconds: float,
    source: str,
    counts: Mapping[str, int],
) -> Path:
    """Each table as ``<name>.parquet`` and ``<name>.csv``, the figures as PNG, and ``report.html``."""
    out.mkdir(parents=True, exist_ok=True)
    for table in tables:
        _write_parquet(table.frame.schema, table.rows, out / f"{table.name}.parquet")
        _write_csv(table.frame.columns, table.rows, out / f"{table.name}.csv")
    by_name = {t.name: t.rows for t in tables}
    plots.latency_plot(by_name.get("delivery_latency", []), out / _FIGURES["delivery_latency"])
    plots.audit_plot(by_name.get("loss_audit", []), out / _FIGURES["loss_audit"])
    plots.switchover_plot(by_name.get("switchover_steps", []), out / _FIGURES["switchover_steps"])
    plots.comparison_plot(by_name.get("switchover_comparison", []), out / _FIGURES["switchover_comparison"])
    plots.transfers_plot(by_name.get("transfers", []), out / _FIGURES["transfers"])
    plots.sequencer_plot(by_name.get("sequencer_domains", []), out / _FIGURES["sequencer_domains"])
    report = out / "report.html"
    page = _html(tables, window_seconds=window_seconds, phase_seconds=phase_seconds, source=source, counts=counts)
    report.write_text(page, encoding="utf-8")
    return report

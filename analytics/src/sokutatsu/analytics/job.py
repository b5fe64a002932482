"""``sokutatsu analyze`` as a function: read the traces, run the transforms, write the report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession

from sokutatsu.analytics import transforms
from sokutatsu.analytics.reader import read_spans
from sokutatsu.analytics.report import Table, write_report

__all__ = ["AnalysisResult", "analyze", "spark_session"]

_LOG4J = Path(__file__).with_name("log4j2.properties")


def spark_session(
    master: str = "local[*]", app_name: str = "sokutatsu-analyze", *, short_job: bool = False
) -> SparkSession:
    """A session for the job: quiet driver log, no console progress bar, UTC, few shuffle partitions.

    ``short_job``: the JVM compiles with its quick compiler only (``-XX:TieredStopAtLevel=1``), for a
    session that analyses a few thousand spans and stops (the demo, the tests). On the demo's 1,008
    spans, a new session plus two analyses cost the JVM 39-41 s of CPU with it and 63-64 s without
    (two runs each, 2 cores); the optimising compiler only pays back over long jobs.

    Result tables are small aggregates, so adaptive execution coalesces shuffles; the
    initial partition count, twice the cores, only bounds the parallelism of the joins (on
    2 cores over 1M spans, the audit took 7 s with 4 and 8-11 s with 16, single runs). The
    input is read in splits of 32 MiB, so every core has work to the end of the parse. The
    spans and the frames several tables share are cached uncompressed: compressing them cost
    more than it saved (300k spans, three interleaved rounds on 2 cores: 0.73-0.87 of the time
    with compression).
    """
    jit = " -XX:TieredStopAtLevel=1" if short_job else ""
    session = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={_LOG4J.as_uri()}{jit}")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.files.maxPartitionBytes", "32m")
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.sql.inMemoryColumnarStorage.compressed", "false")
        .getOrCreate()
    )
    session.conf.set("spark.sql.shuffle.partitions", str(2 * session.sparkContext.defaultParallelism))
    return session


@dataclass(frozen=True)
class AnalysisResult:
    report: Path
    spans: int
    lines: int
    malformed_lines: int
    incomplete_spans: int
    rows: dict[str, int]  # table name -> rows written
    seconds: float


def analyze(
    spark: SparkSession,
    traces: str,
    out: Path,
    *,
    window_seconds: float = 1.0,
    phase_seconds: float = 10.0,
    progress: Callable[[str], None] = lambda _: None,
) -> AnalysisResult:
    """Analyse every span under ``traces`` into ``out``; raises ``NoSpansError`` when there is none."""
    started = time.monotonic()
    progress(f"reading spans from {traces}")
    read = read_spans(spark, traces)
    progress(
        f"read {read.span_count} spans from {read.lines} lines"
        f" ({read.malformed_lines} malformed lines and {read.incomplete_spans} incomplete spans skipped)"
    )
    # The frames three analyses share (sends, message runs and their unions), built once and kept.
    kept: list[DataFrame] = []

    def keep(frame: DataFrame) -> DataFrame:
        kept.append(frame.persist(StorageLevel.MEMORY_AND_DISK))
        return frame

    messages = transforms.Messages.of(read.spans, keep)
    # The control plane's few spans, scanned by five tables: apart, instead of each scanning every span.
    control = keep(transforms.control_plane(read.spans))
    try:
        frames: list[tuple[str, str, DataFrame]] = [
            (
                "delivery_latency",
                "delivery latency",
                transforms.delivery_latency(read.spans, window_seconds, messages=messages),
            ),
            ("loss_audit", "loss/duplicate audit", transforms.loss_audit(read.spans, messages=messages)),
            ("dependency_graph", "service dependency graph", transforms.dependency_graph(read.spans)),
            ("switchover_steps", "switchover steps", transforms.switchover_steps(control)),
            (
                "switchover_comparison",
                "latency before, during and after switchovers",
                transforms.switchover_comparison(control, phase_seconds, messages=messages),
            ),
            ("transfers", "queue-db transfers", transforms.transfers(control)),
            (
                "sequencer_domains",
                "sequencer stamping and fillers per domain",
                transforms.sequencer_domains(control),
            ),
            ("sequencer_fills", "sequencer distributions and fillers", transforms.sequencer_fills(control)),
        ]

        tables = []
        for name, title, frame in frames:
            progress(f"computing {title}")
            tables.append(Table(name=name, title=title, frame=frame, rows=frame.collect()))
        progress(f"writing tables, plots and report.html to {out}")
        report = write_report(
            tables,
            out,
            window_seconds=window_seconds,
            phase_seconds=phase_seconds,
            source=traces,
            counts={
                "spans": read.span_count,
                "lines": read.lines,
                "malformed_lines": read.malformed_lines,
                "incomplete_spans": read.incomplete_spans,
            },
        )
    finally:
        for frame in kept:
            frame.unpersist()
        read.release()
    return AnalysisResult(
        report=report,
        spans=read.span_count,
        lines=read.lines,
        malformed_lines=read.malformed_lines,
        incomplete_spans=read.incomplete_spans,
        rows={t.name: len(t.rows) for t in tables},
        seconds=time.monotonic() - started,
    )

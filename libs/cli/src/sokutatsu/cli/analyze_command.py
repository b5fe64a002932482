"""``sokutatsu analyze``: the Spark job over the suite's traces (docs/analytics.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

# Spark and the job are the optional extra sokutatsu-cli[analytics]: the CLI (and the runtime image) go without.
ANALYTICS_MISSING = (
    "`sokutatsu analyze` needs the analytics extra (sokutatsu-analytics, pyspark), which is not installed: "
    "pip install 'sokutatsu-cli[analytics]' (in the repository: make setup)"
)
_ANALYTICS_MODULES = ("sokutatsu.analytics", "pyspark", "pyarrow", "matplotlib")


def analytics_missing(exc: ModuleNotFoundError) -> bool:
    """Whether the import failed for want of the analytics extra (not of something else)."""
    return any(exc.name == m or (exc.name or "").startswith(m + ".") for m in _ANALYTICS_MODULES)


def analyze(
    traces: Annotated[
        str,
        typer.Option(
            "--traces", help="OTLP/JSON-lines trace files: a file, folder or glob, local or any Hadoop-compatible URI."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Folder for the tables, plots and report.html.")],
    master: Annotated[str, typer.Option("--master", help="Spark master URL.")] = "local[*]",
    window_seconds: Annotated[
        float, typer.Option("--window-seconds", help="Length of the delivery-latency windows.")
    ] = 1.0,
    phase_seconds: Annotated[
        float,
        typer.Option(
            "--phase-seconds",
            help="How far before and after each switchover the before/after comparison looks (publish times).",
        ),
    ] = 10.0,
) -> None:
    """Analyse traces with Spark: latency, loss audit, service graph, switchovers, transfers, sequencers."""
    if window_seconds <= 0:
        raise typer.BadParameter("must be positive", param_hint="--window-seconds")
    if phase_seconds <= 0:
        raise typer.BadParameter("must be positive", param_hint="--phase-seconds")
    try:
        from pyspark.sql import SparkSession  # noqa: PLC0415 - Spark only for this command

        from sokutatsu.analytics.job import analyze as run_job  # noqa: PLC0415
        from sokutatsu.analytics.job import spark_session  # noqa: PLC0415
        from sokutatsu.analytics.reader import NoSpansError  # noqa: PLC0415
    except ModuleNotFoundError as exc:
        if not analytics_missing(exc):
            raise
        err.print(f"sokutatsu: error: {ANALYTICS_MISSING}", markup=False)
        raise typer.Exit(2) from None

    started = time.monotonic()

    def progress(stage: str) -> None:
        console.print(f"[{time.monotonic() - started:6.1f} s] {stage}", markup=False)

    # In a process that already runs Spark (a notebook, a test) the job joins that session and leaves it running.
    ours = SparkSession.getActiveSession() is None
    progress(f"starting Spark ({master})" if ours else "using the running Spark session")
    spark = spark_session(master)
    try:
        result = run_job(
            spark, traces, out, window_seconds=window_seconds, phase_seconds=phase_seconds, progress=progress
        )
    except NoSpansError as exc:
        err.print(f"sokutatsu: error: {exc}", markup=False)
        raise typer.Exit(1) from None
    finally:
        if ours:
            spark.stop()
    if result.malformed_lines or result.incomplete_spans:
        err.print(
            f"sokutatsu: warning: skipped {result.malformed_lines} malformed lines"
            f" and {result.incomplete_spans} incomplete spans",
            markup=False,
        )
    rows = ", ".join(f"{name} {n}" for name, n in result.rows.items())
    progress(f"done: {result.spans} spans analysed; rows: {rows}")
    console.print(f"report: {result.report.resolve()}", markup=False)

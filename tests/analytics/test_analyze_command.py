"""``sokutatsu analyze`` as a user runs it, in-process on the tests' running Spark session (the
command joins a running session and leaves it running). Starting a JVM of its own costs a cold
JVM per test (tens of seconds here); the demo's test runs the analysis in a process that starts
its own Spark (tests/demo)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner

from sokutatsu.cli.app import app
from tests.analytics.tracegen import generate, write_otlp

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.spark, pytest.mark.slow]

TABLES = (
    "delivery_latency",
    "loss_audit",
    "dependency_graph",
    "switchover_steps",
    "switchover_comparison",
    "transfers",
    "sequencer_domains",
    "sequencer_fills",
)
FIGURES = (
    "latency.png",
    "audit.png",
    "switchover_steps.png",
    "switchover_comparison.png",
    "transfers.png",
    "sequencer.png",
)


def test_analyze_writes_the_report(spark: SparkSession, tmp_path: Path) -> None:
    import pyarrow.parquet as pq  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    traces, out = tmp_path / "traces", tmp_path / "out"
    write_otlp(generate(5, publishers=2, subscribers=2, topics=2, batches=5), traces, 5)
    with (traces / "broken.jsonl").open("w", encoding="utf-8") as f:
        f.write("this is not OTLP\n")
    # In a notebook's long-lived session every run's persisted spans and runs must be released.
    spark.catalog.clearCache()  # other tests' frames: they are recomputed when used again
    cache = spark._jsparkSession.sharedState().cacheManager()  # no public API lists cached plans
    assert cache.isEmpty()
    done = CliRunner().invoke(
        app, ["analyze", "--traces", str(traces), "--out", str(out), "--window-seconds", "0.5"]
    )  # fmt: skip
    assert done.exit_code == 0, (done.stdout, done.stderr, done.exception)
    assert f"report: {out.resolve() / 'report.html'}" in done.stdout
    assert "using the running Spark session" in done.stdout
    assert "computing delivery latency" in done.stdout
    assert "skipped 1 malformed lines" in done.stderr
    html = (out / "report.html").read_text(encoding="utf-8")
    for name in TABLES:
        with (out / f"{name}.csv").open(encoding="utf-8") as f:
            csv_rows = list(csv.DictReader(f))
        parquet = pq.read_table(out / f"{name}.parquet")
        assert parquet.num_rows == len(csv_rows) > 0, name
        assert parquet.column_names == list(csv_rows[0])
        assert f"href='{name}.csv'" in html
    for figure in FIGURES:
        assert (out / figure).read_bytes().startswith(b"\x89PNG"), figure
        assert f"src='{figure}'" in html
    assert cache.isEmpty(), "the job left frames cached in a session it shares"
    assert spark.range(3).count() == 3  # left running


def test_analyze_without_spans_fails_in_one_line(spark: SparkSession, tmp_path: Path) -> None:
    # In-process, on the tests' running session (the command leaves a session it did not start running).
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["analyze", "--traces", str(tmp_path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("sokutatsu:")]
    assert errors == [f"sokutatsu: error: no spans in {tmp_path} (0 non-blank lines, 0 malformed, 0 incomplete spans)"]
    assert not (tmp_path / "out" / "report.html").exists()
    assert spark.range(3).count() == 3  # still running

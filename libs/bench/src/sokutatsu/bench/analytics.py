"""``sokutatsu bench analytics``: seconds for ``sokutatsu analyze`` over N generated spans.

The spans (``sokutatsu.analytics.synthetic``: send and process spans with links, gRPC calls
between services) are written to a temporary folder first; the clock runs from the start of
the job (Spark's session started already, as when a cluster is up) to ``report.html``
written, every stage included: reading and parsing the JSON, the eight tables, the files and
plots. Spark runs ``local[*]`` on this machine.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from sokutatsu.cli.measure import machine, write_json

console = Console(highlight=False, soft_wrap=True)

TARGET_SECONDS_PER_MILLION = 60.0


def run(spans: int, master: str = "local[*]") -> dict[str, Any]:
    from sokutatsu.analytics import synthetic  # noqa: PLC0415 - Spark only for this command
    from sokutatsu.analytics.job import analyze, spark_session  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-analytics-") as tmp:
        folder = Path(tmp)
        began = time.monotonic()
        written = synthetic.write(folder / "traces", spans)
        generated = time.monotonic() - began
        size = sum(f.stat().st_size for f in (folder / "traces").iterdir())
        console.print(f"generated {written:,} spans ({size / 2**20:,.0f} MiB) in {generated:.1f} s")
        from pyspark.sql import SparkSession  # noqa: PLC0415

        ours = SparkSession.getActiveSession() is None  # a running session (a test's) is left running
        spark = spark_session(master)
        stages: list[tuple[str, float]] = []
        try:
            started = time.monotonic()

            def progress(stage: str) -> None:
                stages.append((stage, round(time.monotonic() - started, 2)))
                console.print(f"[{time.monotonic() - started:6.1f} s] {stage}", markup=False)

            result = analyze(spark, str(folder / "traces"), folder / "out", progress=progress)
            seconds = time.monotonic() - started
        finally:
            if ours:
                spark.stop()
    per_million = seconds / (written / 1e6)
    return {
        "benchmark": "analytics",
        "spans": written,
        "seconds": round(seconds, 2),
        "seconds_per_million_spans": round(per_million, 2),
        "target_seconds_per_million": TARGET_SECONDS_PER_MILLION,
        "target_met": per_million <= TARGET_SECONDS_PER_MILLION,
        "input_bytes": size,
        "generate_seconds": round(generated, 2),
        "stages": stages,
        "rows": result.rows,
        "master": master,
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def bench_analytics(
    spans: Annotated[int, typer.Option("--spans", min=1_000, help="Spans to generate and analyse.")] = 1_000_000,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the result here.")] = None,
    master: Annotated[str, typer.Option("--master", help="Spark master URL.")] = "local[*]",
) -> None:
    """Seconds for `sokutatsu analyze` over N generated spans (target: 1,000,000 in 60 s or less)."""
    result = run(spans, master)
    console.print(
        f"analysed {result['spans']:,} spans in {result['seconds']} s "
        f"({result['seconds_per_million_spans']} s per million; target <= {TARGET_SECONDS_PER_MILLION:g})"
    )
    write_json(json_path, result)

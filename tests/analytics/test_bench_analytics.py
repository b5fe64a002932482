"""The analytics benchmark's machinery on a tiny real run: generated spans, the whole job, the
figures; and the generated set audits clean (every message processed once by every subscriber).
The figures themselves come from `make bench`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from sokutatsu.bench.analytics import run

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.timeout(240), pytest.mark.spark]


def test_a_tiny_run_measures_the_job(spark: SparkSession) -> None:
    from pyspark.sql import SparkSession  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    result = run(3_000)
    assert result["spans"] >= 3_000
    assert result["seconds"] > 0
    assert isinstance(result["target_met"], bool)
    assert result["rows"]["loss_audit"] > 0
    assert result["rows"]["delivery_latency"] > 0
    assert result["rows"]["dependency_graph"] == 1  # monitor -> broker
    assert [stage for stage, _ in result["stages"]][-1].startswith("writing")
    assert SparkSession.getActiveSession() is not None  # the test's session was left running


def test_generated_spans_audit_clean(spark: SparkSession, tmp_path: Path) -> None:
    from sokutatsu.analytics import synthetic, transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)
    from sokutatsu.analytics.reader import read_spans  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    written = synthetic.write(tmp_path, 5_000, subscribers=2)
    read = read_spans(spark, str(tmp_path))
    assert read.span_count == written
    assert read.malformed_lines == read.incomplete_spans == 0
    audit = transforms.loss_audit(read.spans).collect()
    assert audit
    assert all(r["sent"] == r["processed"] and r["lost"] == r["duplicates"] == r["unsent"] == 0 for r in audit)

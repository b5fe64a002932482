"""The Spark analyses against the plain-Python reference, on random trace sets written as OTLP/JSON lines."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import pytest

from tests.analytics import reference
from tests.analytics.tracegen import TraceSet, generate, write_otlp

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sokutatsu.analytics.reader import SpanRead

pytestmark = pytest.mark.spark

SEEDS = (1, 2)  # each seed costs a few seconds of Spark; their shapes differ


@pytest.fixture(scope="module", params=SEEDS, ids=[f"seed{s}" for s in SEEDS])
def traces(
    request: pytest.FixtureRequest, spark: SparkSession, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TraceSet, SpanRead]:
    from sokutatsu.analytics.reader import read_spans  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    seed: int = request.param
    trace_set = generate(seed, publishers=2 + seed % 2, subscribers=3, topics=2 + seed % 2)
    directory = tmp_path_factory.mktemp(f"traces{seed}")
    write_otlp(trace_set, directory, seed)
    return trace_set, read_spans(spark, str(directory))


def _close(actual: dict[str, Any], expected: dict[str, float]) -> None:
    for column, value in expected.items():
        assert math.isclose(actual[column], value, rel_tol=1e-9, abs_tol=1e-9), (column, actual, expected)


def test_every_span_is_read_once(traces: tuple[TraceSet, SpanRead]) -> None:
    trace_set, read = traces
    assert read.span_count == len(trace_set.spans)
    assert read.malformed_lines == 0
    assert read.incomplete_spans == 0
    assert read.spans.select("span_id").distinct().count() == len(trace_set.spans)
    kinds = {row["kind"] for row in read.spans.select("kind").distinct().collect()}
    assert kinds == {"PRODUCER", "CONSUMER", "SERVER", "CLIENT", "INTERNAL"}


@pytest.mark.parametrize("window_seconds", [1.0, 0.25, 3.0])
def test_delivery_latency_matches_the_reference(traces: tuple[TraceSet, SpanRead], window_seconds: float) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set, read = traces
    expected = reference.delivery_latency(trace_set.spans, round(window_seconds * 1e9))
    rows = transforms.delivery_latency(read.spans, window_seconds).collect()
    actual = {(r["subscriber"], r["topic"], r["window_start_ns"]): r.asDict() for r in rows}
    assert actual.keys() == expected.keys()
    for key, values in expected.items():
        _close(actual[key], values)
        assert actual[key]["window_seconds"] == window_seconds


def test_loss_audit_matches_the_reference_and_the_truth(traces: tuple[TraceSet, SpanRead]) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set, read = traces
    expected = reference.loss_audit(trace_set.spans)
    actual = {(r["subscriber"], r["topic"]): r.asDict() for r in transforms.loss_audit(read.spans).collect()}
    assert actual.keys() == expected.keys()
    for key, values in expected.items():
        assert {k: actual[key][k] for k in values} == values, key
    # What the generator lost and repeated on purpose is what the audit finds (sends left out of the
    # traces show as "unsent" instead of as sent).
    if trace_set.missing_sends == 0:
        assert {k: v["lost"] for k, v in actual.items() if v["lost"]} == dict(trace_set.lost)
    assert {k: v["duplicates"] for k, v in actual.items() if v["duplicates"]} == dict(trace_set.duplicated)


def test_dependency_graph_matches_the_reference(traces: tuple[TraceSet, SpanRead]) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set, read = traces
    expected = reference.dependency_graph(trace_set.spans)
    rows = transforms.dependency_graph(read.spans).collect()
    actual = {(r["parent_service"], r["child_service"]): r.asDict() for r in rows}
    assert actual.keys() == expected.keys()
    assert any(values["errors"] for values in expected.values())
    for key, values in expected.items():
        _close(actual[key], values)


def test_switchover_steps_match_the_reference(traces: tuple[TraceSet, SpanRead]) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set, read = traces
    expected = reference.switchover_steps(trace_set.spans)
    actual: dict[str, list[tuple[str, float, float]]] = {}
    for r in transforms.switchover_steps(read.spans).collect():
        steps = actual.setdefault(r["span_id"], [])
        if r["step"] is not None:
            steps.append((r["step"], r["step_offset_ms"], r["step_ms"]))
    assert actual.keys() == expected.keys()
    for key, steps in expected.items():
        assert [s[0] for s in actual[key]] == [s[0] for s in steps]
        for got, want in zip(actual[key], steps, strict=True):
            assert math.isclose(got[1], want[1])
            assert math.isclose(got[2], want[2])


def test_transfers_match_the_reference(traces: tuple[TraceSet, SpanRead]) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set, read = traces
    expected = reference.transfers(trace_set.spans)
    rows = transforms.transfers(read.spans).collect()
    actual = {(r["from_node"], r["to_node"], r["mode"]): r.asDict() for r in rows}
    assert actual.keys() == expected.keys()
    for key, values in expected.items():
        for column in reference.TRANSFER_COUNTS:
            assert actual[key][column] == values[column], (key, column)
        if "p50_ms" in values:
            _close(actual[key], {k: values[k] for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms")})


def test_sequencer_fills_match_the_reference(traces: tuple[TraceSet, SpanRead]) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set, read = traces
    expected = reference.sequencer_fills(trace_set.spans)
    rows = transforms.sequencer_fills(read.spans).collect()
    actual = {(r["domain"], r["distribution_id"]): r.asDict() for r in rows}
    assert actual.keys() == expected.keys()
    for key, values in expected.items():
        assert {k: actual[key][k] for k in values} == values, key


@pytest.mark.parametrize("phase_seconds", [1.0, 0.3])
def test_switchover_comparison_matches_the_reference(traces: tuple[TraceSet, SpanRead], phase_seconds: float) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set, read = traces
    expected = reference.switchover_comparison(trace_set.spans, round(phase_seconds * 1e9))
    rows = transforms.switchover_comparison(read.spans, phase_seconds).collect()
    actual = {(r["span_id"], r["subscriber"]): r.asDict() for r in rows}
    assert actual.keys() == expected.keys()
    # The generated trace sets must exercise every phase and both roles, or the check says little.
    assert {r["role"] for r in expected.values()} == {"moved", "normal"}
    assert all(any(r[f"{p}_messages"] for r in expected.values()) for p in transforms.PHASES)
    for key, values in expected.items():
        for column, value in values.items():
            if isinstance(value, float):
                assert math.isclose(actual[key][column], value, rel_tol=1e-9), (key, column)
            else:
                assert actual[key][column] == value, (key, column)


def test_sequencer_domains_match_the_reference(traces: tuple[TraceSet, SpanRead]) -> None:
    from sokutatsu.analytics import transforms  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set, read = traces
    expected = reference.sequencer_domains(trace_set.spans)
    actual = {r["domain"]: r.asDict() for r in transforms.sequencer_domains(read.spans).collect()}
    assert actual.keys() == expected.keys() == {"a", "b", "quiet"}
    assert actual["quiet"]["stamp_requests"] == 0
    assert actual["quiet"]["p50_ms"] is None
    for domain, values in expected.items():
        for column, value in values.items():
            if isinstance(value, float):
                assert math.isclose(actual[domain][column], value, rel_tol=1e-9), (domain, column)
            else:
                assert actual[domain][column] == value, (domain, column)

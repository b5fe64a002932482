"""Reading trace files: OTLP/JSON variants, malformed lines counted and skipped, no spans refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.analytics.tracegen import generate, write_otlp

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

# Another exporter's way of writing the same things: enum names, intValue as a JSON number,
# upper-case ids, a double, a bool, an array; and a span without a span id (incomplete).
HAND_WRITTEN = {
    "resourceSpans": [
        {
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "other-exporter"}}]},
            "scopeSpans": [
                {
                    "spans": [
                        {
                            "traceId": "0AF7651916CD43DD8448EB211C80319C",
                            "spanId": "B7AD6B7169203331",
                            "name": "send t",
                            "kind": "SPAN_KIND_PRODUCER",
                            "startTimeUnixNano": 1700000000000000000,
                            "endTimeUnixNano": "1700000000000500000",
                            "status": {"code": "STATUS_CODE_ERROR"},
                            "attributes": [
                                {"key": "sokutatsu.seq.first", "value": {"intValue": 7}},
                                {"key": "sokutatsu.seq.last", "value": {"intValue": "9"}},
                                {"key": "ratio", "value": {"doubleValue": 0.5}},
                                {"key": "flag", "value": {"boolValue": True}},
                                {"key": "list", "value": {"arrayValue": {"values": [{"stringValue": "a"}]}}},
                            ],
                            "links": [
                                {
                                    "traceId": "0af7651916cd43dd8448eb211c80319d",
                                    "spanId": "00f067aa0ba902b7",
                                    "attributes": [{"key": "messaging.client.id", "value": {"stringValue": "p"}}],
                                }
                            ],
                        },
                        {"traceId": "0af7651916cd43dd8448eb211c80319c", "name": "no span id"},
                    ]
                }
            ],
        }
    ]
}

MALFORMED = [
    "not json at all",
    '{"resourceSpans": [{"scopeSpans": [{"spans": [',  # cut off mid-write
    "[1, 2, 3]",
    '{"resourceSpans": "not a list"}',
]


def test_other_encodings_of_otlp_json_are_read(spark: SparkSession, tmp_path: Path) -> None:
    from sokutatsu.analytics.reader import read_spans  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    (tmp_path / "other.jsonl").write_text(json.dumps(HAND_WRITTEN) + "\n", encoding="utf-8")
    read = read_spans(spark, str(tmp_path))
    assert (read.span_count, read.lines, read.malformed_lines, read.incomplete_spans) == (1, 1, 0, 1)
    span = read.spans.first()
    assert span is not None
    assert span["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert span["span_id"] == "b7ad6b7169203331"
    assert span["parent_span_id"] is None
    assert (span["kind"], span["status_code"], span["service_name"]) == ("PRODUCER", "ERROR", "other-exporter")
    assert (span["start_ns"], span["end_ns"]) == (1700000000000000000, 1700000000000500000)
    attributes = span["attributes"]
    assert (attributes["sokutatsu.seq.first"], attributes["sokutatsu.seq.last"]) == ("7", "9")
    assert (attributes["ratio"], attributes["flag"]) == ("0.5", "true")
    assert json.loads(attributes["list"]) == {"values": [{"stringValue": "a"}]}
    # The same file by a glob and by a file: URI (Spark reads any Hadoop-compatible path).
    assert read_spans(spark, str(tmp_path / "*.jsonl")).span_count == 1
    assert read_spans(spark, (tmp_path / "other.jsonl").as_uri()).span_count == 1
    (link,) = span["links"]
    assert (link["trace_id"], link["span_id"], link["attributes"]) == (
        "0af7651916cd43dd8448eb211c80319d",
        "00f067aa0ba902b7",
        {"messaging.client.id": "p"},
    )


def test_malformed_lines_are_counted_and_skipped(spark: SparkSession, tmp_path: Path) -> None:
    from sokutatsu.analytics.reader import read_spans  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    trace_set = generate(11, publishers=1, subscribers=1, topics=1, batches=3)
    paths = write_otlp(trace_set, tmp_path, 11)
    good_lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in paths)
    path = paths[0]
    good = path.read_text(encoding="utf-8").splitlines()
    mixed = [good[0], *MALFORMED[:2], "", "   ", *good[1:], *MALFORMED[2:]]
    path.write_text("\n".join(mixed) + "\n", encoding="utf-8")
    read = read_spans(spark, str(tmp_path))
    assert read.malformed_lines == len(MALFORMED)
    assert read.lines == good_lines + len(MALFORMED)  # blank lines are not lines of the trace
    assert read.span_count == len(trace_set.spans)
    assert read.incomplete_spans == 0


def test_no_spans_is_an_error(spark: SparkSession, tmp_path: Path) -> None:
    from sokutatsu.analytics.reader import NoSpansError, read_spans  # noqa: PLC0415 - Spark only where it runs (conftest.py)

    with pytest.raises(NoSpansError, match="no spans in"):
        read_spans(spark, str(tmp_path / "missing"))
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(NoSpansError, match="0 non-blank lines"):
        read_spans(spark, str(tmp_path))
    (tmp_path / "bad.jsonl").write_text("\n".join([*MALFORMED, '{"resourceSpans": []}']) + "\n", encoding="utf-8")
    with pytest.raises(NoSpansError, match=f"5 non-blank lines, {len(MALFORMED)} malformed"):
        read_spans(spark, str(tmp_path))

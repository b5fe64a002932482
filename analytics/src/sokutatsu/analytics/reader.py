"""Reading OTLP/JSON-lines trace files into one flat span DataFrame (I/O only).

Each line of a trace file is one OTLP ``ExportTraceServiceRequest`` in JSON
(``sokutatsu.core.telemetry``): ``resourceSpans`` → ``scopeSpans`` → ``spans``,
ids in hex, attributes as ``{key, value: {stringValue|intValue|...}}``. Spark
reads the text (``spark.read.text``), so any Hadoop-compatible path works: a
file, a directory, a glob, ``hdfs://``, ``s3a://`` ...

Every attribute value is read as its JSON text (Spark keeps the raw text of a
number, a boolean or a nested array when the declared type is a string), so
``intValue`` works both as a JSON string (as protobuf JSON writes 64-bit
integers) and as a JSON number.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql.types import ArrayType, StringType, StructField, StructType

__all__ = ["SPAN_COLUMNS", "NoSpansError", "SpanRead", "read_spans"]

_CORRUPT = "_corrupt_record"

_VALUE_KINDS = ("stringValue", "intValue", "doubleValue", "boolValue", "arrayValue", "kvlistValue", "bytesValue")
_ATTRIBUTES = ArrayType(
    StructType(
        [
            StructField("key", StringType()),
            StructField("value", StructType([StructField(kind, StringType()) for kind in _VALUE_KINDS])),
        ]
    )
)
_LINK = StructType(
    [
        StructField("traceId", StringType()),
        StructField("spanId", StringType()),
        StructField("attributes", _ATTRIBUTES),
    ]
)
_SPAN = StructType(
    [
        StructField("traceId", StringType()),
        StructField("spanId", StringType()),
        StructField("parentSpanId", StringType()),
        StructField("name", StringType()),
        StructField("kind", StringType()),
        StructField("startTimeUnixNano", StringType()),
        StructField("endTimeUnixNano", StringType()),
        StructField("attributes", _ATTRIBUTES),
        StructField("links", ArrayType(_LINK)),
        StructField("status", StructType([StructField("code", StringType()), StructField("message", StringType())])),
    ]
)
_REQUEST = StructType(
    [
        StructField(
            "resourceSpans",
            ArrayType(
                StructType(
                    [
                        StructField("resource", StructType([StructField("attributes", _ATTRIBUTES)])),
                        StructField("scopeSpans", ArrayType(StructType([StructField("spans", ArrayType(_SPAN))]))),
                    ]
                )
            ),
        ),
        StructField(_CORRUPT, StringType()),
    ]
)

# OTLP/JSON writes enums as integers; some exporters write their names.
_KINDS = {
    "1": "INTERNAL", "SPAN_KIND_INTERNAL": "INTERNAL",
    "2": "SERVER", "SPAN_KIND_SERVER": "SERVER",
    "3": "CLIENT", "SPAN_KIND_CLIENT": "CLIENT",
    "4": "PRODUCER", "SPAN_KIND_PRODUCER": "PRODUCER",
    "5": "CONSUMER", "SPAN_KIND_CONSUMER": "CONSUMER",
}  # fmt: skip
_STATUS_CODES = {
    "0": "UNSET", "STATUS_CODE_UNSET": "UNSET",
    "1": "OK", "STATUS_CODE_OK": "OK",
    "2": "ERROR", "STATUS_CODE_ERROR": "ERROR",
}  # fmt: skip

#: The columns of the span DataFrame, in order.
SPAN_COLUMNS = (
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "kind",
    "start_ns",
    "end_ns",
    "status_code",
    "service_name",
    "attributes",
    "links",
)


class NoSpansError(Exception):
    """The path holds no span: nothing to analyse."""


@dataclass(frozen=True)
class SpanRead:
    """The spans read from a path, and what was skipped on the way."""

    spans: DataFrame  # SPAN_COLUMNS, over a persisted DataFrame
    span_count: int
    lines: int  # non-blank lines read
    malformed_lines: int  # not JSON, or not an ExportTraceServiceRequest: skipped
    incomplete_spans: int  # without a trace id, span id or start/end time: skipped
    cached: DataFrame  # what ``spans`` is selected from, persisted

    def release(self) -> None:
        """Drop the persisted spans. (``spans.unpersist()`` would not: ``spans`` is a query over them.)"""
        self.cached.unpersist()


def _lookup(mapping: dict[str, str], column: Column, default: str) -> Column:
    table = F.create_map(*[F.lit(x) for pair in mapping.items() for x in pair])
    return F.coalesce(table[column], F.lit(default))


def _attribute_map(attributes: Column) -> Column:
    """``[{key, value: {...}}]`` → ``map<string, string>`` (later keys win; never null)."""
    entries = F.transform(
        F.filter(attributes, lambda a: a["key"].isNotNull()),
        lambda a: F.struct(
            a["key"].alias("key"),
            F.coalesce(*[a["value"][kind] for kind in _VALUE_KINDS]).alias("value"),
        ),
    )
    empty = F.create_map().cast("map<string,string>")
    return F.coalesce(F.map_from_entries(entries), empty)


def _hex_id(column: Column) -> Column:
    """Ids lower case; an empty id (protobuf JSON's default) is no id."""
    return F.when(F.length(column) > 0, F.lower(column))


def read_spans(spark: SparkSession, path: str) -> SpanRead:
    """Every span under ``path`` as one row; raises :class:`NoSpansError` when there is none."""
    # Attributes given twice keep the last value instead of failing the job.
    spark.conf.set("spark.sql.mapKeyDedupPolicy", "LAST_WIN")
    options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT}
    try:
        text = spark.read.text(path)
    except AnalysisException as exc:
        # The path, or every path a glob names, does not exist.
        raise NoSpansError(f"no spans in {path}: {exc.getMessage() or exc}") from None
    lines = text.where(F.length(F.trim("value")) > 0).select(F.from_json("value", _REQUEST, options).alias("request"))
    malformed = F.col("request").isNull() | F.col(f"request.{_CORRUPT}").isNotNull()
    # Each line's spans as one array of (service_name, span), exploded keeping the lines without any, so that
    # a single pass (one JSON parse) counts lines, malformed lines, spans and incomplete spans.
    resources = F.transform(
        F.col("request.resourceSpans"),
        lambda rs: F.struct(
            _attribute_map(rs["resource"]["attributes"])["service.name"].alias("service_name"),
            F.flatten(F.filter(F.transform(rs["scopeSpans"], lambda ss: ss["spans"]), lambda x: x.isNotNull())).alias(
                "spans"
            ),
        ),
    )
    line_spans = F.flatten(
        F.filter(
            F.transform(
                resources,
                lambda r: F.transform(
                    r["spans"], lambda s: F.struct(r["service_name"].alias("service_name"), s.alias("s"))
                ),
            ),
            lambda x: x.isNotNull(),
        )
    )
    raw = lines.select(
        malformed.alias("_malformed"), F.posexplode_outer(F.when(~malformed, line_spans)).alias("_pos", "_item")
    ).select("_malformed", "_pos", "_item.service_name", "_item.s")
    links = F.transform(
        F.coalesce(F.col("s.links"), F.array().cast(ArrayType(_LINK))),
        lambda link: F.struct(
            _hex_id(link["traceId"]).alias("trace_id"),
            _hex_id(link["spanId"]).alias("span_id"),
            _attribute_map(link["attributes"]).alias("attributes"),
        ),
    )
    flat = raw.select(
        "_malformed",
        (F.col("_pos").isNull() | (F.col("_pos") == 0)).alias("_first"),  # one row of each line has it
        F.col("s").isNotNull().alias("_span"),
        _hex_id(F.col("s.traceId")).alias("trace_id"),
        _hex_id(F.col("s.spanId")).alias("span_id"),
        _hex_id(F.col("s.parentSpanId")).alias("parent_span_id"),
        F.coalesce(F.col("s.name"), F.lit("")).alias("name"),
        _lookup(_KINDS, F.col("s.kind"), "UNSPECIFIED").alias("kind"),
        F.col("s.startTimeUnixNano").cast("long").alias("start_ns"),
        F.col("s.endTimeUnixNano").cast("long").alias("end_ns"),
        _lookup(_STATUS_CODES, F.col("s.status.code"), "UNSET").alias("status_code"),
        "service_name",
        _attribute_map(F.col("s.attributes")).alias("attributes"),
        links.alias("links"),
    )
    complete = (
        F.col("_span")
        & F.col("trace_id").isNotNull()
        & F.col("span_id").isNotNull()
        & F.col("start_ns").isNotNull()
        & F.col("end_ns").isNotNull()
    )
    flagged = flat.withColumn("_complete", complete).persist(StorageLevel.MEMORY_AND_DISK)
    counts = flagged.agg(
        F.count(F.when(F.col("_first"), 1)).alias("lines"),
        F.count(F.when(F.col("_first") & F.col("_malformed"), 1)).alias("malformed"),
        F.count(F.when(F.col("_complete"), 1)).alias("spans"),
        F.count(F.when(F.col("_span") & ~F.col("_complete"), 1)).alias("incomplete"),
    ).first()
    if counts is None:  # an aggregate without grouping always has its one row
        raise RuntimeError("Spark returned no row for the span counts")
    line_count, malformed_count = int(counts["lines"]), int(counts["malformed"])
    span_count, incomplete = int(counts["spans"]), int(counts["incomplete"])
    if span_count == 0:
        flagged.unpersist()
        detail = f"{line_count} non-blank lines, {malformed_count} malformed, {incomplete} incomplete spans"
        raise NoSpansError(f"no spans in {path} ({detail})")
    return SpanRead(
        spans=flagged.where("_complete").select(*SPAN_COLUMNS),
        span_count=span_count,
        lines=line_count,
        malformed_lines=malformed_count,
        incomplete_spans=incomplete,
        cached=flagged,
    )

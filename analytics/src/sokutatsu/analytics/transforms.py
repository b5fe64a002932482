"""The analyses: pure functions from the span DataFrame to result tables (no I/O).

Each follows docs/tracing.md. The input has the columns of
:data:`sokutatsu.analytics.reader.SPAN_COLUMNS`. Percentiles are exact (Spark's
``percentile``, linear interpolation between the closest ranks, as numpy's
default), weighted where a row stands for several messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

__all__ = [
    "PERCENTILES",
    "PHASES",
    "Messages",
    "control_plane",
    "delivery_latency",
    "dependency_graph",
    "loss_audit",
    "message_runs",
    "sent_ranges",
    "sequencer_domains",
    "sequencer_fills",
    "switchover_comparison",
    "switchover_steps",
    "transfers",
]

#: The percentiles every latency table reports, and their column suffixes.
PERCENTILES = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))

_NS_PER_MS = 1_000_000.0

OPERATION = "messaging.operation.type"
DESTINATION = "messaging.destination.name"
CLIENT_ID = "messaging.client.id"
CONSUMER_GROUP = "messaging.consumer.group.name"
SEQ_FIRST = "sokutatsu.seq.first"
SEQ_LAST = "sokutatsu.seq.last"
PUBLISHED = "sokutatsu.publish_time_unix_nano"
RECEIVED = "sokutatsu.receive_time_unix_nano"
WORST = "sokutatsu.latency_max_ns"
FILTERED_FROM = "sokutatsu.seq.filtered_from"


def _attr(name: str, column: str = "attributes") -> Column:
    return F.col(column)[name]


def _percentile_columns(value: Column, prefix: str, frequency: Column | None = None) -> list[Column]:
    fractions = F.array(*[F.lit(p) for p, _ in PERCENTILES])
    values = F.percentile(value, fractions) if frequency is None else F.percentile(value, fractions, frequency)
    return [values.alias(f"_{prefix}_percentiles")]


def _expand_percentiles(frame: DataFrame, prefix: str) -> DataFrame:
    array = F.col(f"_{prefix}_percentiles")
    columns = [array[i].alias(f"{name}_{prefix}") for i, (_, name) in enumerate(PERCENTILES)]
    return frame.select(*[c for c in frame.columns if c != f"_{prefix}_percentiles"], *columns)


def sent_ranges(spans: DataFrame) -> DataFrame:
    """One row per ``send`` span: its batch's range of publisher sequence numbers.

    Columns: trace_id, span_id, publisher, topic, seq_first, seq_last, send_start_ns.
    """
    return spans.where(_attr(OPERATION) == "send").select(
        "trace_id",
        "span_id",
        _attr(CLIENT_ID).alias("publisher"),
        _attr(DESTINATION).alias("topic"),
        _attr(SEQ_FIRST).cast("long").alias("seq_first"),
        _attr(SEQ_LAST).cast("long").alias("seq_last"),
        F.col("start_ns").alias("send_start_ns"),
    )


def message_runs(spans: DataFrame) -> DataFrame:
    """One row per link of a ``process`` span: a run of consecutive messages from one send span.

    Columns: subscriber, topic, process_span_id, process_start_ns, send_trace_id,
    send_span_id, publisher, seq_first, seq_last, messages (seq_last - seq_first + 1), and
    published_ns, received_ns, worst_ns (the run's first message's publish and receive times
    and the run's largest latency), filtered_from (numbers from it to seq_first - 1 were left
    out by the subscription's filter); null where the link does not carry them.
    Links without a valid range are left out.
    """
    links = spans.where(_attr(OPERATION) == "process").select(
        _attr(CONSUMER_GROUP).alias("subscriber"),
        _attr(DESTINATION).alias("topic"),
        F.col("span_id").alias("process_span_id"),
        F.col("start_ns").alias("process_start_ns"),
        F.explode("links").alias("link"),
    )
    runs = links.select(
        "subscriber",
        "topic",
        "process_span_id",
        "process_start_ns",
        F.col("link.trace_id").alias("send_trace_id"),
        F.col("link.span_id").alias("send_span_id"),
        _attr(CLIENT_ID, "link.attributes").alias("publisher"),
        _attr(SEQ_FIRST, "link.attributes").cast("long").alias("seq_first"),
        _attr(SEQ_LAST, "link.attributes").cast("long").alias("seq_last"),
        _attr(PUBLISHED, "link.attributes").cast("long").alias("published_ns"),
        _attr(RECEIVED, "link.attributes").cast("long").alias("received_ns"),
        _attr(WORST, "link.attributes").cast("long").alias("worst_ns"),
        _attr(FILTERED_FROM, "link.attributes").cast("long").alias("filtered_from"),
    ).withColumn("messages", F.col("seq_last") - F.col("seq_first") + 1)
    return runs.where(F.col("messages") > 0)


@dataclass(frozen=True)
class Messages:
    """The message-level frames the delivery analyses share (:func:`delivery_latency`,
    :func:`switchover_comparison`, :func:`loss_audit`), built once from the spans.

    ``sends`` is :func:`sent_ranges`, ``runs`` :func:`message_runs`; ``sent`` is the union of the
    sent ranges per publisher and topic, ``processed`` the union of the processed ranges per
    subscriber, topic and publisher (with the numbers a filter left out, see :func:`loss_audit`),
    both as disjoint ranges. ``keep`` is applied to each as it is built (a job persists them,
    so that no analysis recomputes them: Spark does not share the subplans on its own).
    """

    sends: DataFrame
    runs: DataFrame
    sent: DataFrame
    processed: DataFrame

    @classmethod
    def of(cls, spans: DataFrame, keep: Callable[[DataFrame], DataFrame] = lambda frame: frame) -> Messages:
        sends = keep(sent_ranges(spans))
        runs = keep(message_runs(spans))
        sent = _merged(
            sends.where(F.col("seq_last") >= F.col("seq_first")).select("publisher", "topic", "seq_first", "seq_last"),
            ["publisher", "topic"],
        )
        processed = _merged(_audited_runs(runs).drop("messages"), ["subscriber", "topic", "publisher"])
        return cls(sends, runs, keep(sent), keep(processed))


def _audited_runs(runs: DataFrame) -> DataFrame:
    """Runs as the audit counts them: a filtered subscriber's link also accounts for the numbers
    before its run that its filter left out."""
    return (
        runs.withColumn("seq_first", F.least("seq_first", F.coalesce("filtered_from", "seq_first")))
        .withColumn("messages", F.col("seq_last") - F.col("seq_first") + 1)
        .select("subscriber", "topic", "publisher", "seq_first", "seq_last", "messages")
    )


def _timed_runs(messages: Messages) -> DataFrame:
    """Message runs with their timing: the first message's latency and the run's worst.

    A link with the SDK's publish and receive times gives ``received - published``; one without
    them gives the process span's start minus its send span's start (left out when the send span
    is not in the traces): only those are joined to their send spans. Columns: subscriber, topic,
    messages, published_ns, at_ns (the receive time, else the process span's start), latency_ms,
    worst_ms.
    """
    runs = messages.runs
    timed = F.col("received_ns").isNotNull() & F.col("published_ns").isNotNull()
    columns = ["subscriber", "topic", "messages", "published_ns", "at_ns", "latency_ms", "worst_ms"]
    latency = (F.col("received_ns") - F.col("published_ns")) / _NS_PER_MS
    with_times = runs.where(timed).select(
        "subscriber",
        "topic",
        "messages",
        "published_ns",
        F.col("received_ns").alias("at_ns"),
        latency.alias("latency_ms"),
        F.greatest(latency, F.col("worst_ns") / _NS_PER_MS).alias("worst_ms"),
    )
    starts = messages.sends.select(
        F.col("trace_id").alias("send_trace_id"), F.col("span_id").alias("send_span_id"), "send_start_ns"
    )
    by_spans = (F.col("process_start_ns") - F.col("send_start_ns")) / _NS_PER_MS
    without = (
        runs.where(~timed)
        .join(starts, ["send_trace_id", "send_span_id"])
        .select(
            "subscriber",
            "topic",
            "messages",
            F.col("send_start_ns").alias("published_ns"),
            F.col("process_start_ns").alias("at_ns"),
            by_spans.alias("latency_ms"),
            F.greatest(by_spans, F.col("worst_ns") / _NS_PER_MS).alias("worst_ms"),
        )
    )
    return with_times.select(*columns).unionByName(without.select(*columns))


def delivery_latency(spans: DataFrame, window_seconds: float, *, messages: Messages | None = None) -> DataFrame:
    """Delivery latency per subscriber, topic and time window.

    A run contributes, once per message, its first message's ``receive - publish`` time from
    the link (in the window of the receive time), and its largest latency to ``max_ms``; a link
    without those times contributes ``process.start - send.start`` (in the window of the
    process span's start), left out when its send span is not in the traces. Columns:
    subscriber, topic, window_start_ns, window_seconds, messages, p50_ms, p95_ms, p99_ms, max_ms.
    ``messages``: the spans' :class:`Messages`, when the caller has them already.
    """
    window_ns = round(window_seconds * 1e9)
    if window_ns <= 0:
        raise ValueError(f"window_seconds must be positive, not {window_seconds}")
    at = F.col("at_ns")
    timed = _timed_runs(messages or Messages.of(spans)).withColumn("window_start_ns", at - F.pmod(at, F.lit(window_ns)))
    grouped = timed.groupBy("subscriber", "topic", "window_start_ns").agg(
        F.sum("messages").alias("messages"),
        *_percentile_columns(F.col("latency_ms"), "ms", F.col("messages")),
        F.max("worst_ms").alias("max_ms"),
    )
    table = _expand_percentiles(grouped, "ms").withColumn("window_seconds", F.lit(float(window_seconds)))
    return table.select(
        "subscriber", "topic", "window_start_ns", "window_seconds", "messages", "p50_ms", "p95_ms", "p99_ms", "max_ms"
    ).orderBy("subscriber", "topic", "window_start_ns")


#: The phases of :func:`switchover_comparison`, in order.
PHASES = ("before", "during", "after")


def switchover_comparison(spans: DataFrame, phase_seconds: float, *, messages: Messages | None = None) -> DataFrame:
    """Each subscriber's latency before, during and after each switchover of its topic (seed 000's Tables 6-7).

    Messages are placed by their publish time, as in the seed: *before* is what was published in
    the ``phase_seconds`` before the switchover span started, *during* what was published while it
    ran, *after* what was published in the ``phase_seconds`` after it ended. A run counts once per
    message with its first message's latency (as in :func:`delivery_latency`); a phase's worst is
    the largest latency of its runs. One row per switchover and subscriber that processed anything
    of the switchover's topic in those phases; ``role`` is ``moved`` for the switched subscriber
    and ``normal`` for the others. Columns: switchover_id, span_id, start_ns, topic, moved_subscriber,
    subscriber, role, before_messages, during_messages, after_messages, before_mean_ms,
    before_worst_ms, and relative to before_mean_ms (as the seed's tables): during_mean,
    after_mean, during_worst, after_worst (null when a phase has no message, or before has none).
    """
    phase_ns = round(phase_seconds * 1e9)
    if phase_ns <= 0:
        raise ValueError(f"phase_seconds must be positive, not {phase_seconds}")
    switchovers = spans.where(F.col("name") == "switchover").select(
        F.col("span_id").alias("switchover_span_id"),
        _attr("sokutatsu.switchover.id").alias("switchover_id"),
        _attr("sokutatsu.topic").alias("topic"),
        _attr("sokutatsu.subscriber_id").alias("moved_subscriber"),
        F.col("start_ns").alias("s_start_ns"),
        F.col("end_ns").alias("s_end_ns"),
    )
    runs = _timed_runs(messages or Messages.of(spans))
    published = F.col("published_ns")
    phase = (
        F.when((published >= F.col("s_start_ns") - phase_ns) & (published < F.col("s_start_ns")), "before")
        .when((published >= F.col("s_start_ns")) & (published <= F.col("s_end_ns")), "during")
        .when((published > F.col("s_end_ns")) & (published <= F.col("s_end_ns") + phase_ns), "after")
    )
    placed = runs.join(F.broadcast(switchovers), "topic").withColumn("phase", phase).where(F.col("phase").isNotNull())
    keys = ["switchover_span_id", "switchover_id", "s_start_ns", "topic", "moved_subscriber", "subscriber"]
    per_phase = (
        placed.groupBy(*keys)
        .pivot("phase", list(PHASES))
        .agg(
            F.sum("messages").alias("messages"),
            (F.sum(F.col("latency_ms") * F.col("messages")) / F.sum("messages")).alias("mean"),
            F.max("worst_ms").alias("worst"),
        )
    )
    before_mean = F.col("before_mean")

    def relative(column: str) -> Column:
        return F.when(before_mean > 0, F.col(column) / before_mean)

    return per_phase.select(
        "switchover_id",
        F.col("switchover_span_id").alias("span_id"),
        F.col("s_start_ns").alias("start_ns"),
        "topic",
        "moved_subscriber",
        "subscriber",
        F.when(F.col("subscriber") == F.col("moved_subscriber"), "moved").otherwise("normal").alias("role"),
        *[F.coalesce(F.col(f"{p}_messages"), F.lit(0)).alias(f"{p}_messages") for p in PHASES],
        before_mean.alias("before_mean_ms"),
        F.col("before_worst").alias("before_worst_ms"),
        *[relative(column).alias(column) for column in ("during_mean", "after_mean", "during_worst", "after_worst")],
    ).orderBy("start_ns", "span_id", "role", "subscriber")


def _merged(ranges: DataFrame, keys: list[str]) -> DataFrame:
    """The union of [seq_first, seq_last] ranges per key, as disjoint, non-adjacent ranges."""
    ordered = Window.partitionBy(*keys).orderBy("seq_first", "seq_last")
    reach = F.max("seq_last").over(ordered.rowsBetween(Window.unboundedPreceding, -1))
    starts = ranges.withColumn("_new", F.when(reach.isNull() | (F.col("seq_first") > reach + 1), 1).otherwise(0))
    grouped = starts.withColumn("_range", F.sum("_new").over(ordered.rowsBetween(Window.unboundedPreceding, 0)))
    return grouped.groupBy(*keys, "_range").agg(
        F.min("seq_first").alias("seq_first"), F.max("seq_last").alias("seq_last")
    )


def _size(first: str = "seq_first", last: str = "seq_last") -> Column:
    return F.col(last) - F.col(first) + 1


def loss_audit(spans: DataFrame, *, messages: Messages | None = None) -> DataFrame:
    """Sent against processed sequence numbers, per subscriber and topic (exact, by range arithmetic).

    A subscriber is audited for every topic it processed anything from, against every
    publisher that sent on that topic. Columns: subscriber, topic, publishers, sent
    (distinct sequence numbers sent), processed (messages processed, repeats counted),
    lost (sent, never processed), duplicates (processings beyond the first), unsent
    (processed, but no send span covers them: e.g. a publisher's traces are missing).
    """
    messages = messages or Messages.of(spans)
    sent, processed = messages.sent, messages.processed
    sent_sizes = sent.groupBy("publisher", "topic").agg(F.sum(_size()).alias("sent"))
    processed_totals = (
        _audited_runs(messages.runs)
        .groupBy("subscriber", "topic", "publisher")
        .agg(F.sum("messages").alias("processed"))
    )
    distinct = processed.groupBy("subscriber", "topic", "publisher").agg(F.sum(_size()).alias("distinct"))
    s, p = sent.alias("s"), processed.alias("p")
    overlap = (F.col("s.seq_first") <= F.col("p.seq_last")) & (F.col("p.seq_first") <= F.col("s.seq_last"))
    both = (
        p.join(s, (F.col("s.publisher") == F.col("p.publisher")) & (F.col("s.topic") == F.col("p.topic")) & overlap)
        .select(
            "p.subscriber",
            "p.topic",
            "p.publisher",
            (F.least("s.seq_last", "p.seq_last") - F.greatest("s.seq_first", "p.seq_first") + 1).alias("n"),
        )
        .groupBy("subscriber", "topic", "publisher")
        .agg(F.sum("n").alias("delivered"))
    )
    audited = processed_totals.select("subscriber", "topic").distinct()
    keys = ["subscriber", "topic", "publisher"]
    expected = audited.join(sent_sizes, "topic")  # every publisher of an audited topic
    per_publisher = (
        expected.join(processed_totals, keys, "full_outer")
        .join(distinct, keys, "left")
        .join(both, keys, "left")
        .fillna(0, ["sent", "processed", "distinct", "delivered"])
    )
    return (
        per_publisher.groupBy("subscriber", "topic")
        .agg(
            F.countDistinct("publisher").alias("publishers"),
            F.sum("sent").alias("sent"),
            F.sum("processed").alias("processed"),
            F.sum(F.col("sent") - F.col("delivered")).alias("lost"),
            F.sum(F.col("processed") - F.col("distinct")).alias("duplicates"),
            F.sum(F.col("distinct") - F.col("delivered")).alias("unsent"),
        )
        .orderBy("subscriber", "topic")
    )


def dependency_graph(spans: DataFrame) -> DataFrame:
    """Edges parent service → child service (where they differ), from each span's parent.

    Columns: parent_service, child_service, calls, errors (child status ERROR),
    p50_ms, p95_ms, p99_ms, max_ms of the child spans' durations.
    """
    children = spans.where(F.col("parent_span_id").isNotNull()).select(
        "trace_id",
        "parent_span_id",
        F.col("service_name").alias("child_service"),
        F.col("status_code"),
        ((F.col("end_ns") - F.col("start_ns")) / _NS_PER_MS).alias("duration_ms"),
    )
    parents = spans.select(
        "trace_id", F.col("span_id").alias("parent_span_id"), F.col("service_name").alias("parent_service")
    )
    edges = children.join(parents, ["trace_id", "parent_span_id"]).where(
        F.col("parent_service") != F.col("child_service")  # null on either side: no edge
    )
    grouped = edges.groupBy("parent_service", "child_service").agg(
        F.count(F.lit(1)).alias("calls"),
        F.count(F.when(F.col("status_code") == "ERROR", 1)).alias("errors"),
        *_percentile_columns(F.col("duration_ms"), "ms"),
        F.max("duration_ms").alias("max_ms"),
    )
    return (
        _expand_percentiles(grouped, "ms")
        .select("parent_service", "child_service", "calls", "errors", "p50_ms", "p95_ms", "p99_ms", "max_ms")
        .orderBy("parent_service", "child_service")
    )


def control_plane(spans: DataFrame) -> DataFrame:
    """The spans :func:`switchover_steps`, :func:`switchover_comparison` (its switchovers),
    :func:`transfers`, :func:`sequencer_domains` and :func:`sequencer_fills` read: a few among
    the messaging spans, so a job can persist them apart and scan them instead of every span."""
    name = F.col("name")
    return spans.where(
        (name == "switchover")
        | name.startswith("switchover.")
        | name.startswith("transfer")
        | name.startswith("sequencer.")
    )


def switchover_steps(spans: DataFrame) -> DataFrame:
    """One row per ``switchover`` span and ``switchover.{step}`` child (seed 000's Fig. 8).

    Columns: trace_id, span_id (of the switchover), switchover_id, subscriber, topic,
    from_broker, to_broker, reason, status_code, start_ns, total_ms, step,
    step_offset_ms (from the switchover's start), step_ms. A switchover without step
    spans has one row with step null.
    """
    switchovers = spans.where(F.col("name") == "switchover").select(
        "trace_id",
        "span_id",
        _attr("sokutatsu.switchover.id").alias("switchover_id"),
        _attr("sokutatsu.subscriber_id").alias("subscriber"),
        _attr("sokutatsu.topic").alias("topic"),
        _attr("sokutatsu.from_broker").alias("from_broker"),
        _attr("sokutatsu.to_broker").alias("to_broker"),
        _attr("sokutatsu.reason").alias("reason"),
        "status_code",
        "start_ns",
        ((F.col("end_ns") - F.col("start_ns")) / _NS_PER_MS).alias("total_ms"),
    )
    steps = spans.where(F.col("name").startswith("switchover.")).select(
        "trace_id",
        F.col("parent_span_id").alias("span_id"),
        F.substring_index(F.col("name"), ".", -1).alias("step"),
        F.col("start_ns").alias("step_start_ns"),
        ((F.col("end_ns") - F.col("start_ns")) / _NS_PER_MS).alias("step_ms"),
    )
    joined = switchovers.join(steps, ["trace_id", "span_id"], "left")
    return joined.select(
        *switchovers.columns,
        "step",
        ((F.col("step_start_ns") - F.col("start_ns")) / _NS_PER_MS).alias("step_offset_ms"),
        "step_ms",
    ).orderBy("start_ns", "span_id", "step_offset_ms")


def transfers(spans: DataFrame) -> DataFrame:
    """Per queue-db link and protocol: the transfer daemon's batches and recoveries (docs/tracing.md).

    Columns: from_node, to_node, mode, batches, messages, resent_batches, duplicates,
    unconfirmed_batches (status ERROR: the session ended before the answer), p50_ms, p95_ms,
    p99_ms, max_ms (batch durations, confirmed batches), recoveries, marked_sent (1PC),
    aborted, finished (2PC).
    """
    link = [
        _attr("sokutatsu.transfer.from_node").alias("from_node"),
        _attr("sokutatsu.transfer.to_node").alias("to_node"),
        _attr("sokutatsu.transfer.mode").alias("mode"),
    ]
    keys = ["from_node", "to_node", "mode"]
    batches = spans.where(F.col("name").startswith("transfer ") & _attr("sokutatsu.transfer.mode").isNotNull())
    confirmed = F.col("status_code") != "ERROR"
    duration = F.when(confirmed, (F.col("end_ns") - F.col("start_ns")) / _NS_PER_MS)
    per_batch = batches.select(
        *link,
        _attr("messaging.batch.message_count").cast("long").alias("count"),
        (_attr("sokutatsu.transfer.resent") == "true").alias("resent"),
        F.coalesce(_attr("sokutatsu.transfer.duplicates").cast("long"), F.lit(0)).alias("dups"),
        confirmed.alias("confirmed"),
        duration.alias("duration_ms"),
    )
    grouped = per_batch.groupBy(*keys).agg(
        F.count(F.lit(1)).alias("batches"),
        F.sum("count").alias("messages"),
        F.count(F.when(F.col("resent"), 1)).alias("resent_batches"),
        F.sum("dups").alias("duplicates"),
        F.count(F.when(~F.col("confirmed"), 1)).alias("unconfirmed_batches"),
        *_percentile_columns(F.col("duration_ms"), "ms"),
        F.max("duration_ms").alias("max_ms"),
    )
    recoveries = (
        spans.where(F.col("name") == "transfer.recover")
        .select(
            *link,
            F.coalesce(_attr("sokutatsu.transfer.marked_sent").cast("long"), F.lit(0)).alias("marked"),
            F.coalesce(_attr("sokutatsu.transfer.aborted").cast("long"), F.lit(0)).alias("abort"),
            F.coalesce(_attr("sokutatsu.transfer.finished").cast("long"), F.lit(0)).alias("finish"),
        )
        .groupBy(*keys)
        .agg(
            F.count(F.lit(1)).alias("recoveries"),
            F.sum("marked").alias("marked_sent"),
            F.sum("abort").alias("aborted"),
            F.sum("finish").alias("finished"),
        )
    )
    counts = ["batches", "messages", "resent_batches", "duplicates", "unconfirmed_batches"]
    recovered = ["recoveries", "marked_sent", "aborted", "finished"]
    table = _expand_percentiles(grouped, "ms").join(recoveries, keys, "full_outer").fillna(0, [*counts, *recovered])
    return table.select(*keys, *counts, "p50_ms", "p95_ms", "p99_ms", "max_ms", *recovered).orderBy(*keys)


def sequencer_fills(spans: DataFrame) -> DataFrame:
    """Per sequencer domain and distribution id: installs and fillers (docs/tracing.md).

    Columns: domain, distribution_id, installs, skip_markers, skip_slots, dummy_fills,
    dummy_slots.
    """
    keys = ["domain", "distribution_id"]
    installs = (
        spans.where(F.col("name") == "sequencer.install_distribution")
        .select(
            _attr("sokutatsu.domain").alias("domain"),
            _attr("sokutatsu.distribution.id").cast("long").alias("distribution_id"),
        )
        .groupBy(*keys)
        .agg(F.count(F.lit(1)).alias("installs"))
    )
    fills = (
        spans.where(F.col("name") == "sequencer.fill")
        .select(
            _attr("sokutatsu.domain").alias("domain"),
            _attr("sokutatsu.distribution.id").cast("long").alias("distribution_id"),
            _attr("sokutatsu.fill.kind").alias("kind"),
            _attr("sokutatsu.fill.slots").cast("long").alias("slots"),
        )
        .groupBy(*keys)
        .agg(
            F.count(F.when(F.col("kind") == "skip", 1)).alias("skip_markers"),
            F.sum(F.when(F.col("kind") == "skip", F.col("slots")).otherwise(0)).alias("skip_slots"),
            F.count(F.when(F.col("kind") == "dummy", 1)).alias("dummy_fills"),
            F.sum(F.when(F.col("kind") == "dummy", F.col("slots")).otherwise(0)).alias("dummy_slots"),
        )
    )
    columns = ["installs", "skip_markers", "skip_slots", "dummy_fills", "dummy_slots"]
    return installs.join(fills, keys, "full_outer").fillna(0, columns).select(*keys, *columns).orderBy(*keys)


_INT_ARRAY = "struct<values: array<struct<intValue: string>>>"  # an OTLP/JSON arrayValue of ints


def sequencer_domains(spans: DataFrame) -> DataFrame:
    """Per sequencer domain: stamping latency seen by the ordered publishers, and the fillers' rates.

    From ``sequencer.stamp`` spans (the SDK's: one per window of a publisher's stamp requests,
    each request's round trip in ``sokutatsu.stamp.latency_ns``), ``sequencer.fill`` and
    ``sequencer.install_distribution`` spans (docs/tracing.md). Columns: domain, publishers,
    stamp_requests, stamped_messages, p50_ms, p95_ms, p99_ms, max_ms (round trips), distributions
    (distinct ids installed), skip_markers, skip_slots, dummy_fills, dummy_slots, seconds (first
    to last span of the domain), skip_markers_per_s, dummy_fills_per_s, filler_share (filler slots
    over all slots: stamped messages and fillers; null without any).
    """
    domain = _attr("sokutatsu.domain").alias("domain")
    stamps = spans.where(F.col("name") == "sequencer.stamp")
    latencies = stamps.select(
        domain,
        F.explode(
            F.transform(F.from_json(_attr("sokutatsu.stamp.latency_ns"), _INT_ARRAY)["values"], lambda v: v["intValue"])
        ).alias("latency_ns"),
    ).select("domain", (F.col("latency_ns").cast("long") / _NS_PER_MS).alias("latency_ms"))
    stamping = _expand_percentiles(
        latencies.groupBy("domain").agg(
            *_percentile_columns(F.col("latency_ms"), "ms"), F.max("latency_ms").alias("max_ms")
        ),
        "ms",
    )
    stamp_counts = (
        stamps.select(
            domain,
            _attr(CLIENT_ID).alias("publisher"),
            _attr("sokutatsu.stamp.requests").cast("long").alias("requests"),
            _attr("messaging.batch.message_count").cast("long").alias("messages"),
        )
        .groupBy("domain")
        .agg(
            F.countDistinct("publisher").alias("publishers"),
            F.sum("requests").alias("stamp_requests"),
            F.sum("messages").alias("stamped_messages"),
        )
    )
    fills = (
        spans.where(F.col("name") == "sequencer.fill")
        .select(
            domain,
            _attr("sokutatsu.fill.kind").alias("kind"),
            _attr("sokutatsu.fill.slots").cast("long").alias("slots"),
        )
        .groupBy("domain")
        .agg(
            F.count(F.when(F.col("kind") == "skip", 1)).alias("skip_markers"),
            F.sum(F.when(F.col("kind") == "skip", F.col("slots")).otherwise(0)).alias("skip_slots"),
            F.count(F.when(F.col("kind") == "dummy", 1)).alias("dummy_fills"),
            F.sum(F.when(F.col("kind") == "dummy", F.col("slots")).otherwise(0)).alias("dummy_slots"),
        )
    )
    installs = (
        spans.where(F.col("name") == "sequencer.install_distribution")
        .select(domain, _attr("sokutatsu.distribution.id").alias("distribution_id"))
        .groupBy("domain")
        .agg(F.countDistinct("distribution_id").alias("distributions"))
    )
    period = (
        spans.where(F.col("name").isin("sequencer.stamp", "sequencer.fill", "sequencer.install_distribution"))
        .select(domain, "start_ns", "end_ns")
        .groupBy("domain")
        .agg(((F.max("end_ns") - F.min("start_ns")) / 1e9).alias("seconds"))
    )
    counts = ["publishers", "stamp_requests", "stamped_messages", "distributions"]
    fillers = ["skip_markers", "skip_slots", "dummy_fills", "dummy_slots"]
    joined = (
        period.join(stamp_counts, "domain", "left")
        .join(stamping, "domain", "left")
        .join(installs, "domain", "left")
        .join(fills, "domain", "left")
        .fillna(0, [*counts, *fillers])
    )
    slots = F.col("stamped_messages") + F.col("skip_slots") + F.col("dummy_slots")
    seconds = F.col("seconds")
    return joined.select(
        "domain",
        *counts[:3],
        "p50_ms",
        "p95_ms",
        "p99_ms",
        "max_ms",
        "distributions",
        *fillers,
        "seconds",
        F.when(seconds > 0, F.col("skip_markers") / seconds).alias("skip_markers_per_s"),
        F.when(seconds > 0, F.col("dummy_fills") / seconds).alias("dummy_fills_per_s"),
        F.when(slots > 0, (F.col("skip_slots") + F.col("dummy_slots")) / slots).alias("filler_share"),
    ).orderBy("domain")

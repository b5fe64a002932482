"""The analyses of docs/tracing.md computed again in plain Python, one message at a time.

Deliberately naive (expanded lists, sets, Counters) and independent of the Spark code:
the tests compare the two.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from tests.analytics.tracegen import SpanRec


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(values, 0.5),
        "p95_ms": percentile(values, 0.95),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values),
    }


def _op(span: SpanRec) -> object:
    return span.attributes.get("messaging.operation.type")


def delivery_latency(spans: list[SpanRec], window_ns: int) -> dict[tuple[str, str, int], dict[str, float]]:
    """(subscriber, topic, window start) -> messages and percentiles, from one latency per message.

    A link with its run's publish and receive times (docs/tracing.md) gives receive - publish, in the
    window of its receive time, and its largest latency to the maximum; a link without them gives
    process start - send start, in the window of the process span's start."""
    sends = {(s.trace_id, s.span_id): s for s in spans if _op(s) == "send"}
    samples: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    worst: dict[tuple[str, str, int], float] = {}
    for span in spans:
        if _op(span) != "process":
            continue
        subscriber = str(span.attributes["messaging.consumer.group.name"])
        topic = str(span.attributes["messaging.destination.name"])
        for link in span.links:
            count = int(link.attributes["sokutatsu.seq.last"]) - int(link.attributes["sokutatsu.seq.first"]) + 1
            if "sokutatsu.receive_time_unix_nano" in link.attributes:
                received = int(link.attributes["sokutatsu.receive_time_unix_nano"])
                latency = (received - int(link.attributes["sokutatsu.publish_time_unix_nano"])) / 1e6
                key = (subscriber, topic, received // window_ns * window_ns)
                largest = int(link.attributes["sokutatsu.latency_max_ns"]) / 1e6
                worst[key] = max(worst.get(key, largest), largest)
            else:
                send = sends.get((link.trace_id, link.span_id))
                if send is None:
                    continue
                latency = (span.start_ns - send.start_ns) / 1e6
                key = (subscriber, topic, span.start_ns // window_ns * window_ns)
            samples[key].extend([latency] * count)
    result = {}
    for key, values in samples.items():
        row = {"messages": len(values), **summary(values)}
        row["max_ms"] = max(row["max_ms"], worst.get(key, row["max_ms"]))
        result[key] = row
    return result


def _timed_links(spans: list[SpanRec]) -> list[tuple[str, str, int, int, float, float]]:
    """Every link with a latency: (subscriber, topic, messages, publish time, latency ms, worst ms)."""
    sends = {(s.trace_id, s.span_id): s for s in spans if _op(s) == "send"}
    out = []
    for span in spans:
        if _op(span) != "process":
            continue
        for link in span.links:
            count = int(link.attributes["sokutatsu.seq.last"]) - int(link.attributes["sokutatsu.seq.first"]) + 1
            if "sokutatsu.receive_time_unix_nano" in link.attributes:
                published = int(link.attributes["sokutatsu.publish_time_unix_nano"])
                latency = (int(link.attributes["sokutatsu.receive_time_unix_nano"]) - published) / 1e6
                worst = max(latency, int(link.attributes["sokutatsu.latency_max_ns"]) / 1e6)
            else:
                send = sends.get((link.trace_id, link.span_id))
                if send is None:
                    continue
                published, latency = send.start_ns, (span.start_ns - send.start_ns) / 1e6
                worst = latency
            out.append(
                (
                    str(span.attributes["messaging.consumer.group.name"]),
                    str(span.attributes["messaging.destination.name"]),
                    count,
                    published,
                    latency,
                    worst,
                )
            )
    return out


def switchover_comparison(spans: list[SpanRec], phase_ns: int) -> dict[tuple[str, str], dict[str, object]]:
    """(switchover span id hex, subscriber) -> messages per phase, the before mean and worst, and the
    other phases' means and worsts relative to the before mean; from one latency per message."""
    links = _timed_links(spans)
    result: dict[tuple[str, str], dict[str, object]] = {}
    for switchover in (s for s in spans if s.name == "switchover"):
        topic, moved = switchover.attributes["sokutatsu.topic"], switchover.attributes["sokutatsu.subscriber_id"]
        start, end = switchover.start_ns, switchover.end_ns
        latencies: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        worst: dict[str, dict[str, float]] = defaultdict(dict)
        for subscriber, link_topic, count, published, latency, largest in links:
            if link_topic != topic:
                continue
            if start - phase_ns <= published < start:
                phase = "before"
            elif start <= published <= end:
                phase = "during"
            elif end < published <= end + phase_ns:
                phase = "after"
            else:
                continue
            latencies[subscriber][phase].extend([latency] * count)
            worst[subscriber][phase] = max(worst[subscriber].get(phase, largest), largest)
        for subscriber, phases in latencies.items():
            means = {phase: sum(values) / len(values) for phase, values in phases.items()}
            base = means.get("before")
            row: dict[str, object] = {
                "role": "moved" if subscriber == moved else "normal",
                "before_messages": len(phases.get("before", [])),
                "during_messages": len(phases.get("during", [])),
                "after_messages": len(phases.get("after", [])),
                "before_mean_ms": base,
                "before_worst_ms": worst[subscriber].get("before"),
            }
            for phase in ("during", "after"):
                has = base is not None and base > 0 and phase in means
                row[f"{phase}_mean"] = means[phase] / base if has and base else None
                row[f"{phase}_worst"] = worst[subscriber][phase] / base if has and base else None
            result[f"{switchover.span_id:016x}", subscriber] = row
    return result


def loss_audit(spans: list[SpanRec]) -> dict[tuple[str, str], dict[str, int]]:
    """(subscriber, topic) -> sent, processed, lost, duplicates, unsent, from sets of (publisher, seq)."""
    sent: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for span in spans:
        if _op(span) == "send":
            first, last = int(span.attributes["sokutatsu.seq.first"]), int(span.attributes["sokutatsu.seq.last"])
            publisher = str(span.attributes["messaging.client.id"])
            sent[str(span.attributes["messaging.destination.name"])].update(
                (publisher, q) for q in range(first, last + 1)
            )
    processed: dict[tuple[str, str], Counter[tuple[str, int]]] = defaultdict(Counter)
    for span in spans:
        if _op(span) != "process":
            continue
        key = (
            str(span.attributes["messaging.consumer.group.name"]),
            str(span.attributes["messaging.destination.name"]),
        )
        for link in span.links:
            first, last = int(link.attributes["sokutatsu.seq.first"]), int(link.attributes["sokutatsu.seq.last"])
            first = min(first, int(link.attributes.get("sokutatsu.seq.filtered_from", first)))
            publisher = str(link.attributes["messaging.client.id"])
            processed[key].update((publisher, q) for q in range(first, last + 1))
    result = {}
    for (subscriber, topic), counts in processed.items():
        expected = sent[topic]
        result[subscriber, topic] = {
            "sent": len(expected),
            "processed": sum(counts.values()),
            "lost": len(expected - counts.keys()),
            "duplicates": sum(n - 1 for n in counts.values()),
            "unsent": len(counts.keys() - expected),
        }
    return result


def dependency_graph(spans: list[SpanRec]) -> dict[tuple[str, str], dict[str, float]]:
    """(parent service, child service) -> calls, errors and the child durations' percentiles."""
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    errors: Counter[tuple[str, str]] = Counter()
    for span in spans:
        parent = by_id.get((span.trace_id, span.parent_span_id)) if span.parent_span_id is not None else None
        if parent is None or parent.service == span.service:
            continue
        edge = (parent.service, span.service)
        durations[edge].append((span.end_ns - span.start_ns) / 1e6)
        errors[edge] += span.error
    return {
        edge: {"calls": len(values), "errors": errors[edge], **summary(values)} for edge, values in durations.items()
    }


def switchover_steps(spans: list[SpanRec]) -> dict[str, list[tuple[str, float, float]]]:
    """Switchover span id (hex) -> [(step, offset from the switchover's start ms, duration ms)] by start."""
    switchovers = {s.span_id: s for s in spans if s.name == "switchover"}
    steps: dict[str, list[tuple[str, float, float]]] = {f"{k:016x}": [] for k in switchovers}
    for span in spans:
        if span.name.startswith("switchover.") and span.parent_span_id in switchovers:
            parent = switchovers[span.parent_span_id]
            steps[f"{parent.span_id:016x}"].append(
                (
                    span.name.removeprefix("switchover."),
                    (span.start_ns - parent.start_ns) / 1e6,
                    (span.end_ns - span.start_ns) / 1e6,
                )
            )
    return {k: sorted(v, key=lambda step: step[1]) for k, v in steps.items()}


def transfers(spans: list[SpanRec]) -> dict[tuple[str, str, str], dict[str, float]]:
    """(from, to, mode) -> the transfer table's columns, one span at a time."""
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    durations: dict[tuple[str, str, str], list[float]] = defaultdict(list)

    def row(span: SpanRec) -> dict[str, float]:
        key = (
            str(span.attributes["sokutatsu.transfer.from_node"]),
            str(span.attributes["sokutatsu.transfer.to_node"]),
            str(span.attributes["sokutatsu.transfer.mode"]),
        )
        return rows.setdefault(key, dict.fromkeys(TRANSFER_COUNTS, 0))

    for span in spans:
        if span.name == "transfer.recover":
            r = row(span)
            r["recoveries"] += 1
            for column in ("marked_sent", "aborted", "finished"):
                r[column] += int(span.attributes.get(f"sokutatsu.transfer.{column}", 0))
        elif span.name.startswith("transfer ") and "sokutatsu.transfer.mode" in span.attributes:
            r = row(span)
            r["batches"] += 1
            r["messages"] += int(span.attributes["messaging.batch.message_count"])
            r["resent_batches"] += bool(span.attributes["sokutatsu.transfer.resent"])
            r["duplicates"] += int(span.attributes.get("sokutatsu.transfer.duplicates", 0))
            if span.error:
                r["unconfirmed_batches"] += 1
            else:
                key = (
                    str(span.attributes["sokutatsu.transfer.from_node"]),
                    str(span.attributes["sokutatsu.transfer.to_node"]),
                    str(span.attributes["sokutatsu.transfer.mode"]),
                )
                durations[key].append((span.end_ns - span.start_ns) / 1e6)
    for key, r in rows.items():
        if durations[key]:
            r.update(summary(durations[key]))
    return rows


TRANSFER_COUNTS = (
    "batches",
    "messages",
    "resent_batches",
    "duplicates",
    "unconfirmed_batches",
    "recoveries",
    "marked_sent",
    "aborted",
    "finished",
)


def sequencer_fills(spans: list[SpanRec]) -> dict[tuple[str, int], dict[str, int]]:
    """(domain, distribution id) -> installs, skip markers and slots, dummy fills and slots."""
    rows: dict[tuple[str, int], dict[str, int]] = {}
    for span in spans:
        if span.name not in {"sequencer.install_distribution", "sequencer.fill"}:
            continue
        key = (str(span.attributes["sokutatsu.domain"]), int(span.attributes["sokutatsu.distribution.id"]))
        r = rows.setdefault(
            key, dict.fromkeys(("installs", "skip_markers", "skip_slots", "dummy_fills", "dummy_slots"), 0)
        )
        if span.name == "sequencer.install_distribution":
            r["installs"] += 1
        elif span.attributes["sokutatsu.fill.kind"] == "skip":
            r["skip_markers"] += 1
            r["skip_slots"] += int(span.attributes["sokutatsu.fill.slots"])
        else:
            r["dummy_fills"] += 1
            r["dummy_slots"] += int(span.attributes["sokutatsu.fill.slots"])
    return rows


def sequencer_domains(spans: list[SpanRec]) -> dict[str, dict[str, float | int | None]]:
    """domain -> the sequencer_domains table's columns, from one latency per stamp request."""
    names = {"sequencer.stamp", "sequencer.fill", "sequencer.install_distribution"}
    rows: dict[str, dict[str, float | int | None]] = {}
    latencies: dict[str, list[float]] = defaultdict(list)
    publishers: dict[str, set[str]] = defaultdict(set)
    distributions: dict[str, set[int]] = defaultdict(set)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for span in spans:
        if span.name not in names:
            continue
        domain = str(span.attributes["sokutatsu.domain"])
        first[domain] = min(first.get(domain, span.start_ns), span.start_ns)
        last[domain] = max(last.get(domain, span.end_ns), span.end_ns)
        r = rows.setdefault(domain, dict.fromkeys(SEQUENCER_DOMAIN_COUNTS, 0))
        if span.name == "sequencer.stamp":
            publishers[domain].add(str(span.attributes["messaging.client.id"]))
            r["stamp_requests"] = int(r["stamp_requests"] or 0) + int(span.attributes["sokutatsu.stamp.requests"])
            r["stamped_messages"] = int(r["stamped_messages"] or 0) + int(
                span.attributes["messaging.batch.message_count"]
            )
            values = span.attributes["sokutatsu.stamp.latency_ns"]
            assert isinstance(values, list)
            latencies[domain].extend(ns / 1e6 for ns in values)
        elif span.name == "sequencer.install_distribution":
            distributions[domain].add(int(span.attributes["sokutatsu.distribution.id"]))
        else:
            kind = "skip" if span.attributes["sokutatsu.fill.kind"] == "skip" else "dummy"
            count, slots = ("skip_markers", "skip_slots") if kind == "skip" else ("dummy_fills", "dummy_slots")
            r[count] = int(r[count] or 0) + 1
            r[slots] = int(r[slots] or 0) + int(span.attributes["sokutatsu.fill.slots"])
    for domain, r in rows.items():
        r["publishers"] = len(publishers[domain])
        r["distributions"] = len(distributions[domain])
        if latencies[domain]:
            r.update(summary(latencies[domain]))
        seconds = (last[domain] - first[domain]) / 1e9
        r["seconds"] = seconds
        r["skip_markers_per_s"] = int(r["skip_markers"] or 0) / seconds if seconds > 0 else None
        r["dummy_fills_per_s"] = int(r["dummy_fills"] or 0) / seconds if seconds > 0 else None
        fillers = int(r["skip_slots"] or 0) + int(r["dummy_slots"] or 0)
        total = fillers + int(r["stamped_messages"] or 0)
        r["filler_share"] = fillers / total if total else None
    return rows


SEQUENCER_DOMAIN_COUNTS = (
    "publishers",
    "stamp_requests",
    "stamped_messages",
    "distributions",
    "skip_markers",
    "skip_slots",
    "dummy_fills",
    "dummy_slots",
)

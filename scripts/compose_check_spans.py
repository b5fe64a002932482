"""What `make compose-check` asks of the spans the stand-in receiver recorded (scripts/compose_check_run.py).

The receiver keeps each OTLP export request as OTLP/JSON (ids in hex). Asked of them:

* every Sokutatsu service instance of the compose file sent spans (``service.instance.id``);
* the check's own SDK spans arrived: ``send`` spans of its publisher on the pub/sub topic and
  ``process`` spans of its subscriber (docs/tracing.md);
* the messaging links are intact: each link of a ``process`` span points at a ``send`` span
  that arrived (same trace and span id), and the links' sequence ranges cover every number
  the publisher sent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

TOPIC = "compose-check"
PUBLISHER = "compose-check-pub"
SENT = 500


@dataclass
class SpanReport:
    per_instance: Counter[str] = field(default_factory=Counter)
    missing_instances: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    summary: str = ""


def _value(attribute: dict[str, Any]) -> Any:
    value = attribute.get("value", {})
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return value[kind]
    if "intValue" in value:
        return int(value["intValue"])  # a string in OTLP/JSON
    return None


def _attributes(item: dict[str, Any]) -> dict[str, Any]:
    return {a["key"]: _value(a) for a in item.get("attributes", [])}


def _seqs(attributes: dict[str, Any]) -> range:
    return range(int(attributes["sokutatsu.seq.first"]), int(attributes["sokutatsu.seq.last"]) + 1)


def _collect(
    requests: list[dict[str, Any]], report: SpanReport, own_instance: str
) -> tuple[dict[tuple[str, str], dict[str, Any]], list[dict[str, Any]]]:
    """Count spans per instance; the check's own send spans (by id) and process spans on TOPIC."""
    sends: dict[tuple[str, str], dict[str, Any]] = {}
    processes: list[dict[str, Any]] = []
    for request in requests:
        for resource_spans in request.get("resourceSpans", []):
            resource = _attributes(resource_spans.get("resource", {}))
            instance = str(resource.get("service.instance.id", "?"))
            spans = [span for scope in resource_spans.get("scopeSpans", []) for span in scope.get("spans", [])]
            report.per_instance[instance] += len(spans)
            if instance != own_instance:
                continue
            for span in spans:
                if span.get("name") == f"send {TOPIC}":
                    sends[(span["traceId"], span["spanId"])] = _attributes(span)
                elif span.get("name") == f"process {TOPIC}":
                    processes.append(span)
    return sends, processes


def span_report(requests: list[dict[str, Any]], instances: set[str], own_instance: str) -> SpanReport:
    report = SpanReport()
    sends, processes = _collect(requests, report, own_instance)
    report.missing_instances = {i for i in instances if report.per_instance[i] == 0}
    if report.missing_instances:
        report.problems.append(f"no spans from {', '.join(sorted(report.missing_instances))}")
    if not sends or not processes:
        report.problems.append(f"the check's own spans: {len(sends)} send, {len(processes)} process on {TOPIC!r}")
    sent = {seq for a in sends.values() if a.get("messaging.client.id") == PUBLISHER for seq in _seqs(a)}
    links = [link for span in processes for link in span.get("links", [])]
    dangling = [link for link in links if (link.get("traceId"), link.get("spanId")) not in sends]
    covered = {
        seq for link in links if (a := _attributes(link)).get("messaging.client.id") == PUBLISHER for seq in _seqs(a)
    }
    everything = set(range(1, SENT + 1))
    if dangling:
        report.problems.append(f"{len(dangling)} of {len(links)} process links point at no send span that arrived")
    if sent != everything:
        report.problems.append(f"send spans cover {len(sent & everything)} of the {SENT} numbers published")
    if not everything <= covered:
        report.problems.append(f"process links cover {len(everything & covered)} of the {SENT} numbers published")
    counts = ", ".join(f"{i} {report.per_instance[i]}" for i in sorted(instances))
    report.summary = (
        f"spans from all {len(instances)} service instances ({counts}); the check's SDK: {len(sends)} send and "
        f"{len(processes)} process spans on {TOPIC!r}, all {len(links)} links point at send spans that arrived "
        f"and cover seq 1..{SENT}"
    )
    return report

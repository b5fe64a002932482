"""Random trace sets that follow docs/tracing.md, written as real OTLP/JSON-lines files.

A :class:`TraceSet` is plain Python records; :func:`write_otlp` turns them into
OpenTelemetry SDK spans and writes them with ``sokutatsu.core.span_files.spans_to_otlp_json``,
the exporter the services use, several spans per line and one file per service.
The generator also remembers what it lost and duplicated on purpose, so the audit
can be checked against the truth as well as against the reference calculation.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from sokutatsu.core.span_files import spans_to_otlp_json

T0 = 1_700_000_000 * 1_000_000_000  # ns
MS = 1_000_000

# OpenTelemetry attribute values: str, int, float, bool or a homogeneous list of them. (Any: the
# reference reads them as what it knows they are, without a cast per attribute.)
Attrs = dict[str, Any]


@dataclass
class LinkRec:
    trace_id: int
    span_id: int
    attributes: Attrs


@dataclass
class SpanRec:
    trace_id: int
    span_id: int
    parent_span_id: int | None
    name: str
    kind: SpanKind
    start_ns: int
    end_ns: int
    service: str
    attributes: Attrs = field(default_factory=dict)
    links: list[LinkRec] = field(default_factory=list)
    error: bool = False


@dataclass
class TraceSet:
    spans: list[SpanRec] = field(default_factory=list)
    # (subscriber, topic) -> messages lost / delivered more than once, on purpose
    lost: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    duplicated: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    # sends left out of the traces (as if sampled out): their messages are "unsent" for the audit
    missing_sends: int = 0
    # topic -> the subscribers that process it
    subscribers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


class _Ids:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def trace(self) -> int:
        return self.rng.getrandbits(128) | 1

    def span(self) -> int:
        return self.rng.getrandbits(64) | 1


@dataclass
class _Message:
    publisher: str
    seq: int
    send: SpanRec


def generate(seed: int, *, publishers: int = 3, subscribers: int = 3, topics: int = 2, batches: int = 12) -> TraceSet:
    """A random trace set: publishing and delivery, service calls, switchovers."""
    rng = random.Random(seed)  # noqa: S311 - reproducible test data, not secrets
    ids = _Ids(rng)
    out = TraceSet()
    topic_names = [f"topic.{i}" for i in range(topics)]
    # -- send spans: per publisher and topic, batches with dense sequence numbers from 1
    by_topic: dict[str, list[_Message]] = defaultdict(list)
    for p in range(publishers):
        publisher = f"pub-{p}"
        for topic in rng.sample(topic_names, rng.randint(1, topics)):
            seq, t = 1, T0 + rng.randint(0, 200) * MS
            for _ in range(rng.randint(1, batches)):
                size = rng.randint(1, 20)
                t += rng.randint(1, 400) * MS
                send = SpanRec(
                    ids.trace(), ids.span(), None, f"send {topic}", SpanKind.PRODUCER,
                    t, t + rng.randint(10, 900) * 1000,
                    f"app-{publisher}",
                    {
                        "messaging.system": "sokutatsu", "messaging.operation.type": "send",
                        "messaging.operation.name": "send", "messaging.destination.name": topic,
                        "messaging.batch.message_count": size, "messaging.client.id": publisher,
                        "sokutatsu.seq.first": seq, "sokutatsu.seq.last": seq + size - 1,
                        "messaging.message.body.size": size * 1024,
                    },
                )  # fmt: skip
                if rng.random() < 0.05:
                    out.missing_sends += 1
                else:
                    out.spans.append(send)
                by_topic[topic].extend(_Message(publisher, s, send) for s in range(seq, seq + size))
                seq += size
    # -- process spans: each subscriber takes some topics, loses and repeats a few runs on purpose
    for s in range(subscribers):
        subscriber = f"sub-{s}"
        for topic in rng.sample(topic_names, rng.randint(1, topics)):
            out.subscribers[topic].append(subscriber)
            messages = sorted(by_topic[topic], key=lambda m: (m.send.start_ns, m.publisher, m.seq))
            delivered: list[_Message] = []
            i = 0
            while i < len(messages):
                run = messages[i : i + rng.randint(1, 6)]
                i += len(run)
                roll = rng.random()
                if roll < 0.04:
                    out.lost[subscriber, topic] += len(run)
                    continue
                delivered.extend(run)
                if roll > 0.96:
                    delivered.extend(run)
                    out.duplicated[subscriber, topic] += len(run)
            _process_spans(rng, ids, out, subscriber=subscriber, topic=topic, delivered=delivered)
    _service_calls(rng, ids, out)
    _switchovers(rng, ids, out)
    _transfers(rng, ids, out)
    _sequencers(rng, ids, out)
    return out


def _process_spans(
    rng: random.Random, ids: _Ids, out: TraceSet, *, subscriber: str, topic: str, delivered: list[_Message]
) -> None:
    i = 0
    clock = 0
    while i < len(delivered):
        batch = delivered[i : i + rng.randint(1, 25)]
        i += len(batch)
        ready = max(m.send.start_ns for m in batch)
        latency = rng.choice([rng.randint(100, 5000), rng.randint(1000, 80_000)]) * 1000
        start = max(clock, ready + latency)
        clock = start + rng.randint(1, 50) * 1000
        links: list[LinkRec] = []
        # Half the process spans carry their runs' publish and receive times (the SDK's), the other
        # half not (older traces): the analysis takes the times where they are, else the spans' starts.
        timed = rng.random() < 0.5
        for m in batch:  # one link per run of consecutive messages from the same send span
            last = links[-1] if links else None
            if (
                last is not None
                and last.span_id == m.send.span_id
                and last.attributes["sokutatsu.seq.last"] == m.seq - 1
            ):
                last.attributes["sokutatsu.seq.last"] = m.seq
                continue
            attributes: Attrs = {
                "sokutatsu.seq.first": m.seq,
                "sokutatsu.seq.last": m.seq,
                "messaging.client.id": m.publisher,
            }
            if timed:
                # The run's first message: published after its send span started, received at most the
                # process span's start; and the run's worst latency (docs/tracing.md).
                published = m.send.start_ns + rng.randint(0, 900) * 1000
                received = start - rng.randint(0, 400) * 1000
                attributes["sokutatsu.publish_time_unix_nano"] = published
                attributes["sokutatsu.receive_time_unix_nano"] = received
                attributes["sokutatsu.latency_max_ns"] = received - published + rng.randint(0, 3000) * 1000
            links.append(LinkRec(m.send.trace_id, m.send.span_id, attributes))
        out.spans.append(
            SpanRec(
                ids.trace(), ids.span(), None, f"process {topic}", SpanKind.CONSUMER, start,
                start + rng.randint(5, 2000) * 1000, f"app-{subscriber}",
                {
                    "messaging.system": "sokutatsu", "messaging.operation.type": "process",
                    "messaging.operation.name": "process", "messaging.destination.name": topic,
                    "messaging.batch.message_count": len(batch), "messaging.consumer.group.name": subscriber,
                },
                links,
            )
        )  # fmt: skip


SERVICES = ("sokutatsu-monitor", "sokutatsu-broker", "sokutatsu-sequencer", "sokutatsu-queue-db")


def _service_calls(rng: random.Random, ids: _Ids, out: TraceSet) -> None:
    """Random call trees: a server span, in-process children, client calls to other services."""

    def serve(trace_id: int, parent: int | None, service: str, start: int, depth: int) -> int:
        span_id = ids.span()
        end = start + rng.randint(50, 20_000) * 1000
        out.spans.append(
            SpanRec(
                trace_id, span_id, parent, f"svc.v1.Api/Call{depth}", SpanKind.SERVER, start, end, service,
                {"rpc.system": "grpc", "rpc.service": "svc.v1.Api", "rpc.method": f"Call{depth}"},
                error=rng.random() < 0.15,
            )
        )  # fmt: skip
        for _ in range(rng.randint(0, 3) if depth < 3 else 0):
            child_start = rng.randint(start, end)
            if rng.random() < 0.3:  # same service: no edge
                out.spans.append(
                    SpanRec(trace_id, ids.span(), span_id, "work", SpanKind.INTERNAL, child_start, end, service)
                )
            else:
                serve(trace_id, span_id, rng.choice(SERVICES), child_start, depth + 1)
        return span_id

    for _ in range(40):
        serve(ids.trace(), None, rng.choice(SERVICES), T0 + rng.randint(0, 5000) * MS, 0)


STEPS = ("position", "accept", "redirect", "release")


def _switchovers(rng: random.Random, ids: _Ids, out: TraceSet) -> None:
    """Switchovers of subscribers of the busiest topic, some slow enough to have messages published during them."""
    topic = max(sorted(out.subscribers), key=lambda t: len(out.subscribers[t]))
    for k in range(rng.randint(3, 8)):
        trace_id, span_id = ids.trace(), ids.span()
        start = T0 + rng.randint(0, 5000) * MS
        t = start + rng.randint(10, 500) * 1000
        steps = STEPS if rng.random() > 0.1 else STEPS[: rng.randint(0, 3)]
        slow = rng.random() < 0.3
        for step in steps:
            duration = rng.randint(100, 4000) * 1000 + (rng.randint(50, 400) * MS if slow else 0)
            out.spans.append(
                SpanRec(trace_id, ids.span(), span_id, f"switchover.{step}", SpanKind.INTERNAL, t, t + duration,
                        "sokutatsu-monitor")
            )  # fmt: skip
            t += duration + rng.randint(1, 300) * 1000
        out.spans.append(
            SpanRec(
                trace_id, span_id, None, "switchover", SpanKind.INTERNAL, start, t + rng.randint(10, 500) * 1000,
                "sokutatsu-monitor",
                {
                    "sokutatsu.switchover.id": k + 1, "sokutatsu.subscriber_id": rng.choice(out.subscribers[topic]),
                    "sokutatsu.topic": topic, "sokutatsu.from_broker": "a", "sokutatsu.to_broker": "b",
                    "sokutatsu.reason": "SLOW", "sokutatsu.depth": rng.randint(100, 9000),
                    "sokutatsu.threshold": 5000.5, "sokutatsu.switchover.moved": True,
                },
                error=len(steps) < len(STEPS),
            )
        )  # fmt: skip


def _transfers(rng: random.Random, ids: _Ids, out: TraceSet) -> None:
    """Transfer daemons' batches and recoveries (docs/tracing.md), two links and both protocols."""
    for from_node, to_node, mode in (("node1", "node2", "1pc"), ("node1", "node3", "2pc"), ("node2", "node1", "1pc")):
        link = {"sokutatsu.transfer.from_node": from_node, "sokutatsu.transfer.to_node": to_node,
                "sokutatsu.transfer.mode": mode}  # fmt: skip
        t = T0 + rng.randint(0, 500) * MS
        for _ in range(rng.randint(0, 4)):
            t += rng.randint(1, 900) * MS
            recovered: Attrs = dict(link)
            if mode == "1pc":
                recovered.update({"sokutatsu.transfer.receiver_last_id": rng.randint(0, 99),
                                  "sokutatsu.transfer.marked_sent": rng.randint(0, 50),
                                  "sokutatsu.transfer.last_assigned_id": rng.randint(0, 99)})  # fmt: skip
            else:
                recovered.update({"sokutatsu.transfer.aborted": rng.randint(0, 3),
                                  "sokutatsu.transfer.finished": rng.randint(0, 3)})  # fmt: skip
            out.spans.append(SpanRec(ids.trace(), ids.span(), None, "transfer.recover", SpanKind.INTERNAL, t,
                                     t + rng.randint(1, 90) * MS, "sokutatsu-transfer", recovered))  # fmt: skip
        for i in range(rng.randint(1, 30)):
            t += rng.randint(1, 90) * MS
            batch: Attrs = {**link, "messaging.batch.message_count": rng.randint(1, 1000),
                            "sokutatsu.transfer.resent": rng.random() < 0.2}  # fmt: skip
            if mode == "1pc":
                batch.update({"sokutatsu.transfer.first_id": i * 1000 + 1, "sokutatsu.transfer.last_id": i * 1000 + 9})
            else:
                batch["sokutatsu.transfer.gid"] = f"sokutatsu:{from_node}:{to_node}:{i}"
            unconfirmed = rng.random() < 0.1
            if not unconfirmed and rng.random() < 0.7:
                batch["sokutatsu.transfer.duplicates"] = rng.randint(0, 5)
            out.spans.append(SpanRec(ids.trace(), ids.span(), None, f"transfer {to_node}", SpanKind.PRODUCER, t,
                                     t + rng.randint(100, 90_000) * 1000, "sokutatsu-transfer", batch,
                                     error=unconfirmed))  # fmt: skip


def _sequencers(rng: random.Random, ids: _Ids, out: TraceSet) -> None:
    """Sequencers' distribution installs and fillers, and the ordered publishers' stamps (docs/tracing.md)."""
    for domain in ("a", "b", "quiet"):
        kind = "dummy" if domain == "quiet" and rng.random() < 0.5 else "skip"
        t = T0
        for distribution in range(1, rng.randint(2, 6)):
            t += rng.randint(1, 900) * MS
            for _ in range(rng.randint(1, 2)):  # a journal replay installs the same one again
                out.spans.append(SpanRec(ids.trace(), ids.span(), None, "sequencer.install_distribution",
                                         SpanKind.INTERNAL, t, t, f"sokutatsu-sequencer-{domain}",
                                         {"sokutatsu.domain": domain, "sokutatsu.distribution.id": distribution,
                                          "sokutatsu.distribution.weights": "[]"}))  # fmt: skip
            if domain != "quiet":  # the ordered publishers' stamp requests, a span per window
                for publisher in range(rng.randint(1, 2)):
                    latencies = [rng.randint(50, 20_000) * 1000 for _ in range(rng.randint(1, 30))]
                    messages = sum(rng.randint(1, 9) for _ in latencies)
                    out.spans.append(SpanRec(ids.trace(), ids.span(), None, "sequencer.stamp", SpanKind.CLIENT, t,
                                             t + 100 * MS, f"app-feed-{domain}{publisher}",
                                             {"sokutatsu.domain": domain, "sokutatsu.distribution.id": distribution,
                                              "messaging.client.id": f"feed-{domain}{publisher}",
                                              "sokutatsu.stamp.requests": len(latencies),
                                              "messaging.batch.message_count": messages,
                                              "sokutatsu.stamp.latency_ns": latencies}))  # fmt: skip
            for _ in range(rng.randint(0, 5)):
                slots = 1 if kind == "dummy" else rng.randint(1, 400)
                out.spans.append(SpanRec(ids.trace(), ids.span(), None, "sequencer.fill", SpanKind.INTERNAL, t,
                                         t + rng.randint(100, 5000) * 1000, f"sokutatsu-sequencer-{domain}",
                                         {"sokutatsu.domain": domain, "sokutatsu.distribution.id": distribution,
                                          "sokutatsu.fill.kind": kind, "sokutatsu.fill.slots": slots}))  # fmt: skip


def _readable(rec: SpanRec) -> ReadableSpan:
    flags = TraceFlags(TraceFlags.SAMPLED)
    return ReadableSpan(
        name=rec.name,
        context=SpanContext(rec.trace_id, rec.span_id, is_remote=False, trace_flags=flags),
        parent=(
            SpanContext(rec.trace_id, rec.parent_span_id, is_remote=False, trace_flags=flags)
            if rec.parent_span_id is not None
            else None
        ),
        resource=Resource.create({"service.name": rec.service, "service.instance.id": "i0"}),
        attributes=rec.attributes,
        links=[
            Link(SpanContext(link.trace_id, link.span_id, is_remote=True, trace_flags=flags), link.attributes)
            for link in rec.links
        ],
        kind=rec.kind,
        status=Status(StatusCode.ERROR, "failed") if rec.error else Status(StatusCode.UNSET),
        start_time=rec.start_ns,
        end_time=rec.end_ns,
        instrumentation_scope=InstrumentationScope("tests.analytics"),
    )


def write_otlp(trace_set: TraceSet, directory: Path, seed: int = 0) -> list[Path]:
    """One ``.jsonl`` file per service, a random number of spans per line (as a batch exporter writes)."""
    rng = random.Random(seed)  # noqa: S311 - reproducible test data, not secrets
    directory.mkdir(parents=True, exist_ok=True)
    by_service: dict[str, list[SpanRec]] = defaultdict(list)
    for rec in trace_set.spans:
        by_service[rec.service].append(rec)
    paths = []
    for service, recs in sorted(by_service.items()):
        shuffled = recs[:]
        rng.shuffle(shuffled)
        lines = []
        while shuffled:
            n = rng.randint(1, 40)
            chunk, shuffled = shuffled[:n], shuffled[n:]
            lines.append(spans_to_otlp_json([_readable(r) for r in chunk]))
        path = directory / f"{service}-i0-1.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths

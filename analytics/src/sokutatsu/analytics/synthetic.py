"""Synthetic trace files for ``sokutatsu bench analytics``: many spans of the shapes of
docs/tracing.md, written fast as OTLP/JSON lines (dictionaries dumped directly, not through
the OpenTelemetry SDK).

Per publisher batch: one ``send`` span; per subscriber, one ``process`` span linking to it
with the batch's run (publish and receive times, worst latency); the publishers' batches
are dense ranges, and every subscriber processes everything once, so the audit of a
generated set finds nothing lost. A tenth of the spans are gRPC server spans with a parent in
another service (the dependency graph).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_T0 = 1_790_000_000_000_000_000  # ns since the epoch
_MS = 1_000_000
SPANS_PER_LINE = 1_000


def _value(value: object) -> dict[str, object]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    return {"stringValue": str(value)}


def _attributes(values: Mapping[str, object]) -> list[dict[str, object]]:
    return [{"key": k, "value": _value(v)} for k, v in values.items()]


def _span(  # noqa: PLR0917 - one span's fields, as OTLP has them
    trace_id: int, span_id: int, parent: int | None, name: str, kind: int, start: int, end: int, attributes: list[Any]
) -> dict[str, object]:
    span: dict[str, object] = {
        "traceId": f"{trace_id:032x}",
        "spanId": f"{span_id:016x}",
        "name": name,
        "kind": kind,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(end),
        "attributes": attributes,
        "status": {},
    }
    if parent is not None:
        span["parentSpanId"] = f"{parent:016x}"
    return span


def _line(service: str, spans: list[dict[str, object]]) -> str:
    resource = {"attributes": _attributes({"service.name": service})}
    body = {"resourceSpans": [{"resource": resource, "scopeSpans": [{"scope": {"name": "synthetic"}, "spans": spans}]}]}
    return json.dumps(body, separators=(",", ":"))


def write(directory: Path, spans: int, *, subscribers: int = 3, seed: int = 1) -> int:
    """About ``spans`` spans into ``directory``; returns how many were written."""
    rng = random.Random(seed)  # noqa: S311 - benchmark data, not secrets
    directory.mkdir(parents=True, exist_ok=True)
    written = 0
    seqs: dict[str, int] = {}
    t = _T0
    with (directory / "synthetic.jsonl").open("w", encoding="utf-8") as out:
        while written < spans:
            client: list[dict[str, object]] = []
            services: list[dict[str, object]] = []
            while len(client) + len(services) < SPANS_PER_LINE:
                publisher = f"pub-{rng.randrange(8)}"
                topic = f"topic.{rng.randrange(4)}"
                size = rng.randint(1, 200)
                key = f"{publisher}/{topic}"
                first = seqs.get(key, 0) + 1
                seqs[key] = first + size - 1
                t += rng.randint(1, 5) * _MS
                trace_id, send_id = rng.getrandbits(127) | 1, rng.getrandbits(63) | 1
                common = {"messaging.system": "sokutatsu", "messaging.destination.name": topic}
                send = {
                    **common,
                    "messaging.operation.type": "send",
                    "messaging.client.id": publisher,
                    "messaging.batch.message_count": size,
                    "sokutatsu.seq.first": first,
                    "sokutatsu.seq.last": first + size - 1,
                }
                client.append(_span(trace_id, send_id, None, f"send {topic}", 4, t, t + _MS, _attributes(send)))
                for s in range(subscribers):
                    received = t + rng.randint(1, 50) * _MS // 10
                    link = {
                        "traceId": f"{trace_id:032x}",
                        "spanId": f"{send_id:016x}",
                        "attributes": _attributes(
                            {
                                "sokutatsu.seq.first": first,
                                "sokutatsu.seq.last": first + size - 1,
                                "messaging.client.id": publisher,
                                "sokutatsu.publish_time_unix_nano": t,
                                "sokutatsu.receive_time_unix_nano": received,
                                "sokutatsu.latency_max_ns": received - t + rng.randint(0, 9) * _MS // 10,
                            }
                        ),
                    }
                    process = {
                        **common,
                        "messaging.operation.type": "process",
                        "messaging.consumer.group.name": f"sub-{s}",
                    }
                    span = _span(
                        rng.getrandbits(127) | 1, rng.getrandbits(63) | 1, None, f"process {topic}", 5,
                        received, received + _MS, _attributes(process),
                    )  # fmt: skip
                    span["links"] = [link]
                    client.append(span)
                if rng.random() < 0.35:  # a gRPC call from the monitor to a broker
                    rpc_trace, parent = rng.getrandbits(127) | 1, rng.getrandbits(63) | 1
                    services.append(_span(rpc_trace, parent, None, "monitor.poll", 1, t, t + 3 * _MS, []))
                    services.append(
                        _span(rpc_trace, rng.getrandbits(63) | 1, parent, "/sokutatsu.broker.v1.BrokerAdmin/GetStats",
                              2, t + _MS, t + 2 * _MS, _attributes({"rpc.system": "grpc"})),
                    )  # fmt: skip
            out.write(_line("sokutatsu-sdk", client) + "\n")
            out.write(_line("sokutatsu-monitor", services[0::2]) + "\n")
            out.write(_line("sokutatsu-broker", services[1::2]) + "\n")
            written += len(client) + len(services)
    return written

"""OpenTelemetry bootstrap shared by every service and tool.

Tracing is on when at least one destination is configured:

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (standard OpenTelemetry variable): spans go
  to that OTLP/gRPC endpoint, e.g. Jaeger's ``http://jaeger:4317``. The other
  standard ``OTEL_EXPORTER_OTLP_*`` variables apply.
* ``SOKUTATSU_TRACE_DIR``: spans are appended to
  ``<dir>/<service>-<instance>-<pid>.jsonl``, one OTLP/JSON
  ``ExportTraceServiceRequest`` per line (the layout of the OpenTelemetry
  Collector's file exporter), for the Spark analytics job.

With neither, the OpenTelemetry API's no-op tracer is used and tracing costs
nothing.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from google.protobuf.json_format import MessageToDict
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(obj: Any) -> None:
    """OTLP/JSON encodes trace and span ids as hex, not base64 as protobuf JSON does."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in _ID_FIELDS and isinstance(value, str):
                obj[key] = base64.b64decode(value).hex()
            else:
                _hex_ids(value)
    elif isinstance(obj, list):
        for item in obj:
            _hex_ids(item)


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> str:
    """One line of OTLP/JSON (an ``ExportTraceServiceRequest``) for ``spans``."""
    body = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    _hex_ids(body)
    return json.dumps(body, separators=(",", ":"))


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported batch of spans as one OTLP/JSON line to a file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[str] | None = path.open("a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = spans_to_otlp_json(spans)
        with self._lock:
            if self._file is None:
                return SpanExportResult.FAILURE
            self._file.write(line + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@dataclass
class Telemetry:
    """What :func:`setup_telemetry` installed; call :meth:`shutdown` to flush."""

    provider: TracerProvider | None
    destinations: list[str]

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def setup_telemetry(service: str, instance: str, trace_dir: Path | None) -> Telemetry:
    """Install the global tracer provider for ``service`` if tracing is configured."""
    exporters: list[SpanExporter] = []
    destinations: list[str] = []
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )

        exporters.append(OTLPSpanExporter())
        destinations.append(f"otlp {endpoint}")
    if trace_dir is not None:
        path = trace_dir / f"{service}-{instance}-{os.getpid()}.jsonl"
        exporters.append(JsonLinesSpanExporter(path))
        destinations.append(f"file {path}")
    if not exporters:
        return Telemetry(provider=None, destinations=[])
    resource = Resource.create({"service.name": f"sokutatsu-{service}", "service.instance.id": instance})
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return Telemetry(provider=provider, destinations=destinations)

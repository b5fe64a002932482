"""Spans as OTLP/JSON lines in a file (``SOKUTATSU_TRACE_DIR``, :mod:`sokutatsu.core.telemetry`):
one ``ExportTraceServiceRequest`` per line, the layout of the OpenTelemetry Collector's file
exporter, for the Spark analytics job. It needs the OpenTelemetry SDK, which a process imports
only when it traces."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

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

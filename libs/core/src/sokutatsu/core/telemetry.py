"""OpenTelemetry bootstrap shared by every service and tool.

Tracing is on when at least one destination is configured:

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (standard OpenTelemetry variable): spans go
  to that OTLP/gRPC endpoint, e.g. Jaeger's ``http://jaeger:4317``. The other
  standard ``OTEL_EXPORTER_OTLP_*`` variables apply.
* ``SOKUTATSU_TRACE_DIR``: spans are appended to
  ``<dir>/<service>-<instance>-<pid>.jsonl``, one OTLP/JSON
  ``ExportTraceServiceRequest`` per line (the layout of the OpenTelemetry
  Collector's file exporter), for the Spark analytics job (``span_files.py``).

With neither, the OpenTelemetry API's no-op tracer is used and tracing costs
nothing: the SDK, the exporters and the gRPC server instrumentation are not even
imported (``sokutatsu.core.server``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter


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
    # The SDK and the exporters only when tracing is on: a service that does not trace starts
    # without importing them (tens of milliseconds of CPU at every start).
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
        from sokutatsu.core.span_files import JsonLinesSpanExporter  # noqa: PLC0415 - see above

        path = trace_dir / f"{service}-{instance}-{os.getpid()}.jsonl"
        exporters.append(JsonLinesSpanExporter(path))
        destinations.append(f"file {path}")
    if not exporters:
        return Telemetry(provider=None, destinations=[])
    from opentelemetry import trace  # noqa: PLC0415 - see above
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    resource = Resource.create({"service.name": f"sokutatsu-{service}", "service.instance.id": instance})
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return Telemetry(provider=provider, destinations=destinations)

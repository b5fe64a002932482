"""Whether the SDK traces, without importing OpenTelemetry when it does not.

OpenTelemetry is an optional extra (``pip install sokutatsu-client[tracing]``): the SDK traces
when the OpenTelemetry API is importable and an SDK tracer provider is installed (the
application's choice; the API's default is a no-op). The spans themselves are in
:mod:`sokutatsu.client._spans`, imported only then.
"""

from __future__ import annotations

SYSTEM = "sokutatsu"
TRACEPARENT = "traceparent"


def tracing_on() -> bool:
    """Whether an OpenTelemetry SDK tracer provider is installed (else the API's no-op one, or no API at all)."""
    try:
        from opentelemetry import trace  # noqa: PLC0415 - the optional extra, imported only when present
    except ImportError:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)

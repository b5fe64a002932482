"""The SDK's messaging spans (docs/tracing.md; OpenTelemetry messaging semantic conventions v1.27.0).

Publisher: a ``send {topic}`` PRODUCER span gathers consecutive messages of one topic as they
are handed to the SDK; each gets the span's context as its ``traceparent`` header (its creation
context). The span is sealed when the publisher cuts a batch for the wire and ends once its
last message has been written to a broker; it carries the publisher sequence numbers it
covers, which are dense (a topic change opens a new span).

Subscriber: a ``process {topic}`` CONSUMER span per batch the SDK accepts, with one link per
run of consecutive messages that share a creation context, carrying that run's sequence
numbers: the analysis counts what arrived, and when, from the links, without a span per
message.

Both are off, at no cost, while no tracer provider is installed (the OpenTelemetry API's
default); :func:`tracing_on` is checked when a publisher or subscriber starts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, TraceFlags

from sokutatsu.broker.v1 import broker_pb2

SYSTEM = "sokutatsu"
TRACEPARENT = "traceparent"
SEQ_FIRST, SEQ_LAST = "sokutatsu.seq.first", "sokutatsu.seq.last"
CLIENT_ID = "messaging.client.id"
# Links' parsed creation contexts kept for reuse (a batch's messages share one).
_CACHE_LIMIT = 4096


def tracing_on() -> bool:
    """Whether an OpenTelemetry SDK tracer provider is installed (else the API's no-op one)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _tracer() -> trace.Tracer:
    return trace.get_tracer("sokutatsu.client")


@dataclass
class _Send:
    span: Span
    topic: str
    traceparent: str
    first: int
    last: int
    count: int = 0
    size: int = 0


class SendSpans:
    """The publisher's send spans: one open (gathering), the sealed ones until written."""

    def __init__(self, publisher_id: str) -> None:
        self.publisher_id = publisher_id
        self.tracer = _tracer()
        self._open: _Send | None = None
        self._sealed: deque[_Send] = deque()

    def traceparent(self, topic: str, seq: int, size: int) -> str:
        """The creation context for message ``seq`` of ``topic``, as a W3C traceparent."""
        send = self._open
        if send is None or send.topic != topic:
            self.seal()
            span = self.tracer.start_span(
                f"send {topic}",
                kind=SpanKind.PRODUCER,
                attributes={
                    "messaging.system": SYSTEM,
                    "messaging.operation.type": "send",
                    "messaging.operation.name": "send",
                    "messaging.destination.name": topic,
                    CLIENT_ID: self.publisher_id,
                },
            )
            context = span.get_span_context()
            header = f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
            send = self._open = _Send(span, topic, header, seq, seq)
        send.last = seq
        send.count += 1
        send.size += size
        return send.traceparent

    def seal(self) -> None:
        """No more messages join the open span (a batch is being cut for the wire)."""
        send = self._open
        if send is not None:
            self._open = None
            self._sealed.append(send)

    def written(self, last_seq: int) -> None:
        """Messages up to ``last_seq`` are on the wire to a broker: end the spans they complete."""
        sealed = self._sealed
        while sealed and sealed[0].last <= last_seq:
            self._end(sealed.popleft())

    def close(self) -> None:
        self.seal()
        while self._sealed:
            self._end(self._sealed.popleft())

    @staticmethod
    def _end(send: _Send) -> None:
        span = send.span
        span.set_attribute("messaging.batch.message_count", send.count)
        span.set_attribute("messaging.message.body.size", send.size)
        span.set_attribute(SEQ_FIRST, send.first)
        span.set_attribute(SEQ_LAST, send.last)
        span.end()


class ProcessSpans:
    """The subscriber's process spans: one per accepted batch, linked to its messages' creation contexts."""

    def __init__(self, subscriber_id: str, topic: str) -> None:
        self.tracer = _tracer()
        self.name = f"process {topic}"
        self.attributes = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": topic,
            "messaging.consumer.group.name": subscriber_id,
        }
        self._contexts: dict[str, SpanContext | None] = {}

    def accepted(self, messages: Sequence[broker_pb2.Message]) -> None:
        """Trace one batch of messages handed to the application (duplicates left out)."""
        if not messages:
            return
        links: list[Link] = []
        run_header = ""
        run_publisher = ""
        first = last = 0
        for message in messages:
            header = message.headers.get(TRACEPARENT, "")
            seq = message.publisher_seq
            # A run goes on through sequence numbers the subscription's filter left out: the broker's
            # previous_seq says no message between matched.
            if (
                header == run_header
                and message.publisher_id == run_publisher
                and last + 1 in (seq, message.previous_seq + 1)
            ):
                last = seq
                continue
            self._link(links, run_header, run_publisher, first, last)
            run_header, run_publisher, first, last = header, message.publisher_id, seq, seq
        self._link(links, run_header, run_publisher, first, last)
        span = self.tracer.start_span(self.name, kind=SpanKind.CONSUMER, links=links, attributes=self.attributes)
        span.set_attribute("messaging.batch.message_count", len(messages))
        span.end()

    def _link(self, links: list[Link], header: str, publisher: str, first: int, last: int) -> None:
        if not header:
            return
        context = self._context(header)
        if context is not None:
            links.append(Link(context, {SEQ_FIRST: first, SEQ_LAST: last, CLIENT_ID: publisher}))

    def _context(self, header: str) -> SpanContext | None:
        try:
            return self._contexts[header]
        except KeyError:
            pass
        if len(self._contexts) >= _CACHE_LIMIT:
            self._contexts.clear()
        context = _parse(header)
        self._contexts[header] = context
        return context


def _parse(header: str) -> SpanContext | None:
    """A W3C ``traceparent`` (version 00) as a remote span context; None when malformed."""
    parts = header.split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))

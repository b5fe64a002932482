"""The SDK's messaging spans (docs/tracing.md; OpenTelemetry messaging semantic conventions v1.27.0).

Publisher: a ``send {topic}`` PRODUCER span gathers the consecutive messages of one topic handed
to the SDK within ``WINDOW_SECONDS``; each gets the span's context as its ``traceparent`` header
(its creation context). It ends once the window has passed and its last message has been
written to a broker, carrying the publisher sequence numbers it covers, which are dense (a topic
change opens a new span).

Ordered publisher: a ``sequencer.stamp`` CLIENT span per window of stamp requests to the
domain's sequencer, carrying every request's round trip (the stamping latency) as an array.

Subscriber: a ``process {topic}`` CONSUMER span per window of batches the SDK accepted, with one
link per run of consecutive messages that share a creation context, carrying the run's sequence
numbers and the publish and arrival times of its first message and its largest latency: the
analysis counts what arrived, and when, from the links, without a span per message.

A span per wire batch was measured first: at 5,000 msgs/s one every few messages, and their
export (a background thread holding the GIL) raised the latency run's p99 several times over
(bench throughput --tracing); windows keep the spans to a few per second per client whatever
the rate. Both are off, at no cost, while no SDK tracer provider is installed (the OpenTelemetry
API's default); :func:`tracing_on` is checked when a publisher or subscriber starts.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, TraceFlags

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client._tracing import SYSTEM, TRACEPARENT
from sokutatsu.client._wire import header_field

SEQ_FIRST, SEQ_LAST = "sokutatsu.seq.first", "sokutatsu.seq.last"
# On a link: the numbers from here to sokutatsu.seq.first - 1 did not match the subscription's
# filter (the broker's previous_seq vouches), so the loss audit counts them as accounted for.
FILTERED_FROM = "sokutatsu.seq.filtered_from"
CLIENT_ID = "messaging.client.id"
# Link attributes of a run: its first message's publish time and arrival (ns since the epoch),
# and the run's largest arrival - publish (ns).
PUBLISHED, RECEIVED, WORST = (
    "sokutatsu.publish_time_unix_nano",
    "sokutatsu.receive_time_unix_nano",
    "sokutatsu.latency_max_ns",
)
# How long one send or process span gathers messages.
WINDOW_SECONDS = 0.1
WINDOW_NS = round(WINDOW_SECONDS * 1e9)
# Links per process span at most (the OpenTelemetry SDK keeps 128 by default).
MAX_LINKS = 100
# Links' parsed creation contexts kept for reuse (a batch's messages share one).
_CACHE_LIMIT = 4096


def _tracer() -> trace.Tracer:
    return trace.get_tracer("sokutatsu.client")


@dataclass
class _Send:
    span: Span
    topic: str
    traceparent: bytes  # the encoded header field
    first: int
    last: int
    opened_ns: int  # wall clock, when its first message was handed over
    count: int = 0
    size: int = 0
    sealed: bool = False


class SendSpans:
    """The publisher's send spans: one open (gathering), the sealed ones until written."""

    def __init__(self, publisher_id: str) -> None:
        self.publisher_id = publisher_id
        self.tracer = _tracer()
        self._open: _Send | None = None
        self._sealed: deque[_Send] = deque()
        self._written = 0

    def traceparent(self, topic: str, seq: int, size: int, now_ns: int) -> bytes:
        """The creation context for message ``seq`` of ``topic``: its W3C traceparent header, encoded
        (the span's messages share the bytes)."""
        send = self._open
        if send is None or send.topic != topic or now_ns - send.opened_ns >= WINDOW_NS:
            self._seal()
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
            send = self._open = _Send(span, topic, header_field(TRACEPARENT, header), seq, seq, now_ns)
            asyncio.get_running_loop().call_later(WINDOW_SECONDS, self._expire, send)
        send.last = seq
        send.count += 1
        send.size += size
        return send.traceparent

    def _seal(self) -> None:
        send = self._open
        if send is not None:
            self._open = None
            send.sealed = True
            self._sealed.append(send)
            self.written(self._written)

    def _expire(self, send: _Send) -> None:
        if send is self._open:
            self._seal()

    def written(self, last_seq: int) -> None:
        """Messages up to ``last_seq`` are on the wire to a broker: end the sealed spans they complete."""
        self._written = max(self._written, last_seq)
        sealed = self._sealed
        while sealed and sealed[0].last <= self._written:
            self._end(sealed.popleft())

    def close(self) -> None:
        self._seal()
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


@dataclass
class _Run:
    header: str
    publisher: str
    first: int
    last: int
    published_ns: int  # the first message's publish time
    received_ns: int  # when the SDK accepted it
    worst_ns: int  # the run's largest receive - publish
    filtered_from: int  # numbers from here to first - 1 did not match the subscription (0: none known)


class ProcessSpans:
    """The subscriber's process spans: one per window of accepted batches, linked to their messages'
    creation contexts (one link per run)."""

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
        self._links: list[Link] = []
        self._run: _Run | None = None
        self._count = 0
        self._started_ns = 0

    def accepted(self, messages: Sequence[broker_pb2.Message]) -> None:
        """Count one batch of messages handed to the application (duplicates left out)."""
        if not messages:
            return
        now = time.time_ns()
        if not self._started_ns:
            self._started_ns = now
            asyncio.get_running_loop().call_later(WINDOW_SECONDS, self.flush)
        self._count += len(messages)
        run = self._run
        for message in messages:
            header = message.headers.get(TRACEPARENT, "")
            seq = message.publisher_seq
            latency = now - message.publish_time_unix_nano
            # A run goes on through sequence numbers the subscription's filter left out: the broker's
            # previous_seq says no message between matched.
            if (
                run is not None
                and header == run.header
                and message.publisher_id == run.publisher
                and run.last + 1 in (seq, message.previous_seq + 1)
            ):
                run.last = seq
                run.worst_ns = max(run.worst_ns, latency)
                continue
            self._close_run()
            previous = message.previous_seq  # the broker's: nothing between it and seq matched (0: unknown)
            filtered_from = previous + 1 if 0 < previous < seq - 1 else 0
            run = self._run = _Run(
                header, message.publisher_id, seq, seq, message.publish_time_unix_nano, now, latency, filtered_from
            )
        if len(self._links) >= MAX_LINKS:
            self.flush()

    def _close_run(self) -> None:
        run = self._run
        self._run = None
        if run is None or not run.header:
            return
        context = self._context(run.header)
        if context is not None:
            attributes: dict[str, int | str] = {
                SEQ_FIRST: run.first,
                SEQ_LAST: run.last,
                CLIENT_ID: run.publisher,
                PUBLISHED: run.published_ns,
                RECEIVED: run.received_ns,
                WORST: run.worst_ns,
            }
            if run.filtered_from:
                attributes[FILTERED_FROM] = run.filtered_from
            self._links.append(Link(context, attributes))

    def flush(self) -> None:
        """End the window's span (its timer, a full link list, or the subscriber closing)."""
        if not self._started_ns:
            return
        self._close_run()
        span = self.tracer.start_span(
            self.name,
            kind=SpanKind.CONSUMER,
            links=self._links,
            attributes=self.attributes,
            start_time=self._started_ns,
        )
        span.set_attribute("messaging.batch.message_count", self._count)
        span.end()
        self._links = []
        self._count = 0
        self._started_ns = 0

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


# Round trips one stamp span carries at most; a busier window ends its span early.
MAX_STAMPS = 1000
STAMP_LATENCIES = "sokutatsu.stamp.latency_ns"


class StampSpans:
    """The ordered publisher's stamp requests: a ``sequencer.stamp`` span per window, with each
    request's round trip from writing the request to reading the stamped range."""

    def __init__(self, client_id: str, sequencer: str) -> None:
        self.tracer = _tracer()
        self.attributes: dict[str, str] = {
            "rpc.system": "grpc",
            "rpc.service": "sokutatsu.sequencer.v1.Sequencer",
            "rpc.method": "Stamp",
            "server.address": sequencer,
            CLIENT_ID: client_id,
        }
        self._latencies: list[int] = []
        self._messages = 0
        self._domain = ""
        self._distribution = 0
        self._started_ns = 0
        self._ended_ns = 0

    def stamped(self, domain: str, distribution_id: int, messages: int, sent_ns: int, received_ns: int) -> None:
        """Count one answered request: ``messages`` stamped by ``domain``'s sequencer."""
        if self._latencies and domain != self._domain:
            self.flush()  # a span is one domain's
        if not self._started_ns:
            self._started_ns = sent_ns
            asyncio.get_running_loop().call_later(WINDOW_SECONDS, self.flush)
        self._domain, self._distribution = domain, distribution_id
        self._latencies.append(received_ns - sent_ns)
        self._messages += messages
        self._ended_ns = received_ns
        if len(self._latencies) >= MAX_STAMPS:
            self.flush()

    def flush(self) -> None:
        """End the window's span (its timer, a full window, a domain change or the publisher closing)."""
        if not self._latencies:
            self._started_ns = 0
            return
        span = self.tracer.start_span(
            "sequencer.stamp",
            kind=SpanKind.CLIENT,
            attributes={
                **self.attributes,
                "sokutatsu.domain": self._domain,
                "sokutatsu.distribution.id": self._distribution,
                "sokutatsu.stamp.requests": len(self._latencies),
                "messaging.batch.message_count": self._messages,
                STAMP_LATENCIES: self._latencies,
            },
            start_time=self._started_ns,
        )
        span.end(end_time=self._ended_ns)
        self._latencies = []
        self._messages = 0
        self._started_ns = 0


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

"""The SDK's messaging spans (docs/tracing.md), exported over OTLP/gRPC to a real trace receiver
started here (opentelemetry-proto's TraceService), from a client process publishing to and
subscribing from a real broker. Every message sent is covered once by the send spans' ranges, and
the subscriber's process spans link to those send spans with ranges that cover every message it
got, filtered ones included."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import pytest
from grpc import aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from sokutatsu.client._spans import _parse
from tests.broker.fix_broker import BrokerProcess

pytestmark = pytest.mark.timeout(120)

N = 300

CLIENT = """
import asyncio, sys
from sokutatsu.client import Publisher, Subscriber
from sokutatsu.core.telemetry import setup_telemetry

N = int(sys.argv[2])

async def main():
    telemetry = setup_telemetry("sdk-test", "client", None)
    assert telemetry.provider is not None, "OTEL_EXPORTER_OTLP_ENDPOINT is not set"
    async with Subscriber(sys.argv[1], "all", "ticks") as everything, Subscriber(
        sys.argv[1], "even", "ticks", keys=["even"]
    ) as even:
        await asyncio.wait_for(everything.connected.wait(), 10)
        await asyncio.wait_for(even.connected.wait(), 10)
        async with Publisher(sys.argv[1], "feed") as pub:
            for i in range(1, N + 1):
                # Two topics interleaved in runs, keys alternating: spans break at each topic change.
                topic = "ticks" if (i // 7) % 3 else "other"
                pub.publish_nowait(topic, "even" if i % 2 == 0 else "odd", b"x" * 64)
                if i % 25 == 0:
                    await pub.flush()
            await pub.flush()
            last = pub.last_seq
        expected = sum(1 for i in range(1, N + 1) if (i // 7) % 3)
        got = 0
        async for _ in everything:
            got += 1
            if got == expected:
                break
        got_even = 0
        async for message in even:
            got_even += 1
            if message.publisher_seq == max(i for i in range(1, N + 1) if (i // 7) % 3 and i % 2 == 0):
                break
    telemetry.shutdown()
    print(last, got, got_even, flush=True)

asyncio.run(main())
"""


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []  # (service.name, span)

    async def Export(  # noqa: N802 - the proto's RPC name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: aio.ServicerContext[Any, Any]
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((str(service), span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _attributes(values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in values:
        value: common_pb2.AnyValue = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value") or "string_value")
    return out


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, int]]:
    server = aio.server()
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, port
    await server.stop(None)


async def test_send_and_process_spans_cover_every_message_and_link_to_their_creation_context(
    broker: BrokerProcess, receiver: tuple[Receiver, int]
) -> None:
    servicer, port = receiver
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, broker.address, str(N), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(child.communicate(), 90)
    assert child.returncode == 0, err.decode()[-3000:]
    last, got, got_even = (int(x) for x in out.split())
    ticks = [i for i in range(1, N + 1) if (i // 7) % 3]
    assert (last, got, got_even) == (N, len(ticks), sum(1 for i in ticks if i % 2 == 0))

    client = [span for service, span in servicer.spans if service == "sokutatsu-sdk-test"]
    sends = [s for s in client if s.kind == trace_pb2.Span.SPAN_KIND_PRODUCER]
    processes = [s for s in client if s.kind == trace_pb2.Span.SPAN_KIND_CONSUMER]

    # Send spans: per topic, their ranges cover exactly that topic's sequence numbers, once each.
    covered: dict[str, list[int]] = defaultdict(list)
    by_id: dict[bytes, trace_pb2.Span] = {}
    for span in sends:
        attributes = _attributes(span.attributes)
        topic = attributes["messaging.destination.name"]
        assert span.name == f"send {topic}"
        assert attributes["messaging.system"] == "sokutatsu"
        assert attributes["messaging.operation.type"] == "send"
        assert attributes["messaging.client.id"] == "feed"
        first, last_seq = attributes["sokutatsu.seq.first"], attributes["sokutatsu.seq.last"]
        assert attributes["messaging.batch.message_count"] == last_seq - first + 1
        covered[topic].extend(range(first, last_seq + 1))
        by_id[span.span_id] = span
    assert sorted(covered["ticks"]) == ticks
    assert sorted(covered["other"]) == [i for i in range(1, N + 1) if i not in set(ticks)]

    # Process spans: per subscriber, the links' ranges cover what it got, each link to a send span of
    # its topic whose range holds the link's.
    links_of: dict[str, list[int]] = defaultdict(list)
    for span in processes:
        attributes = _attributes(span.attributes)
        assert span.name == "process ticks"
        assert attributes["messaging.operation.type"] == "process"
        subscriber = attributes["messaging.consumer.group.name"]
        assert span.links, "a process span without links"
        for link in span.links:
            send = by_id[link.span_id]
            assert link.trace_id == send.trace_id
            link_attributes = _attributes(link.attributes)
            send_attributes = _attributes(send.attributes)
            assert send_attributes["messaging.destination.name"] == "ticks"
            first, last_seq = link_attributes["sokutatsu.seq.first"], link_attributes["sokutatsu.seq.last"]
            assert send_attributes["sokutatsu.seq.first"] <= first <= last_seq <= send_attributes["sokutatsu.seq.last"]
            assert link_attributes["messaging.client.id"] == "feed"
            # The run's first message: published before it arrived; the run's worst latency at least its.
            published = link_attributes["sokutatsu.publish_time_unix_nano"]
            received = link_attributes["sokutatsu.receive_time_unix_nano"]
            assert 0 < published <= received
            assert link_attributes["sokutatsu.latency_max_ns"] >= received - published
            links_of[subscriber].extend(range(first, last_seq + 1))
    assert sorted(links_of["all"]) == ticks
    # The filtered subscriber's runs span the odd numbers its filter left out, never another send span's.
    even = links_of["even"]
    assert len(even) == len(set(even)), "a message covered twice"
    assert {i for i in ticks if i % 2 == 0} <= set(even) <= set(ticks)


def test_a_malformed_traceparent_gives_no_link() -> None:
    assert _parse("00-" + "0" * 32 + "-" + "1" * 16 + "-01") is None  # all-zero trace id
    assert _parse("zz-abc") is None
    assert _parse("00-" + "g" * 32 + "-" + "1" * 16 + "-01") is None
    context = _parse("00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    assert context is not None
    assert context.is_remote
    assert (context.trace_id, context.span_id, int(context.trace_flags)) == (int("a" * 32, 16), int("b" * 16, 16), 1)

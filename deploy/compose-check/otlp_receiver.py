"""Stand-in for Jaeger in `make compose-check`: an OTLP/gRPC trace receiver that records spans.

Jaeger cannot be pulled on the machines this check runs on, so the check runs this in its
place, on Jaeger's ports (docker-compose.yml, ``JAEGER_IMAGE``):

* 4317: OTLP/gRPC ``TraceService/Export``; every request is appended, as OTLP/JSON (ids in
  hex, as ``sokutatsu.core.telemetry`` writes its files), one line per request, to the
  record file;
* 13133: ``GET /status`` answers 200 while the receiver runs (the compose health check);
* 16686: ``GET /spans`` returns the record file (what the check reads from the host).

It is no Jaeger: no UI, no storage, no query API, no OTLP/HTTP on 4318. It stops on
SIGTERM or SIGINT: the gRPC server is given a second to finish the exports under way.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

RECORD = Path(os.environ.get("RECEIVER_RECORD", "/data/spans.jsonl"))
OTLP_PORT = 4317
HEALTH_PORT = 13133
QUERY_PORT = 16686
_HTTP_HEAD_LIMIT = 8192


def _hex_ids(value: Any) -> Any:
    """OTLP/JSON writes trace and span ids in hex; protobuf's JSON mapping gives base64."""
    if isinstance(value, dict):
        return {
            key: (base64.b64decode(item).hex() if key in {"traceId", "spanId", "parentSpanId"} else _hex_ids(item))
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_hex_ids(item) for item in value]
    return value


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, record: Path) -> None:
        self._record = record
        self.spans = 0

    async def Export(  # noqa: N802 - the proto's RPC name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        line = json.dumps(_hex_ids(json_format.MessageToDict(request)), separators=(",", ":"))
        with self._record.open("a", encoding="utf-8") as out:
            out.write(line + "\n")
        self.spans += sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _read(record: Path) -> bytes:
    return record.read_bytes() if record.exists() else b""


async def _http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: Path) -> None:
    """A minimal HTTP/1.0 answer to one GET: /status or /spans."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
        path = head[:_HTTP_HEAD_LIMIT].split(b" ", 2)[1].decode("ascii", "replace")
        if path == "/status":
            status, body, kind = "200 OK", b'{"status":"ok"}\n', "application/json"
        elif path == "/spans":
            body = await asyncio.to_thread(_read, record)
            status, kind = "200 OK", "application/x-ndjson"
        else:
            status, body, kind = "404 Not Found", b"stand-in OTLP receiver: GET /status or /spans\n", "text/plain"
        writer.write(
            f"HTTP/1.0 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        await writer.drain()
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, IndexError, ConnectionError):
        pass
    finally:
        writer.close()


async def main() -> int:
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    service = TraceService(RECORD)
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"[::]:{OTLP_PORT}")
    await server.start()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _http(reader, writer, RECORD)

    http_servers = [await asyncio.start_server(answer, port=port) for port in (HEALTH_PORT, QUERY_PORT)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sys.stdout.write(f"stand-in OTLP receiver: OTLP/gRPC :{OTLP_PORT}, /status :{HEALTH_PORT}, /spans :{QUERY_PORT}\n")
    sys.stdout.flush()
    await stop.wait()
    for http_server in http_servers:
        http_server.close()
    await server.stop(1.0)
    sys.stdout.write(f"stand-in OTLP receiver: stopped after {service.spans} spans\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

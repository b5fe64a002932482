"""``sokutatsu bench grpc-cost``: the CPU a grpc.aio server spends per message on a stream, under the
gRPC environment the services set (core/grpc_environment.py) and under gRPC's own defaults, in turns.

A bare server (``python -m sokutatsu.bench.grpc_cost``: one bidirectional raw-bytes method that answers
each request with 8 bytes, no protobuf, no interceptor, nothing of Sokutatsu's) is started once per turn
with one environment; a client in this process sends it ``rate`` requests of ``size`` bytes a second, one
at a time, as a publisher sends a broker its frames. The server's CPU (user + system from /proc) over the
middle of the turn, divided by the requests answered meanwhile, is its cost per request/response pair: the
floor under what any broker message costs before the broker does anything. The variants alternate, turn
by turn, so the machine's drift falls on both.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from sokutatsu.bench.queuedb_remote import process_cpu
from sokutatsu.core import grpc_environment

SERVICE = "sokutatsu.bench.v1.GrpcCost"
METHOD = f"/{SERVICE}/Echo"
VARIANTS = {
    # What the services set (core/grpc_environment.py), and gRPC's own defaults.
    "services": grpc_environment.DEFAULTS["GRPC_EXPERIMENTS"],
    "grpc-defaults": "",
}


@dataclass(frozen=True)
class Config:
    rate: int = 560  # bench fanout's publish frames a second per link at N = 64
    size: int = 900  # about one such frame (3.5 messages of 256 B)
    seconds: float = 10.0  # measured, after a second's warm-up
    rounds: int = 4


QUICK = Config(seconds=3.0, rounds=1)


def _identity(raw: bytes) -> bytes:
    return raw


async def serve() -> None:
    """The bare server: prints its port, serves until stdin closes."""

    async def echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for raw in requests:
            yield raw[:8]

    server = aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo, _identity, _identity)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Echo": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)  # noqa: T201 - the parent reads it
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)


async def _turn(cfg: Config, experiments: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in grpc_environment.DEFAULTS}
    env |= {"GRPC_VERBOSITY": "NONE", "GRPC_EXPERIMENTS": experiments}
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sokutatsu.bench.grpc_cost", env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdin, stdout = server.stdin, server.stdout
    if stdin is None or stdout is None:
        raise RuntimeError("the server's pipes were not opened")
    try:
        port = int(await asyncio.wait_for(stdout.readline(), 30))
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(METHOD, request_serializer=_identity, response_deserializer=_identity)()
            answered = 0

            async def read() -> None:
                nonlocal answered
                async for _ in call:
                    answered += 1

            reader = asyncio.create_task(read())
            body = b"x" * cfg.size
            gap = 1 / cfg.rate
            loop = asyncio.get_running_loop()
            start = loop.time()
            window: tuple[float, int] | None = None
            result: tuple[float, int] = (0.0, 0)
            sent = 0
            while True:
                now = loop.time()
                if window is None and now - start >= 1.0:
                    window = (process_cpu(server.pid), answered)
                if window is not None and now - start >= 1.0 + cfg.seconds:
                    result = (process_cpu(server.pid) - window[0], answered - window[1])
                    if server.returncode is not None:  # its /proc entry was gone: no CPU to count
                        raise RuntimeError(f"the server exited ({server.returncode}) during the turn")
                    break
                await call.write(body)
                sent += 1
                delay = start + sent * gap - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            await call.done_writing()
            await reader
    finally:
        stdin.close()
        try:
            await asyncio.wait_for(server.wait(), 10)
        except TimeoutError:
            server.kill()
            await server.wait()
    cpu, pairs = result
    return {
        "experiments": experiments,
        "pairs": pairs,
        "cpu_s": round(cpu, 3),
        "cpu_us_per_pair": round(1e6 * cpu / pairs, 1) if pairs else None,
    }


async def run(cfg: Config) -> dict[str, Any]:
    started = time.gmtime()
    turns: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for _ in range(cfg.rounds):
        for name, experiments in VARIANTS.items():
            turns[name].append(await _turn(cfg, experiments))
    per_pair = {name: [t["cpu_us_per_pair"] for t in runs if t["cpu_us_per_pair"]] for name, runs in turns.items()}
    medians = {name: statistics.median(v) if v else None for name, v in per_pair.items()}
    services, defaults = medians["services"], medians["grpc-defaults"]
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", started),
        "grpcio": grpc.__version__,
        "rate": cfg.rate,
        "size": cfg.size,
        "seconds": cfg.seconds,
        "rounds": cfg.rounds,
        "turns": turns,
        "cpu_us_per_pair": {
            name: {"min": min(v), "median": medians[name], "max": max(v)} for name, v in per_pair.items() if v
        },
        "services_over_defaults": round(services / defaults, 3) if services and defaults else None,
        "load_1m": round(os.getloadavg()[0], 2),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# bench grpc-cost, {result['time_utc']}",
        "",
        f"A bare grpc.aio server (grpcio {result['grpcio']}) answering {result['rate']:,} requests of "
        f"{result['size']} B a second on one stream, one at a time; its CPU per request/response pair over "
        f"{result['seconds']:g} s, {result['rounds']} turn(s) per variant, alternating. Load (1 min) at the end: "
        f"{result['load_1m']}.",
        "",
        "| GRPC_EXPERIMENTS | CPU µs per pair, each turn | median |",
        "|---|---|---|",
    ]
    for name, runs in result["turns"].items():
        value = runs[0]["experiments"] or "(empty: gRPC's defaults)"
        each = ", ".join(str(t["cpu_us_per_pair"]) for t in runs)
        median = result["cpu_us_per_pair"].get(name, {}).get("median", "none measured")
        lines.append(f"| {name}: `{value}` | {each} | {median} |")
    lines += ["", f"services / gRPC's defaults (medians): {result['services_over_defaults']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    asyncio.run(serve())

"""Market-data subscribers of ``sokutatsu demo``, in a process of their own.

    python -m sokutatsu.demo.subscribers BROKERS TOPIC DESKS_JSON

``DESKS_JSON`` is a list of desks (``{"id", "keys", "prefixes", "mode", "budget",
"slow_rate"}``); each is a durable :class:`~sokutatsu.client.Subscriber` with that key
filter. The process prints ``ready`` once every desk is connected. Lines on standard input
steer it (:func:`~sokutatsu.cli.children.tell`): ``slow`` makes the desks with a
``slow_rate`` consume at most that many messages per second, ``fast`` lifts it, and
``end {"desk": n, ...}`` makes each desk stop once it holds ``n`` distinct messages (or
after ``END_LIMIT_SECONDS``). It then prints one JSON line: per desk the publisher
sequence numbers received (every one, repeats included), their publish times and
latencies (receive - publish, one clock), the brokers that served it in turn, and the
SDK's gap and dropped-duplicate counts.

With ``SOKUTATSU_TRACE_DIR`` set, the SDK's process spans go to a file there.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sokutatsu.cli.children import stdin_words
from sokutatsu.client import Subscriber
from sokutatsu.core.telemetry import setup_telemetry
from sokutatsu.core.tls import client_config

READY = "ready"
CONNECT_LIMIT_SECONDS = 30.0
END_LIMIT_SECONDS = 60.0


@dataclass
class Desk:
    """One subscriber and what it received."""

    sub: Subscriber
    slow_rate: float
    seqs: list[int] = field(default_factory=list)
    published_ns: list[int] = field(default_factory=list)
    latency_us: list[int] = field(default_factory=list)
    brokers: list[str] = field(default_factory=list)
    rate: float = 0.0  # messages per second while slow; 0 = as fast as they come
    expected: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: str = ""

    def result(self) -> dict[str, Any]:
        return {
            "seqs": self.seqs,
            "published_ns": self.published_ns,
            "latency_us": self.latency_us,
            "brokers": self.brokers,
            "gaps": len(self.sub.gaps),
            "sdk_duplicates": self.sub.duplicates,
            "error": self.error,
        }


def _subscriber(brokers: list[str], topic: str, spec: dict[str, Any]) -> Subscriber:
    mode: Literal["flow-to-disk", "migrate"] | None = spec.get("mode")
    return Subscriber(
        brokers,
        spec["id"],
        topic,
        keys=spec.get("keys", ()),
        prefixes=spec.get("prefixes", ()),
        durable=True,
        mode=mode,
        memory_budget=int(spec.get("budget", 0)),
        on_gap="report",
        config=client_config(),
    )


async def _consume(desk: Desk) -> None:
    distinct: set[int] = set()
    next_at = time.monotonic()
    async for message in desk.sub:
        now_ns = time.time_ns()
        desk.seqs.append(message.publisher_seq)
        desk.published_ns.append(message.publish_time_unix_nano)
        desk.latency_us.append((now_ns - message.publish_time_unix_nano) // 1000)
        distinct.add(message.publisher_seq)
        if not desk.brokers or desk.brokers[-1] != desk.sub.broker_id:
            desk.brokers.append(desk.sub.broker_id)
        if desk.expected is not None and len(distinct) >= desk.expected:
            desk.done.set()
            return
        if desk.rate:
            next_at = max(next_at + 1 / desk.rate, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())
        else:
            next_at = time.monotonic()


async def _steer(desks: dict[str, Desk], ended: asyncio.Event) -> None:
    async for line in stdin_words():
        word, _, rest = line.partition(" ")
        if word in {"slow", "fast"}:
            for desk in desks.values():
                desk.rate = desk.slow_rate if word == "slow" else 0.0
        elif word == "end":
            for name, n in json.loads(rest).items():
                desk = desks[name]
                desk.expected = n
                if len(set(desk.seqs)) >= n:
                    desk.done.set()
            ended.set()
            return


async def main(argv: list[str]) -> dict[str, Any]:
    brokers, topic, specs = argv[0].split(","), argv[1], json.loads(argv[2])
    trace_dir = os.environ.get("SOKUTATSU_TRACE_DIR")
    telemetry = setup_telemetry("demo", f"subscribers-{os.getpid()}", Path(trace_dir) if trace_dir else None)
    desks = {s["id"]: Desk(_subscriber(brokers, topic, s), float(s.get("slow_rate", 0))) for s in specs}
    for desk in desks.values():
        await desk.sub.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(d.sub.connected.wait() for d in desks.values())), CONNECT_LIMIT_SECONDS)
        consumers = [asyncio.create_task(_consume(d)) for d in desks.values()]
        ended = asyncio.Event()
        steering = asyncio.create_task(_steer(desks, ended))
        print(READY, flush=True)  # noqa: T201 - protocol with the parent process
        await ended.wait()
        # Whatever has not arrived by then is reported missing by the parent.
        waits = [asyncio.create_task(d.done.wait()) for d in desks.values()]
        await asyncio.wait(waits, timeout=END_LIMIT_SECONDS)
        for task in (*consumers, *waits, steering):
            task.cancel()
        outcomes = await asyncio.gather(*consumers, return_exceptions=True)
        await asyncio.gather(*waits, steering, return_exceptions=True)
        for desk, outcome in zip(desks.values(), outcomes, strict=True):
            if isinstance(outcome, Exception):
                desk.error = repr(outcome)
    finally:
        for desk in desks.values():
            await desk.sub.close()
        telemetry.shutdown()
    return {name: desk.result() for name, desk in desks.items()}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))))  # noqa: T201 - the result, for the parent process

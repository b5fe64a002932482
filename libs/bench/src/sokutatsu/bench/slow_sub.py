"""A subscriber process for ``sokutatsu bench slow-subscriber``.

    python -m sokutatsu.bench.slow_sub ADDRESSES TOPIC SUBSCRIBER MODE BUDGET COUNT SLOW_RATE

It subscribes (durable, the given overflow mode and memory budget), prints
``ready``, and receives ``COUNT`` messages. Lines on standard input steer it:
``slow`` makes it consume at most ``SLOW_RATE`` messages per second, ``fast``
lifts that. At the end it prints one JSON line: per message its publisher
sequence number, publish time and latency (receive time minus publish time,
one clock), and the SDK's gap and duplicate counts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, Literal

from sokutatsu.cli.children import stdin_words
from sokutatsu.client import Subscriber
from sokutatsu.core.tls import client_config

READY = "ready"


class Pace:
    def __init__(self) -> None:
        self.rate = 0.0  # 0 = as fast as messages come


async def _steer(pace: Pace, slow_rate: float) -> None:
    async for word in stdin_words():
        if word == "slow":
            pace.rate = slow_rate
        elif word == "fast":
            pace.rate = 0.0


async def main(argv: list[str]) -> dict[str, Any]:
    addresses, topic, subscriber_id, mode, budget, count, slow_rate = argv
    overflow: Literal["flow-to-disk", "migrate"] = "migrate" if mode == "migrate" else "flow-to-disk"
    pace = Pace()
    seqs: list[int] = []
    published: list[int] = []
    latencies: list[float] = []
    steering = asyncio.create_task(_steer(pace, float(slow_rate)))
    async with Subscriber(
        addresses.split(","),
        subscriber_id,
        topic,
        durable=True,
        mode=overflow,
        memory_budget=int(budget),
        on_gap="report",
        config=client_config(),
    ) as sub:
        await asyncio.wait_for(sub.connected.wait(), 30)
        print(READY, flush=True)  # noqa: T201 - protocol with the parent process
        next_at = time.monotonic()
        async for message in sub:
            now_ns = time.time_ns()
            seqs.append(message.publisher_seq)
            published.append(message.publish_time_unix_nano)
            latencies.append((now_ns - message.publish_time_unix_nano) / 1e6)
            if len(seqs) == int(count):
                break
            if pace.rate:
                next_at = max(next_at + 1 / pace.rate, time.monotonic())
                await asyncio.sleep(next_at - time.monotonic())
            else:
                next_at = time.monotonic()
        gaps, duplicates = len(sub.gaps), sub.duplicates
    steering.cancel()
    return {
        "seqs": seqs,
        "published_ns": published,
        "latency_ms": [round(x, 3) for x in latencies],
        "gaps": gaps,
        "sdk_duplicates": duplicates,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))))  # noqa: T201

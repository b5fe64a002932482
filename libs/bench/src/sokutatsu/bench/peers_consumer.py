"""A consumer process for ``sokutatsu bench peers``, the same for every system.

    python -m sokutatsu.bench.peers_consumer SYSTEM ADDRESSES BUDGET CONSUMER COUNT SLOW_RATE

It connects as ``CONSUMER`` (``ADDRESSES`` and ``BUDGET`` matter to sokutatsu only), prints
``ready`` and consumes until it has ``COUNT`` messages (0: until told ``stop``). Lines on
standard input steer it: ``slow`` limits it to ``SLOW_RATE`` messages per second, ``fast``
lifts that, ``stop`` ends it. At the end it prints one JSON line: per message its sequence
number, publish time and latency (receive time minus publish time, one clock).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sokutatsu.bench.peers_clients import peer_named, read_body
from sokutatsu.cli.children import stdin_words

READY = "ready"


@dataclass
class _State:
    rate: float = 0.0  # messages per second; 0 = as fast as they come
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    seqs: list[int] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    first_ns: int = 0
    done_ns: int = 0


async def _steer(state: _State, slow_rate: float) -> None:
    async for word in stdin_words():
        if word == "slow":
            state.rate = slow_rate
        elif word == "fast":
            state.rate = 0.0
        elif word == "stop":
            break
    state.stop.set()


async def _receive(bodies: AsyncIterator[bytes], state: _State, count: int) -> None:
    next_at = time.monotonic()
    async for body in bodies:
        now = time.time_ns()
        seq, published = read_body(body)
        if not state.seqs:
            state.first_ns = now
        state.seqs.append(seq)
        state.published.append(published)
        state.latency_ms.append(round((now - published) / 1e6, 3))
        state.done_ns = now
        if len(state.seqs) == count:
            return
        if state.rate:
            next_at = max(next_at + 1 / state.rate, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())
        else:
            next_at = time.monotonic()


async def main(argv: list[str]) -> dict[str, Any]:
    system, addresses, budget, consumer, count, slow_rate = argv
    state = _State()
    peer = peer_named(system, [a for a in addresses.split(",") if a], int(budget))
    steering = asyncio.create_task(_steer(state, float(slow_rate)))
    async with peer.consume(consumer) as bodies:
        print(READY, flush=True)  # noqa: T201 - protocol with the parent process
        receiving = asyncio.create_task(_receive(bodies, state, int(count)))
        stopping = asyncio.create_task(state.stop.wait())
        await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in (receiving, stopping):
            task.cancel()
        await asyncio.gather(receiving, stopping, return_exceptions=True)
        failure = None if receiving.cancelled() else receiving.exception()
        if failure is not None:
            raise failure
    steering.cancel()
    return {
        "received": len(state.seqs),
        "first_ns": state.first_ns,
        "done_ns": state.done_ns,
        "seqs": state.seqs,
        "published_ns": state.published,
        "latency_ms": state.latency_ms,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))))  # noqa: T201

"""A member of ``sokutatsu demo``'s total-order group, in a process of its own.

    python -m sokutatsu.demo.order_member BROKERS TOPIC MEMBER_ID

It subscribes with an :class:`~sokutatsu.client.OrderedSubscriber` (durable, so it must
run before the group's first distribution is published) and prints ``ready``. Each order
it receives is appended, in the order it receives them, to a list of ``[domain, seq]``.
``end N`` on standard input makes it print ``got <count>`` once it holds N orders (or after
``END_LIMIT_SECONDS``), reading on; ``finish`` (sent once the sequencers are stopped) makes it
read until the topic is quiet for ``QUIET_SECONDS`` (the sequencers' last distributions and
fillers, so that its traces show them processed), then print one JSON line: that list, the first orders' bodies
as it printed them, and the error that stopped it, if any.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from sokutatsu.cli.children import stdin_words
from sokutatsu.client import OrderedSubscriber
from sokutatsu.core.telemetry import setup_telemetry
from sokutatsu.core.tls import client_config

CONNECT_LIMIT_SECONDS = 30.0
END_LIMIT_SECONDS = 60.0
QUIET_SECONDS = 1.0
SHOWN = 5


async def main(argv: list[str]) -> dict[str, Any]:
    brokers, topic, member = argv[0].split(","), argv[1], argv[2]
    trace_dir = os.environ.get("SOKUTATSU_TRACE_DIR")
    telemetry = setup_telemetry("demo", member, Path(trace_dir) if trace_dir else None)
    order: list[tuple[str, int]] = []
    shown: list[str] = []
    expected: list[int] = []
    ended, enough, finish = asyncio.Event(), asyncio.Event(), asyncio.Event()
    error = ""

    async def read(sub: OrderedSubscriber) -> None:
        async for message in sub:
            order.append((message.stamp.domain, message.stamp.seq))
            if len(shown) < SHOWN:
                shown.append(message.body.decode(errors="replace"))
            if expected and len(order) >= expected[0]:
                enough.set()

    async def steer() -> None:
        async for line in stdin_words():
            word, _, n = line.partition(" ")
            if word == "end":
                expected.append(int(n))
                if len(order) >= expected[0]:
                    enough.set()
                ended.set()
            elif word == "finish":
                finish.set()
                return

    sub = OrderedSubscriber(brokers, member, topic, config=client_config())
    await sub.start()
    steering = asyncio.create_task(steer())
    try:
        await asyncio.wait_for(sub.subscriber.connected.wait(), CONNECT_LIMIT_SECONDS)
        reading = asyncio.create_task(read(sub))
        print("ready", flush=True)  # noqa: T201 - protocol with the parent process
        await ended.wait()
        waiting = asyncio.create_task(enough.wait())
        await asyncio.wait([waiting, reading], timeout=END_LIMIT_SECONDS, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        print(f"got {len(order)}", flush=True)  # noqa: T201 - protocol: the parent stops the sequencers now
        await finish.wait()
        reading.cancel()
        outcome, _ = await asyncio.gather(reading, waiting, return_exceptions=True)
        if isinstance(outcome, Exception):
            error = repr(outcome)
        else:
            await _drain(sub, order)
    finally:
        steering.cancel()
        await sub.close()
        telemetry.shutdown()
    return {"order": order, "shown": shown, "error": error}


async def _drain(sub: OrderedSubscriber, order: list[tuple[str, int]]) -> None:
    """Read until nothing arrives for ``QUIET_SECONDS`` (an order arriving now is recorded too)."""
    while True:
        try:
            message = await asyncio.wait_for(sub.__anext__(), QUIET_SECONDS)
        except TimeoutError:
            return
        order.append((message.stamp.domain, message.stamp.seq))


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))))  # noqa: T201 - the result, for the parent process

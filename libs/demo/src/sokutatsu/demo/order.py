"""The total-order part of ``sokutatsu demo`` (extended ATOP, seed 002).

Two order desks in two domains publish with :class:`~sokutatsu.client.OrderedPublisher`
(domain a stamped by seq-a, domain b by seq-b) to one total-order topic on the broker
pair. The group's members (:mod:`sokutatsu.demo.order_member`, a process each)
subscribe before the sequencers start. At the end every member's list of ``(domain,
seq)`` is compared with the others' and with the stamps the desks were given: the same
order everywhere, each stamp once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sokutatsu.cli.children import child_process, child_result, tell
from sokutatsu.client import OrderedPublisher
from sokutatsu.core.tls import client_config
from sokutatsu.demo.suite import ORDER_TOPIC
from sokutatsu.sequencer.server import create_total_order_topic

Progress = Callable[[str], None]
DESKS = {"a": "tokyo-desk", "b": "osaka-desk"}


@dataclass(frozen=True)
class OrderConfig:
    members: int
    orders_per_desk: int


@dataclass
class MemberResult:
    name: str
    order: list[tuple[str, int]]
    shown: list[str]
    error: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.order).encode()).hexdigest()[:12]


@dataclass
class OrderResult:
    stamps: dict[str, list[int]]  # per domain, the numbers the desks were given
    members: list[MemberResult]
    lost: int
    duplicates: int
    agree: bool

    @property
    def sent(self) -> int:
        return sum(len(v) for v in self.stamps.values())


@contextlib.asynccontextmanager
async def order_group(brokers: list[str], members: int) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """The topic and the members' processes, before the sequencers publish their first distribution."""
    await create_total_order_topic(brokers, ORDER_TOPIC)
    async with contextlib.AsyncExitStack() as stack:
        procs = [
            await stack.enter_async_context(
                child_process(
                    "sokutatsu.demo.order_member",
                    ",".join(brokers),
                    ORDER_TOPIC,
                    f"replica-{i}",
                    what=f"order group member replica-{i}",
                )
            )
            for i in range(1, members + 1)
        ]
        yield procs


async def _desk(sequencer: str, brokers: list[str], domain: str, count: int, rng: random.Random) -> list[int]:
    """One desk's orders in batches of 1-40 at a random pace; returns the numbers it was stamped."""
    numbers: list[int] = []
    desk = DESKS[domain]
    async with OrderedPublisher(
        sequencer, brokers, ORDER_TOPIC, domain=domain, client_id=desk, config=client_config()
    ) as pub:
        while len(numbers) < count:
            n = min(count - len(numbers), rng.randrange(1, 40))
            futures = []
            for _ in range(n):
                side, qty, code = rng.choice(("BUY", "SELL")), rng.randrange(1, 30) * 100, rng.randrange(1300, 10000)
                body = f"{desk} {side} {qty} {code}.T"
                futures.append(pub.publish_nowait(f"{code}.T", body.encode()))
            stamps = await asyncio.wait_for(asyncio.gather(*futures), 60)
            numbers.extend(s.seq for s in stamps)
            await asyncio.sleep(rng.random() * 0.02)
    return numbers


async def run_orders(
    cfg: OrderConfig,
    sequencers: dict[str, str],
    brokers: list[str],
    members: list[asyncio.subprocess.Process],
    *,
    progress: Progress,
    before_collect: Callable[[], Awaitable[None]],
) -> OrderResult:
    """The desks' orders; once every replica holds them (the merge needs the sequencers until then),
    ``before_collect`` (the demo stops the sequencers) and each replica's order."""
    rng = random.Random(5)  # noqa: S311 - reproducible orders, not security
    progress(
        f"order: {', '.join(DESKS.values())} send {cfg.orders_per_desk:,} orders each, stamped by "
        f"{' and '.join(f'seq-{d}' for d in sequencers)}; {len(members)} replicas merge them"
    )
    numbers = await asyncio.gather(
        *(
            _desk(address, brokers, domain, cfg.orders_per_desk, random.Random(rng.random()))  # noqa: S311
            for domain, address in sequencers.items()
        )
    )
    stamps = dict(zip(sequencers, numbers, strict=True))
    total = sum(len(n) for n in numbers)
    progress(f"order: {total:,} orders acknowledged by both brokers; collecting the replicas' order")
    for proc in members:
        await tell(proc, f"end {total}")
    for proc in members:
        assert proc.stdout is not None  # noqa: S101 - child_process pipes it
        await asyncio.wait_for(proc.stdout.readline(), 120)  # "got <count>": it has them all, or gave up
    await before_collect()
    for proc in members:
        await tell(proc, "finish")
    results = [await child_result(proc, 120) for proc in members]
    got = [
        MemberResult(f"replica-{i}", [(d, s) for d, s in r["order"]], r["shown"], r["error"])
        for i, r in enumerate(results, 1)
    ]
    return _check(stamps, got)


def _check(stamps: dict[str, list[int]], members: list[MemberResult]) -> OrderResult:
    lost = duplicates = 0
    for m in members:
        for domain, numbers in stamps.items():
            received = [seq for d, seq in m.order if d == domain]
            lost += len(set(numbers) - set(received))
            duplicates += len(received) - len(set(received))
    agree = all(m.order == members[0].order for m in members) and not any(m.error for m in members)
    return OrderResult(stamps=stamps, members=members, lost=lost, duplicates=duplicates, agree=agree)


def shown(result: OrderResult, n: int = 6) -> dict[str, Any]:
    """The first ``n`` positions of each member's order, as ``a1 b1 b2``."""
    return {m.name: " ".join(f"{d}{s}" for d, s in m.order[:n]) for m in result.members}

"""Exactly once through kill -9 during grouped commits: many concurrent callers enqueue remotely into
node 1 (durable on both nodes, and alternating), so their calls commit in groups, while a seeded
schedule SIGKILLs node 1's and node 2's PostgreSQL clusters (postmaster and every backend), both
queue-db services and the transfer daemon, twice each. Real processes, real PostgreSQL, each node
its own cluster with a lazy WAL writer (test_alternate's fixtures): an unflushed commit is really
lost. Every acknowledged message must arrive exactly once, in each caller's order.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re

import pytest
from grpc import aio

from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from tests.queuedb.test_alternate import (  # noqa: F401 - pair and client are fixtures
    RPC_TIMEOUT,
    VICTIMS,
    Pair,
    _enqueue,
    _outbox,
    _received,
    _until,
    client,
    pair,
)

pytestmark = pytest.mark.timeout(600)
log = logging.getLogger(__name__)

CALLERS = 24


async def _create(client: queuedb_pb2_grpc.QueueServiceAsyncStub, durability: str) -> None:  # noqa: F811
    rule = queuedb_pb2.TransferRule(
        to_node="node2",
        to_queue="inbox",
        immediate=True,
        durability=queuedb_pb2.REMOTE_DURABILITY_ALTERNATE
        if durability == "alternate"
        else queuedb_pb2.REMOTE_DURABILITY_BOTH,
    )
    request = queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name="orders", transfer=rule))
    await client.CreateQueue(request, timeout=RPC_TIMEOUT, wait_for_ready=True)


def _largest_group(pair: Pair) -> int:  # noqa: F811
    text = "".join(path.read_text(errors="replace") for path in pair.service1.logs)
    return max((int(n) for n in re.findall(r"group commit: (\d+) calls in one transaction", text)), default=1)


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["both", "alternate"])
async def test_every_acknowledged_message_arrives_once_in_order_through_kill_9_during_grouped_commits(
    pair: Pair,  # noqa: F811
    client: queuedb_pb2_grpc.QueueServiceAsyncStub,  # noqa: F811
    durability: str,
) -> None:
    pair.service1.env.update(
        {
            "SOKUTATSU_QUEUEDB_ALTERNATE_WAIT_MS": "2000",
            # A short wait for more calls: groups form even when the callers are slow to come back.
            "SOKUTATSU_QUEUEDB_GROUP_COMMIT_WINDOW_US": "2000",
            "SOKUTATSU_LOG_LEVEL": "INFO",  # the log says how large the groups got
        }
    )
    pair.start_all()
    await _create(client, durability)
    rng = random.Random(24)  # noqa: S311 - a reproducible crash schedule
    plan = [*VICTIMS, *VICTIMS]
    rng.shuffle(plan)

    stop = asyncio.Event()
    acked: dict[int, list[bytes]] = {c: [] for c in range(CALLERS)}
    refused: list[str] = []

    async def caller(c: int) -> None:
        n = 0
        while not stop.is_set():
            body = f"c{c}-{n}".encode()
            n += 1
            try:
                await _enqueue(client, body)
            except aio.AioRpcError as exc:  # not acknowledged: may or may not arrive
                refused.append(f"{exc.code().name}: {exc.details()}")
                await asyncio.sleep(0.05)
                continue
            acked[c].append(body)

    callers = [asyncio.create_task(caller(c)) for c in acked]
    try:
        for victim in plan:
            await asyncio.sleep(0.3 + rng.random())  # pacing only
            if victim.endswith("postgres"):
                cluster = pair.node1 if victim == "node1-postgres" else pair.node2
                cluster.kill9()
                cluster.restart()
            else:
                node = {"node1-service": pair.service1, "node2-service": pair.service2}.get(victim, pair.daemon)
                node.kill9()
                node.start()
        await asyncio.sleep(1)
    finally:
        stop.set()
        await asyncio.gather(*callers)
    pair.start_all()
    await _until(lambda: _outbox(pair) == [], "node 1's outbox to drain", pair, limit=180)

    received = _received(pair)
    assert len(set(received)) == len(received), "a message arrived twice"
    got = set(received)
    for c, bodies in acked.items():
        assert [b for b in bodies if b not in got] == [], f"caller {c}: acknowledged messages lost"
        numbers = [int(b.split(b"-")[1]) for b in received if b.startswith(f"c{c}-".encode())]
        assert numbers == sorted(numbers), f"caller {c}: out of order"
    assert sum(len(b) for b in acked.values()) > 200, "the callers hardly got anything through"
    assert _largest_group(pair) > 1, "no commit was grouped: the test proves nothing about group commit"
    log.info(
        "%s: acked %d, refused %d, largest group %d",
        durability,
        sum(map(len, acked.values())),
        len(refused),
        _largest_group(pair),
    )

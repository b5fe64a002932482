"""Group commit (sokutatsu.queuedb.group_commit) through a real queue-db process on a real PostgreSQL.

The node waits ``WINDOW_US`` after a group's first call for more, far longer than the calls a test
sends at once take to arrive, so those calls share one transaction: the node's log says how many
calls its largest group held. Nothing here asserts on how long anything takes.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import psycopg
import pytest
from grpc import aio

from sokutatsu.queuedb.v1 import queuedb_pb2_grpc
from sokutatsu.queuedb.v1.queuedb_pb2 import (
    AckRequest,
    CreateQueueRequest,
    DequeueRequest,
    EnqueueRequest,
    NewMessage,
    Queue,
)
from tests.helpers import ServiceProc, ensure_stopped, start_service, stop
from tests.queuedb.fix_queuedb import NodeDatabase

if TYPE_CHECKING:
    from sokutatsu.queuedb.v1.queuedb_pb2_grpc import QueueServiceAsyncStub as Stub

RPC_TIMEOUT = 30.0
WINDOW_US = 400_000  # far above the time a test's concurrent calls take to arrive
CALLS = 12
# A trigger refuses one body with SQLSTATE 22023 (a data exception: the request's own values).
POISON = b"poison"
_TRIGGER = """
CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.body = '\\x706f69736f6e'::bytea THEN
        RAISE EXCEPTION 'this body is refused' USING ERRCODE = '22023';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_poison BEFORE INSERT ON sokutatsu.messages FOR EACH ROW EXECUTE FUNCTION refuse_poison();
"""


@pytest.fixture
def node(node_database: NodeDatabase, tmp_path: Path) -> Iterator[tuple[ServiceProc, str]]:
    dsn = node_database()
    env = {
        "SOKUTATSU_QUEUEDB_LISTEN": "127.0.0.1:0",
        "SOKUTATSU_QUEUEDB_DSN": dsn,
        "SOKUTATSU_QUEUEDB_GROUP_COMMIT_WINDOW_US": str(WINDOW_US),
        "SOKUTATSU_GRACE_SECONDS": "1",
        "SOKUTATSU_LOG_LEVEL": "INFO",
    }
    proc = start_service("sokutatsu.queuedb", env, tmp_path)
    try:
        yield proc, dsn
        assert stop(proc.process) == 0, proc.output()
        assert "Traceback" not in proc.output()
    finally:
        ensure_stopped(proc.process)


@pytest.fixture
async def queues(node: tuple[ServiceProc, str]) -> AsyncIterator[Stub]:
    async with aio.insecure_channel(node[0].address) as channel:
        stub: Stub = queuedb_pb2_grpc.QueueServiceStub(channel)
        await stub.CreateQueue(CreateQueueRequest(queue=Queue(name="jobs")), timeout=RPC_TIMEOUT)
        yield stub


def _largest_group(proc: ServiceProc) -> int:
    sizes = [int(n) for n in re.findall(r"group commit: (\d+) calls in one transaction", proc.output())]
    return max(sizes, default=1)


def _bodies(dsn: str) -> list[bytes]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT body FROM sokutatsu.messages WHERE queue = 'jobs' ORDER BY seq").fetchall()
    return [bytes(r[0]) for r in rows]


async def _enqueue(queues: Stub, *bodies: bytes, deadline: float = RPC_TIMEOUT) -> list[int]:
    request = EnqueueRequest(queue="jobs", messages=[NewMessage(body=b) for b in bodies])
    return list((await queues.Enqueue(request, timeout=deadline)).seqs)


async def test_concurrent_calls_share_a_transaction_and_each_gets_its_own_ids_in_order(
    node: tuple[ServiceProc, str], queues: Stub
) -> None:
    proc, dsn = node
    batches = [[f"c{c}-{i}".encode() for i in range(c % 3 + 1)] for c in range(CALLS)]
    answers = await asyncio.gather(*(_enqueue(queues, *batch) for batch in batches))
    assert _largest_group(proc) > 1, proc.output()
    stored = dict(zip(_bodies(dsn), sorted(s for ids in answers for s in ids), strict=True))
    for batch, ids in zip(batches, answers, strict=True):
        assert len(ids) == len(batch)
        assert [stored[b] for b in batch] == ids  # each caller's ids: its own messages, in its order


async def test_a_callers_refused_values_fail_that_caller_alone(node: tuple[ServiceProc, str], queues: Stub) -> None:
    proc, dsn = node
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_TRIGGER.encode())
    good = [f"good-{c}".encode() for c in range(CALLS)]
    results = await asyncio.gather(
        *(_enqueue(queues, b) for b in good[: CALLS // 2]),
        _enqueue(queues, POISON),
        *(_enqueue(queues, b) for b in good[CALLS // 2 :]),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(refused) == 1, results
    assert isinstance(refused[0], aio.AioRpcError)
    assert refused[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "this body is refused" in (refused[0].details() or "")
    assert sorted(_bodies(dsn)) == sorted(good)  # every other caller's message, once
    assert "running them one by one" in proc.output()
    assert _largest_group(proc) > 1


async def test_a_call_cancelled_before_its_group_commits_is_left_out(
    node: tuple[ServiceProc, str], queues: Stub
) -> None:
    _, dsn = node
    with pytest.raises(aio.AioRpcError) as info:
        # Its deadline passes while it waits for the group's window: the handler is cancelled.
        await _enqueue(queues, b"cancelled", deadline=WINDOW_US / 1e6 / 4)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _enqueue(queues, b"kept")  # a group after it has committed
    assert _bodies(dsn) == [b"kept"]


async def test_a_lease_two_calls_of_a_group_ack_is_acked_for_one_of_them(queues: Stub) -> None:
    await _enqueue(queues, b"a", b"b")
    leased = (await queues.Dequeue(DequeueRequest(queue="jobs", max_messages=2), timeout=RPC_TIMEOUT)).messages
    lease_a, lease_b = (m.lease_id for m in leased)
    answers = await asyncio.gather(
        queues.Ack(AckRequest(queue="jobs", lease_ids=[lease_a]), timeout=RPC_TIMEOUT),
        queues.Ack(AckRequest(queue="jobs", lease_ids=[lease_a, lease_b, "not-a-lease"]), timeout=RPC_TIMEOUT),
    )
    first, second = (list(a.expired) for a in answers)
    assert first == []
    assert second == [lease_a, "not-a-lease"]  # acked for the first call; the rest in request order
    left = (await queues.Dequeue(DequeueRequest(queue="jobs", max_messages=2), timeout=RPC_TIMEOUT)).messages
    assert list(left) == []

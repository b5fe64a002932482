"""QueueService end to end: a real queue-db process on a fresh PostgreSQL database, called over gRPC.

Queues are created, read, listed and counted; messages are enqueued in order, leased in seq order
to one consumer at a time, redelivered when a lease expires, removed by Ack and made visible again
by Nack; bad requests get a status code and a sentence saying what to do. Nothing here asserts on
how long anything takes: waits are bounded loops that only stop a hung test.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import psycopg
import pytest
from grpc import aio

from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from sokutatsu.queuedb.v1.queuedb_pb2 import (
    AckRequest,
    CreateQueueRequest,
    DequeueRequest,
    EnqueueRequest,
    GetQueueRequest,
    GetQueueStatsRequest,
    ListQueuesRequest,
    NackRequest,
    NewMessage,
    Queue,
    TransferRule,
)
from tests.queuedb.fix_queuedb import QueueDbNode

if TYPE_CHECKING:  # the async stub exists in the type stubs only
    from sokutatsu.queuedb.v1.queuedb_pb2_grpc import QueueServiceAsyncStub as Stub

MAX_BATCH = 20
MAX_BODY_BYTES = 1024
RPC_TIMEOUT = 30.0
# Bounds on polling loops (iterations of a Dequeue or stats call), far above what is needed.
POLL_LIMIT = 600


@pytest.fixture
def node(queuedb_node: Callable[..., QueueDbNode]) -> QueueDbNode:
    """A queue-db process on a fresh database, with small limits so the refusals are cheap to reach."""
    return queuedb_node(max_batch=str(MAX_BATCH), max_body_bytes=str(MAX_BODY_BYTES), peers="node2,node3")


@pytest.fixture
async def queues(node: QueueDbNode) -> AsyncIterator[Stub]:
    async with aio.insecure_channel(node.address) as channel:
        yield queuedb_pb2_grpc.QueueServiceStub(channel)


async def _refused(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details() or ""


async def _create(queues: Stub, name: str, transfer: TransferRule | None = None) -> Queue:
    response = await queues.CreateQueue(
        CreateQueueRequest(queue=Queue(name=name, transfer=transfer)), timeout=RPC_TIMEOUT
    )
    return response.queue


async def _enqueue(queues: Stub, queue: str, *bodies: bytes) -> list[int]:
    request = EnqueueRequest(queue=queue, messages=[NewMessage(body=b) for b in bodies])
    return list((await queues.Enqueue(request, timeout=RPC_TIMEOUT)).seqs)


async def _dequeue(queues: Stub, queue: str, n: int = 1, **options: int) -> list[queuedb_pb2.QueueMessage]:
    request = DequeueRequest(queue=queue, max_messages=n, **options)
    return list((await queues.Dequeue(request, timeout=RPC_TIMEOUT)).messages)


async def _stats(queues: Stub, queue: str) -> queuedb_pb2.QueueStats:
    return await queues.GetQueueStats(GetQueueStatsRequest(queue=queue), timeout=RPC_TIMEOUT)


async def _ack(queues: Stub, queue: str, *leases: str) -> list[str]:
    return list((await queues.Ack(AckRequest(queue=queue, lease_ids=leases), timeout=RPC_TIMEOUT)).expired)


async def _nack(queues: Stub, queue: str, *leases: str, delay_ms: int = 0) -> list[str]:
    request = NackRequest(queue=queue, lease_ids=leases, delay_ms=delay_ms)
    return list((await queues.Nack(request, timeout=RPC_TIMEOUT)).expired)


async def _redelivered(queues: Stub, queue: str) -> list[queuedb_pb2.QueueMessage]:
    """Dequeue until something comes (each call waits up to a second for it)."""
    for _ in range(POLL_LIMIT):
        got = await _dequeue(queues, queue, 10, wait_ms=1000, visibility_timeout_ms=60_000)
        if got:
            return got
    raise AssertionError(f"nothing in {queue!r} became ready again")


async def test_queues_are_created_read_listed_and_counted(node: QueueDbNode, queues: Stub) -> None:
    forwarding = TransferRule(to_node="node2", to_queue="inbox", immediate=False, min_batch=10, max_age_ms=500)
    alternating = TransferRule(to_node="node2", immediate=True, durability=queuedb_pb2.REMOTE_DURABILITY_ALTERNATE)
    assert await _create(queues, "orders") == Queue(name="orders")
    # Durability left unspecified is durable-on-both, and the answer says so.
    forwarding_both = TransferRule(durability=queuedb_pb2.REMOTE_DURABILITY_BOTH)
    forwarding_both.MergeFrom(forwarding)
    assert await _create(queues, "to-node2", forwarding) == Queue(name="to-node2", transfer=forwarding_both)
    assert await _create(queues, "to-node2-alt", alternating) == Queue(name="to-node2-alt", transfer=alternating)
    assert await queues.GetQueue(GetQueueRequest(name="orders")) == Queue(name="orders")
    assert await queues.GetQueue(GetQueueRequest(name="to-node2")) == Queue(name="to-node2", transfer=forwarding_both)
    assert await queues.GetQueue(GetQueueRequest(name="to-node2-alt")) == Queue(
        name="to-node2-alt", transfer=alternating
    )
    listed = await queues.ListQueues(ListQueuesRequest())
    assert list(listed.queues) == [
        Queue(name="orders"),
        Queue(name="to-node2", transfer=forwarding_both),
        Queue(name="to-node2-alt", transfer=alternating),
    ]

    empty = await _stats(queues, "orders")
    assert empty == queuedb_pb2.QueueStats(queue="orders")

    await _enqueue(queues, "orders", b"a", b"b", b"c")
    [first] = await _dequeue(queues, "orders")
    stats = await _stats(queues, "orders")
    assert (stats.ready, stats.leased, stats.transfer_pending, stats.transfer_sending) == (2, 1, 0, 0)
    # The batch was enqueued in one transaction: every message has the same enqueue time.
    assert stats.oldest_ready_unix_nano == first.enqueued_unix_nano != 0
    # Nacked with a delay: neither ready nor leased until the delay passes.
    assert await _nack(queues, "orders", first.lease_id, delay_ms=3_600_000) == []
    stats = await _stats(queues, "orders")
    assert (stats.ready, stats.leased) == (2, 0)

    # A forwarding queue's messages wait in the outbox; the daemon marks a batch as sending.
    await _enqueue(queues, "to-node2", b"x", b"y", b"z")
    with psycopg.connect(node.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO sokutatsu.transfer_batches (to_node, first_id, last_id, outbox_ids) "
            "SELECT 'node2', 1, 1, ARRAY[min(id)] FROM sokutatsu.outbox"
        )
    stats = await _stats(queues, "to-node2")
    assert (stats.ready, stats.leased, stats.transfer_pending, stats.transfer_sending) == (0, 0, 2, 1)
    assert stats.oldest_ready_unix_nano == 0


async def test_creating_an_existing_queue_answers_it_or_names_the_difference(queues: Stub) -> None:
    rule = TransferRule(to_node="node2", immediate=True, durability=queuedb_pb2.REMOTE_DURABILITY_BOTH)
    await _create(queues, "local")
    await _create(queues, "fwd", TransferRule(to_node="node2", immediate=True))
    assert await _create(queues, "local") == Queue(name="local")
    assert await _create(queues, "fwd", rule) == Queue(name="fwd", transfer=rule)
    # An empty to_queue means the same name: asking for it explicitly is the same queue.
    same = await _create(queues, "fwd", TransferRule(to_node="node2", to_queue="fwd", immediate=True))
    assert same == Queue(name="fwd", transfer=rule)

    code, details = await _refused(_create(queues, "local", rule))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "'local'" in details
    assert "forwarding to node 'node2'" in details
    code, details = await _refused(_create(queues, "fwd", TransferRule(to_node="node2", min_batch=5)))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "immediate is True (asked: False)" in details
    assert "min_batch is 0 (asked: 5)" in details
    code, details = await _refused(_create(queues, "fwd", TransferRule(to_node="node3", immediate=True)))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "node2" in details
    assert "node3" in details
    code, details = await _refused(_create(queues, "fwd"))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "(asked: local)" in details
    alternate = TransferRule(to_node="node2", immediate=True, durability=queuedb_pb2.REMOTE_DURABILITY_ALTERNATE)
    code, details = await _refused(_create(queues, "fwd", alternate))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "durability is 'both' (asked: 'alternate')" in details


async def test_enqueue_keeps_request_order_single_and_batch(queues: Stub) -> None:
    await _create(queues, "orders")
    [one] = await _enqueue(queues, "orders", b"m0")
    request = EnqueueRequest(
        queue="orders",
        messages=[NewMessage(body=f"m{i}".encode(), headers={"i": str(i)}, key=f"k{i}") for i in range(1, 11)],
    )
    batch = list((await queues.Enqueue(request)).seqs)
    assert len(batch) == 10
    assert [one, *batch] == sorted({one, *batch})

    got = await _dequeue(queues, "orders", MAX_BATCH)
    assert [m.body for m in got] == [f"m{i}".encode() for i in range(11)]
    assert [m.seq for m in got] == [one, *batch]
    assert all(m.queue == "orders" and m.delivery_count == 1 for m in got)
    assert dict(got[3].headers) == {"i": "3"}
    assert got[3].key == "k3"
    assert not got[0].headers
    assert got[0].enqueued_unix_nano != 0


async def test_dequeue_leases_in_seq_order_and_hides_leased_messages(queues: Stub) -> None:
    await _create(queues, "jobs")
    seqs = await _enqueue(queues, "jobs", *[f"j{i}".encode() for i in range(5)])

    first = await _dequeue(queues, "jobs", 2)
    assert [m.seq for m in first] == seqs[:2]
    # A second consumer gets the rest, never a leased message.
    second = await _dequeue(queues, "jobs", 10)
    assert [m.seq for m in second] == seqs[2:]
    assert await _dequeue(queues, "jobs", 10) == []
    leases = [m.lease_id for m in first + second]
    assert len(set(leases)) == 5
    # max_messages left at 0 means one.
    await _enqueue(queues, "jobs", b"a", b"b")
    assert [m.body for m in await _dequeue(queues, "jobs", 0)] == [b"a"]
    # MAX_BATCH asked: served; more is refused (issue #20: no answer says how many were granted).
    await _enqueue(queues, "jobs", *[b"x"] * MAX_BATCH)
    code, details = await _refused(_dequeue(queues, "jobs", MAX_BATCH * 10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"over the maximum of {MAX_BATCH} (SOKUTATSU_QUEUEDB_MAX_BATCH)" in details
    assert len(await _dequeue(queues, "jobs", MAX_BATCH)) == MAX_BATCH


async def test_concurrent_consumers_never_share_a_message(queues: Stub) -> None:
    await _create(queues, "work")
    seqs = []
    for start in range(0, 100, MAX_BATCH):
        seqs += await _enqueue(queues, "work", *[f"w{i}".encode() for i in range(start, start + MAX_BATCH)])

    async def consumer() -> list[int]:
        taken: list[int] = []
        while got := await _dequeue(queues, "work", 3):
            taken += [m.seq for m in got]
        return taken

    results = await asyncio.gather(*[consumer() for _ in range(8)])
    everything = [seq for taken in results for seq in taken]
    assert sorted(everything) == seqs
    assert all(taken == sorted(taken) for taken in results)


async def test_an_expired_lease_is_delivered_again_and_its_ack_comes_back_expired(queues: Stub) -> None:
    await _create(queues, "retry")
    [seq, other] = await _enqueue(queues, "retry", b"first", b"second")
    [leased] = await _dequeue(queues, "retry", visibility_timeout_ms=300)
    [held] = await _dequeue(queues, "retry", visibility_timeout_ms=3_600_000)
    assert (leased.seq, leased.delivery_count, held.seq) == (seq, 1, other)

    [again] = await _redelivered(queues, "retry")
    assert (again.seq, again.body, again.delivery_count) == (seq, b"first", 2)
    assert again.lease_id != leased.lease_id
    assert await _ack(queues, "retry", leased.lease_id) == [leased.lease_id]
    assert await _nack(queues, "retry", leased.lease_id) == [leased.lease_id]
    assert await _ack(queues, "retry", again.lease_id, held.lease_id) == []
    stats = await _stats(queues, "retry")
    assert (stats.ready, stats.leased) == (0, 0)


async def test_an_expired_lease_cannot_ack_and_its_message_comes_back_ahead_of_newer_ones(queues: Stub) -> None:
    await _create(queues, "late")
    [seq] = await _enqueue(queues, "late", b"slow")
    [leased] = await _dequeue(queues, "late", visibility_timeout_ms=300)
    for _ in range(POLL_LIMIT):
        if (await _stats(queues, "late")).ready == 1:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the lease never expired")
    # Expired but not yet delivered again: the Ack is too late and the message stays.
    assert await _ack(queues, "late", leased.lease_id) == [leased.lease_id]
    [newer] = await _enqueue(queues, "late", b"newer")
    got = await _dequeue(queues, "late", 10)
    # The redelivered message keeps its seq, so it comes back first.
    assert [(m.seq, m.body, m.delivery_count) for m in got] == [(seq, b"slow", 2), (newer, b"newer", 1)]


async def test_ack_removes_and_nack_makes_visible_again(queues: Stub) -> None:
    await _create(queues, "tasks")
    seqs = await _enqueue(queues, "tasks", b"t0", b"t1", b"t2")
    got = await _dequeue(queues, "tasks", 3)
    assert await _ack(queues, "tasks", got[0].lease_id) == []
    # Acked twice: the second time the lease is gone.
    assert await _ack(queues, "tasks", got[0].lease_id) == [got[0].lease_id]
    assert await _nack(queues, "tasks", got[1].lease_id, got[2].lease_id) == []
    stats = await _stats(queues, "tasks")
    assert (stats.ready, stats.leased) == (2, 0)
    # The old leases no longer hold.
    assert await _ack(queues, "tasks", got[1].lease_id) == [got[1].lease_id]

    again = await _dequeue(queues, "tasks", 3)
    assert [m.seq for m in again] == seqs[1:]
    assert [m.delivery_count for m in again] == [2, 2]
    assert await _ack(queues, "tasks", *(m.lease_id for m in again)) == []
    assert await _dequeue(queues, "tasks", 3) == []
    stats = await _stats(queues, "tasks")
    assert (stats.ready, stats.leased) == (0, 0)


async def test_dequeue_waits_for_a_message_and_returns_empty_when_none_comes(queues: Stub) -> None:
    await _create(queues, "idle")
    assert await _dequeue(queues, "idle", wait_ms=100) == []

    waiting = asyncio.ensure_future(_dequeue(queues, "idle", wait_ms=20_000))
    await asyncio.sleep(0.2)
    await _enqueue(queues, "idle", b"late")
    got = await waiting
    # Usually the waiting call gets it; if it had given up already, the message is still there.
    if not got:
        got = await _dequeue(queues, "idle")
    assert [m.body for m in got] == [b"late"]


async def test_bad_input_is_refused_with_a_code_and_a_reason(queues: Stub) -> None:
    await _create(queues, "real")
    await _create(queues, "fwd", TransferRule(to_node="node2"))

    for call in (
        queues.GetQueue(GetQueueRequest(name="nope")),
        queues.GetQueueStats(GetQueueStatsRequest(queue="nope")),
        queues.Enqueue(EnqueueRequest(queue="nope", messages=[NewMessage(body=b"x")])),
        queues.Dequeue(DequeueRequest(queue="nope")),
        queues.Dequeue(DequeueRequest(queue="nope", wait_ms=100)),
        queues.Ack(AckRequest(queue="nope", lease_ids=["00000000-0000-0000-0000-000000000000"])),
        queues.Nack(NackRequest(queue="nope", lease_ids=[])),
    ):
        code, details = await _refused(call)
        assert code == grpc.StatusCode.NOT_FOUND
        assert "queue 'nope' does not exist" in details
        assert "CreateQueue" in details

    code, details = await _refused(queues.Enqueue(EnqueueRequest(queue="real")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at least one message" in details
    too_many = EnqueueRequest(queue="real", messages=[NewMessage(body=b"x")] * (MAX_BATCH + 1))
    code, details = await _refused(queues.Enqueue(too_many))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{MAX_BATCH + 1} messages" in details
    assert str(MAX_BATCH) in details
    oversized = [NewMessage(body=b"ok"), NewMessage(body=b"ok"), NewMessage(body=b"x" * (MAX_BODY_BYTES + 1))]
    code, details = await _refused(queues.Enqueue(EnqueueRequest(queue="real", messages=oversized)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[2]" in details
    assert f"{MAX_BODY_BYTES:,} bytes" in details
    # Refused as a whole: nothing of the batch was stored.
    assert (await _stats(queues, "real")).ready == 0

    code, details = await _refused(queues.Dequeue(DequeueRequest(queue="real", wait_ms=20_001)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "wait_ms" in details
    code, details = await _refused(queues.Dequeue(DequeueRequest(queue="fwd")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "node 'node2'" in details

    for name in ("", "has space", "-leading-dash", "x" * 65):
        code, details = await _refused(_create(queues, name))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "name" in details
    code, details = await _refused(_create(queues, "q", TransferRule(to_queue="elsewhere")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "to_node is empty" in details
    code, details = await _refused(_create(queues, "q", TransferRule(to_node="bad node")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "TransferRule.to_node" in details
    alternate_local = TransferRule(durability=queuedb_pb2.REMOTE_DURABILITY_ALTERNATE)
    code, details = await _refused(_create(queues, "q", alternate_local))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "TransferRule.durability is set but to_node is empty" in details
    unknown = TransferRule(to_node="node2", durability=7)  # type: ignore[arg-type]
    code, details = await _refused(_create(queues, "q", unknown))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "durability 7 is not a RemoteDurability" in details
    code, details = await _refused(queues.GetQueue(GetQueueRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "GetQueueRequest.name is empty" in details
    # Nothing above created a queue.
    names = [q.name for q in (await queues.ListQueues(ListQueuesRequest())).queues]
    assert names == ["fwd", "real"]


async def test_malformed_and_unknown_lease_ids_come_back_expired(queues: Stub) -> None:
    await _create(queues, "q")
    await _create(queues, "other")
    await _enqueue(queues, "q", b"a", b"b")
    [a, b] = await _dequeue(queues, "q", 2)
    unknown = "5f0c4a3e-0000-4000-8000-000000000000"
    junk = ["not-a-uuid", "", "1234", "'; DROP TABLE x; --"]
    # The good lease is acked although the others are junk; the rest come back in request order.
    assert await _ack(queues, "q", junk[0], a.lease_id, unknown, *junk[1:]) == [junk[0], unknown, *junk[1:]]
    assert await _nack(queues, "q", *junk, b.lease_id, unknown) == [*junk, unknown]
    # A lease of another queue's message does not hold in this one.
    [b_again] = await _dequeue(queues, "q")
    assert await _ack(queues, "other", b_again.lease_id) == [b_again.lease_id]
    assert await _ack(queues, "q", b_again.lease_id) == []
    code, details = await _refused(queues.Ack(AckRequest(queue="q", lease_ids=[unknown] * (MAX_BATCH + 1))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "lease ids" in details


async def test_a_forwarding_queue_enqueues_into_the_outbox(node: QueueDbNode, queues: Stub) -> None:
    await _create(queues, "to-node2", TransferRule(to_node="node2", to_queue="inbox", immediate=True))
    ids = await _enqueue(queues, "to-node2", b"1", b"2")
    assert ids == sorted(ids)
    with psycopg.connect(node.dsn) as conn:
        rows = conn.execute("SELECT id, to_node, to_queue, body FROM sokutatsu.outbox ORDER BY id").fetchall()
    assert [(r[0], r[1], r[2], bytes(r[3])) for r in rows] == [
        (ids[0], "node2", "inbox", b"1"),
        (ids[1], "node2", "inbox", b"2"),
    ]
    stats = await _stats(queues, "to-node2")
    assert (stats.ready, stats.transfer_pending) == (0, 2)

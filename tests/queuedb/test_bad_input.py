"""Queue-db refuses what a client may not ask for (issue #20 items 3 and 6), on a real process.

* Every name on the Transfer endpoint follows CreateQueue's rule and is ``INVALID_ARGUMENT`` before
  any SQL: a 10,000-character ``sender_node`` or ``queue`` was ``UNAVAILABLE`` with the node's DSN
  (``index row requires 10016 bytes``).
* ``CreateQueue`` forwards only to a node of ``SOKUTATSU_QUEUEDB_PEERS``.
* Every client-supplied amount is capped by a setting: one over is refused naming the field, the
  maximum and the setting; the maximum itself is served.
* A database error the request's values caused is ``INVALID_ARGUMENT``, never ``UNAVAILABLE``.
"""

from __future__ import annotations

import random
import string
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import psycopg
import pytest
from grpc import aio

from sokutatsu.core.errors import InvalidArgument, Unavailable
from sokutatsu.core.tls import open_channel
from sokutatsu.queuedb.db import Database
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from sokutatsu.queuedb.v1.queuedb_pb2 import (
    CreateQueueRequest,
    DequeueRequest,
    EnqueueRequest,
    NackRequest,
    NewMessage,
    Queue,
    TransferBatch,
    TransferredMessage,
    TransferRule,
)
from tests.queuedb.fix_queuedb import NodeDatabase, QueueDbNode

if TYPE_CHECKING:  # the async stubs exist in the type stubs only
    from sokutatsu.queuedb.v1.queuedb_pb2_grpc import QueueServiceAsyncStub, TransferAsyncStub

RPC_TIMEOUT = 30.0
# 10,000 letters that do not compress (PostgreSQL compresses "x" * 10_000 enough to index it).
LONG = "".join(random.Random(20).choices(string.ascii_letters, k=10_000))  # noqa: S311 - test data
# Small caps, so that each refusal is cheap to reach (names as in settings.py).
CAPS = {
    "MAX_BATCH": 20,
    "MAX_WAIT_MS": 300,
    "MAX_VISIBILITY_TIMEOUT_MS": 60_000,
    "MAX_NACK_DELAY_MS": 5_000,
    "MAX_TRANSFER_MIN_BATCH": 100,
    "MAX_TRANSFER_AGE_MS": 10_000,
}


@pytest.fixture
def node(queuedb_node: Callable[..., QueueDbNode]) -> QueueDbNode:
    return queuedb_node(
        instance="node1",
        # The transfer daemon's PEERS value, taken as it is.
        peers="node2=127.0.0.1:1,node3=127.0.0.1:2",
        **{name: str(value) for name, value in CAPS.items()},
    )


@pytest.fixture
async def channel(node: QueueDbNode) -> AsyncIterator[aio.Channel]:
    async with open_channel(node.address, cluster=True) as channel:
        yield channel


async def _refused(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details() or ""


def _batch(sender: str, *queues: str, first: int = 1) -> TransferBatch:
    return TransferBatch(
        sender_node=sender,
        messages=[TransferredMessage(transfer_id=first + i, queue=q, body=b"m") for i, q in enumerate(queues)],
    )


async def _stream(transfer: TransferAsyncStub, *batches: TransferBatch) -> list[queuedb_pb2.TransferAck]:
    call = transfer.DeliverStream(timeout=RPC_TIMEOUT)
    for batch in batches:
        await call.write(batch)
    await call.done_writing()
    return [ack async for ack in call]


# ---------------------------------------------------------------------------------------- names --
async def test_long_or_malformed_names_on_the_transfer_endpoint_are_invalid_argument(
    node: QueueDbNode, channel: aio.Channel
) -> None:
    transfer: TransferAsyncStub = queuedb_pb2_grpc.TransferStub(channel)
    calls: dict[str, Awaitable[Any]] = {
        "Deliver sender_node": transfer.Deliver(_batch(LONG, "inbox"), timeout=RPC_TIMEOUT),
        "Deliver queue": transfer.Deliver(_batch("node9", LONG), timeout=RPC_TIMEOUT),
        "DeliverStream sender_node": _stream(transfer, _batch(LONG, "inbox")),
        "DeliverStream queue": _stream(transfer, _batch("node9", "inbox", LONG)),
        "Deliver queue with a space": transfer.Deliver(_batch("node9", "has space"), timeout=RPC_TIMEOUT),
        "GetRecoveryState": transfer.GetRecoveryState(
            queuedb_pb2.GetRecoveryStateRequest(sender_node=LONG), timeout=RPC_TIMEOUT
        ),
        "PrepareBatch": transfer.PrepareBatch(
            queuedb_pb2.PrepareBatchRequest(batch=_batch(LONG, "inbox"), gid=f"sokutatsu:{LONG}:1"),
            timeout=RPC_TIMEOUT,
        ),
        "ListPrepared": transfer.ListPrepared(queuedb_pb2.ListPreparedRequest(sender_node=LONG), timeout=RPC_TIMEOUT),
    }
    for what, call in calls.items():
        code, details = await _refused(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, details)
        assert "is not a valid name" in details, (what, details)
        assert "(10000 characters)" in details or "space" in what, (what, details)
        assert "dbname" not in details, (what, details)
        assert "user=" not in details, (what, details)
    # Nothing was stored or created, not even the valid queue of a refused batch.
    assert node.queues() == []
    # A valid name the receiver does not know yet is created, as the protocol needs (local, no rule).
    ack = await transfer.Deliver(_batch("node9", "inbox"), timeout=RPC_TIMEOUT)
    assert ack.last_received_id == 1
    assert node.queues() == ["inbox"]


async def test_an_unknown_durability_on_a_transferred_message_is_refused(
    node: QueueDbNode, channel: aio.Channel
) -> None:
    transfer: TransferAsyncStub = queuedb_pb2_grpc.TransferStub(channel)
    batch = _batch("node9", "inbox")
    batch.messages[0].durability = 99  # type: ignore[assignment]
    code, details = await _refused(transfer.Deliver(batch, timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].durability 99 is not a Durability: use one of DURABILITY_UNSPECIFIED = 0" in details
    assert node.queues() == []


async def test_create_queue_forwards_only_to_a_known_node(channel: aio.Channel) -> None:
    queues: QueueServiceAsyncStub = queuedb_pb2_grpc.QueueServiceStub(channel)
    nowhere = Queue(name="q", transfer=TransferRule(to_node="nowhere", immediate=True))
    code, details = await _refused(queues.CreateQueue(CreateQueueRequest(queue=nowhere), timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "TransferRule.to_node 'nowhere' is not a node this node forwards to" in details
    assert "(SOKUTATSU_QUEUEDB_PEERS): 'node2', 'node3'" in details
    known = Queue(name="q", transfer=TransferRule(to_node="node3", immediate=True))
    created = await queues.CreateQueue(CreateQueueRequest(queue=known), timeout=RPC_TIMEOUT)
    assert created.queue.transfer.to_node == "node3"


async def test_without_peers_no_queue_forwards(queuedb_node: Callable[..., QueueDbNode]) -> None:
    node = queuedb_node()
    async with open_channel(node.address, cluster=True) as channel:
        queues: QueueServiceAsyncStub = queuedb_pb2_grpc.QueueServiceStub(channel)
        rule = TransferRule(to_node="node2", immediate=True)
        request = CreateQueueRequest(queue=Queue(name="q", transfer=rule))
        code, details = await _refused(queues.CreateQueue(request, timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "(SOKUTATSU_QUEUEDB_PEERS): none" in details


# ----------------------------------------------------------------------------------------- caps --
def _says_cap(details: str, field: str, value: int, setting: str) -> None:
    assert f"{field} of {value:,}" in details, details
    assert f"over the maximum of {CAPS[setting]:,}" in details, details
    assert f"(SOKUTATSU_QUEUEDB_{setting})" in details, details


async def test_every_client_supplied_amount_is_capped_by_its_setting(channel: aio.Channel) -> None:
    queues: QueueServiceAsyncStub = queuedb_pb2_grpc.QueueServiceStub(channel)
    transfer: TransferAsyncStub = queuedb_pb2_grpc.TransferStub(channel)
    await queues.CreateQueue(CreateQueueRequest(queue=Queue(name="q")), timeout=RPC_TIMEOUT)
    batch = CAPS["MAX_BATCH"]
    await queues.Enqueue(EnqueueRequest(queue="q", messages=[NewMessage(body=b"m")] * batch), timeout=RPC_TIMEOUT)

    def dequeue(**fields: int) -> Awaitable[Any]:
        return queues.Dequeue(DequeueRequest(queue="q", **fields), timeout=RPC_TIMEOUT)

    # (the call one over the cap, the field, the value, the setting); then the cap itself is served
    over: list[tuple[Awaitable[Any], str, int, str]] = [
        (dequeue(max_messages=batch + 1), "DequeueRequest.max_messages", batch + 1, "MAX_BATCH"),
        (dequeue(max_messages=2**32 - 1), "DequeueRequest.max_messages", 2**32 - 1, "MAX_BATCH"),
        (dequeue(wait_ms=CAPS["MAX_WAIT_MS"] + 1), "DequeueRequest.wait_ms", CAPS["MAX_WAIT_MS"] + 1, "MAX_WAIT_MS"),
        (
            dequeue(visibility_timeout_ms=2**32 - 1),
            "DequeueRequest.visibility_timeout_ms",
            2**32 - 1,
            "MAX_VISIBILITY_TIMEOUT_MS",
        ),
        (
            queues.Nack(NackRequest(queue="q", delay_ms=CAPS["MAX_NACK_DELAY_MS"] + 1), timeout=RPC_TIMEOUT),
            "NackRequest.delay_ms",
            CAPS["MAX_NACK_DELAY_MS"] + 1,
            "MAX_NACK_DELAY_MS",
        ),
        (
            queues.Nack(NackRequest(queue="q", lease_ids=["x"] * (batch + 1)), timeout=RPC_TIMEOUT),
            "NackRequest.lease_ids",
            batch + 1,
            "MAX_BATCH",
        ),
        (
            queues.Enqueue(EnqueueRequest(queue="q", messages=[NewMessage()] * (batch + 1)), timeout=RPC_TIMEOUT),
            "EnqueueRequest.messages",
            batch + 1,
            "MAX_BATCH",
        ),
        (
            transfer.Deliver(_batch("node9", *["q"] * (batch + 1)), timeout=RPC_TIMEOUT),
            "TransferBatch.messages",
            batch + 1,
            "MAX_BATCH",
        ),
    ]
    for rule, field, value, setting in (
        (
            TransferRule(to_node="node2", min_batch=2**32 - 1),
            "TransferRule.min_batch",
            2**32 - 1,
            "MAX_TRANSFER_MIN_BATCH",
        ),
        (TransferRule(to_node="node2", max_age_ms=10_001), "TransferRule.max_age_ms", 10_001, "MAX_TRANSFER_AGE_MS"),
    ):
        request = CreateQueueRequest(queue=Queue(name="fwd", transfer=rule))
        over.append((queues.CreateQueue(request, timeout=RPC_TIMEOUT), field, value, setting))
    for call, field, value, setting in over:
        code, details = await _refused(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, details)
        _says_cap(details, field, value, setting)

    # At the caps: served.
    leased = (await dequeue(max_messages=batch, wait_ms=CAPS["MAX_WAIT_MS"], visibility_timeout_ms=60_000)).messages
    assert len(leased) == batch
    leases = [m.lease_id for m in leased]
    nacked = await queues.Nack(NackRequest(queue="q", lease_ids=leases, delay_ms=5_000), timeout=RPC_TIMEOUT)
    assert list(nacked.expired) == []
    rule = TransferRule(to_node="node2", min_batch=100, max_age_ms=10_000)
    created = await queues.CreateQueue(CreateQueueRequest(queue=Queue(name="fwd", transfer=rule)), timeout=RPC_TIMEOUT)
    assert (created.queue.transfer.min_batch, created.queue.transfer.max_age_ms) == (100, 10_000)


# ------------------------------------------------------------------------------ database errors --
async def test_a_database_error_caused_by_the_request_is_invalid_argument(node_database: NodeDatabase) -> None:
    """What a 10,000-character name did before names were checked: PostgreSQL's btree refuses the row
    (SQLSTATE 54000, an OperationalError to psycopg), which was mapped to UNAVAILABLE with the DSN."""
    dsn = node_database()
    db = Database(dsn, 1, "node1")
    await db.open()
    try:
        random_text = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(10_000))  # does not compress
        with pytest.raises(InvalidArgument) as refused:
            async with db.transaction() as conn:
                await conn.execute("INSERT INTO sokutatsu.queues (name) VALUES (%s)", (random_text,))
    finally:
        await db.close()
    text = str(refused.value)
    assert "index row" in text
    assert "SQLSTATE 54000" in text
    assert "node node1's database at " in text
    assert "dbname" not in text
    assert str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]) not in text


async def test_a_transaction_that_lost_a_lock_is_unavailable_to_retry(node_database: NodeDatabase) -> None:
    """A lock that could not be had (55P03; a deadlock or serialization failure, class 40, alike) is
    transient: UNAVAILABLE, which clients retry, not an INTERNAL with a traceback (review of #20)."""
    dsn = node_database()
    db = Database(dsn, 1, "node1")
    await db.open()
    try:
        async with await psycopg.AsyncConnection.connect(dsn) as holder:
            await holder.execute("LOCK TABLE sokutatsu.queues IN ACCESS EXCLUSIVE MODE")

            async def read_the_locked_table() -> None:
                async with db.transaction() as conn:
                    await conn.execute("SET LOCAL lock_timeout = '50ms'")
                    await conn.execute("SELECT count(*) FROM sokutatsu.queues")

            with pytest.raises(Unavailable) as refused:
                await read_the_locked_table()
            await holder.rollback()
    finally:
        await db.close()
    text = str(refused.value)
    assert "SQLSTATE 55P03" in text
    assert "retry" in text

"""Alternating durability (seed 001) on the remote-enqueue path, with each node on its own
PostgreSQL cluster, killed with SIGKILL (postmaster and every backend) and started again.

The clusters delay the WAL writer (``wal_writer_delay = 10s``, no background writer, no
autovacuum), so a commit made without waiting for the flush is really lost when its cluster
is killed: what the protocol must repair is there to repair. Every test ends by checking that
each message acknowledged to a client arrived exactly once, in the client's order.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from grpc import aio

from sokutatsu.core.embedded_pg import free_port
from sokutatsu.queuedb.enqueue import FLUSH_SENDER
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from tests.queuedb.fix_queuedb import Cluster, Node, own_cluster

pytestmark = pytest.mark.timeout(600)
log = logging.getLogger(__name__)

RPC_TIMEOUT = 30.0
LAZY_WAL = {"wal_writer_delay": "10s", "bgwriter_lru_maxpages": "0", "autovacuum": "off"}


@dataclass
class Pair:
    """Node 1 (clients enqueue here, queue ``orders`` forwards to node 2's ``inbox``) and node 2."""

    node1: Cluster
    node2: Cluster
    service1: Node
    service2: Node
    daemon: Node
    address1: str

    def start_all(self) -> None:
        for node in (self.service2, self.service1, self.daemon):
            if not node.alive():
                node.start()

    def tails(self) -> str:
        return "\n".join(n.tail() for n in (self.service1, self.service2, self.daemon))


@pytest.fixture
def pair(tmp_path: Path, pg_tmp_folder: Path) -> Iterator[Pair]:
    """Two clusters, both nodes' services and node 1's transfer daemon (not started)."""
    folder = pg_tmp_folder  # as root the clusters run as postgres: not under tmp_path
    clusters: list[Cluster] = []
    try:
        clusters.append(own_cluster(folder, "node1", LAZY_WAL))
        clusters.append(own_cluster(folder, "node2", LAZY_WAL))
        node1, node2 = clusters
        address1, address2 = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        common = {"SOKUTATSU_GRACE_SECONDS": "1", "SOKUTATSU_QUEUEDB_DB_CHECK_SECONDS": "0.5"}
        service1 = Node(
            "sokutatsu.queuedb",
            {
                **common,
                "SOKUTATSU_QUEUEDB_LISTEN": address1,
                "SOKUTATSU_QUEUEDB_INSTANCE": "node1",
                "SOKUTATSU_QUEUEDB_PEERS": "node2",
                "SOKUTATSU_QUEUEDB_DSN": node1.dsn,
            },
            tmp_path / "node1",
        )
        service2 = Node(
            "sokutatsu.queuedb",
            {
                **common,
                "SOKUTATSU_QUEUEDB_LISTEN": address2,
                "SOKUTATSU_QUEUEDB_INSTANCE": "node2",
                "SOKUTATSU_QUEUEDB_DSN": node2.dsn,
            },
            tmp_path / "node2",
        )
        daemon = Node(
            "sokutatsu.queuedb.transferd",
            {
                "SOKUTATSU_GRACE_SECONDS": "1",
                "SOKUTATSU_TRANSFER_LISTEN": "127.0.0.1:0",
                "SOKUTATSU_TRANSFER_NODE": "node1",
                "SOKUTATSU_TRANSFER_DSN": node1.dsn,
                "SOKUTATSU_TRANSFER_PEERS": f"node2={address2}",
                "SOKUTATSU_TRANSFER_BATCH": "50",
            },
            tmp_path,
        )
        yield Pair(node1, node2, service1, service2, daemon, address1)
        for node in (daemon, service1, service2):
            node.stop()
    finally:
        for cluster in clusters:
            cluster.pg.stop()


@pytest.fixture
async def client(pair: Pair) -> AsyncIterator[queuedb_pb2_grpc.QueueServiceAsyncStub]:
    async with aio.insecure_channel(pair.address1) as channel:
        yield queuedb_pb2_grpc.QueueServiceStub(channel)


async def _create_alternating(client: queuedb_pb2_grpc.QueueServiceAsyncStub) -> None:
    rule = queuedb_pb2.TransferRule(
        to_node="node2", to_queue="inbox", immediate=True, durability=queuedb_pb2.REMOTE_DURABILITY_ALTERNATE
    )
    request = queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name="orders", transfer=rule))
    await client.CreateQueue(request, timeout=RPC_TIMEOUT, wait_for_ready=True)


async def _enqueue(client: queuedb_pb2_grpc.QueueServiceAsyncStub, body: bytes) -> None:
    request = queuedb_pb2.EnqueueRequest(queue="orders", messages=[queuedb_pb2.NewMessage(body=body)])
    await client.Enqueue(request, timeout=RPC_TIMEOUT, wait_for_ready=True)


def _rows(dsn: str, query: str) -> list[tuple[Any, ...]]:
    try:
        with psycopg.connect(dsn, connect_timeout=5) as conn:
            return list(conn.execute(query).fetchall())
    except psycopg.OperationalError:
        return []  # restarting


def _received(pair: Pair) -> list[bytes]:
    rows = _rows(pair.node2.dsn, "SELECT body FROM sokutatsu.messages WHERE queue = 'inbox' ORDER BY seq")
    return [bytes(r[0]) for r in rows]


def _outbox(pair: Pair) -> list[tuple[bytes, int]]:
    rows = _rows(pair.node1.dsn, "SELECT body, flush FROM sokutatsu.outbox ORDER BY id")
    return [(bytes(r[0]), int(r[1])) for r in rows]


async def _until(check: object, what: str, pair: Pair, limit: float = 120.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + limit  # only stops a hung test; nothing is timed
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"gave up waiting for {what}: outbox {_outbox(pair)[:5]}…, received {_received(pair)[-5:]}\n"
                + pair.tails()
            )
        await asyncio.sleep(0.05)


async def test_a_receiver_crash_loses_what_it_stored_unflushed_and_the_sender_resends_it(
    pair: Pair, client: queuedb_pb2_grpc.QueueServiceAsyncStub
) -> None:
    # No idle flush request from the daemon during the test: what node 2 stored unflushed stays so.
    pair.daemon.env["SOKUTATSU_TRANSFER_POLL_MS"] = "600000"
    pair.service1.env["SOKUTATSU_QUEUEDB_ALTERNATE_WAIT_MS"] = "60000"
    pair.start_all()
    await _create_alternating(client)

    pair.node2.freeze_wal_writer()  # node 2's unflushed commit of a stays in its WAL buffers
    await _enqueue(client, b"a")  # the first request is the sender's to flush: answered at once
    await _until(lambda: _received(pair) == [b"a"], "a at node 2", pair)
    # Node 2 acknowledged it without flushing, so node 1 keeps it until node 2 reports it flushed.
    assert _outbox(pair) == [(b"a", FLUSH_SENDER)]

    pair.node2.kill9()
    pair.node2.restart()
    assert _received(pair) == [], "node 2's unflushed commit survived SIGKILL: the test proves nothing"

    # The next request is the receiver's: answered only once node 2 has flushed it. On its way the
    # daemon finds node 2 behind (a gap), recovers and resends a before b.
    await _enqueue(client, b"b")
    assert _received(pair) == [b"a", b"b"]
    await _until(lambda: _outbox(pair) == [], "node 1 to forget what node 2 flushed", pair)


async def test_an_unreachable_receiver_makes_the_sender_flush_every_message_and_a_sender_crash_loses_none(
    pair: Pair, client: queuedb_pb2_grpc.QueueServiceAsyncStub
) -> None:
    pair.service1.env["SOKUTATSU_QUEUEDB_ALTERNATE_WAIT_MS"] = "300"
    pair.service2.start()
    pair.service1.start()  # no transfer daemon yet: node 2 never confirms anything
    await _create_alternating(client)

    for body in (b"c", b"d", b"e", b"f"):
        await _enqueue(client, body)
    # c: the sender's turn; d: the receiver's, unconfirmed in time, so flushed by node 1 itself;
    # e and f: node 2 counts as down, every request is the sender's.
    assert _outbox(pair) == [(b, FLUSH_SENDER) for b in (b"c", b"d", b"e", b"f")]

    pair.node1.kill9()
    pair.node1.restart()
    assert _outbox(pair) == [(b, FLUSH_SENDER) for b in (b"c", b"d", b"e", b"f")], "an acknowledged message was lost"

    pair.daemon.start()
    await _until(lambda: _received(pair) == [b"c", b"d", b"e", b"f"], "the transfer", pair)
    await _until(lambda: _outbox(pair) == [], "node 1 to forget what node 2 flushed", pair)


async def test_an_enqueue_whose_own_flush_fails_is_told_its_messages_may_or_may_not_be_stored(
    pair: Pair, client: queuedb_pb2_grpc.QueueServiceAsyncStub
) -> None:
    """A review's schedule: on the receiver's turn the call's messages are committed on node 1 without
    the flush; node 2 never confirms them, and node 1's database goes away before node 1 flushes them
    itself. The call was told "retry later", though its messages may be stored (the commit ran; only
    the flush failed) and a retry may then store them twice. It is told they may or may not be."""
    pair.service1.env["SOKUTATSU_QUEUEDB_ALTERNATE_WAIT_MS"] = "3000"
    pair.service2.start()
    pair.service1.start()  # no transfer daemon: node 2 never confirms anything
    await _create_alternating(client)
    await _enqueue(client, b"c")  # the sender's turn: flushed before the answer
    receivers = asyncio.ensure_future(_enqueue(client, b"d"))  # the receiver's turn: waits for node 2
    await _until(lambda: [body for body, _ in _outbox(pair)] == [b"c", b"d"], "d committed unflushed", pair)
    pair.node1.kill9()  # before node 1's own flush of d (ALTERNATE_WAIT_MS after the commit)
    with pytest.raises(aio.AioRpcError) as raised:
        await receivers
    pair.node1.restart()
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value
    assert "may or may not be stored" in (raised.value.details() or ""), raised.value.details()


VICTIMS = ("node1-postgres", "node2-postgres", "node1-service", "node2-service", "transfer-daemon")


@pytest.mark.slow
async def test_every_acknowledged_message_arrives_once_in_order_through_kill_9_of_either_side(
    pair: Pair, client: queuedb_pb2_grpc.QueueServiceAsyncStub
) -> None:
    pair.service1.env["SOKUTATSU_QUEUEDB_ALTERNATE_WAIT_MS"] = "2000"
    pair.start_all()
    await _create_alternating(client)
    rng = random.Random(11)  # noqa: S311 - a reproducible crash schedule
    plan = [*VICTIMS, *VICTIMS]
    rng.shuffle(plan)

    stop = asyncio.Event()
    acked: dict[int, list[bytes]] = {c: [] for c in range(3)}
    refused: list[str] = []

    async def one_client(c: int) -> None:
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

    clients = [asyncio.create_task(one_client(c)) for c in acked]
    backwards = 0
    try:
        for victim in plan:
            await asyncio.sleep(0.3 + rng.random())  # pacing only
            if victim.endswith("postgres"):
                cluster = pair.node1 if victim == "node1-postgres" else pair.node2
                before = _received(pair) if cluster is pair.node2 else []
                # (The event loop waits meanwhile: the clients' calls stall as on a slow server.)
                cluster.kill9()
                cluster.restart()
                if cluster is pair.node2 and len(_received(pair)) < len(before):
                    backwards += 1  # node 2 lost what it had stored unflushed
            else:
                node = {"node1-service": pair.service1, "node2-service": pair.service2}.get(victim, pair.daemon)
                node.kill9()
                node.start()
        await asyncio.sleep(1)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    pair.start_all()
    await _until(lambda: _outbox(pair) == [], "node 1's outbox to drain", pair, limit=180)

    received = _received(pair)
    assert len(set(received)) == len(received), "a message arrived twice"
    for c, bodies in acked.items():
        mine = [b for b in received if b.startswith(f"c{c}-".encode())]
        got = set(mine)
        assert [b for b in bodies if b not in got] == [], f"client {c}: acknowledged messages lost"
        numbers = [int(b.split(b"-")[1]) for b in mine]
        assert numbers == sorted(numbers), f"client {c}: out of order"
    assert sum(len(b) for b in acked.values()) > 100, "the clients hardly got anything through"
    log.info(
        "acked %d, refused %d, node 2 lost unflushed batches %d times",
        sum(map(len, acked.values())),
        len(refused),
        backwards,
    )

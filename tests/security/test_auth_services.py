"""Service-to-service calls with auth on: a broker pair and two sequencers (leader and peer) that
reach each other only with the service principal's token, serving total order end to end; and a
queue-db transfer daemon delivering to another node's queue-db service.

Every process of the test, and the test's own clients, take ``SOKUTATSU_AUTH_FILE`` and the
service principal's ``SOKUTATSU_AUTH_TOKEN`` from the environment; what another principal or
no token gets from a sequencer is checked next to it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import psycopg
import pytest
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import ClientConfig
from sokutatsu.core.cluster import control_metadata
from sokutatsu.core.tls import open_channel
from sokutatsu.queuedb.enqueue import Message, enqueue_batch
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc
from tests.broker.fix_broker import BrokerProcess, Pair, until
from tests.queuedb.fix_queuedb import NodeDatabase, queue_bodies, transfer_nodes
from tests.security.fix_auth import AuthFile
from tests.sequencer.fix_sequencer import GroupFactory
from tests.sequencer.test_ordered import TOPIC, _check_same_order, _feed, _wait_all, ordered_group

pytestmark = pytest.mark.timeout(240)
RPC_SECONDS = 10.0


async def test_total_order_across_sequencer_peers_with_auth_on(
    broker_factory: Callable[..., BrokerProcess],
    sequencer_group: GroupFactory,
    auth_file: AuthFile,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in auth_file.env("svc").items():
        monkeypatch.setenv(name, value)
    a = broker_factory(instance="broker-a", role="active", peer_timeout_ms="500")
    a.start()
    b = broker_factory(instance="broker-b", role="standby", peer=a.address, peer_timeout_ms="500")
    b.start()
    pair = Pair(a, b)

    async def heard() -> bool:
        for broker in (a, b):
            async with open_channel(broker.address) as channel:  # the environment's token
                stats = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
                    broker_pb2.GetStatsRequest(), timeout=RPC_SECONDS
                )
            if not stats.peer_up:
                return False
        return True

    await until(heard, "the brokers of the pair to hear each other with auth on")
    group = sequencer_group(["a", "b"], pair.addresses, TOPIC)
    config = ClientConfig.from_env()  # the SDK reads the environment only when asked to
    async with ordered_group(pair, group, readers=2, config=config) as readers:
        first = await _feed(group, pair, "a", "a0", 40, random.Random(1), config=config)  # noqa: S311
        other = await _feed(group, pair, "b", "b0", 40, random.Random(2), config=config)  # noqa: S311
        await _wait_all(readers, 80, group)
        status = await _status(group["a"].address)
        assert status.leader
        for metadata, want in [
            ((), grpc.StatusCode.UNAUTHENTICATED),
            (auth_file.metadata("app"), grpc.StatusCode.PERMISSION_DENIED),
        ]:
            async with aio.insecure_channel(group["b"].address) as channel:
                with pytest.raises(aio.AioRpcError) as refused:
                    await sequencer_pb2_grpc.SequencerStub(channel).InstallDistribution(
                        sequencer_pb2.InstallDistributionRequest(leader="intruder"),
                        metadata=(*metadata, *control_metadata()),  # the cluster secret, so auth decides
                        timeout=RPC_SECONDS,
                    )
                assert refused.value.code() == want
    _check_same_order(readers, {"a": sorted(first), "b": sorted(other)})
    # Auth was on everywhere, and nothing but the two calls above was refused.
    for log in (a.log(), b.log(), group["a"].log(), group["b"].log()):
        assert "auth on" in log
        assert "Traceback" not in log
        assert [
            line
            for line in log.splitlines()
            if "auth:" in line and "intruder" not in line and "InstallDistribution" not in line
        ] == []


async def _status(address: str) -> sequencer_pb2.SequencerStatus:
    async with open_channel(address) as channel:
        status: sequencer_pb2.SequencerStatus = await sequencer_pb2_grpc.SequencerStub(channel).GetStatus(
            sequencer_pb2.GetStatusRequest(), timeout=RPC_SECONDS
        )
        return status


async def test_the_transfer_daemon_delivers_with_auth_on(
    node_database: NodeDatabase, tmp_path: Path, auth_file: AuthFile
) -> None:
    node1, node2 = node_database(), node_database()
    with psycopg.connect(node1, autocommit=True) as conn:
        conn.execute("INSERT INTO sokutatsu.queues (name, to_node, to_queue) VALUES ('orders', 'node2', 'inbox')")
    receiver, daemon = transfer_nodes(node1, node2, tmp_path, both=auth_file.env("svc"))
    receiver_address = receiver.env["SOKUTATSU_QUEUEDB_LISTEN"]
    try:
        receiver.start()
        daemon.start()
        bodies = [f"order-{i}".encode() for i in range(50)]
        with psycopg.connect(node1) as conn:
            enqueue_batch(conn, "orders", [Message(b, key="k") for b in bodies])
            conn.commit()
        deadline = time.monotonic() + 60  # only stops a hung test
        while queue_bodies(node2) != bodies:
            assert time.monotonic() < deadline, daemon.tail() + receiver.tail()
            await asyncio.sleep(0.05)
        async with open_channel(receiver_address, cluster=True) as channel:
            transfer = queuedb_pb2_grpc.TransferStub(channel)
            with pytest.raises(aio.AioRpcError) as refused:
                await transfer.GetRecoveryState(
                    queuedb_pb2.GetRecoveryStateRequest(sender_node="node1"),
                    metadata=auth_file.metadata("app"),
                    timeout=RPC_SECONDS,
                )
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        receiver_log = "".join(p.read_text(errors="replace") for p in receiver.logs)
        logs = receiver_log + "".join(p.read_text(errors="replace") for p in daemon.logs)
        assert "auth on" in receiver_log
        assert [line for line in logs.splitlines() if "auth:" in line and "GetRecoveryState" not in line] == []
    finally:
        daemon.stop()
        receiver.stop()

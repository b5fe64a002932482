"""The harness's service pieces (``sokutatsu.harness.broker``, ``.monitor``, ``.sequencer``,
``.queuedb``) on real processes: what the tests, the benchmarks and the launcher share."""

from __future__ import annotations

from pathlib import Path

import pytest

from sokutatsu.harness import HarnessError
from sokutatsu.harness.broker import Pair
from sokutatsu.harness.monitor import MonitorProcess
from sokutatsu.harness.queuedb import QueueDbNode, transfer_nodes
from sokutatsu.harness.sequencer import SequencerProcess, sequencer_group, start_group, stop_group
from sokutatsu.sequencer.server import create_total_order_topic
from tests.queuedb.fix_queuedb import NodeDatabase


async def test_a_pair_is_paired_and_a_standby_started_again_finds_the_active(tmp_path: Path) -> None:
    pair = Pair.in_folder(tmp_path, peer_timeout_ms="500")
    try:
        await pair.start().wait_paired()
        assert [await b.stats() for b in pair.brokers]  # both answer
        pair.standby.kill9()
        assert not await _answers(pair)
        pair.standby.start()  # its folder, its state, told the active's address again
        await pair.wait_paired()
        assert [p.name for p in pair.standby.logs] == ["broker-b-1.log", "broker-b-2.log"]
    finally:
        pair.stop()
    assert not any(b.alive() for b in pair.brokers)


async def _answers(pair: Pair) -> bool:
    try:
        return await pair.paired()
    except Exception:  # noqa: BLE001 - a broker that is gone does not answer
        return False


async def test_a_monitor_sees_the_pair_it_watches_and_a_wait_that_never_holds_is_bounded(tmp_path: Path) -> None:
    pair = Pair.in_folder(tmp_path)
    monitor = MonitorProcess(tmp_path / "monitor")
    try:
        pair.start()
        monitor = MonitorProcess.watching(tmp_path / "monitor", pair.brokers, stats_interval_ms="50")
        monitor.start()
        status = await monitor.until(lambda s: len(s.brokers) == 2 and all(b.serving for b in s.brokers), "both")
        assert {b.broker_id for b in status.brokers} == {"broker-a", "broker-b"}
        with pytest.raises(HarnessError, match="never; last status"):
            await monitor.until(lambda s: False, "never", limit=0.2)
    finally:
        monitor.stop()
        pair.stop()


async def test_a_sequencer_group_installs_and_a_member_comes_back_on_its_address(tmp_path: Path) -> None:
    pair = Pair.in_folder(tmp_path)
    group: dict[str, SequencerProcess] = {}
    try:
        pair.start()
        await create_total_order_topic(pair.addresses, "harness-ordered")
        group = sequencer_group(tmp_path, ["a", "b"], pair.addresses, "harness-ordered", distribution_interval_ms="300")
        assert [m.leader for m in group.values()] == [True, False]
        start_group(group)
        for member in group.values():
            await member.wait_installed()
        follower = group["b"]
        address = follower.address
        follower.kill9()
        assert follower.start() == address  # its peers name it by address
        await follower.wait_installed()
    finally:
        stop_group(group)
        pair.stop()


def test_queuedb_nodes_start_on_their_databases_and_stop_cleanly(node_database: NodeDatabase, tmp_path: Path) -> None:
    node = QueueDbNode(tmp_path / "alone", node_database())
    receiver, daemon = transfer_nodes(node_database(), node_database(), tmp_path / "pair")
    try:
        node.start()
        assert node.queues() == []
        receiver.start()
        daemon.start()
        assert receiver.address == daemon.env["SOKUTATSU_TRANSFER_PEERS"].removeprefix("node2=")
    finally:
        codes = [daemon.stop(), receiver.stop(), node.stop()]
    assert codes == [0, 0, 0], node.tail()

"""A subscription queue's disk backlog against its own disk worker (in-process, real files)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sokutatsu.broker.disk_worker import DiskWorker
from sokutatsu.broker.messages import StoredMessage
from sokutatsu.broker.subscription import SubscriptionSpec
from sokutatsu.broker.subscription_queue import SHADOW, SubscriptionQueue
from sokutatsu.broker.v1 import broker_pb2


def _message(seq: int) -> StoredMessage:
    payload = broker_pb2.Message(publisher_id="feed", publisher_seq=seq, key="K", body=b"x" * 200).SerializeToString()
    msg = StoredMessage(publisher_id="feed", seq=seq, payload=payload, persistent=True)
    msg.hold(1)
    return msg


async def _drained(disk: DiskWorker) -> None:
    """Every job submitted so far has run (the worker runs them in order)."""
    await disk.call(lambda: None)


async def test_a_read_back_overtaken_by_emptying_the_queue_changes_nothing(tmp_path: Path) -> None:
    """Switchover step 4 empties a queue while a read-back of its disk backlog is queued: the
    read must neither count what it read against the emptied queue (the counter went to -1 and
    the broker's stats failed) nor hand it out."""
    disk = DiskWorker()
    worker = asyncio.create_task(disk.run())
    try:
        spec = SubscriptionSpec("desk", "ticks", frozenset(), (), durable=True, mode="migrate", budget=1024)
        queue = SubscriptionQueue(
            spec=spec,
            folder=tmp_path / "desk",
            disk=disk,
            batch_messages=50,
            batch_bytes=2**20,
            linger_seconds=0,
            state=SHADOW,
        )
        for seq in range(1, 201):
            queue.enqueue(_message(seq))
        for _ in range(1000):  # until the spill job wrote them; only stops a hung test
            await _drained(disk)
            if queue.disk_count == 200:
                break
        assert queue.disk_count == 200
        queue.trim({})  # not attached, nothing in memory: it asks for a read-back
        assert queue.empty_out() == 200
        await _drained(disk)
        await _drained(disk)
        assert queue.disk_count == 0
        assert not queue.readback
        assert queue.depth == 0
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        disk.close()

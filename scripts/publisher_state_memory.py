"""How much a broker keeps for each publisher id it has seen, once that publisher's messages are
acknowledged (docs/broker.md, Limits and memory: per-publisher state).

A broker in this process with ``QUEUES`` durable subscriptions to one topic takes one message from
each of ``PUBLISHERS`` new publisher ids (as many processes using the SDK's default id, unique per
process, would); every queue is then trimmed as if its subscriber acknowledged everything. What
Python still holds beyond a warm-up of 100 publishers is measured with tracemalloc.

    .tools/bin/uv run --locked --no-sync python scripts/publisher_state_memory.py 64 5000
"""

from __future__ import annotations

import asyncio
import gc
import sys
import tempfile
import tracemalloc

from sokutatsu.broker.broker import Broker
from sokutatsu.broker.disk_worker import DiskWorker
from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.settings import load


async def _publish_once_each(broker: Broker, first: int, count: int) -> None:
    for number in range(first, first + count):
        publisher = f"publisher-{number:08d}-0123456789abcdef"
        message = broker_pb2.Message(publisher_id=publisher, publisher_seq=1, key="K", body=b"x" * 64, persistent=True)
        batch = broker_pb2.PublishBatch(topic="prices", messages=[message])
        await broker.publish(publisher, broker.publisher(publisher), batch)
    for queue in broker.topics["prices"].queue_list:
        queue.trim(dict(queue.last_enqueued))  # every subscriber acknowledged everything


async def measure(queues: int, publishers: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        disk = DiskWorker()
        worker = asyncio.create_task(disk.run())
        env = {
            "SOKUTATSU_BROKER_STATE_DIR": folder,
            "SOKUTATSU_BROKER_INSTANCE": "broker-a",
            "SOKUTATSU_BROKER_ROLE": "active",
        }
        broker = Broker(load(BrokerSettings, env), disk)
        try:
            await broker.open()
            for index in range(queues):
                subscription = broker_pb2.Subscription(subscriber_id=f"s{index}", topic="prices", durable=True)
                await broker.create_subscription(broker.subscription_spec(subscription))
            await _publish_once_each(broker, 0, 100)
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            await _publish_once_each(broker, 100, publishers)
            gc.collect()
            grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
            left = sum(queue.depth for queue in broker.topics["prices"].queue_list)
            return (
                f"queues={queues} publishers={publishers} messages_left={left} "
                f"grown={grown / 1e6:.2f} MB per_publisher={grown / publishers:.0f} B"
            )
        finally:
            await broker.close()
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            disk.close()


if __name__ == "__main__":
    print(asyncio.run(measure(int(sys.argv[1]), int(sys.argv[2]))))

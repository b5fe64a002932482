"""``OrderedSubscriber``: a total-order topic in the order every ordered subscriber of it agrees on.

It reads every message of the topic (a durable :class:`~sokutatsu.client.Subscriber`) and
hands them to the application in the total order of
:class:`~sokutatsu.ordering.OrderedMerge`, as :class:`~sokutatsu.client.OrderedMessage` with the
message's :class:`~sokutatsu.client.Stamp`: every ordered subscriber of a topic receives the same
messages in the same order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from types import TracebackType

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client._subscription import to_ordered_message
from sokutatsu.client.config import ClientConfig
from sokutatsu.client.errors import OrderingError
from sokutatsu.client.structs import OrderedMessage
from sokutatsu.client.subscriber import Subscriber
from sokutatsu.ordering import OrderedMerge
from sokutatsu.ordering.wire import distribution_from_message, entry_from_stamp
from sokutatsu.sequencer.v1 import sequencer_pb2, stamp_pb2


class OrderedSubscriber:
    """Receive the total-order ``topic`` from the broker pair ``brokers`` as ``subscriber_id``.

    Subscribe before the first message is published (the subscription is durable and must see
    the topic from its first distribution). Raises :class:`~sokutatsu.client.errors.OrderingError`
    for a message that cannot be ordered (no stamp, an unknown distribution id, a stale epoch, more
    than ``max_buffered`` messages waiting for one): never a silent reorder. ``config``, ``flow_limit``,
    ``flow_threshold`` and ``ack_interval`` are the :class:`~sokutatsu.client.Subscriber`'s.
    """

    def __init__(
        self,
        brokers: str | Sequence[str],
        subscriber_id: str,
        topic: str,
        *,
        config: ClientConfig | None = None,
        max_buffered: int = 1_000_000,
        flow_limit: int = 1000,
        flow_threshold: float = 0.5,
        ack_interval: float = 0.05,
    ) -> None:
        self.subscriber = Subscriber(
            brokers,
            subscriber_id,
            topic,
            durable=True,
            config=config,
            flow_limit=flow_limit,
            flow_threshold=flow_threshold,
            ack_interval=ack_interval,
        )
        self.topic = topic
        self.merge: OrderedMerge[broker_pb2.Message] = OrderedMerge()
        self.max_buffered = max_buffered
        self._ready: deque[broker_pb2.Message] = deque()

    async def __aenter__(self) -> OrderedSubscriber:
        await self.subscriber.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.subscriber.close()

    async def start(self) -> None:
        await self.subscriber.start()

    async def close(self) -> None:
        await self.subscriber.close()

    def __aiter__(self) -> OrderedSubscriber:
        return self

    async def __anext__(self) -> OrderedMessage:
        ready = self._ready
        merge = self.merge
        while not ready:
            message = await self.subscriber._next_raw()
            if not message.HasField("stamp"):
                raise OrderingError(
                    f"message {message.publisher_id}/{message.publisher_seq} has no sequencer stamp: "
                    f"the topic is not a total-order topic or its publisher is not an OrderedPublisher"
                )
            stamp = message.stamp
            if stamp.kind == stamp_pb2.STAMP_KIND_DISTRIBUTION:
                try:
                    distribution = distribution_from_message(sequencer_pb2.Distribution.FromString(message.body))
                except ValueError as error:
                    raise OrderingError(f"distribution {stamp.distribution_id} is malformed: {error}") from None
                merge.add_distribution(distribution)
            else:
                merge.add(entry_from_stamp(stamp, message))
            ready.extend(merge.pop_ready())
            if not ready and merge.buffered() > self.max_buffered:
                raise OrderingError(
                    f"{merge.buffered()} messages buffered while waiting for {merge.waiting_for} "
                    f"(max_buffered={self.max_buffered})"
                )
        return to_ordered_message(ready.popleft(), self.topic)

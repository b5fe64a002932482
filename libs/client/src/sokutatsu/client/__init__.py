"""The Sokutatsu client SDK (``pip install sokutatsu-client``; tracing: ``sokutatsu-client[tracing]``).

    from sokutatsu.client import Publisher, Subscriber

    brokers = ["127.0.0.1:7201", "127.0.0.1:7202"]
    async with Publisher(brokers, "feed-1") as pub:
        await pub.publish("prices", "7203.T", b"2890")   # acknowledged by both brokers
    async with Subscriber(brokers, "desk-1", "prices", prefixes=["72"], durable=True) as sub:
        async for message in sub:                        # each message once, in per-publisher order
            print(message.key, message.body)

The subscribers of a process can share one stream per broker: give them the same
``connection=SubscriberConnection()`` (:mod:`sokutatsu.client.subscriber_connection`).
Connections are plaintext without a token unless a :class:`ClientConfig` says otherwise
(``config=ClientConfig.from_env()`` reads ``SOKUTATSU_TLS_*`` and ``SOKUTATSU_AUTH_TOKEN``).
Every error is a :class:`~sokutatsu.client.errors.ClientError` (:mod:`sokutatsu.client.errors`).
"""

from sokutatsu.client.config import ChannelTls, ClientConfig
from sokutatsu.client.errors import (
    BrokerError,
    BufferFull,
    ClientError,
    Closed,
    ConfigError,
    GapError,
    OrderingError,
    PublishTimeout,
    SequencerError,
    Unreachable,
)
from sokutatsu.client.ordered_publisher import OrderedPublisher
from sokutatsu.client.ordered_subscriber import OrderedSubscriber
from sokutatsu.client.publisher import Publisher
from sokutatsu.client.structs import Message, OrderedMessage, Stamp
from sokutatsu.client.subscriber import Subscriber
from sokutatsu.client.subscriber_connection import SubscriberConnection

__all__ = [
    "BrokerError",
    "BufferFull",
    "ChannelTls",
    "ClientConfig",
    "ClientError",
    "Closed",
    "ConfigError",
    "GapError",
    "Message",
    "OrderedMessage",
    "OrderedPublisher",
    "OrderedSubscriber",
    "OrderingError",
    "PublishTimeout",
    "Publisher",
    "SequencerError",
    "Stamp",
    "Subscriber",
    "SubscriberConnection",
    "Unreachable",
]

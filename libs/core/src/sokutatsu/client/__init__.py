"""The Sokutatsu client SDK."""

from sokutatsu.client.errors import BrokerError, BufferFull, ClientError, Closed, GapError, PublishTimeout
from sokutatsu.client.ordered import OrderedPublisher, OrderedSubscriber, SequencerError
from sokutatsu.client.publisher import Publisher
from sokutatsu.client.subscriber import Subscriber
from sokutatsu.core.tls import ChannelTls

__all__ = [
    "BrokerError",
    "BufferFull",
    "ChannelTls",
    "ClientError",
    "Closed",
    "GapError",
    "OrderedPublisher",
    "OrderedSubscriber",
    "PublishTimeout",
    "Publisher",
    "SequencerError",
    "Subscriber",
]

"""The SDK's own types at its boundary: what a subscriber hands to the application.

Small frozen records, never the wire's generated classes (whose internals, such as the
broker's ``previous_seq`` or the raw sequencer stamp, are the SDK's business). Without
``__slots__``: the subscriber builds each message straight into its ``__dict__``
(:func:`sokutatsu.client._subscription.to_message`), several times cheaper than a frozen
dataclass's ``__init__`` on the receiving hot path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Message:
    """One message of a topic, as published.

    ``publisher_seq`` numbers the messages of ``publisher_id`` (1, 2, ...): a subscriber receives
    each publisher's messages in that order, each once. ``publish_time_unix_nano`` is the
    publisher's wall clock when it handed the message to its SDK.
    """

    topic: str
    key: str
    body: bytes
    headers: Mapping[str, str]
    publisher_id: str
    publisher_seq: int
    publish_time_unix_nano: int
    persistent: bool


@dataclass(frozen=True, kw_only=True)
class Stamp:
    """A message's place in a total-order topic: the ``seq``-th number of ``domain``'s sequencer
    under distribution ``distribution_id`` (``epoch``: the sequencer's term)."""

    domain: str
    seq: int
    distribution_id: int
    epoch: int


@dataclass(frozen=True, kw_only=True)
class OrderedMessage(Message):
    """A message of a total-order topic, with the stamp that placed it in the order every ordered
    subscriber of the topic agrees on."""

    stamp: Stamp

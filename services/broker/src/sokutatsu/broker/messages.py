"""Stored messages, their accounting, and the wire framing of deliveries.

A published message is validated once, serialised once (``payload``) and
shared by every subscriber queue it matches; delivery frames are built by
concatenating those payloads, without building protobuf objects again:
a ``DeliveryBatch`` is field 1 repeated, and appending field 9
(``previous_seq``) to a serialised ``Message`` sets it, since protobuf
parsers take the last value of a scalar field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sokutatsu.client._wire import varint
from sokutatsu.core.errors import InvalidArgument, echo

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Keys: 1-256 characters, no whitespace or control characters (e.g. "7203.T", "fx/USDJPY").
KEY_PATTERN = re.compile(r"[^\s\x00-\x1f\x7f]{1,256}")

_TAG_DELIVERY_MESSAGE = b"\x0a"  # DeliveryBatch.messages = 1, length-delimited
_TAG_PREVIOUS_SEQ = b"\x48"  # Message.previous_seq = 9, varint
_TAG_RESPONSE_BATCH = b"\x12"  # SubscribeResponse.batch = 2, length-delimited
_TAG_MANY_FRAME = b"\x0a"  # SubscribeManyResponse.frames = 1, length-delimited
_TAG_SUBSCRIPTION_ID = b"\x08"  # SubscriptionResponse.id = 1, varint
_TAG_SUBSCRIPTION_BATCH = b"\x1a"  # SubscriptionResponse.batch = 3, length-delimited


def check_name(kind: str, value: str) -> str:
    if not NAME_PATTERN.fullmatch(value):
        raise InvalidArgument(
            f"invalid {kind} {echo(value)}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def check_key(value: str, seq: int) -> None:
    if not KEY_PATTERN.fullmatch(value):
        raise InvalidArgument(
            f"message seq {seq}: invalid key {echo(value)}: use 1-256 characters without spaces or control characters"
        )


def delivery_element(payload: bytes, previous_seq: int, extra: bytes = b"") -> bytes:
    """One ``DeliveryBatch.messages`` element: the stored payload with ``previous_seq`` set, then
    ``extra`` (serialised fields the broker sets on delivery, e.g. ``retention_gap``)."""
    if previous_seq or extra:
        tail = (_TAG_PREVIOUS_SEQ + varint(previous_seq) if previous_seq else b"") + extra
        return b"".join((_TAG_DELIVERY_MESSAGE, varint(len(payload) + len(tail)), payload, tail))
    return b"".join((_TAG_DELIVERY_MESSAGE, varint(len(payload)), payload))


def delivery_body(elements: list[bytes]) -> bytes:
    """A serialised ``DeliveryBatch`` of ``elements``."""
    return b"".join(elements)


def batch_response(body: bytes) -> bytes:
    """A serialised ``SubscribeResponse`` carrying the serialised ``DeliveryBatch`` ``body``."""
    return b"".join((_TAG_RESPONSE_BATCH, varint(len(body)), body))


def subscription_batch(tag: bytes, body: bytes) -> bytes:
    """One ``SubscribeManyResponse.frames`` element: ``tag`` (the serialised ``SubscriptionResponse.id``,
    :func:`subscription_tag`) and the serialised ``DeliveryBatch`` ``body`` as its ``batch``."""
    inner = b"".join((tag, _TAG_SUBSCRIPTION_BATCH, varint(len(body)), body))
    return b"".join((_TAG_MANY_FRAME, varint(len(inner)), inner))


def subscription_tag(subscription_id: int) -> bytes:
    """The serialised ``SubscriptionResponse.id`` field."""
    return _TAG_SUBSCRIPTION_ID + varint(subscription_id)


@dataclass
class Usage:
    """Messages and bytes held in memory, with optional limits (0 = none)."""

    name: str
    max_count: int = 0
    max_bytes: int = 0
    count: int = 0
    bytes: int = 0

    def exceeded_by(self, size: int) -> str | None:
        """Which limit one more message of ``size`` bytes would cross, in words."""
        if self.max_count and self.count + 1 > self.max_count:
            return f"{self.name} max_count ({self.max_count} messages)"
        if self.max_bytes and self.bytes + size > self.max_bytes:
            return f"{self.name} max_bytes ({self.max_bytes} bytes)"
        return None


@dataclass(eq=False)
class StoredMessage:
    """One accepted message, shared by the queues it matched."""

    publisher_id: str
    seq: int
    payload: bytes
    persistent: bool
    # Accounts the message belongs to (the topic's and the broker's); released when refs drop to 0.
    usages: tuple[Usage, ...] = ()
    refs: int = 0
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.payload)

    def hold(self, refs: int) -> None:
        self.refs = refs
        for usage in self.usages:
            usage.count += 1
            usage.bytes += self.size

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            for usage in self.usages:
                usage.count -= 1
                usage.bytes -= self.size

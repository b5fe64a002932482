"""What a subscriber asks the broker for, and what it makes of what arrives.

The ``Subscription`` message a :class:`~sokutatsu.client.Subscriber` opens its streams with,
the gaps a message reveals (the broker's ``previous_seq`` and retention notes, internals the
application never sees), and the conversion of a wire message to the SDK's own
:class:`~sokutatsu.client.Message`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client.errors import GapError
from sokutatsu.client.structs import Message, OrderedMessage, Stamp

Mode = Literal["flow-to-disk", "migrate"]
Policy = Literal["drop_oldest", "refuse_publish"]

_MODES: dict[Mode | None, broker_pb2.OverflowMode.ValueType] = {
    None: broker_pb2.OVERFLOW_MODE_UNSPECIFIED,
    "flow-to-disk": broker_pb2.OVERFLOW_MODE_FLOW_TO_DISK,
    "migrate": broker_pb2.OVERFLOW_MODE_MIGRATE,
}
_POLICIES: dict[Policy | None, broker_pb2.RetentionPolicy.ValueType] = {
    None: broker_pb2.RETENTION_POLICY_UNSPECIFIED,
    "drop_oldest": broker_pb2.RETENTION_POLICY_DROP_OLDEST,
    "refuse_publish": broker_pb2.RETENTION_POLICY_REFUSE_PUBLISH,
}
NO_HEADERS: Mapping[str, str] = MappingProxyType({})


def subscription_message(
    subscriber_id: str,
    topic: str,
    *,
    keys: Sequence[str],
    prefixes: Sequence[str],
    durable: bool,
    mode: Mode | None,
    memory_budget: int,
    retention_max_bytes: int,
    retention_max_age: float,
    retention_policy: Policy | None,
) -> broker_pb2.Subscription:
    return broker_pb2.Subscription(
        subscriber_id=subscriber_id,
        topic=topic,
        filter=broker_pb2.KeyFilter(exact_keys=list(keys), prefixes=list(prefixes)),
        durable=durable,
        overflow_mode=_MODES[mode],
        memory_budget_bytes=memory_budget,
        # A durable subscription's retention (0 / None = the broker's maximum and default policy).
        retention=broker_pb2.Retention(
            max_bytes=retention_max_bytes,
            max_age_ms=round(retention_max_age * 1000),
            policy=_POLICIES[retention_policy],
        ),
    )


def find_gaps(message: broker_pb2.Message, have: int) -> list[GapError]:
    """The messages of ``message``'s publisher lost between ``have`` (the last one received, 0: none
    yet) and ``message``: what the broker's ``previous_seq`` (the publisher's last message before
    it that matched the subscription) and its retention note say."""
    publisher = message.publisher_id
    told = message.retention_gap if message.HasField("retention_gap") else None
    if told is not None and told.last_seq > have:
        # The subscription's retention discarded messages before this one: the broker says which and why.
        gaps = []
        if have and told.first_seq > have + 1:
            # What went missing before the discarded range, for another reason, is a gap of its own.
            gaps.append(GapError(publisher, have + 1, told.first_seq - 1))
        gaps.append(
            GapError(
                publisher,
                max(have + 1, told.first_seq),
                max(told.last_seq, message.previous_seq),
                over_bytes=told.over_bytes,
                over_age=told.over_age,
            )
        )
        return gaps
    if message.previous_seq > have and have:
        return [GapError(publisher, have + 1, message.previous_seq)]
    return []


_new = object.__new__
_set = object.__setattr__


def _fields(message: broker_pb2.Message, topic: str) -> dict[str, Any]:
    headers = message.headers
    return {
        "topic": topic,
        "key": message.key,
        "body": message.body,
        "headers": dict(headers) if headers else NO_HEADERS,
        "publisher_id": message.publisher_id,
        "publisher_seq": message.publisher_seq,
        "publish_time_unix_nano": message.publish_time_unix_nano,
        "persistent": message.persistent,
    }


def to_message(message: broker_pb2.Message, topic: str) -> Message:
    """The SDK's :class:`Message` for a message the broker sent.

    Built into its ``__dict__`` rather than through the frozen dataclass's ``__init__`` (which sets
    each field with ``object.__setattr__``): the same instance, equal to one made by ``__init__``,
    at a fraction of the cost, once per message received.
    """
    built = _new(Message)
    _set(built, "__dict__", _fields(message, topic))
    return built


def to_ordered_message(message: broker_pb2.Message, topic: str) -> OrderedMessage:
    """The SDK's :class:`OrderedMessage` for a stamped message the broker sent (built as :func:`to_message`)."""
    stamp = message.stamp
    fields = _fields(message, topic)
    fields["stamp"] = Stamp(
        domain=stamp.domain, seq=stamp.seq, distribution_id=stamp.distribution_id, epoch=stamp.epoch
    )
    built = _new(OrderedMessage)
    _set(built, "__dict__", fields)
    return built

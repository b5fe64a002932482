"""Caps on client-supplied amounts, and the enums and names a request gives (issue #20).

Every number a QueueService or Transfer request gives that makes the node do, hold or wait more is
capped by a setting (``SOKUTATSU_QUEUEDB_*``): over it, the request is ``INVALID_ARGUMENT`` naming
the field, the maximum and the setting, before any SQL. Nothing is clamped silently: no answer
of these RPCs could report a granted value. docs/security.md ("Caps on client-supplied amounts")
has the table.

| field | cap |
|---|---|
| ``EnqueueRequest.messages``, ``DequeueRequest.max_messages`` | ``MAX_BATCH`` |
| ``AckRequest.lease_ids``, ``NackRequest.lease_ids``, ``TransferBatch.messages`` | ``MAX_BATCH`` |
| ``NewMessage.body`` | ``MAX_BODY_BYTES`` |
| ``DequeueRequest.visibility_timeout_ms`` | ``MAX_VISIBILITY_TIMEOUT_MS`` |
| ``DequeueRequest.wait_ms`` | ``MAX_WAIT_MS`` |
| ``NackRequest.delay_ms`` | ``MAX_NACK_DELAY_MS`` |
| ``TransferRule.min_batch``, ``TransferRule.max_age_ms`` | ``MAX_TRANSFER_MIN_BATCH``, ``MAX_TRANSFER_AGE_MS`` |
| ``TransferRule.to_node`` | one of ``PEERS`` |
"""

from __future__ import annotations

from google.protobuf.descriptor import EnumDescriptor

from sokutatsu.core.errors import FailedPrecondition, InvalidArgument, echo
from sokutatsu.queuedb.settings import QueueDbSettings
from sokutatsu.queuedb.text import valid_name
from sokutatsu.queuedb.v1 import queuedb_pb2

PREFIX = QueueDbSettings.env_prefix


def over(field: str, value: int, maximum: int, setting: str, unit: str = "") -> InvalidArgument:
    """The refusal of ``value`` in ``field``, above ``maximum`` (the setting ``PREFIX + setting``)."""
    unit = f" {unit}" if unit else ""
    return InvalidArgument(
        f"{field} of {value:,}{unit} is over the maximum of {maximum:,}{unit} ({PREFIX}{setting}); ask for less"
    )


def cap(field: str, value: int, maximum: int, setting: str, unit: str = "") -> int:
    """``value`` when it is at most ``maximum``; else :func:`over`."""
    if value > maximum:
        raise over(field, value, maximum, setting, unit)
    return value


def known_enum(field: str, value: int, enum: EnumDescriptor) -> int:
    """``value`` when it is a value of ``enum``; else ``InvalidArgument`` naming the field and the
    allowed values (an unknown number is never read as one of them)."""
    if value not in enum.values_by_number:
        listed = ", ".join(f"{v.name} = {v.number}" for v in enum.values)
        raise InvalidArgument(f"{field} {value} is not a {enum.name}: use one of {listed}")
    return value


def check_rule(queue: queuedb_pb2.Queue, settings: QueueDbSettings) -> None:
    """A CreateQueue's transfer rule: names, enum, caps, and a receiving node this node knows."""
    rule = queue.transfer
    if not rule.to_node:
        extra = [f for f in ("to_queue", "min_batch", "max_age_ms", "durability") if getattr(rule, f)]
        if extra:
            raise InvalidArgument(
                f"TransferRule.{extra[0]} is set but to_node is empty: name the receiving node in to_node, "
                "or leave the transfer rule out for a local queue"
            )
        return
    valid_name(rule.to_node, "TransferRule.to_node")
    if rule.to_queue:
        valid_name(rule.to_queue, "TransferRule.to_queue")
    known_enum("TransferRule.durability", rule.durability, queuedb_pb2.RemoteDurability.DESCRIPTOR)
    cap("TransferRule.min_batch", rule.min_batch, settings.max_transfer_min_batch, "MAX_TRANSFER_MIN_BATCH", "messages")
    cap("TransferRule.max_age_ms", rule.max_age_ms, settings.max_transfer_age_ms, "MAX_TRANSFER_AGE_MS")
    if rule.to_node not in settings.peers:
        known = ", ".join(repr(p) for p in settings.peers) if settings.peers else "none"
        raise FailedPrecondition(
            f"TransferRule.to_node {echo(rule.to_node)} is not a node this node forwards to; the nodes it knows "
            f"({PREFIX}PEERS): {known}. Name one of them, or add the node to {PREFIX}PEERS and to the transfer "
            "daemon's SOKUTATSU_TRANSFER_PEERS"
        )

"""Conversions between the ordering types and their protobuf messages."""

from __future__ import annotations

import time
from typing import TypeVar

from sokutatsu.client.errors import OrderingError
from sokutatsu.ordering.merge import Entry, Kind
from sokutatsu.ordering.schedule import Distribution
from sokutatsu.sequencer.v1 import sequencer_pb2, stamp_pb2

T = TypeVar("T")


def distribution_from_message(message: sequencer_pb2.Distribution) -> Distribution:
    """Raises ``ValueError`` (naming the problem) for weights that do not form a distribution."""
    weights = tuple((w.domain, w.weight_ppm) for w in message.weights)
    return Distribution(message.id, weights, message.total_rate)


def distribution_message(distribution: Distribution) -> sequencer_pb2.Distribution:
    return sequencer_pb2.Distribution(
        id=distribution.id,
        weights=[sequencer_pb2.DomainWeight(domain=d, weight_ppm=w) for d, w in distribution.weights],
        created_unix_nano=time.time_ns(),
        total_rate=distribution.total_rate,
    )


_KINDS = {
    stamp_pb2.STAMP_KIND_DATA: Kind.DATA,
    stamp_pb2.STAMP_KIND_DUMMY: Kind.DUMMY,
    stamp_pb2.STAMP_KIND_SKIP: Kind.SKIP,
}


def entry_from_stamp(stamp: stamp_pb2.Stamp, payload: T) -> Entry[T]:
    kind = _KINDS.get(stamp.kind)
    if kind is None:
        raise OrderingError(f"domain {stamp.domain!r} seq {stamp.seq}: stamp kind {stamp.kind} is not a slot")
    slots = stamp.slots or 1
    if kind is not Kind.SKIP and slots != 1:
        raise OrderingError(f"domain {stamp.domain!r} seq {stamp.seq}: only a skip marker covers {slots} slots")
    return Entry(stamp.distribution_id, stamp.domain, stamp.epoch, stamp.seq, kind, slots, payload)

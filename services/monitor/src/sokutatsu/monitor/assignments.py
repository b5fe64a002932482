"""Where each subscriber is served, derived from the brokers' statistics alone.

The monitor keeps no state of its own about assignments: a restarted monitor reads the
same statistics and gets the same view. A broker serves a subscriber when its queue is
``SERVING`` or ``LEAVING`` (redirected, not yet released). Transient overlaps (between
switchover steps 2 and 4 both brokers may claim it) are settled by preferring, in order:
a broker that answers now, ``SERVING`` over ``LEAVING``, the broker the subscriber is
connected to, the active, the higher epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sokutatsu.broker.v1 import broker_pb2

SubKey = tuple[str, str]  # (subscriber_id, topic)

SERVING_STATES = frozenset({broker_pb2.QUEUE_STATE_SERVING, broker_pb2.QUEUE_STATE_LEAVING})


@dataclass(frozen=True)
class BrokerView:
    """One broker as the monitor sees it: its last statistics and whether it answers now."""

    broker_id: str
    address: str
    stats: broker_pb2.BrokerStats | None
    reachable: bool

    @property
    def role(self) -> broker_pb2.BrokerRole.ValueType:
        return self.stats.role if self.stats is not None else broker_pb2.BROKER_ROLE_UNSPECIFIED

    @property
    def epoch(self) -> int:
        return self.stats.epoch if self.stats is not None else 0


@dataclass(frozen=True)
class Served:
    """One subscription and the broker serving it (``broker_id`` empty: none does)."""

    subscriber_id: str
    topic: str
    broker_id: str
    address: str
    role: broker_pb2.BrokerRole.ValueType
    # The serving broker's statistics of the queue (else the freshest any broker has).
    stats: broker_pb2.SubscriberStats

    @property
    def key(self) -> SubKey:
        return (self.subscriber_id, self.topic)

    @property
    def migrated(self) -> bool:
        """Served by the standby."""
        return bool(self.broker_id) and self.role == broker_pb2.BROKER_ROLE_STANDBY

    def placement(self) -> tuple[str, bool]:
        """What a change of assignment is: the broker and whether that is the standby."""
        return (self.broker_id, self.migrated)


def _rank(view: BrokerView, sub: broker_pb2.SubscriberStats) -> tuple[bool, bool, bool, bool, int]:
    return (
        view.reachable,
        sub.state == broker_pb2.QUEUE_STATE_SERVING,
        sub.connected,
        view.role == broker_pb2.BROKER_ROLE_ACTIVE,
        view.epoch,
    )


def derive_assignments(brokers: Sequence[BrokerView]) -> dict[SubKey, Served]:
    """Every subscription either broker reports, and which broker serves it."""
    seen: dict[SubKey, list[tuple[BrokerView, broker_pb2.SubscriberStats]]] = {}
    for view in brokers:
        if view.stats is None:
            continue
        for sub in view.stats.subscribers:
            seen.setdefault((sub.subscriber_id, sub.topic), []).append((view, sub))
    out: dict[SubKey, Served] = {}
    for key, entries in seen.items():
        serving = [(v, s) for v, s in entries if s.state in SERVING_STATES]
        if serving:
            view, sub = max(serving, key=lambda e: _rank(*e))
            out[key] = Served(key[0], key[1], view.broker_id, view.address, view.role, sub)
        else:
            # Nobody serves it (e.g. only a shadow is left): show where its backlog is.
            view, sub = max(entries, key=lambda e: (e[0].reachable, e[1].depth))
            out[key] = Served(key[0], key[1], "", "", broker_pb2.BROKER_ROLE_UNSPECIFIED, sub)
    return out


def active_broker(brokers: Iterable[BrokerView]) -> BrokerView | None:
    """The broker answering now as active (the higher epoch if both claim it)."""
    actives = [b for b in brokers if b.reachable and b.role == broker_pb2.BROKER_ROLE_ACTIVE]
    return max(actives, key=lambda b: b.epoch, default=None)


def by_subscriber(assignments: Iterable[Served], subscriber_id: str) -> list[Served]:
    return sorted((a for a in assignments if a.subscriber_id == subscriber_id), key=lambda a: a.topic)

"""The monitor's answers as protobuf messages: brokers, assignments."""

from __future__ import annotations

import time

from sokutatsu.monitor.assignments import Served
from sokutatsu.monitor.broker_link import BrokerLink
from sokutatsu.monitor.measures import Measures
from sokutatsu.monitor.v1 import monitor_pb2


def broker_state(link: BrokerLink, now: float) -> monitor_pb2.BrokerState:
    out = monitor_pb2.BrokerState(
        broker_id=link.broker_id,
        address=link.address,
        serving=link.reachable(now),
        last_seen_unix_nano=link.last_seen_unix_nano,
        error=link.problem(now),
        stats_streaming=link.streaming,
    )
    stats = link.stats
    if stats is not None:
        out.role = stats.role
        out.epoch = stats.epoch
        out.peer_up = stats.peer_up
        out.held_count = stats.held_count
        out.held_bytes = stats.held_bytes
        out.spilled_bytes = stats.spilled_bytes
        out.rss_bytes = stats.rss_bytes
        out.max_bytes = stats.max_bytes
    return out


def assignment(served: Served, measures: Measures | None, switching: bool, low_mark: int) -> monitor_pb2.Assignment:
    s = served.stats
    out = monitor_pb2.Assignment(
        subscriber_id=served.subscriber_id,
        topic=served.topic,
        broker_id=served.broker_id,
        address=served.address,
        depth=s.depth,
        depth_bytes=s.memory_bytes + s.spilled_bytes,
        migrated=served.migrated,
        inflow_per_second=s.inflow_per_second,
        outflow_per_second=s.outflow_per_second,
        connected=s.connected,
        overflow_mode=s.overflow_mode,
        state=s.state,
        switching=switching,
        memory_bytes=s.memory_bytes,
        memory_budget_bytes=s.memory_budget_bytes,
    )
    if measures is not None:
        out.threshold = measures.threshold.messages
        out.threshold_basis = measures.threshold.basis
        out.migrate_back_depth = low_mark
    return out


def removed(subscriber_id: str, topic: str) -> monitor_pb2.Assignment:
    return monitor_pb2.Assignment(subscriber_id=subscriber_id, topic=topic, removed=True)


def unix_nano_at(monotonic_time: float) -> int:
    """The wall-clock time (ns) of a past ``time.monotonic()`` reading."""
    return time.time_ns() - round((time.monotonic() - monotonic_time) * 1e9)

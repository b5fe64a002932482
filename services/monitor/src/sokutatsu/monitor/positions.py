"""Position vectors (per publisher, the last sequence number) and the switch's safety check."""

from __future__ import annotations

from collections.abc import Mapping

from sokutatsu.broker.v1 import broker_pb2

Vector = Mapping[str, int]


def vector(position: broker_pb2.Position) -> dict[str, int]:
    return dict(position.last_seq)


def behind(position: Vector, floor: Vector) -> dict[str, tuple[int, int]]:
    """Publishers where ``position`` is below ``floor``: ``{publisher: (position, floor)}``.

    A publisher missing from ``position`` counts as 0 (the subscriber has nothing of it);
    one missing from ``floor`` is covered (the taking broker holds all of it).
    """
    return {p: (position.get(p, 0), f) for p, f in floor.items() if position.get(p, 0) < f}


def covers(position: Vector, floor: Vector) -> bool:
    """Whether the taking broker holds everything the subscriber still needs.

    The taking broker holds every message after ``floor``; the subscriber has (acknowledged)
    everything up to ``position``. Redirecting is safe only when, for every publisher,
    ``position >= floor``: otherwise the messages in between are held by nobody the
    subscriber would reconnect to.
    """
    return not behind(position, floor)


def describe_behind(position: Vector, floor: Vector, limit: int = 3) -> str:
    """``pub-1 at 17 < 42, pub-2 at 0 < 5`` (the first ``limit`` publishers behind)."""
    gaps = sorted(behind(position, floor).items())
    text = ", ".join(f"{p} at {have} < {need}" for p, (have, need) in gaps[:limit])
    if len(gaps) > limit:
        text += f" and {len(gaps) - limit} more"
    return text

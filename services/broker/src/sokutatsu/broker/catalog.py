"""Topics and durable subscriptions, kept in ``<state>/catalog.json`` across restarts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sokutatsu.broker.subscription import SubscriptionSpec


@dataclass
class TopicSpec:
    name: str
    max_count: int = 0
    max_bytes: int = 0
    total_order: bool = False


@dataclass
class Catalog:
    topics: dict[str, TopicSpec] = field(default_factory=dict)
    # Durable subscriptions only, by (topic, subscriber id).
    subscriptions: dict[tuple[str, str], SubscriptionSpec] = field(default_factory=dict)
    # The durable subscriptions this broker served (delivered) when the catalog was written
    # (pair_state.py, invariant 7).
    served: set[tuple[str, str]] = field(default_factory=set)
    # Each durable subscription's creation tags (subscription_lists.py, invariant 8); none in a
    # catalog written before them.
    creations: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    # The tags of copies deleted or expired here that the peer may still list, and the expiries and
    # deletions not yet known to be applied by the peer (invariant 8): a restart keeps them.
    tombstones: dict[tuple[str, str], tuple[list[str], int]] = field(default_factory=dict)
    expired: list[tuple[tuple[str, str], list[str]]] = field(default_factory=list)
    deleted: list[tuple[tuple[str, str], list[str]]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "topics": [vars(t) for t in self.topics.values()],
            "subscriptions": [
                {**s.to_json(), "creations": self.creations.get(name, [])} for name, s in self.subscriptions.items()
            ],
            "served": [list(name) for name in sorted(self.served)],
            "tombstones": [[*name, tags, version] for name, (tags, version) in self.tombstones.items()],
            "expired": [[*name, tags] for name, tags in self.expired],
            "deleted": [[*name, tags] for name, tags in self.deleted],
        }


def load_catalog(path: Path) -> Catalog:
    if not path.exists():
        return Catalog()
    data = json.loads(path.read_text())
    catalog = Catalog()
    for t in data["topics"]:
        catalog.topics[t["name"]] = TopicSpec(**t)
    for s in data["subscriptions"]:
        spec = SubscriptionSpec.from_json(s)
        catalog.subscriptions[(spec.topic, spec.subscriber_id)] = spec
        catalog.creations[(spec.topic, spec.subscriber_id)] = [str(tag) for tag in s.get("creations", [])]
    for topic, subscriber_id in data.get("served", []):  # absent in catalogs written before it
        catalog.served.add((str(topic), str(subscriber_id)))
    for topic, subscriber_id, tags, version in data.get("tombstones", []):  # absent in catalogs before them
        catalog.tombstones[(str(topic), str(subscriber_id))] = ([str(t) for t in tags], int(version))
    for topic, subscriber_id, tags in data.get("expired", []):
        catalog.expired.append(((str(topic), str(subscriber_id)), [str(t) for t in tags]))
    for topic, subscriber_id, tags in data.get("deleted", []):
        catalog.deleted.append(((str(topic), str(subscriber_id)), [str(t) for t in tags]))
    return catalog


def save_catalog(path: Path, data: dict[str, Any]) -> None:
    """Write atomically and durably (runs on the disk thread)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as out:
        json.dump(data, out, separators=(",", ":"))  # compact: up to 10,000 tombstones, written often
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""The pair's durable subscriptions as an observed-remove set: the one place its rule is enforced.

**Invariant 8: a durable subscription is held by both brokers unless it was deleted or expired, and a
peer's stale list neither brings back a deleted one nor keeps out one created again.**

Each creation of a durable subscription on a broker (``CreateSubscription``, or ``AcceptSubscriber`` for
one it lacked) gets a *creation tag*, random. A broker's copy carries the tags it knows for that name:
its own creation's, and those the peer's lists (``DeliveredWatermarks.subscriptions``, each with
``Subscription.creations``) give for the same name: a copy adopted from the peer takes the peer's.
While the pair's link is up both copies come to carry the same tags (each list goes out when its
sender creates one, and whole on every new stream).

- Deleting or expiring a copy here *tombstones* the tags it carried.
- A peer's list that names a subscription only with tombstoned tags names the old one, which the peer
  has not deleted yet: it is not created again here. One with a tag not tombstoned is a creation that
  the deletion here never saw (created again on the peer, or at the same time as the deletion): it is
  created here (adopted). A creation the deletion did not see wins over it.
- An expiry the peer sends carries the tags it expired, with those it tombstoned for the name before
  (``SubscriptionName.creations``): the copy here goes only if each of its tags is among them; otherwise
  it holds a creation the peer never saw, and stays with those tags, which the peer then adopts from the
  next list. An expiry without tags (from a broker before them) deletes by name, the old rule.
- A tombstone is forgotten once a whole list of the peer holds none of its tags.
- The catalog records the tombstones and the expiries to send, so a broker that restarts before its peer
  heard of a deletion or an expiry neither takes the old copy back from the peer's list nor leaves the
  peer's copy of an expired one in place.

Before, a tombstone was by name and left only when a whole list came without the name. A subscription
created again on the standby in the milliseconds after it applied the active's expiry (before its next
frame was built) then kept one copy: its list without the name was never sent, and the active never
took the new one (``tests/broker/test_subscription_lists.py``).

Catalogs written before tags give their subscriptions the tag ``""`` (:data:`LEGACY`) on both
brokers, as does a peer's list entry without tags: for those the rule above is the old one.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

Name = tuple[str, str]  # (topic, subscriber id)
# The tag of a subscription from a catalog, or a peer's list, written before creation tags.
LEGACY = ""
# What an expiry of the peer's does to the copy here (SubscriptionLists.peer_expired).
DELETE, TRIMMED, KEPT = "delete", "trimmed", "kept"


def new_tag() -> str:
    return secrets.token_hex(8)


def tags_of(creations: Iterable[str]) -> frozenset[str]:
    """The tags a list entry, an expired name or a catalog entry carries (none: :data:`LEGACY`)."""
    tags = frozenset(creations)
    return tags or frozenset({LEGACY})


def encoded(tags: Iterable[str]) -> list[str]:
    """The inverse of :func:`tags_of`: sorted, and none for the legacy tag alone."""
    listed = sorted(tags)
    return [] if listed == [LEGACY] else listed


class SubscriptionLists:
    """The creation tags of the durable subscriptions a broker holds, and the tombstones of those it
    deleted or expired. The broker keeps it in step with its queues (``Broker._add_queue`` callers and
    ``Broker._remove_queue``); the decisions of invariant 8 are made here."""

    def __init__(self) -> None:
        self._held: dict[Name, set[str]] = {}
        self._tombstones: dict[Name, frozenset[str]] = {}

    def tags(self, name: Name) -> list[str]:
        """The tags of a copy held here, as a list or a catalog carries them (:func:`encoded`)."""
        return encoded(self._held.get(name, ()))

    def hold(self, name: Name, tags: Iterable[str] = ()) -> None:
        """A copy is made here: a new creation (no ``tags``: a new one), adopted, or loaded from the catalog."""
        self._held[name] = set(tags) or {new_tag()}

    def tombstones(self) -> dict[Name, list[str]]:
        """The tombstones, as the catalog records them (a restart keeps them)."""
        return {name: encoded(dead) for name, dead in self._tombstones.items()}

    def restore(self, tombstones: dict[Name, list[str]]) -> None:
        """The tombstones the catalog recorded."""
        self._tombstones = {name: tags_of(tags) for name, tags in tombstones.items()}

    def held(self, name: Name) -> bool:
        return name in self._held

    def tombstoned(self, name: Name) -> bool:
        """A copy of this name was deleted here that the peer's lists may still hold."""
        return name in self._tombstones

    def remove(self, name: Name) -> frozenset[str]:
        """The copy here is deleted or expired: tombstone its tags. Returns every tag tombstoned for the
        name (for the expiry the peer is told of: a copy there that also holds a creation deleted here
        earlier, by a DeleteSubscription that reached this broker only, goes too)."""
        tags = frozenset(self._held.pop(name, ()) or {LEGACY})
        dead = self._tombstones.get(name, frozenset()) | tags
        self._tombstones[name] = dead
        return dead

    def peer_list(self, entries: dict[Name, frozenset[str]], *, whole: bool) -> tuple[dict[Name, frozenset[str]], bool]:
        """A list of the peer's (``whole``: all it holds): merge the tags of copies held here, forget
        tombstones it no longer holds any tag of. Returns the entries to adopt, with their tags, and
        whether a copy here took a tag (the catalog then records it)."""
        if whole:
            kept = {name: dead & entries.get(name, frozenset()) for name, dead in self._tombstones.items()}
            self._tombstones = {name: dead for name, dead in kept.items() if dead}
        adopt: dict[Name, frozenset[str]] = {}
        merged = False
        for name, tags in entries.items():
            live = tags - self._tombstones.get(name, frozenset())
            mine = self._held.get(name)
            if mine is not None:
                merged = merged or not live <= mine
                mine |= live
            elif live:
                adopt[name] = frozenset(live)
        return adopt, merged

    def peer_expired(self, name: Name, creations: Sequence[str]) -> str:
        """The peer expired its copy, carrying ``creations`` (its tags and those it deleted before).
        Returns :data:`DELETE` when the copy here goes too: each of its tags is among them, or none is
        given (a peer from before the tags: the old rule, by name). Otherwise the copy here stays:
        :data:`TRIMMED` when it loses tags the peer expired, :data:`KEPT` when nothing changed."""
        mine = self._held.get(name)
        if mine is None:
            return KEPT
        tags = frozenset(creations)
        if not tags or mine <= tags:
            return DELETE
        if not mine & tags:
            return KEPT
        mine -= tags
        # A stale list of the peer's that still names them does not bring them back (peer_list).
        self._tombstones[name] = self._tombstones.get(name, frozenset()) | tags
        return TRIMMED

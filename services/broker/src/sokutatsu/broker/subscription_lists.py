"""The pair's durable subscriptions as an observed-remove set: the one place its rule is enforced.

**Invariant 8: both brokers hold a durable subscription, or neither does, once their frames have crossed:
a creation on either reaches the other, and so does a deletion or an expiry, except of a copy a
subscriber is attached to (that copy stays, and comes back on the other, with the peer's holdings); a
peer's stale list neither brings back a deleted subscription nor keeps out one created again.**

Each creation of a durable subscription on a broker (``CreateSubscription``, or ``AcceptSubscriber`` for
one it lacked) gets a *creation tag*, random. A broker's copy carries the tags it knows for that name:
its own creation's, and those the peer's lists (``DeliveredWatermarks.subscriptions``, each with
``Subscription.creations``) give for the same name: a copy adopted from the peer takes the peer's.
Lists go out when their sender's subscriptions change, and whole on every new stream.

- Deleting or expiring a copy here *tombstones* the tags it carried, and the peer is told
  (``DeliveredWatermarks.deleted`` / ``expired``, each name with every tag tombstoned for it here).
- A peer's list that names a subscription only with tombstoned tags names the old one, which the peer
  has not deleted yet: it is not created again here. One with a tag not tombstoned is a creation that
  the deletion here never saw (created again on the peer, or at the same time as the deletion): it is
  created here (adopted). A creation the deletion did not see wins over it.
- A deletion or expiry of the peer's deletes the copy here only if each of its tags is among those the
  peer names; otherwise the copy holds a creation the peer never saw, and stays with the rest of its
  tags, which the peer then adopts from the next list. A copy a subscriber is attached to here stays
  too, under a new tag: the peer takes it back from the next list, with this broker's holdings (the
  next frame carries them), so that it does not count itself as holding what it deleted. One without
  tags (a broker before them, or a copy from before them) deletes by name, the old rule, not one
  attached here. A client's DeleteSubscription is refused for a copy the peer serves the subscriber
  from (away or leaving here) while the peer is heard: delete it there.
- The peer hears only what is on disk here: the lists, deletions and expiries a frame carries are those
  of the last catalog write that completed, under that write's *list version* (``Broker._save_catalog``).
  Sent before it was on disk, a deletion that the peer applied and acknowledged could be undone by a
  crash here before the write ended, the subscription coming back from the old catalog while the peer,
  tombstoned, never took it again (the third review).
- A tombstone, and the deletion or expiry sent for it, are forgotten once a whole list of the peer's holds
  none of its tags *and* was built after the peer applied the list version that first carried it
  (``DeliveredWatermarks.subscriptions_applied``; until a write carries it, a tombstone is *pending*
  and stays). A list built earlier proves nothing: the peer may still take the creation from an older
  frame of this broker's on its way (a creation and a deletion on both brokers while lists cross; the
  second review). A peer from before the tags acknowledges nothing: its whole lists are taken as built
  after everything, the old rule. The catalog records both, so a broker that restarts before its peer
  heard of a deletion or an expiry neither takes the old copy back from the peer's list nor leaves the
  peer's copy in place. List versions start from the wall clock in nanoseconds, so they grow across
  restarts, and each new stream from the peer starts acknowledging from nothing. At most
  :data:`TOMBSTONES_KEPT` names keep a tombstone (the oldest go first).
- The peer's holdings (invariant 4) are left out when their tags are all tombstoned here: the peer's
  copy is a subscription older than any made here since (:meth:`SubscriptionLists.takes_holdings`).

Before, a tombstone was by name and left only when a whole list came without the name. A subscription
created again on the standby in the milliseconds after it applied the active's expiry (before its next
frame was built) then kept one copy: its list without the name was never sent, and the active never
took the new one (``tests/broker/test_subscription_lists.py`` has that schedule and the others reviews
found).

Catalogs written before tags give their subscriptions the tag ``""`` (:data:`LEGACY`) on both
brokers, as does a peer's list entry without tags: for those the rule above is the old one. A peer from
before the tags (``DeliveredWatermarks.creation_tags`` unset) deletes by name and never hears of
deletions; it is sent no expiry of a subscription created again here since (the old behaviour), since it
would delete the new one.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

Name = tuple[str, str]  # (topic, subscriber id)
# The tag of a subscription from a catalog, or a peer's list, written before creation tags.
LEGACY = ""
# What a deletion or expiry of the peer's does to the copy here (SubscriptionLists.peer_removed).
DELETE, TRIMMED, RENEWED, KEPT = "delete", "trimmed", "renewed", "kept"
# The list version of a tombstone no catalog write has carried yet.
PENDING = 0
# The most names that keep a tombstone, and the most deletions and expiries of each kind waiting to be sent.
TOMBSTONES_KEPT = 10_000


def new_tag() -> str:
    return secrets.token_hex(8)


def tags_of(creations: Iterable[str]) -> frozenset[str]:
    """The tags a list entry or a catalog entry carries (none: :data:`LEGACY`)."""
    tags = frozenset(creations)
    return tags or frozenset({LEGACY})


def encoded(tags: Iterable[str]) -> list[str]:
    """The inverse of :func:`tags_of`: sorted, and none for the legacy tag alone."""
    listed = sorted(tags)
    return [] if listed == [LEGACY] else listed


class SubscriptionLists:
    """The creation tags of the durable subscriptions a broker holds, and the tombstones of those it
    deleted or expired. The broker keeps it in step with its durable queues (``Broker._add_queue``,
    ``Broker._remove_queue``); the decisions of invariant 8 are made here."""

    def __init__(self) -> None:
        self._held: dict[Name, set[str]] = {}
        # Per name: the tags, and the list version of the first catalog write that carried them (the
        # peer must have applied a list at least that new before the tombstone may go; PENDING until a
        # write carries them). The newest last.
        self._tombstones: dict[Name, tuple[frozenset[str], int]] = {}

    def tags(self, name: Name) -> list[str]:
        """The tags of a copy held here, as a list, a holding or a catalog carries them (:func:`encoded`)."""
        return encoded(self._held.get(name, ()))

    def hold(self, name: Name, tags: Iterable[str] = ()) -> None:
        """A copy is made here: a new creation (no ``tags``: a new one), adopted, or loaded from the catalog."""
        self._held[name] = set(tags) or {new_tag()}

    def held(self, name: Name) -> bool:
        return name in self._held

    def tombstoned(self, name: Name) -> bool:
        """A copy of this name was deleted here that the peer's lists may still hold."""
        return name in self._tombstones

    @property
    def tombstone_count(self) -> int:
        return len(self._tombstones)

    def tombstones(self) -> dict[Name, tuple[list[str], int]]:
        """The tombstones, as the catalog records them (a restart keeps them)."""
        return {name: (encoded(dead), version) for name, (dead, version) in self._tombstones.items()}

    def restore(self, tombstones: dict[Name, tuple[list[str], int]]) -> None:
        """The tombstones the catalog recorded."""
        self._tombstones = {name: (tags_of(tags), version) for name, (tags, version) in tombstones.items()}

    def _dead(self, name: Name) -> frozenset[str]:
        entry = self._tombstones.get(name)
        return entry[0] if entry is not None else frozenset()

    def stamp(self, version: int) -> None:
        """A catalog write of list version ``version`` begins, carrying every pending tombstone."""
        for name, (dead, stamped) in self._tombstones.items():
            if stamped == PENDING:
                self._tombstones[name] = (dead, version)

    def _bury(self, name: Name, tags: frozenset[str]) -> frozenset[str]:
        dead = self._dead(name) | tags
        self._tombstones.pop(name, None)
        self._tombstones[name] = (dead, PENDING)
        while len(self._tombstones) > TOMBSTONES_KEPT:
            del self._tombstones[next(iter(self._tombstones))]
        return dead

    def remove(self, name: Name) -> frozenset[str]:
        """The copy here is deleted or expired: tombstone its tags. Returns every tag tombstoned for the
        name, for the deletion or expiry the peer is told of: a copy there that also holds a creation
        deleted here earlier goes too."""
        return self._bury(name, frozenset(self._held.pop(name, ()) or {LEGACY}))

    def peer_list(
        self, entries: dict[Name, frozenset[str]], *, whole: bool, applied: int
    ) -> tuple[dict[Name, frozenset[str]], bool]:
        """A list of the peer's (``whole``: all it holds), built after it applied this broker's list
        version ``applied``: merge the tags of copies held here, and forget the tombstones it had heard
        of whose tags it no longer holds. Returns the entries to adopt, with their tags, and whether a
        copy here took a tag (the catalog then records it)."""
        if whole:
            for name, (dead, version) in list(self._tombstones.items()):
                if version != PENDING and version <= applied:
                    left = dead & entries.get(name, frozenset())
                    if left:
                        self._tombstones[name] = (left, version)
                    else:
                        del self._tombstones[name]
        adopt: dict[Name, frozenset[str]] = {}
        merged = False
        for name, tags in entries.items():
            live = tags - self._dead(name)
            mine = self._held.get(name)
            if mine is not None:
                merged = merged or not live <= mine
                mine |= live
            elif live:
                adopt[name] = frozenset(live)
        return adopt, merged

    def peer_removed(self, name: Name, creations: Sequence[str], *, in_use: bool) -> str:
        """The peer deleted or expired its copy, naming ``creations`` (its tags and those it deleted
        before). Returns :data:`DELETE` when the copy here goes too: each of its tags is among them, or
        none is named (a peer or a copy from before the tags: by name); not one ``in_use`` here, which
        is :data:`RENEWED` (it stays under a new tag, which the peer adopts) or, by name, :data:`KEPT`.
        Otherwise the copy stays: :data:`TRIMMED` when it loses tags the peer removed, :data:`KEPT` when
        nothing changes (a deletion or expiry heard before)."""
        mine = self._held.get(name)
        if mine is None:
            return KEPT
        tags = frozenset(creations)
        if not tags:
            return KEPT if in_use else DELETE
        if not mine & tags:
            return KEPT
        # A stale list of the peer's that still names them does not bring them back (peer_list).
        self._bury(name, tags)
        if mine <= tags:
            if not in_use:
                return DELETE
            self._held[name] = {new_tag()}
            return RENEWED
        mine -= tags
        return TRIMMED

    def takes_holdings(self, name: Name, creations: Sequence[str]) -> bool:
        """Whether the peer's holdings for ``name``, of its copy tagged ``creations``, apply to the copy
        here or to one made here later (invariant 4). Not when every tag is of a copy deleted here: the
        peer's copy is an older subscription, whose numbers a subscriber of the one made here since never
        acknowledges. In doubt they apply: without them a copy here could claim messages it lacks."""
        tags = frozenset(creations)
        if not tags:  # a peer or a copy from before the tags: by name
            return name in self._held or name not in self._tombstones
        return not tags <= self._dead(name)

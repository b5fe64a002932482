"""Which subscriptions of a topic a message's key goes to, without scanning them.

A subscription takes every key (no filter), or the keys it names exactly, or the keys that
start with one of its prefixes (``SubscriptionSpec.matches``: exact keys and prefixes add up).
:class:`KeyIndex` holds, per topic, the unfiltered subscriptions, a map from each exact key to
the subscriptions naming it, and a map from each prefix to the subscriptions naming it with the
prefix lengths in use, so a key costs one look-up per distinct prefix length plus its matches,
not one test per subscription. The answer for a key is kept (keys repeat: a feed has a few
hundred symbols) until the subscriptions change or :data:`CACHED_KEYS` keys are kept.

Invariant: ``matching(key)`` holds exactly the subscriptions whose ``spec.matches(key)`` is true,
each once, in the order they were given (``tests/broker/test_key_index.py`` checks it against
``matches`` on random filters and keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar


class _Spec(Protocol):
    @property
    def exact_keys(self) -> frozenset[str]: ...

    @property
    def prefixes(self) -> tuple[str, ...]: ...


class _Subscription(Protocol):
    @property
    def spec(self) -> _Spec: ...


Q = TypeVar("Q", bound=_Subscription)

# How many keys' answers a topic keeps (then it starts again): bounds memory whatever keys come.
CACHED_KEYS = 4096


class KeyIndex(Generic[Q]):
    def __init__(self, subscriptions: Sequence[Q]) -> None:
        self.order = {id(q): i for i, q in enumerate(subscriptions)}
        self.every = [q for q in subscriptions if not (q.spec.exact_keys or q.spec.prefixes)]
        self.exact: dict[str, list[Q]] = {}
        self.prefixed: dict[str, list[Q]] = {}
        # A subscription that more than one entry leads to (a key and a prefix, two prefixes):
        # only then may a key find it twice.
        entries: dict[int, int] = {}
        for q in subscriptions:
            for key in q.spec.exact_keys:
                self.exact.setdefault(key, []).append(q)
                entries[id(q)] = entries.get(id(q), 0) + 1
            for prefix in set(q.spec.prefixes):
                self.prefixed.setdefault(prefix, []).append(q)
                entries[id(q)] = entries.get(id(q), 0) + 1
        self.lengths = sorted({len(p) for p in self.prefixed})
        self.overlapping = any(n > 1 for n in entries.values())
        self.filtered = bool(self.exact or self.prefixed)
        self._cache: dict[str, list[Q]] = {}

    def matching(self, key: str) -> list[Q]:
        """The subscriptions ``key`` goes to (the caller must not change the list)."""
        if not self.filtered:
            return self.every
        found = self._cache.get(key)
        if found is None:
            found = self._find(key)
            if len(self._cache) >= CACHED_KEYS:
                self._cache.clear()
            self._cache[key] = found
        return found

    def _find(self, key: str) -> list[Q]:
        parts: list[list[Q]] = []
        if self.every:
            parts.append(self.every)
        exact = self.exact.get(key)
        if exact:
            parts.append(exact)
        for length in self.lengths:
            if length > len(key):
                break
            hit = self.prefixed.get(key[:length])
            if hit:
                parts.append(hit)
        if len(parts) == 1:
            return parts[0]
        found = [q for part in parts for q in part]
        if self.overlapping:
            found = list({id(q): q for q in found}.values())
        found.sort(key=lambda q: self.order[id(q)])
        return found

"""The topic's key index routes exactly as the subscriptions' own filters say, each once, in order."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from sokutatsu.broker.key_index import CACHED_KEYS, KeyIndex
from sokutatsu.broker.subscription import SubscriptionSpec

ALPHABET = "AB-1"


@dataclass(eq=False)
class Sub:
    spec: SubscriptionSpec


def _sub(i: int, keys: set[str], prefixes: list[str]) -> Sub:
    return Sub(
        SubscriptionSpec(
            subscriber_id=f"s{i}",
            topic="prices",
            exact_keys=frozenset(keys),
            prefixes=tuple(prefixes),
            durable=True,
            mode="migrate",
            budget=1,
        )
    )


keys = st.text(alphabet=ALPHABET, max_size=4)
filters = st.tuples(st.sets(keys, max_size=3), st.lists(keys, max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.lists(filters, max_size=8), st.lists(keys, min_size=1, max_size=20))
def test_the_index_matches_what_each_subscriptions_filter_matches(
    specs: list[tuple[set[str], list[str]]], probes: list[str]
) -> None:
    subs = [_sub(i, k, p) for i, (k, p) in enumerate(specs)]
    index = KeyIndex(subs)
    for key in probes * 2:  # the second time from the kept answers
        assert index.matching(key) == [s for s in subs if s.spec.matches(key)], key


def test_kept_answers_are_bounded() -> None:
    index = KeyIndex([_sub(0, {"A"}, ["B"])])
    for i in range(3 * CACHED_KEYS):
        index.matching(f"B{i}")
    assert len(index._cache) <= CACHED_KEYS
    assert index.matching("B7") == index.matching("B7") != []

"""The receivers' merge: any arrival interleaving gives every receiver the same total order."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sokutatsu.ordering import Distribution, Entry, Kind, OrderedMerge, OrderingError, weights_from_counts


@dataclass(frozen=True)
class Item:
    distribution_id: int  # 0 = the announcement of a distribution
    entry: Entry[str] | None = None
    distribution: Distribution | None = None


def _stream(rng: random.Random, domains: list[str], distributions: int, per_domain: int) -> list[list[Item]]:
    """Per domain, what its publishers send, in per-domain number order; the leader's announcements."""
    dists = [
        Distribution(d, weights_from_counts({x: rng.randrange(0, 50) for x in domains}, 5000))
        for d in range(1, distributions + 1)
    ]
    streams: list[list[Item]] = [[Item(0, distribution=d) for d in dists]]
    for domain in domains:
        seq = 1
        items = []
        for dist in dists:
            for _ in range(rng.randrange(0, per_domain)):
                kind = rng.choice([Kind.DATA, Kind.DATA, Kind.DATA, Kind.DUMMY, Kind.SKIP])
                slots = rng.randrange(1, 5) if kind is Kind.SKIP else 1
                payload = f"{domain}{seq}" if kind is Kind.DATA else None
                items.append(Item(dist.id, Entry(dist.id, domain, 1, seq, kind, slots, payload)))
                seq += slots
        # Every domain ends with a message of a newer distribution (the way a live
        # domain keeps moving), so the last distribution can close.
        closing = Distribution(distributions + 1, weights_from_counts(dict.fromkeys(domains, 1), 5000))
        items.append(Item(closing.id, Entry(closing.id, domain, 1, seq, Kind.DUMMY, 1)))
        streams.append(items)
    streams[0].append(Item(0, distribution=closing))
    return streams


def _arrival(rng: random.Random, streams: list[list[Item]]) -> list[Item]:
    """A random interleaving. Announcements arrive before anything stamped with them (the
    leader has them acknowledged first); within a domain, numbers may swap locally (several
    publishers of one domain)."""
    announcements = list(streams[0])
    pending = [list(s) for s in streams[1:]]
    for s in pending:
        for i in range(len(s) - 1):
            if rng.random() < 0.3 and s[i].distribution_id == s[i + 1].distribution_id:
                s[i], s[i + 1] = s[i + 1], s[i]
    out: list[Item] = []
    announced = 0
    while any(pending) or announcements:
        choices = [i for i, s in enumerate(pending) if s and s[0].distribution_id <= announced]
        if announcements and (not choices or rng.random() < 0.1):
            item = announcements.pop(0)
            assert item.distribution is not None
            announced = item.distribution.id
            out.append(item)
            continue
        i = rng.choice(choices)
        out.append(pending[i].pop(0))
    return out


def _deliver(arrival: list[Item]) -> list[str]:
    merge: OrderedMerge[str] = OrderedMerge()
    got: list[str] = []
    for item in arrival:
        if item.distribution is not None:
            merge.add_distribution(item.distribution)
        else:
            assert item.entry is not None
            merge.add(item.entry)
        got.extend(merge.pop_ready())
    return got


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 40),
)
def test_every_interleaving_gives_the_same_order(seed: int, domains: int, distributions: int, per: int) -> None:
    rng = random.Random(seed)  # noqa: S311 - reproducible test data, not secrets
    names = [f"d{i}" for i in range(domains)]
    streams = _stream(rng, names, distributions, per)
    sent = sorted(
        item.entry.payload for s in streams[1:] for item in s if item.entry is not None and item.entry.payload
    )
    orders = [_deliver(_arrival(random.Random(seed * 7 + r), streams)) for r in range(3)]  # noqa: S311
    # The three receivers agree, and each got every data message exactly once.
    assert orders[0] == orders[1] == orders[2]
    assert sorted(orders[0]) == sent
    # Per domain, messages come in number order.
    for name in names:
        numbers = [int(p[len(name) :]) for p in orders[0] if p.startswith(name)]
        assert numbers == sorted(numbers)


def test_an_empty_buffer_blocks_and_a_newer_distribution_skips() -> None:
    merge: OrderedMerge[str] = OrderedMerge()
    merge.add_distribution(Distribution(1, (("a", 500_000), ("b", 500_000))))
    merge.add_distribution(Distribution(2, (("a", 500_000), ("b", 500_000))))
    merge.add(Entry(1, "a", 1, 1, payload="a1"))
    first = merge.distributions[1].pick(0)
    if first == "b":
        assert merge.pop_ready() == []  # b's first number has not arrived: blocked
        assert merge.waiting_for == "b"
    # b moves on to distribution 2: its slots in distribution 1 are skipped.
    merge.add(Entry(2, "b", 1, 1, payload="b1"))
    assert merge.pop_ready() == ["a1"]
    assert merge.waiting_for == "a"
    merge.add(Entry(2, "a", 1, 2, payload="a2"))
    got = merge.pop_ready()
    assert sorted(got) == ["a2", "b1"]


def test_skip_markers_and_dummies_take_slots_without_delivering() -> None:
    merge: OrderedMerge[str] = OrderedMerge()
    merge.add_distribution(Distribution(1, (("a", 1_000_000 - 1), ("b", 1))))
    merge.add(Entry(1, "a", 1, 1, Kind.SKIP, 5))
    merge.add(Entry(1, "a", 1, 6, Kind.DUMMY))
    merge.add(Entry(1, "a", 1, 7, payload="a7"))
    assert merge.pop_ready() == ["a7"]
    assert merge.counters.skip_markers == 1
    assert merge.counters.skip_slots == 5
    assert merge.counters.dummies == 1


def test_unknown_distribution_and_stale_epoch_are_refused() -> None:
    merge: OrderedMerge[str] = OrderedMerge()
    merge.add_distribution(Distribution(1, (("a", 1_000_000),)))
    with pytest.raises(OrderingError, match="unknown distribution"):
        merge.add(Entry(2, "a", 1, 1, payload="x"))
    merge.add(Entry(1, "a", 2, 1, payload="a1"))
    merge.add(Entry(1, "a", 1, 2, payload="a2"))
    with pytest.raises(OrderingError, match="stale epoch"):
        merge.pop_ready()


def test_a_duplicate_is_dropped_and_counted() -> None:
    merge: OrderedMerge[str] = OrderedMerge()
    merge.add_distribution(Distribution(1, (("a", 1_000_000),)))
    merge.add(Entry(1, "a", 1, 1, payload="a1"))
    merge.add(Entry(1, "a", 1, 1, payload="a1"))
    assert merge.pop_ready() == ["a1"]
    merge.add(Entry(1, "a", 1, 1, payload="a1"))
    assert merge.counters.duplicates == 2

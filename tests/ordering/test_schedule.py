"""The deterministic schedule: reference values, committed vectors, weights that always sum exactly."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sokutatsu.ordering import (
    TOTAL_PPM,
    Distribution,
    draw_ppm,
    idle_deficit,
    mix64,
    schedule,
    share_deficit,
    weights_from_counts,
)

VECTORS = json.loads((Path(__file__).parent / "schedule_vectors.json").read_text())


def test_mix64_is_splitmix64() -> None:
    # The first two outputs of Vigna's splitmix64.c seeded with 0, published with the generator.
    for given_value, expected in VECTORS["mix64_reference"].items():
        assert mix64(int(given_value, 0)) == int(expected, 0)


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: str(c["distribution_id"]))
def test_the_committed_vectors(case: dict[str, object]) -> None:
    counts = case["counts"]
    assert isinstance(counts, dict)
    weights = weights_from_counts(counts, int(case["min_ppm"]))  # type: ignore[call-overload]
    assert [list(w) for w in weights] == case["weights"]
    distribution = Distribution(int(case["distribution_id"]), weights)  # type: ignore[call-overload]
    assert [draw_ppm(distribution.id, p) for p in range(16)] == case["draws_ppm"]
    assert schedule(distribution, 0, 64) == case["schedule_from_0"]
    assert schedule(distribution, 1_000_000, 16) == case["schedule_from_1000000"]


@given(st.integers(1, 2**64 - 1), st.integers(0, 2**64 - 1), st.lists(st.integers(1, 10**6), min_size=1, max_size=8))
def test_pick_is_the_documented_draw(distribution_id: int, position: int, shares: list[int]) -> None:
    """``pick`` inlines the draw for speed: it must stay the three documented steps."""
    weights = weights_from_counts({f"d{i}": n for i, n in enumerate(shares)}, 1)
    distribution = Distribution(distribution_id, weights)
    r = draw_ppm(distribution_id, position)
    cumulative = list(itertools.accumulate(ppm for _, ppm in weights))
    expected = next(name for (name, _), upto in zip(weights, cumulative, strict=True) if r < upto)
    assert distribution.pick(position) == expected


@pytest.mark.parametrize("weight", [5_000, 100_000, 333_334, 800_000])
@pytest.mark.parametrize("others", [10, 300, 3_000])
def test_an_idle_domain_topped_up_lets_receivers_through_the_others_slots(weight: int, others: int) -> None:
    """A quiet domain at exactly its share, topped up by idle_deficit: over 200 distributions,
    the schedule reaches the others' last slot within its slots in at least 199 (4 deviations)."""
    own = share_deficit(weight, 0, others)  # what the share filler alone keeps it at
    slots = own + idle_deficit(weight, own, others)
    enough = 0
    for distribution_id in range(1, 201):
        distribution = Distribution(distribution_id, (("a", weight), ("b", TOTAL_PPM - weight)))
        drawn_a = drawn_b = position = 0
        while drawn_b < others and drawn_a <= slots:
            if distribution.pick(position) == "a":
                drawn_a += 1
            else:
                drawn_b += 1
            position += 1
        enough += drawn_b == others
    assert enough >= 199


@given(
    st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), st.integers(0, 10**9), min_size=1, max_size=30),
    st.integers(1, 5000),
)
def test_weights_sum_exactly_and_keep_the_floor(counts: dict[str, int], min_ppm: int) -> None:
    weights = weights_from_counts(counts, min_ppm)
    assert sum(ppm for _, ppm in weights) == TOTAL_PPM
    assert [name for name, _ in weights] == sorted(counts)
    assert all(ppm >= min_ppm for _, ppm in weights)
    # A domain that sent more never weighs less than one that sent fewer.
    ranked = sorted(weights, key=lambda w: counts[w[0]])
    assert all(a[1] <= b[1] + 1 for a, b in itertools.pairwise(ranked))


def test_draws_follow_the_weights() -> None:
    distribution = Distribution(9, (("a", 100_000), ("b", 300_000), ("c", 600_000)))
    drawn = Counter(schedule(distribution, 0, 100_000))
    # 100,000 draws: each share within 1.5 % of its weight (about 10 standard deviations).
    assert abs(drawn["a"] / 100_000 - 0.1) < 0.015
    assert abs(drawn["b"] / 100_000 - 0.3) < 0.015
    assert abs(drawn["c"] / 100_000 - 0.6) < 0.015


def test_a_distribution_refuses_bad_weights() -> None:
    with pytest.raises(ValueError, match="sum to"):
        Distribution(1, (("a", 10), ("b", 10)))
    with pytest.raises(ValueError, match="sorted"):
        Distribution(1, (("b", 500_000), ("a", 500_000)))
    with pytest.raises(ValueError, match="at least 1 ppm"):
        Distribution(1, (("a", 0), ("b", 1_000_000)))
    with pytest.raises(ValueError, match="at least 1"):
        Distribution(0, (("a", 1_000_000),))


@given(st.integers(1, TOTAL_PPM - 1), st.integers(0, 10**6), st.integers(0, 10**6))
def test_share_deficit_is_the_least_that_reaches_the_weight(weight: int, own: int, other: int) -> None:
    n = share_deficit(weight, own, other)
    assert n >= 0
    if n:
        assert (own + n) * TOTAL_PPM >= weight * (own + n + other)
        assert (own + n - 1) * TOTAL_PPM < weight * (own + n - 1 + other)
    else:
        assert own * TOTAL_PPM >= weight * (own + other) or own == 0 == other

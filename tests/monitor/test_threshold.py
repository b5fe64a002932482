"""The adaptive slow-subscriber threshold: budget, message size, inflow, switch time, bounds."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from sokutatsu.monitor.threshold import (
    MeanSize,
    RecentPeak,
    SwitchTimes,
    ThresholdInputs,
    derive_threshold,
    percentile,
)

MIB = 2**20


def _inputs(**changes: object) -> ThresholdInputs:
    base: dict[str, object] = {
        "budget_bytes": 64 * MIB,
        "mean_message_bytes": 1024.0,
        "size_source": "measured",
        "inflow_per_second": 5000.0,
        "switch_seconds": 0.02,
        "detect_seconds": 0.1,
        "safety": 2.0,
        "lower": 2000,
        "upper": 0,
    }
    base.update(changes)
    return ThresholdInputs(**base)  # type: ignore[arg-type]


def test_budget_minus_what_arrives_during_the_switch() -> None:
    # 64 MiB of 1 KiB messages = 65536; 5000/s x (20 ms + 100 ms) x 2 = 1200 arrive meanwhile.
    t = derive_threshold(_inputs())
    assert t.messages == 65536 - 1200
    assert "65536 msgs" in t.basis
    assert "inflow 5000/s" in t.basis
    assert "switch 20 ms" in t.basis
    assert "safety 2" in t.basis
    assert "(measured)" in t.basis


def test_larger_messages_mean_fewer_fit_the_budget() -> None:
    small = derive_threshold(_inputs(mean_message_bytes=1024.0)).messages
    large = derive_threshold(_inputs(mean_message_bytes=4096.0)).messages
    assert large == 16384 - 1200
    assert large < small


def test_a_slower_switch_lowers_the_threshold() -> None:
    fast = derive_threshold(_inputs(switch_seconds=0.01)).messages
    slow = derive_threshold(_inputs(switch_seconds=0.5)).messages
    assert slow < fast


def test_heavy_inflow_is_raised_to_the_lower_bound_above_the_credit_window() -> None:
    # 600k msgs/s x (20 ms + 100 ms) x 2 = 144000 arrive during a switch: more than the budget holds.
    t = derive_threshold(_inputs(inflow_per_second=600_000.0))
    assert t.messages == 2000
    assert "raised to the lower bound 2000" in t.basis


def test_a_budget_smaller_than_the_lower_bound_wins() -> None:
    t = derive_threshold(_inputs(budget_bytes=512 * 1024))  # 512 messages of 1 KiB
    assert t.messages == 512
    assert "the budget (512) is under the lower bound 2000" in t.basis


def test_upper_bound_caps_it() -> None:
    t = derive_threshold(_inputs(upper=10_000, inflow_per_second=0.0))
    assert t.messages == 10_000
    assert "capped at the upper bound 10000" in t.basis


def test_no_budget_known_uses_a_bound() -> None:
    assert derive_threshold(_inputs(budget_bytes=0)).messages == 2000
    assert derive_threshold(_inputs(budget_bytes=0, upper=7000)).messages == 7000


@given(
    budget=st.integers(min_value=1, max_value=2**34),
    mean=st.floats(min_value=1, max_value=2**20),
    inflow=st.floats(min_value=0, max_value=1e7),
    switch=st.floats(min_value=0, max_value=10),
    safety=st.floats(min_value=1, max_value=100),
    lower=st.integers(min_value=0, max_value=10**6),
    upper=st.integers(min_value=0, max_value=10**9),
)
def test_threshold_properties(
    *, budget: int, mean: float, inflow: float, switch: float, safety: float, lower: int, upper: int
) -> None:
    i = _inputs(
        budget_bytes=budget,
        mean_message_bytes=mean,
        inflow_per_second=inflow,
        switch_seconds=switch,
        safety=safety,
        lower=lower,
        upper=upper,
    )
    t = derive_threshold(i)
    budget_msgs = max(1, int(budget // mean))
    cap = min(budget_msgs, upper) if upper else budget_msgs
    # Never above what the budget holds (nor the upper bound); at least 1.
    assert 1 <= t.messages <= cap
    # Never below the lower bound unless the budget (or upper bound) is under it.
    assert t.messages >= min(max(1, lower), cap)
    # Unless a bound forced it, what arrives during a switch (with the safety factor) still fits.
    headroom = math.ceil(inflow * (switch + 0.1) * safety)
    if t.messages > max(1, lower):
        assert t.messages + headroom <= budget_msgs
    # More inflow never raises it.
    assert derive_threshold(_inputs(**{**i.__dict__, "inflow_per_second": inflow * 2 + 1})).messages <= t.messages
    assert t.basis


def test_switch_time_estimate_is_conservative_until_measured() -> None:
    times = SwitchTimes(assumed_seconds=0.2)
    assert times.estimate() == 0.2
    assert "assumed (none measured yet)" in times.basis()
    times.add(0.01)
    assert times.estimate() == 0.2  # one fast switch does not lower it yet
    for _ in range(4):
        times.add(0.01)
    assert times.estimate() == 0.01
    times.add(0.3)  # one slow one among six: p90 is it
    assert times.estimate() == 0.3
    assert "p90 of the last 6" in times.basis()


def test_switch_time_above_the_assumption_counts_at_once() -> None:
    times = SwitchTimes(assumed_seconds=0.05)
    times.add(0.4)
    assert times.estimate() == 0.4


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.9) == 90.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([5.0], 0.9) == 5.0


def test_recent_peak_forgets_old_bursts() -> None:
    peak = RecentPeak(kept=3)
    assert peak.add(100.0) == 100.0
    assert peak.add(10.0) == 100.0
    peak.add(10.0)
    assert peak.add(10.0) == 10.0


def test_mean_size_ignores_empty_queues_and_smooths() -> None:
    size = MeanSize()
    assert size.add(0, 0) is None
    assert size.add(1000, 1) == 1000.0
    smoothed = size.add(3000, 1)
    assert smoothed is not None
    assert 1000.0 < smoothed < 3000.0

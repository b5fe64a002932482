"""Two fixed fault schedules of ``sokutatsu chaos`` against real processes: the pair's promise holds.

Seed 2630 is a schedule with only the required steps (two broker kills, a pause, a link cut,
a migration overlapping a broker fault, a subscriber reopening with its position, a publisher
restarting with its id); seed 1964 adds a monitor kill, a flood of 1,500 Subscribe streams, and
ten calls of subscription churn (durable subscriptions created and deleted on one broker or both).
Nothing is timed here: the stalls are reported, not asserted. The wait for a caught-up pair
before a broker fault is bounded at 20 s (60 s in ``sokutatsu chaos``) to bound the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sokutatsu.cli.chaos_run import ChaosConfig, run_schedule

# solo: a fixed schedule runs as drawn; 4 workers on 2 cores starve its processes past the peer
# timeouts, adding faults the seed did not draw (seed 1964 found a real bug that way, since fixed:
# docs/chaos.md, "A promotion over a slow active"). Starvation is the nemesis's flood.
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.solo, pytest.mark.timeout(240)]


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "seconds"), [(2630, 0.0), (1964, 32.0)])
async def test_a_fixed_schedule_loses_nothing_doubles_nothing_and_never_has_two_actives(
    tmp_path: Path, seed: int, seconds: float
) -> None:
    result = await run_schedule(
        seed, ChaosConfig(seconds=seconds, rate=100.0, settle_seconds=20.0), tmp_path / f"seed-{seed}", print
    )
    told = json.dumps(
        {k: result.get(k) for k in ("violations", "faults", "subscribers", "two_active_windows", "evidence")},
        indent=1,
    )
    assert result["error"] == "", told
    assert result["meets_minimum"], told
    assert all(result["acknowledged"].values()), told
    assert result["publisher_starts"]["pub-2"] == 2, told  # it restarted with its id
    assert result["lost"] == 0, told
    assert result["duplicates"] == 0, told
    assert result["reordered"] == 0, told
    assert result["gaps"] == 0, told
    assert result["unexpected"] == 0, told
    assert result["max_actives"] <= 1, told
    assert result["unflushed_publishers"] == [], told
    # The subscription churn (seed 1964 draws 10 calls): both brokers hold the same durable subscriptions.
    churn = result["drain"]["churn"]
    assert churn["same"], json.dumps({"churn": churn, "calls": result["churn"]}, indent=1)
    assert churn["wrong"] == [], json.dumps({"churn": churn, "calls": result["churn"]}, indent=1)

"""The extended-ATOP simulator (`sokutatsu simulate atop`) on short runs; full runs: docs/sequencer-simulation.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sokutatsu.bench.atop import AtopParams, burst_schedule, workload
from sokutatsu.bench.atop_run import simulate, simulate_with_orders
from sokutatsu.cli.app import app

SHORT = 20.0  # simulated seconds: four distributions, a burst or two


def test_a_run_is_deterministic_for_a_seed() -> None:
    params = AtopParams(domains=5, burst_interval=7.5, duration=SHORT, seed=7)
    first = simulate(params)
    assert simulate(params) == first
    assert simulate(AtopParams(domains=5, burst_interval=7.5, duration=SHORT, seed=8)) != first


def test_the_workload_follows_the_seed_parameters() -> None:
    params = AtopParams(domains=10, burst_interval=7.5, duration=60.0)
    bursts = burst_schedule(params)
    assert [start for start, _ in bursts] == [7.5 * k for k in range(1, 8)]
    assert all(len(chosen) == 8 and len(set(chosen)) == 8 for _, chosen in bursts)
    calm = workload(AtopParams(domains=10, duration=60.0))
    assert 0.9 * 200 * 60 < len(calm) < 1.1 * 200 * 60  # 100 clients x 2/s
    # Every configuration of a figure sees the same messages: the workload does not depend on the domains.
    assert [m.generated for m in workload(AtopParams(domains=2, duration=60.0))] == [m.generated for m in calm]


@pytest.mark.parametrize("bursts", [None, 7.5])
def test_one_domain_needs_no_dummies(bursts: float | None) -> None:
    result = simulate(AtopParams(domains=1, burst_interval=bursts, duration=SHORT))
    assert result.filler_slots == 0
    assert result.filler_messages == 0
    assert result.dummies_per_s == 0


def test_more_domains_need_dummies() -> None:
    assert simulate(AtopParams(domains=20, burst_interval=7.5, duration=SHORT)).filler_slots > 0


@pytest.mark.parametrize(("domains", "markers"), [(1, False), (5, False), (5, True), (100, True)])
def test_every_receiver_delivers_every_data_message_once_in_the_same_order(domains: int, markers: bool) -> None:
    result, orders = simulate_with_orders(
        AtopParams(domains=domains, burst_interval=7.5, markers=markers, duration=SHORT)
    )
    assert len(orders) == 2
    for order in orders:
        assert sorted(order) == list(range(result.data_messages))
    assert orders[0] == orders[1]
    assert result.same_order
    assert all(r.delivered_each_once and r.delivered == result.data_messages for r in result.receivers)
    assert result.closing_fillers == domains


def test_a_saturated_sequencer_still_delivers_everything() -> None:
    # 100 clients x 2/s x 10 ms = 2: the queue grows for the whole run, then drains.
    result = simulate(AtopParams(domains=1, service_time=0.010, duration=10.0))
    assert result.saturated
    assert result.drained_at_s > 15.0
    assert result.mean_queue_wait_ms > 1000
    assert all(r.delivered_each_once for r in result.receivers)


def test_skip_markers_fill_the_same_slots_with_fewer_messages() -> None:
    dummies = simulate(AtopParams(domains=5, burst_interval=7.5, duration=SHORT))
    markers = simulate(AtopParams(domains=5, burst_interval=7.5, duration=SHORT, markers=True))
    assert markers.filler_slots == dummies.filler_slots > 0  # the same decisions (share_deficit on slots)
    assert markers.filler_messages < dummies.filler_messages == dummies.filler_slots


def test_the_command_writes_the_json_and_the_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "fig10.json", tmp_path / "fig10.png"
    args = ["simulate", "atop", "--figure", "10", "--duration", "4", "--seed", "3", "--json", str(out)]
    result = CliRunner().invoke(app, [*args, "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["figure"] == 10
    assert data["seed"] == 3
    assert data["duration_s"] == 4
    assert data["checks"] == {"every_data_message_delivered_once": True, "receivers_agree_on_the_order": True}
    assert len(data["results"]) == 18  # 6 domain counts x 3 burst settings
    assert {r["domains"] for r in data["results"] if r["dummies_per_s"] == 0} >= {1}
    assert png.stat().st_size > 0


def test_the_command_refuses_a_figure_the_seed_does_not_have() -> None:
    result = CliRunner().invoke(app, ["simulate", "atop", "--figure", "9"])
    assert result.exit_code == 2

"""`sokutatsu demo --quick` as a user runs it: the whole suite as real processes on the test
session's PostgreSQL, the scenario in a reduced form (fewer symbols, ticks and orders,
shorter phases), Spark over its traces. Its summary (``summary.json``, the figures the demo
prints) must say: nothing lost or doubled anywhere, the slow desk moved to the standby and
back, the replicas in one order, the order events across queue-db exactly once through the
transfer daemon's SIGKILL, a report written, and every process stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sokutatsu.demo.market import DeskResult, DeskSpec, MarketResult, Move
from sokutatsu.demo.order import MemberResult, OrderResult
from sokutatsu.demo.queuedb import QueueResult
from sokutatsu.demo.summary import Outcome, failures

# Only stops a hung run (the quick demo and Spark take about a minute and a half here); nothing is timed.
RUN_LIMIT_SECONDS = 270.0

F = TypeVar("F", bound=Callable[..., None])


def _runs_the_demo(test: F) -> F:
    """The marks of a test that needs the demo's run (the checks below need none)."""
    for mark in (pytest.mark.e2e, pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(300)):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def demo_run(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One quick demo for the module's tests: (the finished process, its state folder)."""
    folder = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "SOKUTATSU_STATE_DIR": str(folder / "state"), "SOKUTATSU_PG_DSN": pg_dsn}
    env.pop("SOKUTATSU_TRACE_DIR", None)
    run = subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", "demo", "--quick", "--out", str(folder / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_SECONDS,
        check=False,
    )
    return run, folder


def _summary(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> dict[str, Any]:
    run, folder = demo_run
    assert run.returncode == 0, f"{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    summary: dict[str, Any] = json.loads((folder / "out" / "summary.json").read_text())
    return summary


@_runs_the_demo
def test_the_demo_passes_with_nothing_lost_or_doubled(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    summary = _summary(demo_run)
    assert summary["passed"], summary["failures"]
    assert summary["failures"] == []
    assert (summary["lost"], summary["duplicates"]) == (0, 0)
    assert summary["delivered"] > 0
    out = demo_run[0].stdout
    assert "RESULT       PASS" in out
    assert "lost = 0 · duplicates = 0" in out


@_runs_the_demo
def test_every_desk_gets_exactly_what_its_filter_asks_for(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    market = _summary(demo_run)["market"]
    assert market["sent"] > 0
    desks = {d["spec"]["id"]: d for d in market["desks"]}
    assert len(desks) == 4
    for desk in desks.values():
        assert desk["expected"] > 0, desk["spec"]
        assert desk["received"] == desk["expected"]
        assert (desk["lost"], desk["duplicates"], desk["unexpected"], desk["gaps"], desk["error"]) == (0, 0, 0, 0, "")
    # The filters split the feed: no desk but the unfiltered total would see every tick.
    assert all(d["expected"] < market["sent"] for d in desks.values())


@_runs_the_demo
def test_the_slow_desk_is_moved_to_the_standby_and_back(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    market = _summary(demo_run)["market"]
    slow = market["slow_desk"]
    moves = [(m["reason"], m["from_broker"], m["to_broker"]) for m in market["moves"]]
    assert moves == [("SLOW", "broker-a", "broker-b"), ("RECOVERED", "broker-b", "broker-a")]
    away = market["moves"][0]
    assert away["depth"] > away["threshold"] > 0
    assert set(away["steps_ms"]) == {"position", "accept", "redirect", "release"}
    assert all(m["started_ns"] > market["slow_at_ns"] for m in market["moves"])
    desks = {d["spec"]["id"]: d for d in market["desks"]}
    # As the subscribers' SDKs saw it: the slow desk served by the standby in between, the others never moved.
    assert desks[slow]["brokers"] == ["broker-a", "broker-b", "broker-a"]
    assert all(d["brokers"] == ["broker-a"] for name, d in desks.items() if name != slow)
    assert market["latency"]["before"]["messages"] > 0


@_runs_the_demo
def test_the_replicas_agree_on_one_order(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    order = _summary(demo_run)["order"]
    assert order["agree"]
    assert (order["lost"], order["duplicates"]) == (0, 0)
    members = order["members"]
    assert len(members) >= 2
    sent = sum(len(numbers) for numbers in order["stamps"].values())
    assert sent > 0
    for member in members:
        assert member["error"] == ""
        assert member["order"] == members[0]["order"]
        assert len(member["order"]) == sent
    # Both domains interleaved, each in its own sequence order.
    first = members[0]["order"]
    for domain, numbers in order["stamps"].items():
        assert [seq for d, seq in first if d == domain] == sorted(numbers)


@_runs_the_demo
def test_order_events_cross_queue_db_exactly_once_through_the_daemon_crash(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    queue = _summary(demo_run)["queue"]
    assert queue["committed"] > 0
    assert queue["rolled_back"] > 0
    assert queue["received"] == queue["committed"] == queue["business_rows"]
    assert (queue["lost"], queue["duplicates"], queue["rolled_back_arrived"]) == (0, 0, 0)
    assert queue["crashes"] == ["transfer-1 died (SIGKILL), restarted"]
    # The restarted daemon's recovery settled what node 2 had committed and node 1 had not marked sent.
    assert any(r.get("sokutatsu.transfer.marked_sent", 0) > 0 for r in queue["recoveries"])


@_runs_the_demo
def test_the_traces_are_analysed_and_everything_stops(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    summary = _summary(demo_run)
    run, folder = demo_run
    report = Path(summary["report"])
    assert report == folder / "out" / "report.html"
    assert report.is_file()
    assert summary["spans"] > 0
    assert (folder / "out" / "loss_audit.csv").is_file()
    assert f"report: {report}" in run.stdout
    logs = folder / "state" / "demo" / "logs"
    services = ["broker-a", "broker-b", "monitor", "queuedb-1", "queuedb-2", "seq-a", "seq-b", "transfer-1"]
    assert sorted(p.stem for p in logs.glob("*.log")) == sorted([*services, "spark"])
    for name in services:
        assert "stopped" in (logs / f"{name}.log").read_text().splitlines()[-1], name
    assert not (folder / "state" / "demo" / "endpoints.json").exists()


# ------------------------------------------------------------- the checks --
# The summary's verdict on results the demo did not get: each failure is named (the demo then exits 1).
def _passing() -> Outcome:
    spec = DeskSpec("desk-quant", prefixes=("1",), mode="migrate")
    desk = DeskResult(
        spec, expected=10, received=10, lost=0, duplicates=0, unexpected=0, brokers=["broker-a"], gaps=0, error=""
    )
    moves = [
        Move("SLOW", "broker-a", "broker-b", 2, 10.0, {}, depth=5, threshold=4),
        Move("RECOVERED", "broker-b", "broker-a", 3, 10.0, {}, depth=0, threshold=4),
    ]
    market = MarketResult(
        60, 800, 100, [desk], "desk-quant", feed_started_ns=0, slow_at_ns=1, fast_at_ns=2, moves=moves
    )
    replicas = [MemberResult(f"replica-{i}", [("a", 1), ("b", 1)], [], "") for i in (1, 2)]
    order = OrderResult({"a": [1], "b": [1]}, replicas, lost=0, duplicates=0, agree=True)
    queue = QueueResult(5, 1, 5, 0, 0, 0, business_rows=5, crashes=["transfer-1 died (SIGKILL), restarted"])
    return Outcome(market=market, order=order, queue=queue, report=Path("report.html"), spans=10)


def test_a_run_with_every_check_met_passes() -> None:
    assert failures(_passing()) == []


def test_a_loss_a_missing_switchover_a_disagreement_or_no_crash_fails_the_demo() -> None:
    lost = _passing()
    assert lost.market is not None
    lost.market.desks[0].lost = 1
    assert failures(lost) == ["desk-quant: lost 1, duplicates 0, outside its filter 0, gaps 0"]
    assert lost.lost == 1

    stayed = _passing()
    assert stayed.market is not None
    stayed.market.moves = stayed.market.moves[:1]
    assert failures(stayed) == ["the monitor never moved desk-quant back"]

    disagree = _passing()
    assert disagree.order is not None
    disagree.order.agree = False
    assert failures(disagree) == ["the replicas disagree on the order"]

    untested = _passing()
    assert untested.queue is not None
    untested.queue.crashes = []
    assert failures(untested) == ["the transfer daemon never crashed: the exactly-once claim was not put to the test"]

    cut_short = _passing()
    cut_short.queue = None
    cut_short.errors.append("queue: the transfer never settled")
    assert failures(cut_short) == ["queue: the transfer never settled", "did not finish: queue"]

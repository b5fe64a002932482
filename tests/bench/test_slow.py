"""The slow-subscriber benchmark's arithmetic, on made-up runs (the benchmark itself is `make bench`)."""

from __future__ import annotations

from sokutatsu.bench.slow import Run, audit, markdown_table, phases, summarize


def test_audit_counts_lost_duplicated_and_reordered_deliveries() -> None:
    assert audit([1, 2, 3, 4], 4) == {"lost": 0, "duplicates": 0, "reordered": 0}
    assert audit([1, 3, 2, 2, 5], 6) == {"lost": 2, "duplicates": 1, "reordered": 1}


def _run(mode: str, latencies: list[float], slow_at: int, reacted: int | None) -> Run:
    n = len(latencies)
    normal = {"seqs": list(range(1, n + 1)), "published_ns": list(range(n)), "latency_ms": latencies, "gaps": 0}
    slow = {"seqs": list(range(1, n + 1)), "gaps": 0}
    return Run(4096, mode, 100, n, slow_at, reacted, normal, slow, {"total_ms": 5.0} if mode == "migrate" else {})


def test_phases_and_ratios_follow_the_seed_tables() -> None:
    # Before the slow-down (published at 0..3) latency 1; flow-to-disk reacts at 6, migrate at 5.
    ftd = _run("flow-to-disk", [1, 1, 1, 1, 20, 30, 50, 50, 50, 50], slow_at=4, reacted=6)
    mig = _run("migrate", [1, 1, 1, 1, 3, 1, 1, 1, 1, 1], slow_at=4, reacted=5)
    assert phases(ftd) == {"before": [1, 1, 1, 1], "during": [20, 30], "after": [50, 50, 50, 50]}
    row = summarize(ftd, mig)
    assert row["ftd_after_mean"] == 50
    assert row["ftd_during_mean"] == 25
    assert row["migrate_after_mean"] == 1
    assert row["mean_ratio"] == 50
    assert row["ftd_worst"] == 50
    assert row["migrate_worst"] == 3
    assert row["worst_ratio"] == round(50 / 3, 1)
    assert row["audit"]["migrate"]["slow"] == {"lost": 0, "duplicates": 0, "reordered": 0, "gaps": 0}
    assert "| 4 KiB | 50" in markdown_table([row])

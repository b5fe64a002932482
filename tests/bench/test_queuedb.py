"""The queue-db benchmark's machinery on a tiny real run against the session's PostgreSQL: pgbench
runs the raw insert and the SDK's own enqueue statement, the SDK phases enqueue, both transfer
modes deliver every preloaded message once with node1's outbox left empty, and remote enqueue
delivers every call's message with durability on both nodes and alternating. The figures themselves
come from `make bench`."""

from __future__ import annotations

import psycopg
import pytest

from sokutatsu.bench.queuedb import QueueDbBenchConfig, run

pytestmark = pytest.mark.timeout(240)
TINY = QueueDbBenchConfig(
    seconds=1,
    concurrency=2,
    transfer_messages=1_500,
    batch=100,
    transfer_batch=200,
    remote_messages=200,
    remote_pgbench_seconds=1,
    remote_callers=(4,),
    remote_runs=1,
)
FIGURES = (
    "pgbench_insert_tps",
    "enqueue_tx_per_s",
    "sdk_enqueue_tx_per_s",
    "enqueue_batch_msgs_per_s",
    "transfer_1pc_msgs_per_s",
    "transfer_2pc_msgs_per_s",
    "alternate_msgs_per_s",
    "both_durable_msgs_per_s",
)


def _bench_databases(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'bench\\_qdb\\_%'").fetchall()
    return [r[0] for r in rows]


@pytest.mark.slow
async def test_a_tiny_run_measures_every_figure_and_transfers_everything(pg_dsn: str) -> None:
    before = _bench_databases(pg_dsn)
    result = await run(TINY, pg_dsn)
    for figure in FIGURES:
        assert isinstance(result[figure], int), figure
        assert result[figure] > 0, figure
    phases = result["phases"]
    assert phases["pgbench_insert"]["failed"] == phases["enqueue_pgbench"]["failed"] == 0
    assert phases["enqueue_pgbench"]["transactions"] > 0
    assert phases["enqueue_batch"]["messages"] % TINY.batch == 0
    for mode in ("1pc", "2pc"):
        transfer = phases[f"transfer_{mode}"]
        assert transfer["received"] == TINY.transfer_messages, mode
        assert transfer["outbox_left"] == 0, mode
        assert transfer["prepared_left"] == 0, mode
        assert transfer["complete"], mode
    assert result["transfers_complete"]
    for durability in ("both", "alternate"):
        remote = phases[f"remote_{durability}_4_1"]
        assert phases[f"remote_{durability}-alone_4_1"]["complete"], durability
        assert remote["health_check_floor"]["calls_per_s"] > 0
        assert remote["received"] == remote["calls"] + remote["warm_up_calls"], durability
        assert remote["complete"], durability
        # Every message was flushed somewhere: node1's enqueue commits, or node2's batches.
        assert remote["node1_flushes_per_msg"] + remote["node2_flushes_per_msg"] > 0, durability
        assert remote["cpu_us_per_call"]["node1_service"] > 0, durability
        assert remote["cpu_us_per_call"]["node1_postgres"] > 0, durability
        assert result["remote_enqueue"]["by_durability"][durability]["4"]["pgbench_tx_per_s"] > 0
        # The runs with each call committed alone are summed up too (they once were left out).
        assert result["remote_enqueue"]["each_call_alone"][durability]["calls_per_s_mean"] > 0, durability
    assert result["remote_enqueue"]["ratios"]["alternate_vs_both_each_call_alone"] > 0
    assert result["remote_enqueue"]["complete"]
    ratios = result["ratios"]
    assert ratios["enqueue_vs_raw"] > 0
    assert ratios["onephase_vs_twophase"] > 0
    assert ratios["alternate_vs_both"] > 0
    assert isinstance(ratios["batch_target_met"], bool)
    assert result["postgres"]["version"]
    assert result["postgres"]["source"] == "given"
    assert result["machine"]["cpus"]
    assert _bench_databases(pg_dsn) == before  # node1 and node2 dropped

"""``sokutatsu bench queue-db``, remote enqueue: ``QueueService.Enqueue`` calls into node 1's queue
that forwards to node 2, durable on both nodes or alternating (seed 001), beside pgbench.

Two embedded clusters of our own (each node its own WAL, so one node's flush does not flush the
other's commits; also with ``SOKUTATSU_PG_DSN``, whose server then holds only the first phases).
For each durability and each number of concurrent callers (``REMOTE_CALLERS``: 1, 16, 128), fresh
processes: node 1's and node 2's queue-db services and node 1's transfer daemon; the callers run in
this process on one channel, each sending single-message ``Enqueue`` calls one after another.

* **calls_per_s**: calls answered per second (the clock from the first call to the last answer),
  and **delivered_msgs_per_s** until node 2 holds every message (checked: exactly all, node 1's
  outbox empty).
* **flushes per message on each node**: ``pg_stat_wal.wal_sync`` over the run (warm-up
  included), read once the processes have stopped (a backend reports its WAL figures at exit).
  Group commit shares one flush among the calls of a group, alternation skips node 1's flush on
  the receiver's turn.
* **CPU per call of each process** (``/proc/<pid>/stat``, user + system): the callers (this
  process), both services, the daemon, and each PostgreSQL cluster (the postmaster, its live
  children, and the children it reaped meanwhile).
* **latency** of the calls (p50, p90, p99), and the **health-check floor**: as many gRPC health
  ``Check`` calls of node 1's service from as many callers right after (no database, no queue-db
  code): what a call costs at the least, its calls/s and CPU per call.
* **each call alone**: at 16 callers, both durabilities again with node 1 committing every call in
  a transaction of its own (``GROUP_COMMIT_MAX_CALLS=1``): one flush per call, as before issue #24
  (a third of the calls).
* **load_average_1m** before and after each run: the machine may be shared.
* **pgbench** on node 1's cluster in the same run, with as many clients as callers: one single-row
  ``INSERT`` of a 256-byte body per transaction, what PostgreSQL itself takes.

``REMOTE_RUNS`` runs of everything, the durabilities interleaved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sokutatsu.bench.common import cpu_sample, started, steal_percent
from sokutatsu.cli.measure import percentile
from sokutatsu.core.embedded_pg import free_port
from sokutatsu.core.tls import open_channel
from sokutatsu.harness import settings
from sokutatsu.harness.process import children
from sokutatsu.harness.queuedb import PREFIXES, SERVICE, QueueDbNode, transfer_daemon
from sokutatsu.queuedb.schema import migrate
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc

if TYPE_CHECKING:
    from sokutatsu.bench.queuedb import QueueDbBenchConfig, Server

REMOTE_CALLERS = (1, 16, 128)
DURABILITIES = ("both", "alternate")
REMOTE_RUNS = 2
ALONE_CALLERS = 16  # the runs with each call committed alone
POLL_SECONDS = 0.05
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Cluster:
    dsn: str
    data_dir: Path | None  # None: a server of SOKUTATSU_PG_DSN (its CPU is not measured)
    server: Server


@contextlib.contextmanager
def remote_clusters(make: Any) -> Iterator[tuple[Cluster, Cluster]]:
    """Two embedded clusters (``make`` is bench_queuedb.postgres), migrated; removed afterwards."""
    with make(None, "embedded") as one, make(None, "embedded") as two:
        for server in (one, two):
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                migrate(conn)
        yield Cluster(one.dsn, one.data_dir, one), Cluster(two.dsn, two.data_dir, two)


def _scalar(dsn: str, query: str, params: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query.encode(), params).fetchone()
    return row[0] if row else None


def wal_syncs(dsn: str) -> int:
    return int(_scalar(dsn, "SELECT wal_sync FROM pg_stat_wal"))


def process_cpu(pid: int, *, reaped: bool = False) -> float:
    """CPU seconds (user + system) of ``pid``; ``reaped``: plus its children it has waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def cluster_cpu(data_dir: Path | None) -> float:
    """CPU seconds of a PostgreSQL cluster: the postmaster, its live children and the ones it reaped."""
    if data_dir is None:
        return 0.0
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return process_cpu(postmaster, reaped=True) + sum(process_cpu(child) for child in children(postmaster))


async def _callers(address: str, queue: str, n: int, size: int, callers: int) -> tuple[float, list[float]]:
    """``n`` single-message Enqueue calls from ``callers`` concurrent callers (``queue`` empty: gRPC
    health ``Check`` calls instead, the server's floor): seconds until all answered, and each call's
    latency in seconds."""
    body = b"x" * size
    left = n
    latencies: list[float] = []
    async with open_channel(address) as channel:
        stub: queuedb_pb2_grpc.QueueServiceAsyncStub = queuedb_pb2_grpc.QueueServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        request = queuedb_pb2.EnqueueRequest(queue=queue, messages=[queuedb_pb2.NewMessage(body=body)])
        check = health_pb2.HealthCheckRequest()

        async def caller() -> None:
            nonlocal left
            clock = time.perf_counter
            while left > 0:
                left -= 1
                start = clock()
                if queue:
                    await stub.Enqueue(request, timeout=60)
                else:
                    await health.Check(check, timeout=60)
                latencies.append(clock() - start)

        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return time.perf_counter() - start, latencies


def _latency_ms(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {f"p{q}": round(percentile(ordered, q / 100) * 1000, 2) for q in (50, 90, 99)}


def calls_for(callers: int, cfg: QueueDbBenchConfig) -> int:
    """Calls per run: ``remote_messages``, a tenth of it for a single caller (one call at a time)."""
    return cfg.remote_messages if callers > 1 else max(100, cfg.remote_messages // 10)


async def measure_remote_enqueue(  # noqa: PLR0917 - the nodes, the run, where to log
    node1: Cluster,
    node2: Cluster,
    durability: str,
    callers: int,
    cfg: QueueDbBenchConfig,
    folder: Path,
    run: int,
    *,
    grouped: bool = True,
) -> dict[str, Any]:
    """Enqueue calls into node 1's queue forwarding to node 2, durable on both or alternating; the clock
    runs until every call is answered, and on until node 2 holds every message. ``grouped=False``:
    node 1 commits each call alone (``GROUP_COMMIT_MAX_CALLS=1``, as before group commit).
    Afterwards, as many gRPC health checks of node 1 from as many callers: the server's floor."""
    n = calls_for(callers, cfg) if grouped else max(100, cfg.remote_messages // 3)
    load_before = os.getloadavg()[0]
    queue = f"remote-{durability}{'' if grouped else '-alone'}-{callers}-{run}"
    run_folder = folder / queue
    run_folder.mkdir()
    rule = queuedb_pb2.TransferRule(
        to_node="node2",
        immediate=True,
        durability=queuedb_pb2.REMOTE_DURABILITY_ALTERNATE
        if durability == "alternate"
        else queuedb_pb2.REMOTE_DURABILITY_BOTH,
    )
    flushes_before = wal_syncs(node1.dsn), wal_syncs(node2.dsn)
    # The receiver's port is chosen now: the daemon, started with the others, names it.
    receiver_address = f"127.0.0.1:{free_port()}"
    receiver = QueueDbNode(
        run_folder, node2.dsn, settings(PREFIXES[SERVICE], instance="node2"), listen=receiver_address, name="node2"
    )
    sender = QueueDbNode(
        run_folder,
        node1.dsn,
        settings(
            PREFIXES[SERVICE], instance="node1", peers="node2", **({} if grouped else {"group_commit_max_calls": "1"})
        ),
        name="node1",
    )
    daemon = transfer_daemon(run_folder, node1.dsn, "node1", f"node2={receiver_address}", name="transfer")
    with started(receiver, sender, daemon):
        async with open_channel(sender.address) as channel:
            stub: queuedb_pb2_grpc.QueueServiceAsyncStub = queuedb_pb2_grpc.QueueServiceStub(channel)
            create = queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name=queue, transfer=rule))
            await stub.CreateQueue(create, timeout=30)
        warm = min(500, n // 10)
        await _callers(sender.address, queue, warm, cfg.size, callers)
        pids = {
            "callers": os.getpid(),
            "node1_service": sender.pid,
            "node2_service": receiver.pid,
            "transfer_daemon": daemon.pid,
        }

        def cpu_now() -> dict[str, float]:
            now = {name: process_cpu(pid) for name, pid in pids.items()}
            now["node1_postgres"] = cluster_cpu(node1.data_dir)
            now["node2_postgres"] = cluster_cpu(node2.data_dir)
            return now

        before, cpu_before = cpu_sample(), cpu_now()
        seconds, latencies = await _callers(sender.address, queue, n, cfg.size, callers)
        cpu_after = cpu_now()
        answered = time.perf_counter()
        deadline = answered + max(60.0, n / 500)
        while True:
            received = int(_scalar(node2.dsn, "SELECT count(*) FROM sokutatsu.messages WHERE queue = %s", (queue,)))
            if received >= n + warm or time.perf_counter() > deadline:
                break
            await asyncio.sleep(POLL_SECONDS)
        delivered = time.perf_counter() - answered + seconds
        steal = steal_percent(before, cpu_sample())
        outbox = outbox_drained(node1.dsn)
        floor_before = process_cpu(sender.pid), process_cpu(os.getpid())
        floor_seconds, floor_latencies = await _callers(sender.address, "", n, cfg.size, callers)
        floor_cpu = [
            round((process_cpu(pid) - b) / n * 1e6)
            for pid, b in zip((sender.pid, os.getpid()), floor_before, strict=True)
        ]
    # Read once the services have stopped: a backend reports its WAL statistics when it exits.
    flushes = [wal_syncs(c.dsn) - b for c, b in zip((node1, node2), flushes_before, strict=True)]
    cpu_us = {name: round((cpu_after[name] - cpu_before[name]) / n * 1e6) for name in cpu_after}
    return {
        "durability": durability,
        "grouped": grouped,
        "callers": callers,
        "calls_per_s": round(n / seconds),
        "latency_ms": _latency_ms(latencies),
        "delivered_msgs_per_s": round(n / delivered),
        # WAL flushes (pg_stat_wal.wal_sync) per message on each node, the whole run (warm-up included).
        "node1_flushes_per_msg": round(flushes[0] / (n + warm), 3),
        "node2_flushes_per_msg": round(flushes[1] / (n + warm), 3),
        # CPU per call of each process while the calls ran (the transfer's tail after the last answer not included).
        "cpu_us_per_call": cpu_us,
        "cpu_us_per_call_total": sum(cpu_us.values()),
        "calls": n,
        "warm_up_calls": warm,
        "seconds": round(seconds, 3),
        "received": received,
        "outbox_left": outbox,
        "complete": received == n + warm and outbox == 0,
        "cpu_steal_percent": steal,
        # The machine is shared: its 1-minute load average before and after the run (2 CPUs).
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        # gRPC health checks of node 1, as many from as many callers right after: no database, no
        # queue-db code; what a call costs the server and the callers at the least.
        "health_check_floor": {
            "calls_per_s": round(n / floor_seconds),
            "latency_ms": _latency_ms(floor_latencies),
            "cpu_us_per_call": {"node1_service": floor_cpu[0], "callers": floor_cpu[1]},
        },
    }


def outbox_drained(node1: str, limit: float = 30.0) -> int:
    """node1's outbox count once empty (1pc deletes the last batch just after the receiver's answer)."""
    deadline = time.monotonic() + limit
    while True:
        left = int(_scalar(node1, "SELECT count(*) FROM sokutatsu.outbox"))
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(POLL_SECONDS)


def _mean(values: list[int]) -> int:
    return round(sum(values) / len(values)) if values else 0


def summary(phases: dict[str, dict[str, Any]], pgbench: dict[int, list[int]]) -> dict[str, Any]:
    """Per durability and number of callers: the runs' calls/s and their mean, flushes per message,
    CPU per call (the runs' mean per process), and the ratios to pgbench and between durabilities."""
    table: dict[str, dict[str, Any]] = {}
    for durability in DURABILITIES:
        table[durability] = {}
        for callers in sorted({p["callers"] for p in phases.values()}):
            runs = [
                p for p in phases.values() if p["durability"] == durability and p["callers"] == callers and p["grouped"]
            ]
            if not runs:
                continue
            processes = runs[0]["cpu_us_per_call"].keys()
            table[durability][str(callers)] = {
                "calls_per_s": [r["calls_per_s"] for r in runs],
                "calls_per_s_mean": _mean([r["calls_per_s"] for r in runs]),
                "node1_flushes_per_msg": [r["node1_flushes_per_msg"] for r in runs],
                "node2_flushes_per_msg": [r["node2_flushes_per_msg"] for r in runs],
                "cpu_us_per_call": {p: _mean([r["cpu_us_per_call"][p] for r in runs]) for p in processes},
                "cpu_us_per_call_total": _mean([r["cpu_us_per_call_total"] for r in runs]),
                "latency_ms_p50": [r["latency_ms"]["p50"] for r in runs],
                "latency_ms_p99": [r["latency_ms"]["p99"] for r in runs],
                "health_check_floor_calls_per_s": _mean([r["health_check_floor"]["calls_per_s"] for r in runs]),
                "health_check_floor_cpu_us_per_call": {
                    p: _mean([r["health_check_floor"]["cpu_us_per_call"][p] for r in runs])
                    for p in ("node1_service", "callers")
                },
                "pgbench_tx_per_s": _mean(pgbench.get(callers, [])),
                "vs_pgbench": _ratio(_mean([r["calls_per_s"] for r in runs]), _mean(pgbench.get(callers, []))),
            }
    ratios = {
        f"alternate_vs_both_{c}": _ratio(
            table["alternate"].get(str(c), {}).get("calls_per_s_mean"),
            table["both"].get(str(c), {}).get("calls_per_s_mean"),
        )
        for c in sorted({p["callers"] for p in phases.values()})
    }
    alone: dict[str, Any] = {}
    for durability in DURABILITIES:
        runs = [p for p in phases.values() if p["durability"] == durability and not p["grouped"]]
        if runs:
            alone[durability] = {
                "callers": runs[0]["callers"],
                "calls_per_s": [r["calls_per_s"] for r in runs],
                "calls_per_s_mean": _mean([r["calls_per_s"] for r in runs]),
                "node1_flushes_per_msg": [r["node1_flushes_per_msg"] for r in runs],
                "node2_flushes_per_msg": [r["node2_flushes_per_msg"] for r in runs],
                "cpu_us_per_call_total": _mean([r["cpu_us_per_call_total"] for r in runs]),
            }
    if len(alone) == len(DURABILITIES):
        ratios["alternate_vs_both_each_call_alone"] = _ratio(
            alone["alternate"]["calls_per_s_mean"], alone["both"]["calls_per_s_mean"]
        )
    return {
        "by_durability": table,
        # Each call committed alone on node 1 (GROUP_COMMIT_MAX_CALLS=1): one flush per call, as before issue #24.
        "each_call_alone": alone,
        "ratios": ratios,
        "pgbench_tx_per_s": {str(c): v for c, v in pgbench.items()},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None

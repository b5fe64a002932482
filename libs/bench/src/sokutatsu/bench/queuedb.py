"""``sokutatsu bench queue-db``: enqueue in the application's database, and transfer between two nodes.

Every figure comes from one run on one PostgreSQL cluster with the same settings (default
durability: ``synchronous_commit`` as the server has it, on by default): an embedded cluster
of our own, or the server of ``SOKUTATSU_PG_DSN``. Two fresh databases, node1 and node2,
migrated, dropped at the end.

* **pgbench_insert_tps**: ``pgbench`` (the cluster's own) with ``concurrency`` clients, one
  single-row ``INSERT`` of a ``size``-byte body into a plain table per transaction.
* **enqueue_tx_per_s**: the same pgbench, clients and duration, running the exact statement of
  the SDK's ``enqueue`` (one message, a local queue) per transaction: the database-side cost of
  enqueue against a raw insert, client overhead equal.
* **sdk_enqueue_tx_per_s**: the Python SDK's ``enqueue_async`` from ``concurrency`` asyncio
  connections in this process, one message per transaction (autocommit: the statement is the
  transaction, as in pgbench): what the Python client adds.
* **enqueue_batch_msgs_per_s**: ``enqueue_batch_async`` of ``batch`` messages per transaction
  from ``concurrency`` asyncio connections.
* **transfer_1pc/2pc_msgs_per_s**: ``transfer_messages`` preloaded into a forwarding queue on
  node1; node2's queue-db service and node1's transfer daemon (each its own process) started;
  the clock runs from the daemon's start (it has announced its address: the interpreter's
  start-up of about a second is left out; ``msgs_per_s_from_launch`` includes it) until
  node2 holds them all, polled every 50 ms. Completeness is checked
  (exactly N at node2, node1's outbox empty). The tables of both nodes are emptied between modes.
  Also measured with batches of ``SMALL_BATCH`` (10) and, between two sites, with batches of
  ``WAN_BATCH`` (100) through a relay that delays every byte ``WAN_ONE_WAY_MS`` (5 ms) each way
  (``bench_link.delayed_link``), each with a tenth of the messages.

* **remote enqueue** (``bench_queuedb_remote``): ``QueueService.Enqueue`` calls from 1, 16 and 128
  concurrent callers into node1's queue forwarding to node2, durable on both nodes or alternating
  (seed 001), each node on a cluster of its own, with WAL flushes per message per node, CPU per call
  of every process, and pgbench's single-row insert on node1's cluster with as many clients, in the
  same run. ``alternate_msgs_per_s`` / ``both_durable_msgs_per_s`` are the 16-caller means.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sokutatsu.bench import queuedb_remote as remote
from sokutatsu.bench.common import cpu_sample, started, steal_percent
from sokutatsu.bench.link import delayed_link
from sokutatsu.cli.measure import machine
from sokutatsu.core.dsn import create_database, database_dsn
from sokutatsu.core.embedded_pg import EmbeddedPostgres, find_bindir
from sokutatsu.harness import settings
from sokutatsu.harness.queuedb import DAEMON, PREFIXES, SERVICE, QueueDbNode, transfer_daemon
from sokutatsu.queuedb.enqueue import (
    _ENQUEUE_LOCAL,
    Message,
    enqueue_async,
    enqueue_batch,
    enqueue_batch_async,
)
from sokutatsu.queuedb.schema import migrate

LOCAL_QUEUE = "bench"
FORWARD_QUEUE, TO_QUEUE = "orders", "inbox"
POLL_SECONDS = 0.05
TARGETS = {
    "enqueue_vs_raw": 0.8,
    "batch_msgs_per_s": 50_000,
    "onephase_vs_twophase": 2.0,
    "alternate_vs_both": 1.3,  # issue #24, at 16 and 128 callers
    "remote_calls_per_s_16": 10_000,  # issue #24, durable on both, 16 callers
    "remote_vs_pgbench_16": 0.5,
}
SERVER_SETTINGS = (
    "synchronous_commit",
    "fsync",
    "wal_level",
    "shared_buffers",
    "max_wal_size",
    "max_prepared_transactions",
    "max_connections",
)


@dataclass
class QueueDbBenchConfig:
    seconds: int  # per throughput phase (pgbench takes whole seconds)
    concurrency: int  # pgbench clients, asyncio connections
    transfer_messages: int  # preloaded per transfer mode
    remote_messages: int = 0  # Enqueue calls per remote-enqueue run (a fifth with one caller)
    remote_pgbench_seconds: int = 5  # pgbench beside the remote runs, per number of clients
    remote_callers: tuple[int, ...] = remote.REMOTE_CALLERS  # concurrent Enqueue callers, one run each
    remote_runs: int = remote.REMOTE_RUNS  # runs of everything, the durabilities interleaved
    batch: int = 1_000  # messages per enqueue_batch transaction
    transfer_batch: int = 1_000  # SOKUTATSU_TRANSFER_BATCH
    size: int = 256  # body bytes


# Messages per batch of the small-batch transfer runs (a tenth of the messages).
SMALL_BATCH = 10
# The inter-site runs: a relay delays every byte between the nodes this long each way (a
# 10 ms round trip, two sites in one region), batches of WAN_BATCH, a tenth of the messages.
WAN_ONE_WAY_MS = 5.0
WAN_BATCH = 100

QUICK = QueueDbBenchConfig(
    seconds=3, concurrency=8, transfer_messages=20_000, remote_messages=3_000, remote_pgbench_seconds=2
)
FULL = QueueDbBenchConfig(
    seconds=20, concurrency=8, transfer_messages=200_000, remote_messages=10_000, remote_pgbench_seconds=10
)


# ---------------------------------------------------------------- the server --
@dataclass
class Server:
    dsn: str  # superuser
    source: str  # "embedded", "SOKUTATSU_PG_DSN" or "given"
    bindir: Path  # where pgbench is
    data_dir: Path | None = None  # an embedded cluster's


@contextlib.contextmanager
def postgres(server_dsn: str | None, source: str) -> Iterator[Server]:
    """The given server, or an embedded cluster in a folder under /tmp (removed afterwards)."""
    if server_dsn:
        yield Server(server_dsn, source, find_bindir())
        return
    # Under /tmp, reachable by all: as root the cluster runs as the postgres user.
    folder = Path(tempfile.mkdtemp(prefix="sokutatsu-bench-qdb-pg-"))
    folder.chmod(0o755)
    try:
        with EmbeddedPostgres(folder / "data") as pg:
            yield Server(pg.dsn, "embedded", pg.bindir, pg.data_dir)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def node_databases(server: str, names: tuple[str, ...]) -> Iterator[dict[str, str]]:
    """Fresh databases (suffix ``_<name>``) with the queue-db schema; dropped afterwards."""
    run_id = uuid.uuid4().hex[:8]
    made = {name: f"bench_qdb_{run_id}_{name}" for name in names}
    dsns: dict[str, str] = {}
    try:
        for name, database in made.items():
            create_database(server, database)
            dsns[name] = database_dsn(server, database)
            with psycopg.connect(dsns[name], autocommit=True) as conn:
                migrate(conn)
        yield dsns
    finally:
        for dsn in dsns.values():
            _rollback_prepared(dsn)
        with psycopg.connect(server, autocommit=True) as conn:
            for database in made.values():
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))


def _rollback_prepared(dsn: str) -> None:
    """Prepared transactions (2PC) left in the database keep it from being dropped."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall():
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def _execute(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())


def _scalar(dsn: str, query: str, params: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query.encode(), params).fetchone()
    return row[0] if row else None


def _settle(dsn: str) -> None:
    """A checkpoint before a phase, so each starts without the previous one's dirty pages."""
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        contextlib.suppress(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("CHECKPOINT")


def server_facts(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        facts = {
            name: str(row[0])
            if (row := conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone())
            else None
            for name in ("server_version", *SERVER_SETTINGS)
        }
    return {"version": facts.pop("server_version"), "settings": facts}


# ------------------------------------------------------------------ pgbench --
def _pgbench_connection(dsn: str) -> tuple[str, dict[str, str]]:
    """pgbench's connection string, without the password (given in PGPASSWORD, not on the command line)."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    env = dict(os.environ)
    if password := params.pop("password", None):
        env["PGPASSWORD"] = password
    return make_conninfo("", **params), env


def enqueue_script(body: str) -> Script:
    """The statement the SDK's ``enqueue`` runs for one message to a local queue, for pgbench
    (one message of ``body``), and its -D variables.

    Each ``%(name)s`` of the SDK's statement becomes a pgbench variable, or a literal where pgbench
    cannot pass the value (NULL). A placeholder this does not know fails here rather than
    measuring another statement."""
    variables = {"queue": LOCAL_QUEUE, "body": body}
    literals = {"headers": "NULL", "key": "''"}  # pgbench -D cannot give an empty value

    def replace(match: re.Match[str]) -> str:
        name = match[1]
        if name in literals:
            return literals[name]
        if name in variables:
            return f":{name}"
        raise RuntimeError(f"the SDK's enqueue statement has a parameter {name!r} this benchmark does not know")

    return Script("enqueue", re.sub(r"%\((\w+)\)s", replace, _ENQUEUE_LOCAL).strip() + ";\n", variables)


@dataclass
class Script:
    """A pgbench custom script: one transaction, and the variables it uses (``-D name=value``)."""

    name: str
    text: str
    variables: dict[str, str]


def raw_insert_script(body: str) -> Script:
    return Script("raw-insert", "INSERT INTO bench_raw (body) VALUES (:body);\n", {"body": body})


async def pgbench(server: Server, dsn: str, script: Script, cfg: QueueDbBenchConfig, folder: Path) -> dict[str, Any]:
    """Run ``script`` with pgbench: ``concurrency`` clients and threads, ``seconds``, prepared statements."""
    name = script.name
    path = folder / f"{name}.sql"
    path.write_text(script.text)
    connection, env = _pgbench_connection(dsn)
    binary = server.bindir / "pgbench"
    if not binary.is_file():
        raise RuntimeError(f"no pgbench in {server.bindir} (it comes with the PostgreSQL server binaries)")
    defines = [arg for k, v in script.variables.items() for arg in ("-D", f"{k}={v}")]
    c = str(cfg.concurrency)
    args = ["-n", "-M", "prepared", "-c", c, "-j", c, "-T", str(cfg.seconds), "-f", str(path), *defines, connection]
    process = await asyncio.create_subprocess_exec(
        str(binary), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    text = out.decode(errors="replace")
    tps = re.search(
        r"^tps = ([\d.]+) \((?:without initial connection time|excluding connections establishing)\)", text, re.M
    )
    if process.returncode != 0 or tps is None:
        said = (err.decode(errors="replace") or text).strip().splitlines()[-5:]
        raise RuntimeError(f"pgbench ({name}) failed with status {process.returncode}: {' / '.join(said)}")
    processed = re.search(r"number of transactions actually processed: (\d+)", text)
    failed = re.search(r"number of failed transactions: (\d+)", text)
    latency = re.search(r"latency average = ([\d.]+) ms", text)
    return {
        "tx_per_s": round(float(tps[1])),
        "transactions": int(processed[1]) if processed else None,
        "failed": int(failed[1]) if failed else 0,
        "latency_avg_ms": float(latency[1]) if latency else None,
        "clients": cfg.concurrency,
        "seconds": cfg.seconds,
    }


# -------------------------------------------------------------- SDK clients --
async def _clients(
    dsn: str, cfg: QueueDbBenchConfig, step: Callable[[psycopg.AsyncConnection[Any]], Awaitable[int]]
) -> tuple[int, int, float]:
    """``step`` in a loop on each of ``concurrency`` autocommit connections for ``seconds``:
    (calls, messages, seconds from the start to the last call's end)."""
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(cfg.concurrency)]
    calls = messages = 0
    try:
        start = time.perf_counter()
        stop = start + cfg.seconds

        async def loop(conn: psycopg.AsyncConnection[Any]) -> float:
            nonlocal calls, messages
            end = time.perf_counter()
            while end < stop:
                got = await step(conn)  # awaited first: `messages += await ...` would lose other loops' counts
                messages += got
                calls += 1
                end = time.perf_counter()
            return end

        ends = await asyncio.gather(*(loop(conn) for conn in conns))
    finally:
        for conn in conns:
            await conn.close()
    return calls, messages, max(ends) - start


async def sdk_enqueue(dsn: str, cfg: QueueDbBenchConfig) -> dict[str, Any]:
    body = b"x" * cfg.size

    async def one(conn: psycopg.AsyncConnection[Any]) -> int:
        await enqueue_async(conn, LOCAL_QUEUE, body)
        return 1

    calls, _, seconds = await _clients(dsn, cfg, one)
    return {"tx_per_s": round(calls / seconds), "transactions": calls, "seconds": round(seconds, 3)}


async def sdk_enqueue_batch(dsn: str, cfg: QueueDbBenchConfig) -> dict[str, Any]:
    messages = [Message(b"x" * cfg.size)] * cfg.batch

    async def batch(conn: psycopg.AsyncConnection[Any]) -> int:
        return len(await enqueue_batch_async(conn, LOCAL_QUEUE, messages))

    calls, sent, seconds = await _clients(dsn, cfg, batch)
    return {
        "msgs_per_s": round(sent / seconds),
        "tx_per_s": round(calls / seconds, 1),
        "batch": cfg.batch,
        "messages": sent,
        "seconds": round(seconds, 3),
    }


# ----------------------------------------------------------------- transfer --
def preload(node1: str, cfg: QueueDbBenchConfig) -> None:
    """``transfer_messages`` into node1's forwarding queue, ``batch`` per transaction, then vacuumed."""
    body = b"x" * cfg.size
    left = cfg.transfer_messages
    with psycopg.connect(node1, autocommit=True) as conn:
        while left > 0:
            count = min(cfg.batch, left)
            with conn.transaction():
                enqueue_batch(conn, FORWARD_QUEUE, [Message(body)] * count)
            left -= count
        conn.execute("VACUUM (ANALYZE) sokutatsu.outbox")


def reset_transfer(node1: str, node2: str) -> None:
    """Both nodes' transfer tables empty, cursors and recovery rows gone: each mode starts alike."""
    _execute(
        node1,
        "TRUNCATE sokutatsu.outbox, sokutatsu.messages RESTART IDENTITY",
        "DELETE FROM sokutatsu.transfer_out",
        "DELETE FROM sokutatsu.twopc_decisions",
    )
    _execute(node2, "TRUNCATE sokutatsu.messages RESTART IDENTITY", "DELETE FROM sokutatsu.transfer_in")


def _wait_received(node2: str, expected: int, daemon_alive: Callable[[], bool], limit: float) -> float:
    """perf_counter() at the first poll that saw ``expected`` messages at node2.

    ``max(seq)`` is cheap (the identity restarts at 1 for each mode and only grows, so it is never
    below the count); the exact ``count(*)`` runs only once it is reached."""
    deadline = time.perf_counter() + limit
    with psycopg.connect(node2, autocommit=True) as conn:
        while True:
            seen = time.perf_counter()
            row = conn.execute("SELECT coalesce(max(seq), 0) FROM sokutatsu.messages").fetchone()
            if row and row[0] >= expected:
                row = conn.execute("SELECT count(*) FROM sokutatsu.messages").fetchone()
                if row and row[0] >= expected:
                    return seen
            if not daemon_alive():
                raise RuntimeError("the transfer daemon exited before every message arrived")
            if seen > deadline:
                raise RuntimeError(f"node2 did not receive {expected:,} messages within {limit:g}s")
            time.sleep(POLL_SECONDS)


def measure_transfer(  # noqa: PLR0917 - the two nodes, the protocol, the sizes, where, and the link
    node1: str, node2: str, mode: str, cfg: QueueDbBenchConfig, folder: Path, one_way_ms: float = 0.0
) -> dict[str, Any]:
    reset_transfer(node1, node2)
    preload(node1, cfg)
    _settle(node1)
    n = cfg.transfer_messages
    run_folder = folder / f"transfer-{mode}-{cfg.transfer_batch}-{one_way_ms:g}ms"
    run_folder.mkdir()
    limit = max(120.0, n / 500)
    receiver = QueueDbNode(run_folder, node2, settings(PREFIXES[SERVICE], instance="node2"), name="node2")
    with started(receiver), delayed_link(receiver.address, one_way_ms) as link:
        before = cpu_sample()
        launched = time.perf_counter()
        tuning = settings(PREFIXES[DAEMON], mode=mode, batch=str(cfg.transfer_batch))
        daemon = transfer_daemon(run_folder, node1, "node1", f"node2={link}", tuning, name="node1")
        with started(daemon):
            # The clock starts when the daemon is up (its announcement), not at the interpreter's launch:
            # its transfer loop starts as it begins serving; what arrived before that is reported.
            start = time.perf_counter()
            early = int(_scalar(node2, "SELECT coalesce(max(seq), 0) FROM sokutatsu.messages"))
            done = _wait_received(node2, n, daemon.alive, limit)
            steal = steal_percent(before, cpu_sample())
            outbox = remote.outbox_drained(node1)
    received = int(_scalar(node2, "SELECT count(*) FROM sokutatsu.messages"))
    to_inbox = int(_scalar(node2, "SELECT count(*) FROM sokutatsu.messages WHERE queue = %s", (TO_QUEUE,)))
    prepared = int(_scalar(node2, "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")) + int(
        _scalar(node1, "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")
    )
    seconds = done - start
    return {
        "mode": mode,
        "msgs_per_s": round(n / seconds),
        "messages": n,
        "batch": cfg.transfer_batch,
        "link_one_way_ms": one_way_ms,
        "seconds": round(seconds, 3),
        # From the daemon's launch (python start-up and imports included), for comparison.
        "daemon_start_s": round(start - launched, 3),
        "msgs_per_s_from_launch": round(n / (done - launched)),
        # Messages node2 held (at most) when the clock started: ~0 if the clock started with the transfer.
        "received_at_start": early,
        "received": received,
        "outbox_left": outbox,
        "prepared_left": prepared,
        "complete": received == n == to_inbox and outbox == 0 and prepared == 0,
        "cpu_steal_percent": steal,
    }


# ---------------------------------------------------------------------- run --
async def _phase(measure: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    before = cpu_sample()
    row = await measure
    row["cpu_steal_percent"] = steal_percent(before, cpu_sample())
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


async def measure_remote(cfg: QueueDbBenchConfig, folder: Path) -> dict[str, dict[str, Any]]:
    """Remote enqueue (bench_queuedb_remote): pgbench and the calls, per number of callers, both
    durabilities interleaved, ``REMOTE_RUNS`` times."""
    phases: dict[str, dict[str, Any]] = {}
    with remote.remote_clusters(postgres) as (node1, node2):
        with psycopg.connect(node1.dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE bench_raw (id bigserial PRIMARY KEY, body bytea, created_at timestamptz DEFAULT now())"
            )
        body = "x" * cfg.size
        for run in range(1, cfg.remote_runs + 1):
            for callers in cfg.remote_callers:
                _execute(node1.dsn, "TRUNCATE bench_raw RESTART IDENTITY")
                _settle(node1.dsn)
                clients = replace(cfg, concurrency=callers, seconds=cfg.remote_pgbench_seconds)
                phases[f"remote_pgbench_{callers}_{run}"] = await _phase(
                    pgbench(node1.server, node1.dsn, raw_insert_script(body), clients, folder)
                )
                for durability in remote.DURABILITIES:
                    _settle(node1.dsn)
                    phases[f"remote_{durability}_{callers}_{run}"] = await remote.measure_remote_enqueue(
                        node1, node2, durability, callers, cfg, folder, run
                    )
            alone = remote.ALONE_CALLERS if remote.ALONE_CALLERS in cfg.remote_callers else cfg.remote_callers[0]
            for durability in remote.DURABILITIES:
                _settle(node1.dsn)
                phases[f"remote_{durability}-alone_{alone}_{run}"] = await remote.measure_remote_enqueue(
                    node1, node2, durability, alone, cfg, folder, run, grouped=False
                )
    return phases


async def measure(cfg: QueueDbBenchConfig, server: Server, folder: Path) -> dict[str, Any]:
    phases: dict[str, dict[str, Any]] = {}
    with node_databases(server.dsn, ("node1", "node2")) as nodes:
        node1, node2 = nodes["node1"], nodes["node2"]
        with psycopg.connect(node1, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE bench_raw (id bigserial PRIMARY KEY, body bytea, created_at timestamptz DEFAULT now())"
            )
            conn.execute("INSERT INTO sokutatsu.queues (name) VALUES (%s)", (LOCAL_QUEUE,))
            conn.execute(
                "INSERT INTO sokutatsu.queues (name, to_node, to_queue) VALUES (%s, 'node2', %s)",
                (FORWARD_QUEUE, TO_QUEUE),
            )
        body = "x" * cfg.size  # bytea escape format: these characters are the bytes
        empty_local = "TRUNCATE sokutatsu.messages RESTART IDENTITY"

        _execute(node1, "TRUNCATE bench_raw RESTART IDENTITY")
        _settle(node1)
        phases["pgbench_insert"] = await _phase(pgbench(server, node1, raw_insert_script(body), cfg, folder))
        script = enqueue_script(body)
        _execute(node1, "TRUNCATE bench_raw RESTART IDENTITY", empty_local)
        _settle(node1)
        phases["enqueue_pgbench"] = await _phase(pgbench(server, node1, script, cfg, folder))
        phases["enqueue_pgbench"]["statement"] = script.text
        _execute(node1, empty_local)
        _settle(node1)
        phases["sdk_enqueue"] = await _phase(sdk_enqueue(node1, cfg))
        _execute(node1, empty_local)
        _settle(node1)
        phases["enqueue_batch"] = await _phase(sdk_enqueue_batch(node1, cfg))
        for mode in ("1pc", "2pc"):
            phases[f"transfer_{mode}"] = measure_transfer(node1, node2, mode, cfg, folder)
        # Small batches: the per-batch protocol cost (commits and round trips) shows; seed 004
        # transfers message by message.
        small = replace(cfg, transfer_batch=SMALL_BATCH, transfer_messages=cfg.transfer_messages // 10)
        for mode in ("1pc", "2pc"):
            phases[f"transfer_{mode}_small_batch"] = measure_transfer(node1, node2, mode, small, folder)
        # Between two sites: every round trip between the nodes costs WAN_ONE_WAY_MS each way.
        wan = replace(cfg, transfer_batch=WAN_BATCH, transfer_messages=cfg.transfer_messages // 10)
        for mode in ("1pc", "2pc"):
            phases[f"transfer_{mode}_wan"] = measure_transfer(node1, node2, mode, wan, folder, WAN_ONE_WAY_MS)
    phases.update(await measure_remote(cfg, folder))
    return phases


def _remote_result(phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The remote-enqueue figures: per durability and callers, ratios, and issue #24's targets."""
    runs = {k: p for k, p in phases.items() if k.startswith("remote_") and "durability" in p}
    pgbench_runs: dict[int, list[int]] = {}
    for key, p in phases.items():
        if key.startswith("remote_pgbench_"):
            pgbench_runs.setdefault(p["clients"], []).append(p["tx_per_s"])
    table = remote.summary(runs, pgbench_runs)
    both16 = table["by_durability"]["both"].get("16", {})
    ratios = table["ratios"]
    ratios["both_16_vs_pgbench"] = both16.get("vs_pgbench")
    ratios["both_16_calls_per_s_target"] = TARGETS["remote_calls_per_s_16"]
    ratios["both_16_calls_per_s_met"] = (both16.get("calls_per_s_mean") or 0) >= TARGETS["remote_calls_per_s_16"]
    ratios["both_16_vs_pgbench_target"] = TARGETS["remote_vs_pgbench_16"]
    ratios["both_16_vs_pgbench_met"] = (both16.get("vs_pgbench") or 0) >= TARGETS["remote_vs_pgbench_16"]
    ratios["alternate_vs_both_target"] = TARGETS["alternate_vs_both"]
    ratios["alternate_vs_both_met"] = all(
        (ratios.get(f"alternate_vs_both_{c}") or 0) >= TARGETS["alternate_vs_both"] for c in (16, 128)
    )
    return {
        **table,
        "complete": all(p["complete"] for p in runs.values()),
        "setup": (
            "two embedded PostgreSQL clusters (node1, node2) on loopback; per run, fresh processes: the queue-db "
            "services of both nodes and node1's transfer daemon; the callers in the benchmark's process on one "
            "gRPC channel, one single-message Enqueue at a time each; pgbench -M prepared on node1's cluster with "
            "as many clients as callers, just before"
        ),
    }


async def run(
    cfg: QueueDbBenchConfig, server_dsn: str | None = None, source: str = "given", only: str = "all"
) -> dict[str, Any]:
    """The whole benchmark: on ``server_dsn`` (a superuser DSN) if given, else on an embedded cluster.
    ``only="remote"``: the remote-enqueue section alone."""
    load_at_start = round(os.getloadavg()[0], 2)
    if only == "remote":
        with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-qdb-") as tmp:
            phases = await measure_remote(cfg, Path(tmp))
        return {
            "benchmark": "queue-db",
            "only": "remote",
            "remote_enqueue": _remote_result(phases),
            "phases": phases,
            "config": asdict(cfg),
            "machine": machine(),
            "load_average_1m": [load_at_start, round(os.getloadavg()[0], 2)],
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    with (
        tempfile.TemporaryDirectory(prefix="sokutatsu-bench-qdb-") as tmp,
        postgres(server_dsn, source) as server,
    ):
        facts = server_facts(server.dsn)
        if int(facts["settings"].get("max_prepared_transactions") or 0) == 0:
            raise RuntimeError("this PostgreSQL has max_prepared_transactions = 0: the 2PC baseline needs it above 0")
        phases = await measure(cfg, server, Path(tmp))
    raw = phases["pgbench_insert"]["tx_per_s"]
    enqueue = phases["enqueue_pgbench"]["tx_per_s"]
    batch = phases["enqueue_batch"]["msgs_per_s"]
    one, two = phases["transfer_1pc"]["msgs_per_s"], phases["transfer_2pc"]["msgs_per_s"]
    one_small = phases["transfer_1pc_small_batch"]["msgs_per_s"]
    two_small = phases["transfer_2pc_small_batch"]["msgs_per_s"]
    one_wan, two_wan = phases["transfer_1pc_wan"]["msgs_per_s"], phases["transfer_2pc_wan"]["msgs_per_s"]
    ratios: dict[str, Any] = {
        "enqueue_vs_raw": _ratio(enqueue, raw),
        "enqueue_vs_raw_target": TARGETS["enqueue_vs_raw"],
        "batch_target_msgs_per_s": TARGETS["batch_msgs_per_s"],
        "batch_target_met": batch >= TARGETS["batch_msgs_per_s"],
        "onephase_vs_twophase": _ratio(one, two),
        "onephase_vs_twophase_target": TARGETS["onephase_vs_twophase"],
        "onephase_vs_twophase_small_batch": _ratio(one_small, two_small),
        "onephase_vs_twophase_wan": _ratio(one_wan, two_wan),
        "enqueue_vs_raw_met": (_ratio(enqueue, raw) or 0) >= TARGETS["enqueue_vs_raw"],
    }
    ratios["onephase_vs_twophase_met"] = (ratios["onephase_vs_twophase"] or 0) >= TARGETS["onephase_vs_twophase"]
    remote_result = _remote_result(phases)
    by = remote_result["by_durability"]
    at = "16" if "16" in by["both"] else next(iter(by["both"]), "16")  # 16 callers, as issue #24 asks
    both = by["both"].get(at, {}).get("calls_per_s_mean")
    alternate = by["alternate"].get(at, {}).get("calls_per_s_mean")
    ratios.update(remote_result["ratios"])
    ratios["alternate_vs_both"] = _ratio(alternate, both)
    return {
        "benchmark": "queue-db",
        "pgbench_insert_tps": raw,
        "enqueue_tx_per_s": enqueue,
        "sdk_enqueue_tx_per_s": phases["sdk_enqueue"]["tx_per_s"],
        "enqueue_batch_msgs_per_s": batch,
        "transfer_1pc_msgs_per_s": one,
        "transfer_2pc_msgs_per_s": two,
        "transfer_small_batch": {"batch": SMALL_BATCH, "1pc_msgs_per_s": one_small, "2pc_msgs_per_s": two_small},
        "transfer_wan": {
            "batch": WAN_BATCH,
            "link_one_way_ms": WAN_ONE_WAY_MS,
            "1pc_msgs_per_s": one_wan,
            "2pc_msgs_per_s": two_wan,
        },
        # Remote enqueue, 16 callers, the runs' mean (remote_enqueue has 1, 16 and 128).
        "remote_callers_in_headline": int(at),
        "alternate_msgs_per_s": alternate,
        "both_durable_msgs_per_s": both,
        "remote_enqueue": remote_result,
        "ratios": ratios,
        "transfers_complete": all(p["complete"] for k, p in phases.items() if k.startswith("transfer_"))
        and remote_result["complete"],
        "phases": phases,
        "config": asdict(cfg),
        "postgres": {**facts, "source": server.source, "pgbench": str(server.bindir / "pgbench")},
        "setup": (
            f"one PostgreSQL cluster, two databases (node1, node2), all on loopback; pgbench -M prepared with "
            f"{cfg.concurrency} clients/threads; SDK phases: {cfg.concurrency} psycopg AsyncConnections in one "
            "process, autocommit (one statement per transaction); transfer: queue-db service on node2 and "
            "transfer daemon on node1, each its own process; remote enqueue: " + remote_result["setup"]
        ),
        "machine": machine(),
        # The machine may be shared: its 1-minute load average at the start and the end (2 CPUs here).
        "load_average_1m": [load_at_start, round(os.getloadavg()[0], 2)],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

"""``sokutatsu bench fanout``: one feed, many subscribers, each with its key filter (issue 23).

One publisher (in this process, asyncio) publishes ``rate`` msgs/s of ``size`` bytes, paced every
millisecond, with keys cycling over ``KEYS`` market keys (:mod:`sokutatsu.bench.fanout_clients`);
every publish is acknowledged (Sokutatsu: by both brokers of the pair; NATS: by JetStream, file
storage). ``N`` durable subscribers run in consumer processes of their own
(:mod:`sokutatsu.bench.fanout_consumer`): one process for N = 1, else ``ceil(N / PER_PROCESS)``
and at least two (2 for N <= 64, 8 for N = 256), every delivery acknowledged. Unfiltered: every
subscriber takes every key. Filtered: each takes one key group, about 1/16 of the keys.

For each (system, N, filtered): deliveries/s against offered (``rate`` times the matching
subscribers), from the first publish to the last delivery; p50/p99/max latency (receive time
minus publish time, one clock; histogram buckets of 1 %); lost (a wanted message skipped and
never delivered), duplicates, reordered, unexpected (outside the filter) and undelivered (still
owed when the subscribers were told to stop, ``drain_seconds`` after the last publish was
acknowledged); the publisher's achieved rate (messages handed over per second: below ``rate``
when acknowledgements held it back); the servers' CPU (``/proc/<pid>/stat``, from the first
publish to the end) per 1,000 deliveries: both brokers of the pair and the active one alone,
or nats-server; the load average and CPU steal around it. Sokutatsu gets a fresh broker pair and
monitor per scenario (as ``bench peers``); NATS, a fresh stream on 127.0.0.1:4222 (skipped when
nothing answers there); nats-push-r3, a fresh cluster of three nats-server processes per scenario
(:func:`nats_cluster`) with the stream on all three.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sokutatsu.bench.common import cpu_sample, pair_with_monitor, steal_percent
from sokutatsu.bench.fanout_clients import REPLICAS, SYSTEMS, cleanup_nats, key_of, prepare_nats, sender
from sokutatsu.bench.fanout_consumer import bucket_ms
from sokutatsu.bench.fanout_profile import Recording, start_recording
from sokutatsu.bench.peers_clients import make_body
from sokutatsu.bench.queuedb_remote import process_cpu
from sokutatsu.cli.children import child_process, child_result, tell
from sokutatsu.cli.measure import machine
from sokutatsu.core.embedded_pg import free_port
from sokutatsu.harness.broker import Pair, stats

PER_PROCESS = 32
# A publisher held back by acknowledgements stops after this many times its planned time.
HELD_FACTOR = 3
NATS_PORT = 4222


@dataclass(frozen=True)
class FanoutConfig:
    counts: tuple[int, ...]  # N subscribers, one scenario each (unfiltered and filtered)
    rate: int  # msgs/s published
    seconds: float  # of publishing per scenario
    drain_seconds: float  # after the last publish is acknowledged, at most this long for the rest
    size: int = 256
    filters: tuple[bool, ...] = (False, True)
    # SOKUTATSU_BROKER_DELIVERY_WORKERS of both brokers, one Sokutatsu scenario each (0: none).
    delivery_workers: tuple[int, ...] = (0,)
    # The Sokutatsu publisher's ``linger`` in milliseconds, one Sokutatsu scenario each (None: the SDK's default).
    linger_ms: tuple[float | None, ...] = (None,)


QUICK = FanoutConfig(counts=(1, 16), rate=2000, seconds=3.0, drain_seconds=5.0)
FULL = FanoutConfig(counts=(1, 4, 16, 64, 256), rate=2000, seconds=8.0, drain_seconds=10.0)


def processes_for(n: int) -> int:
    return 1 if n == 1 else max(2, math.ceil(n / PER_PROCESS))


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each consumer process's subscribers."""
    out, first = [], 0
    for part in range(parts):
        count = n // parts + (1 if part < n % parts else 0)
        out.append((first, count))
        first += count
    return out


# ------------------------------------------------------------------- servers --
@dataclass
class Servers:
    addresses: list[str]
    pids: dict[str, int]  # the server processes whose CPU is measured
    active: int | None  # the process to profile
    pair: Pair | None = None
    standby: int | None = None  # profiled too: it stores every message as the active does


def nats_pid() -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() == "nats-server":
                    return int(entry.name)
    return None


CLUSTER = 3  # nats-push-r3's servers


def cluster_config(index: int, ports: Sequence[tuple[int, int]], folder: Path) -> str:
    """nats-server's configuration for server ``index`` (0-based) of a JetStream cluster on loopback whose
    servers listen on ``ports`` (client port, cluster port each), its store under ``folder``."""
    client, route = ports[index]
    routes = ", ".join(f"nats-route://127.0.0.1:{r}" for _, r in ports)
    return (
        f"server_name: n{index + 1}\n"
        f"listen: 127.0.0.1:{client}\n"
        f'jetstream {{ store_dir: "{folder / f"js{index + 1}"}" }}\n'
        f"cluster {{\n  name: sokutatsu-bench\n  listen: 127.0.0.1:{route}\n  routes: [{routes}]\n}}\n"
    )


@contextlib.contextmanager
def nats_cluster() -> Iterator[tuple[list[str], dict[str, int]]]:
    """Three nats-server processes (``nats-server`` on PATH) in one JetStream cluster on loopback, each
    with its own store in a throw-away folder: their client URLs and pids; stopped on exit."""
    import shutil  # noqa: PLC0415
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    binary = shutil.which("nats-server")
    if binary is None:
        raise RuntimeError("nats-server is not on PATH")
    free: set[int] = set()
    while len(free) < 2 * CLUSTER:
        free.add(free_port())  # below the ephemeral range: no outgoing connection takes it meanwhile
    chosen = sorted(free)
    ports = [(chosen[2 * i], chosen[2 * i + 1]) for i in range(CLUSTER)]
    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-nats-") as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []

        def stop() -> None:
            for proc in procs:  # all at once, then each waited for
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

        stack.callback(stop)
        for i in range(CLUSTER):
            conf = folder / f"n{i + 1}.conf"
            conf.write_text(cluster_config(i, ports, folder))
            log = stack.enter_context((folder / f"n{i + 1}.log").open("wb"))
            procs.append(subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT))  # noqa: S603

        def failed() -> RuntimeError:
            # The folder goes with this context: the logs' ends go in the error.
            tails = [
                f"n{i + 1}: " + (folder / f"n{i + 1}.log").read_text(errors="replace")[-600:] for i in range(CLUSTER)
            ]
            return RuntimeError("the NATS cluster did not start:\n" + "\n".join(tails))

        deadline = time.monotonic() + 30
        for client, _ in ports:
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", client), timeout=1):
                        break
                except OSError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        raise failed() from None
                    time.sleep(0.1)
        time.sleep(0.5)  # a server opens its client port before its route port: one that fails there exits
        if any(p.poll() is not None for p in procs):
            raise failed()
        yield [f"nats://127.0.0.1:{c}" for c, _ in ports], {f"nats-n{i + 1}": p.pid for i, p in enumerate(procs)}


@contextlib.contextmanager
def servers(system: str, workers: int = 0) -> Iterator[Servers]:
    if system == "nats-push-r3":
        with nats_cluster() as (urls, pids):
            yield Servers(urls, pids, None)
        return
    if system != "sokutatsu":
        pid = nats_pid()
        yield Servers([], {"nats-server": pid} if pid else {}, pid)
        return
    with (
        tempfile.TemporaryDirectory(prefix="sokutatsu-bench-fanout-") as tmp,
        pair_with_monitor(Path(tmp), broker={"delivery_workers": str(workers)}) as pair,
    ):
        pids = {"broker-a": pair.active.pid, "broker-b": pair.standby.pid}
        yield Servers(pair.addresses, pids, pair.active.pid, pair, pair.standby.pid)


async def add_workers(where: Servers) -> None:
    """The delivery workers of both brokers, measured as ``broker-a-worker-<i>`` and so on."""
    if where.pair is None:
        return
    for name, broker in (("broker-a", where.pair.active), ("broker-b", where.pair.standby)):
        for worker in (await stats(broker.address)).delivery_workers:
            where.pids[f"{name}-worker-{worker.index}"] = worker.pid


def reachable(system: str) -> str | None:
    """None when the system can be measured, else why not."""
    if system == "sokutatsu":
        return None
    if system == "nats-push-r3":
        import shutil  # noqa: PLC0415

        return None if shutil.which("nats-server") else "nats-server is not on PATH (the bench starts its cluster)"
    import socket  # noqa: PLC0415

    try:
        with socket.create_connection(("127.0.0.1", NATS_PORT), timeout=2):
            return None
    except OSError as exc:
        return f"nothing answers on 127.0.0.1:{NATS_PORT} ({exc.strerror or exc})"


# ------------------------------------------------------------------ scenario --
@dataclass
class Published:
    start_ns: int = 0
    handed_ns: int = 0  # the last message handed over
    sent: int = 0
    acked_ns: int = 0  # every message acknowledged
    frames_per_link: float | None = None  # publish frames written on each broker's stream (Sokutatsu)


async def publish(
    system: str, addresses: Sequence[str], cfg: FanoutConfig, total: int, linger_ms: float | None = None
) -> Published:
    """Up to ``total`` messages at ``cfg.rate``; stops early once ``HELD_FACTOR`` times the planned
    time has passed (acknowledgements holding the publisher back): ``sent`` says how many went."""
    out = Published()
    async with sender(system, addresses, linger_ms) as send:
        out.start_ns = time.time_ns()
        start = time.perf_counter()
        sent = 0
        while sent < total:
            elapsed = time.perf_counter() - start
            if elapsed > HELD_FACTOR * cfg.seconds:
                break
            due = min(total, int(elapsed * cfg.rate) + 1)
            while sent < due:
                sent += 1
                await send.send(key_of(sent), make_body(sent, cfg.size))
            await asyncio.sleep(0.001)
        out.handed_ns = time.time_ns()
        out.sent = sent
        await send.flush()
        out.acked_ns = time.time_ns()
        frames = send.frames
        out.frames_per_link = None if frames is None else frames / len(addresses)
    return out


@dataclass
class Run:
    """What one scenario measured, before it is reduced to figures."""

    system: str
    n: int
    filtered: bool
    total: int
    processes: int
    workers: int = 0
    linger_ms: float | None = None  # the Sokutatsu publisher's (None: the SDK's default)
    published: Published = field(default_factory=Published)
    got: list[dict[str, Any]] = field(default_factory=list)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    end_ns: int = 0
    load: tuple[float, float] = (0.0, 0.0)
    steal: float | None = None
    profile: str | None = None
    profile_standby: str | None = None
    # With delivery workers: the frames the active's core sent its workers, and the writes they took.
    link: dict[str, int] = field(default_factory=dict)


async def scenario(
    system: str,
    n: int,
    filtered: bool,
    cfg: FanoutConfig,
    profile_dir: Path | None = None,
    *,
    workers: int = 0,
    linger_ms: float | None = None,
) -> dict[str, Any]:
    total = int(cfg.rate * cfg.seconds)
    run = Run(system, n, filtered, total, processes_for(n), workers, linger_ms)
    load_before = os.getloadavg()[0]
    steal_before = cpu_sample()
    with servers(system, workers) as where:
        if where.pair is not None:
            await where.pair.wait_paired()  # the standby caught up: no start-up in the figures
            await add_workers(where)
        else:
            await prepare_nats(where.addresses, REPLICAS[system])
        try:
            await _measure(run, where, cfg, profile_dir)
        finally:
            if system != "sokutatsu":
                await cleanup_nats(where.addresses)
    run.load = (round(load_before, 2), round(os.getloadavg()[0], 2))
    run.steal = steal_percent(steal_before, cpu_sample())
    return figures(run, cfg)


async def _measure(run: Run, where: Servers, cfg: FanoutConfig, profile_dir: Path | None) -> None:
    addresses = ",".join(where.addresses)
    async with contextlib.AsyncExitStack() as stack:

        async def consumer(first: int, count: int) -> asyncio.subprocess.Process:
            return await stack.enter_async_context(
                child_process(
                    "sokutatsu.bench.fanout_consumer",
                    run.system,
                    addresses,
                    str(run.total),
                    "1" if run.filtered else "0",
                    str(first),
                    str(count),
                    what=f"{run.system} consumer of subscribers {first}..{first + count - 1}",
                )
            )

        procs = await asyncio.gather(*(consumer(f, c) for f, c in split(run.n, run.processes)))
        limit = (HELD_FACTOR + 1) * cfg.seconds + cfg.drain_seconds + 300
        results = [asyncio.create_task(child_result(p, limit)) for p in procs]
        before = {name: process_cpu(pid) for name, pid in where.pids.items()}
        recording: Recording | None = None
        standby: Recording | None = None
        if profile_dir is not None and where.active is not None:
            label = f"{run.system}-{run.n}-{'filtered' if run.filtered else 'every-key'}"
            label += f"-{run.workers}-workers" if run.workers else ""
            label += f"-linger-{run.linger_ms:g}-ms" if run.linger_ms is not None else ""
            if where.standby is None:
                recording = await start_recording(where.active, cfg.seconds, profile_dir / f"{label}.txt")
            else:  # started together: both record the same seconds
                recording, standby = await asyncio.gather(
                    start_recording(where.active, cfg.seconds, profile_dir / f"{label}.txt"),
                    start_recording(where.standby, cfg.seconds, profile_dir / f"{label}-standby.txt"),
                )
        run.published = await publish(run.system, where.addresses, cfg, run.total, run.linger_ms)
        if run.published.sent < run.total:
            run.total = run.published.sent
            for proc in procs:
                await tell(proc, f"total {run.total}")
        _, pending = await asyncio.wait(results, timeout=cfg.drain_seconds)
        if pending:
            for proc in procs:
                with contextlib.suppress(OSError, RuntimeError):  # a process that already ended
                    await tell(proc, "stop")
        run.got = [await r for r in results]
        run.end_ns = time.time_ns()
        run.cpu_seconds = {name: process_cpu(pid) - before[name] for name, pid in where.pids.items()}
        if run.workers and where.pair is not None:
            workers = (await stats(where.pair.active.address)).delivery_workers
            run.link = {"frames": sum(w.link_frames for w in workers), "writes": sum(w.link_writes for w in workers)}
        if recording is not None:
            run.profile = await recording.finish()
        if standby is not None:
            run.profile_standby = await standby.finish()


# ------------------------------------------------------------------- figures --
def percentile_of(histogram: Counter[int], fraction: float) -> float | None:
    count = sum(histogram.values())
    if not count:
        return None
    rank = max(1, math.ceil(fraction * count))
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= rank:
            return round(bucket_ms(bucket), 3)
    return None  # not reached: the counts add up to count


def figures(run: Run, cfg: FanoutConfig) -> dict[str, Any]:
    subs = [s for g in run.got for s in g["subscribers"]]
    histogram: Counter[int] = Counter()
    for g in run.got:
        histogram.update({int(b): n for b, n in g["histogram"].items()})
    wanted = sum(s["wanted"] for s in subs)
    received = sum(s["received"] for s in subs)
    last_ns = max((s["done_ns"] for s in subs), default=0)
    seconds = (last_ns - run.published.start_ns) / 1e9 if last_ns else 0.0
    offered = cfg.rate * wanted / run.total
    per_s = received / seconds if seconds > 0 else 0.0
    counts = {k: sum(s[k] for s in subs) for k in ("lost", "duplicates", "reordered", "unexpected", "undelivered")}
    broker_cpu = sum(run.cpu_seconds.values())
    # The active broker alone (one nats-server is all of NATS; of a cluster none is "the active": None).
    active: float | None = run.cpu_seconds.get("broker-a", None if run.system == "nats-push-r3" else broker_cpu)
    thousands = received / 1000
    per_worker = [
        round(1000 * run.cpu_seconds[f"broker-a-worker-{i}"] / thousands, 2) if thousands else None
        for i in range(run.workers)
        if f"broker-a-worker-{i}" in run.cpu_seconds
    ]
    max_ns = max((g["max_latency_ns"] for g in run.got), default=0)
    return {
        "system": run.system,
        **({"delivery_workers": run.workers} if run.system == "sokutatsu" else {}),
        **({"publisher_linger_ms": run.linger_ms} if run.linger_ms is not None else {}),
        "subscribers": run.n,
        "filtered": run.filtered,
        "consumer_processes": run.processes,
        "published": run.total,
        "planned": int(cfg.rate * cfg.seconds),  # more than published: the publisher was stopped (HELD_FACTOR)
        "offered_deliveries": wanted,
        "offered_deliveries_per_s": round(offered),
        "deliveries": received,
        "deliveries_per_s": round(per_s),
        "delivered_percent_of_offered": round(100 * per_s / offered, 1) if offered else None,
        "p50_ms": percentile_of(histogram, 0.50),
        "p99_ms": percentile_of(histogram, 0.99),
        "max_ms": round(max_ns / 1e6, 3) if received else None,
        **counts,
        "complete": counts["lost"] == counts["undelivered"] == counts["duplicates"] == counts["reordered"] == 0,
        "publish_msgs_per_s": _rate(run.total, run.published.start_ns, run.published.handed_ns),
        "publish_acked_msgs_per_s": _rate(run.total, run.published.start_ns, run.published.acked_ns),
        # Frames per second on each broker's publish stream (the SDK's links; not known for NATS).
        "publish_frames_per_s_per_link": (
            None
            if run.published.frames_per_link is None
            else _rate(round(run.published.frames_per_link), run.published.start_ns, run.published.acked_ns)
        ),
        "publisher_held_below_rate": _rate(run.total, run.published.start_ns, run.published.handed_ns)
        < 0.95 * cfg.rate,
        "seconds_to_last_delivery": round(seconds, 3),
        "broker_cpu_seconds": {k: round(v, 2) for k, v in run.cpu_seconds.items()},
        "broker_cpu_ms_per_1000_deliveries": round(1000 * broker_cpu / thousands, 2) if thousands else None,
        # The active broker's own process (with delivery workers: the core), then each of its workers.
        "active_cpu_ms_per_1000_deliveries": round(1000 * active / thousands, 2)
        if thousands and active is not None
        else None,
        **({"active_worker_cpu_ms_per_1000_deliveries": per_worker} if run.workers else {}),
        **({"active_link_frames_and_writes": run.link} if run.link else {}),
        "told_to_stop": any(g["told_to_stop"] for g in run.got),
        "load_average_1m": {"before": run.load[0], "after": run.load[1]},
        "cpu_steal_percent": run.steal,
        **({"profile": run.profile} if run.profile else {}),
        **({"profile_standby": run.profile_standby} if run.profile_standby else {}),
    }


def _rate(count: int, start_ns: int, end_ns: int) -> int:
    return round(count / ((end_ns - start_ns) / 1e9)) if end_ns > start_ns else 0


async def measure(
    cfg: FanoutConfig,
    systems: Sequence[str] = SYSTEMS,
    say: Callable[[str], object] = print,
    profile: tuple[Path, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Every scenario of every system that answers; ``profile``: (folder, N values) at which the
    active Sokutatsu broker and its standby are recorded with py-spy while the publisher runs."""
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    started = time.gmtime()
    for system in systems:
        missing = reachable(system)
        if missing:
            say(f"{system}: skipped, {missing}")
            skipped[system] = missing
            continue
        for n in cfg.counts:
            for filtered in cfg.filters:
                sokutatsu = system == "sokutatsu"
                for workers, linger_ms in itertools.product(
                    cfg.delivery_workers if sokutatsu else (0,), cfg.linger_ms if sokutatsu else (None,)
                ):
                    extra = f", {workers} delivery workers" if workers else ""
                    extra += f", publisher linger {linger_ms:g} ms" if linger_ms is not None else ""
                    say(f"{system}: N={n} {'filtered' if filtered else 'every key'}{extra} ...")
                    folder = profile[0] if profile and sokutatsu and n in profile[1] else None
                    try:
                        row = await scenario(system, n, filtered, cfg, folder, workers=workers, linger_ms=linger_ms)
                    except Exception as exc:  # noqa: BLE001 - one failing scenario must not hide the others
                        row = {
                            "system": system,
                            **({"delivery_workers": workers} if sokutatsu else {}),
                            **({"publisher_linger_ms": linger_ms} if linger_ms is not None else {}),
                            "subscribers": n,
                            "filtered": filtered,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    say(f"  {_line(row)}")
                    rows.append(row)
    return {
        "benchmark": "fanout",
        "rows": rows,
        "skipped": skipped,
        "ratios": ratios(rows),
        "table": markdown_table(rows, skipped),
        "setup": (
            f"one publisher at {cfg.rate:,} msgs/s of {cfg.size} B for {cfg.seconds:g}s (paced every ms; stopped after "
            f"{HELD_FACTOR * cfg.seconds:g}s when acknowledgements held it back; keys cycle "
            "over 300, filtered subscribers take one group of ~1/16 of them by prefix); N durable subscribers over "
            f"ceil(N/{PER_PROCESS}) consumer processes (one for N=1, at least two otherwise); every publish and "
            f"delivery acknowledged; subscribers told to stop {cfg.drain_seconds:g}s after the last publish was "
            "acknowledged. Sokutatsu: a fresh broker pair and monitor per scenario, SDK Publisher (acked by both) "
            "and durable Subscribers (prefix filter) sharing one SubscribeMany stream per broker per process; "
            "NATS: nats-py, JetStream file storage, publish_async, one "
            "durable consumer per subscriber (push to a callback, or pull in batches of 100), one connection per "
            "consumer process, max_ack_pending 1000; nats-push-r3: push consumers on a cluster of three "
            "nats-server processes started for the scenario, the stream replicated on all three. Broker CPU: "
            "/proc/<pid>/stat of both brokers (or nats-server, or the three of nats-push-r3) "
            "from the first publish to the end; with delivery workers, the brokers' workers too, and the active's "
            "core and each of its workers apart (`core / workers` column)."
        ),
        "config": {**cfg.__dict__, "per_process": PER_PROCESS},
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", started),
    }


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    workers = row.get("active_worker_cpu_ms_per_1000_deliveries")
    split_cpu = f" (core {row['active_cpu_ms_per_1000_deliveries']}, workers {workers})" if workers else ""
    return (
        f"{row['deliveries_per_s']:,} of {row['offered_deliveries_per_s']:,} deliveries/s "
        f"({row['delivered_percent_of_offered']} %), p50 {row['p50_ms']} p99 {row['p99_ms']} max {row['max_ms']} ms, "
        f"lost {row['lost']} dup {row['duplicates']} undelivered {row['undelivered']}, "
        f"publisher {row['publish_msgs_per_s']:,} msgs/s{_frames(row)}, "
        f"broker CPU {row['broker_cpu_ms_per_1000_deliveries']} ms/1000{split_cpu}, "
        f"load {row['load_average_1m']['before']}"
    )


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per (N, filter) and Sokutatsu variant: Sokutatsu's figures over NATS's, from this one run.
    The label names the variant when it is not Sokutatsu as it comes: ``64-filtered-1-workers-vs-nats-push``,
    ``64-filtered-linger-2-ms-vs-nats-push``."""
    found: dict[str, Any] = {}
    peers = {(r["system"], r["subscribers"], r["filtered"]): r for r in rows if "error" not in r}
    for ours in rows:
        if ours["system"] != "sokutatsu" or "error" in ours:
            continue
        n, filtered = ours["subscribers"], ours["filtered"]
        variant = f"-{ours['delivery_workers']}-workers" if ours.get("delivery_workers") else ""
        variant += f"-linger-{ours['publisher_linger_ms']:g}-ms" if "publisher_linger_ms" in ours else ""
        for peer in SYSTEMS[1:]:
            theirs = peers.get((peer, n, filtered))
            if theirs is None:
                continue
            label = f"{n}-{'filtered' if filtered else 'every-key'}{variant}-vs-{peer}"
            found[label] = {
                "deliveries_per_s_sokutatsu_over_peer": _div(ours["deliveries_per_s"], theirs["deliveries_per_s"]),
                "p50_sokutatsu_over_peer": _div(ours["p50_ms"], theirs["p50_ms"]),
                "p99_sokutatsu_over_peer": _div(ours["p99_ms"], theirs["p99_ms"]),
                "cpu_per_1000_sokutatsu_over_peer": _div(
                    ours["broker_cpu_ms_per_1000_deliveries"], theirs["broker_cpu_ms_per_1000_deliveries"]
                ),
            }
    return found


def _div(top: float | None, bottom: float | None) -> float | None:
    """``top / bottom`` to three significant digits (latency ratios span orders of magnitude)."""
    if top is None or not bottom:
        return None
    ratio = top / bottom
    return float(f"{ratio:.3g}")


def _system_label(r: dict[str, Any]) -> str:
    """The system of a row, with its delivery workers and publisher linger when set."""
    system = str(r["system"]) + (f", {r['delivery_workers']} workers" if r.get("delivery_workers") else "")
    return system + (f", linger {r['publisher_linger_ms']:g} ms" if "publisher_linger_ms" in r else "")


def _frames(row: dict[str, Any]) -> str:
    frames = row.get("publish_frames_per_s_per_link")
    return "" if frames is None else f" in {frames:,} frames/s"


def markdown_table(rows: Sequence[dict[str, Any]], skipped: dict[str, str]) -> str:
    lines = [
        "| system | N | filter | procs | deliveries/s of offered | p50 / p99 / max ms | lost / dup / reord / undeliv "
        "| publisher msgs/s | broker CPU ms per 1,000 (active) | active: core / workers | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {_system_label(r)} | {r['subscribers']} | {'1/16 keys' if r['filtered'] else 'every key'} "
        if "error" in r:
            lines.append(head + f"| | error: {r['error']} | | | | | | |")
            continue
        workers = r.get("active_worker_cpu_ms_per_1000_deliveries")
        split_cpu = f"{r['active_cpu_ms_per_1000_deliveries']} / {', '.join(map(str, workers))}" if workers else ""
        active = r["active_cpu_ms_per_1000_deliveries"]  # None: a cluster, none of whose servers is "the" active
        lines.append(
            head + f"| {r['consumer_processes']} "
            f"| {r['deliveries_per_s']:,} of {r['offered_deliveries_per_s']:,} ({r['delivered_percent_of_offered']} %) "
            f"| {r['p50_ms']} / {r['p99_ms']} / {r['max_ms']} "
            f"| {r['lost']} / {r['duplicates']} / {r['reordered']} / {r['undelivered']} "
            f"| {r['publish_msgs_per_s']:,}{_frames(r)} | {r['broker_cpu_ms_per_1000_deliveries']} "
            f"({'no single active' if active is None else active}) | {split_cpu} | {r['load_average_1m']['before']} |"
        )
    lines.extend(f"| {system} | skipped: {why} | | | | | | | | | |" for system, why in skipped.items())
    return "\n".join(lines)


def p99_plot(result: dict[str, Any], path: Path) -> Path:
    """p99 latency against N, one line per system and filter (log scales)."""
    import matplotlib  # noqa: PLC0415 - only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in result["rows"]:
        if r.get("p99_ms") is not None:
            label = f"{_system_label(r)}, {'1/16 keys' if r['filtered'] else 'every key'}"
            series.setdefault(label, []).append((r["subscribers"], r["p99_ms"]))
    for label, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, "o-" if "every" in label else "s--", label=label, linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("subscribers (N)")
    ax.set_ylabel("p99 latency, ms")
    ax.set_title(f"bench fanout: p99 against N ({result['config']['rate']:,} msgs/s of {result['config']['size']} B)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

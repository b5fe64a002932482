"""The market-data part of ``sokutatsu demo``.

A feed publishes ticks for a few hundred symbols to the broker pair at a steady rate.
Desks subscribe with symbol filters, in two processes of their own
(:mod:`sokutatsu.demo.subscribers`): the normal desks in one, the desk that turns
slow in the other. Partway through, the slow desk drops to a trickle; the monitor sees its
queue pass its threshold and moves it to the standby (seed 000's four steps); then it
catches up, and the monitor moves it back. Everything is measured here: each desk's
received sequence numbers against what the feed sent for its filter (lost, duplicates),
the monitor's switchover records, the brokers each desk was served by, and the normal
desks' publish-to-receive latency in each phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sokutatsu.cli.children import child_process, child_result, tell
from sokutatsu.cli.measure import percentile
from sokutatsu.client import BufferFull, Publisher
from sokutatsu.core.tls import client_config, open_channel
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc

TOPIC = "ticks"
SLOW = monitor_pb2.SWITCHOVER_REASON_SLOW
RECOVERED = monitor_pb2.SWITCHOVER_REASON_RECOVERED
STEP_NAMES = {
    monitor_pb2.SWITCHOVER_STEP_POSITION: "position",
    monitor_pb2.SWITCHOVER_STEP_ACCEPT: "accept",
    monitor_pb2.SWITCHOVER_STEP_REDIRECT: "redirect",
    monitor_pb2.SWITCHOVER_STEP_RELEASE: "release",
}
STATUS_EVERY_SECONDS = 3.0
SYMBOLS_SEED, FEED_SEED = 9, 10
# The feed's first second (connections opening, first batches) is left out of the latency phases.
WARM_UP_NS = 1_000_000_000
Progress = Callable[[str], None]


@dataclass(frozen=True)
class MarketConfig:
    symbols: int
    rate: int  # ticks per second
    warm_seconds: float  # before the slow desk slows down
    hold_seconds: float  # on the standby, still slow
    tail_seconds: float  # after it is back on the active
    move_limit_seconds: float  # the longest wait for each move
    slow_budget: int  # the slow desk's queue memory budget, bytes
    slow_rate: float  # what the slow desk consumes per second while slow


@dataclass(frozen=True)
class DeskSpec:
    id: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    mode: str | None = None
    budget: int = 0
    slow_rate: float = 0.0

    def matches(self, key: str) -> bool:
        """The broker's filter: exact keys or prefixes; none = every key."""
        if not self.keys and not self.prefixes:
            return True
        return key in self.keys or key.startswith(self.prefixes)

    def describe(self) -> str:
        parts = [f"prefixes {','.join(self.prefixes)}"] if self.prefixes else []
        parts += [f"{len(self.keys)} symbols"] if self.keys else []
        return " + ".join(parts) or "every symbol"


def make_symbols(n: int, rng: random.Random) -> list[str]:
    """``n`` Tokyo-style tickers (``7203.T``), sorted."""
    return [f"{code}.T" for code in sorted(rng.sample(range(1300, 10000), n))]


def make_desks(symbols: list[str], cfg: MarketConfig) -> tuple[list[DeskSpec], DeskSpec]:
    """The normal desks and the one that turns slow."""
    normal = [
        DeskSpec("desk-autos", prefixes=("6", "7")),
        DeskSpec("desk-banks", prefixes=("8",)),
        DeskSpec("desk-watchlist", keys=tuple(symbols[:: max(1, len(symbols) // 12)][:12])),
    ]
    slow = DeskSpec(
        "desk-quant",
        prefixes=("1", "2", "3", "4", "5"),
        mode="migrate",
        budget=cfg.slow_budget,
        slow_rate=cfg.slow_rate,
    )
    return normal, slow


@dataclass
class DeskResult:
    spec: DeskSpec
    expected: int
    received: int
    lost: int
    duplicates: int
    unexpected: int
    brokers: list[str]
    gaps: int
    error: str


@dataclass
class Move:
    reason: str
    from_broker: str
    to_broker: str
    started_ns: int
    total_ms: float
    steps_ms: dict[str, float]
    depth: int
    threshold: int


@dataclass
class MarketResult:
    symbols: int
    rate: int
    sent: int
    desks: list[DeskResult]
    slow_desk: str
    feed_started_ns: int
    slow_at_ns: int
    fast_at_ns: int
    moves: list[Move]
    # Normal desks' latency percentiles (ms) by the phase the message was published in.
    latency: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return sum(d.lost for d in self.desks)

    @property
    def duplicates(self) -> int:
        return sum(d.duplicates for d in self.desks)

    def move(self, reason: str) -> Move | None:
        return next((m for m in self.moves if m.reason == reason), None)


# --------------------------------------------------------------------- feed --
@dataclass
class Feed:
    """Ticks at ``rate`` per second until stopped; ``keys[i]`` is the symbol of sequence number i + 1."""

    brokers: list[str]
    symbols: list[str]
    rate: int
    rng: random.Random
    keys: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        prices = {s: 500.0 + self.rng.random() * 5000 for s in self.symbols}
        async with Publisher(self.brokers, "feed", ack_timeout=120, config=client_config()) as pub:
            start = time.perf_counter()
            while not self.stop.is_set():
                due = int((time.perf_counter() - start) * self.rate) + 1
                while len(self.keys) < due:
                    symbol = self.rng.choice(self.symbols)
                    prices[symbol] = round(max(1.0, prices[symbol] + self.rng.gauss(0, 1)), 1)
                    body = f"{symbol} {prices[symbol]:.1f} x{self.rng.randrange(1, 50) * 100}".encode()
                    try:
                        seq = pub.publish_nowait(TOPIC, symbol, body)
                    except BufferFull:
                        await pub.wait_for_room()
                        continue
                    self.keys.append(symbol)
                    if seq != len(self.keys):  # pragma: no cover - the SDK numbers densely from 1
                        raise RuntimeError(f"feed: sequence number {seq}, expected {len(self.keys)}")
                await asyncio.sleep(0.002)
            await pub.flush()


# ------------------------------------------------------------------ monitor --
def _move(record: monitor_pb2.Switchover) -> Move:
    return Move(
        reason=monitor_pb2.SwitchoverReason.Name(record.reason).removeprefix("SWITCHOVER_REASON_"),
        from_broker=record.from_broker_id,
        to_broker=record.to_broker_id,
        started_ns=record.started_unix_nano,
        total_ms=record.total_micros / 1000,
        steps_ms={STEP_NAMES.get(t.step, str(t.step)): t.duration_micros / 1000 for t in record.steps},
        depth=record.depth,
        threshold=record.threshold,
    )


async def _status(stub: monitor_pb2_grpc.MonitorAsyncStub) -> monitor_pb2.MonitorStatus:
    status: monitor_pb2.MonitorStatus = await stub.GetStatus(
        monitor_pb2.GetStatusRequest(recent_switchovers=100), timeout=10
    )
    return status


def _moves(status: monitor_pb2.MonitorStatus, subscriber_id: str) -> list[Move]:
    done = [s for s in status.recent_switchovers if s.subscriber_id == subscriber_id and s.finished and not s.error]
    return [_move(s) for s in sorted(done, key=lambda s: s.started_unix_nano)]


@dataclass
class Watch:
    """Polls the monitor; says how the slow desk and the feed are doing every few seconds."""

    stub: monitor_pb2_grpc.MonitorAsyncStub
    desk: str
    feed: Feed
    progress: Progress
    said_at: float = 0.0

    async def until_moves(self, n: int, limit: float, what: str) -> list[Move]:
        deadline = time.monotonic() + limit
        while True:
            status = await _status(self.stub)
            moves = _moves(status, self.desk)
            if len(moves) >= n:
                return moves
            if time.monotonic() > deadline:
                raise DemoFailure(f"{what} did not happen within {limit:g} s")
            if time.monotonic() - self.said_at >= STATUS_EVERY_SECONDS:
                self.said_at = time.monotonic()
                self.say(status)
            await asyncio.sleep(0.1)

    def say(self, status: monitor_pb2.MonitorStatus) -> None:
        a = next((x for x in status.assignments if x.subscriber_id == self.desk), None)
        where = f"; {self.desk} on {a.broker_id}, queue {a.depth:,} (threshold {a.threshold:,})" if a else ""
        self.progress(f"market: {len(self.feed.keys):,} ticks sent{where}")


class DemoFailure(Exception):
    """Something the demo waited for did not happen; the message says what."""


# ---------------------------------------------------------------------- run --
def _desk_process(
    brokers: list[str], desks: list[DeskSpec], name: str
) -> contextlib.AbstractAsyncContextManager[asyncio.subprocess.Process]:
    specs = [
        {
            "id": d.id,
            "keys": list(d.keys),
            "prefixes": list(d.prefixes),
            "mode": d.mode,
            "budget": d.budget,
            "slow_rate": d.slow_rate,
        }
        for d in desks
    ]
    return child_process(
        "sokutatsu.demo.subscribers", ",".join(brokers), TOPIC, json.dumps(specs), what=f"{name} process"
    )


@dataclass
class Desks:
    """The desks' processes, subscribed (durable, on both brokers) and connected."""

    symbols: list[str]
    normal: list[DeskSpec]
    slow: DeskSpec
    normal_proc: asyncio.subprocess.Process
    slow_proc: asyncio.subprocess.Process


@contextlib.asynccontextmanager
async def market_desks(cfg: MarketConfig, brokers: list[str], progress: Progress) -> AsyncIterator[Desks]:
    """Start the desks' processes; stopped (killed if need be) on exit.

    Subscribe before the feed publishes: a broker starts a new queue's switchover floor at
    the last number of each publisher of its topic, and a desk that joined later could not be
    moved while such a publisher stayed quiet (docs/demo.md, "Known limits").
    """
    symbols = make_symbols(cfg.symbols, random.Random(SYMBOLS_SEED))  # noqa: S311 - sample data
    normal, slow = make_desks(symbols, cfg)
    for d in (*normal, slow):
        progress(f"market: {d.id} subscribes to {d.describe()}" + (" (will turn slow)" if d is slow else ""))
    async with (
        _desk_process(brokers, normal, "normal desks") as normal_proc,
        _desk_process(brokers, [slow], "slow desk") as slow_proc,
    ):
        yield Desks(symbols, normal, slow, normal_proc, slow_proc)


async def run_market(
    cfg: MarketConfig, desks: Desks, brokers: list[str], monitor: str, progress: Progress
) -> MarketResult:
    normal, slow, slow_proc = desks.normal, desks.slow, desks.slow_proc
    async with open_channel(monitor) as channel:
        feed = Feed(brokers, desks.symbols, cfg.rate, random.Random(FEED_SEED))  # noqa: S311 - sample data
        watch = Watch(monitor_pb2_grpc.MonitorStub(channel), slow.id, feed, progress)
        progress(
            f"market: feed publishing {cfg.rate:,} ticks/s for {len(desks.symbols)} symbols to broker-a + broker-b"
        )
        feed_started = time.time_ns()
        feeding = asyncio.create_task(feed.run())
        try:
            await _sleep_or_fail(cfg.warm_seconds, feeding)
            await tell(slow_proc, "slow")
            slow_at = time.time_ns()
            progress(f"market: {slow.id} turns slow ({cfg.slow_rate:g} ticks/s); waiting for the monitor")
            moved = (await watch.until_moves(1, cfg.move_limit_seconds, f"moving {slow.id} to the standby"))[0]
            progress(
                f"market: monitor moved {slow.id} {moved.from_broker} -> {moved.to_broker} in {moved.total_ms:.1f} ms "
                f"(queue {moved.depth:,} > threshold {moved.threshold:,})"
            )
            await _sleep_or_fail(cfg.hold_seconds, feeding)
            await tell(slow_proc, "fast")
            fast_at = time.time_ns()
            progress(f"market: {slow.id} recovers and catches up; waiting for the monitor to move it back")
            back = (await watch.until_moves(2, cfg.move_limit_seconds, f"moving {slow.id} back"))[1]
            progress(
                f"market: monitor moved {slow.id} {back.from_broker} -> {back.to_broker} in {back.total_ms:.1f} ms"
            )
            await _sleep_or_fail(cfg.tail_seconds, feeding)
        finally:
            feed.stop.set()
        await feeding
        sent = len(feed.keys)
        progress(f"market: feed stopped after {sent:,} ticks, all acknowledged by both brokers; collecting")
        expected = {d.id: sum(1 for k in feed.keys if d.matches(k)) for d in (*normal, slow)}
        await tell(desks.normal_proc, "end " + json.dumps({d.id: expected[d.id] for d in normal}))
        await tell(slow_proc, "end " + json.dumps({slow.id: expected[slow.id]}))
        got = {**await child_result(desks.normal_proc, 120), **await child_result(slow_proc, 120)}
        moves = _moves(await _status(watch.stub), slow.id)
    audits = [_audit(d, feed.keys, got[d.id]) for d in (*normal, slow)]
    result = MarketResult(
        symbols=len(desks.symbols),
        rate=cfg.rate,
        sent=sent,
        desks=audits,
        slow_desk=slow.id,
        feed_started_ns=feed_started,
        slow_at_ns=slow_at,
        fast_at_ns=fast_at,
        moves=moves,
    )
    result.latency = _latency_phases(result, [got[d.id] for d in normal])
    return result


async def _sleep_or_fail(seconds: float, feeding: asyncio.Task[None]) -> None:
    """Sleep, but stop at once if the feed failed."""
    await asyncio.wait([feeding], timeout=seconds)
    if feeding.done():
        feeding.result()  # raises what the feed died of
        raise DemoFailure("the feed stopped by itself")


def _audit(spec: DeskSpec, keys: list[str], got: dict[str, Any]) -> DeskResult:
    wanted = {i + 1 for i, k in enumerate(keys) if spec.matches(k)}
    seqs: list[int] = got["seqs"]
    distinct = set(seqs)
    return DeskResult(
        spec=spec,
        expected=len(wanted),
        received=len(distinct & wanted),
        lost=len(wanted - distinct),
        duplicates=len(seqs) - len(distinct),
        unexpected=len(distinct - wanted),
        brokers=got["brokers"],
        gaps=got["gaps"],
        error=got["error"],
    )


def _latency_phases(result: MarketResult, normal: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """p50/p99/max (ms) of the normal desks' latency, by when each message was published."""
    away, back = result.move("SLOW"), result.move("RECOVERED")
    moved_ns = away.started_ns + int(away.total_ms * 1e6) if away else result.slow_at_ns
    back_ns = back.started_ns + int(back.total_ms * 1e6) if back else result.fast_at_ns
    bounds = [
        ("before", result.feed_started_ns + WARM_UP_NS, result.slow_at_ns),
        ("slow, on active", result.slow_at_ns, moved_ns),
        ("slow one on standby", moved_ns, back_ns),
        ("after its return", back_ns, 2**63),
    ]
    phases: dict[str, list[float]] = {name: [] for name, _, _ in bounds}
    for desk in normal:
        for published, latency in zip(desk["published_ns"], desk["latency_us"], strict=True):
            for name, lo, hi in bounds:
                if lo <= published < hi:
                    phases[name].append(latency / 1000)
                    break
    out = {}
    for name, values in phases.items():
        values.sort()
        if values:
            out[name] = {
                "messages": len(values),
                "p50": round(statistics.median(values), 2),
                "p99": round(percentile(values, 0.99), 2),
                "max": round(values[-1], 2),
            }
    return out

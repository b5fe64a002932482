"""``sokutatsu chaos --sequencers``: kills and pauses of a sequencer group's members, checked.

One schedule: a broker pair and a group of three sequencers (domain a leads, b and c do not),
each started as ``sokutatsu up`` starts it (the launcher's :class:`Suite`; every sequencer on a
port chosen before the start, so a killed one comes back on its port and journal); two
``OrderedPublisher``s per domain and three ``OrderedSubscriber``s in this process. The nemesis
kills (``kill -9``, restarted after the drawn time) or pauses (``SIGSTOP`` … ``SIGCONT``) the
leader or a non-leader for 1 to 30 s, one fault at a time.

The check (pure functions below): every subscriber delivered the identical sequence, every
acknowledged stamp exactly once, nothing else; and per fault and per domain, the *stall after
the restart*: from the moment the sequencer serves again (answers health after a restart, or
``SIGCONT``) to the first delivery of that domain at each subscriber. Measured per domain:
deliveries of the restarted domain would hide the others' stall in an overall gap. The target
(issue #21) is within one distribution interval for the domains that were not faulted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sokutatsu.cli.launcher import Running, Suite
from sokutatsu.cli.topology import SuiteProcess, suite
from sokutatsu.client import OrderedPublisher, OrderedSubscriber
from sokutatsu.core.embedded_pg import free_port
from sokutatsu.core.tls import client_config

TOPIC = "chaos-ordered"
DOMAINS = ("a", "b", "c")
LEADER = "a"
DISTRIBUTION_INTERVAL_MS = 2000
SEQUENCER_SETTINGS = {
    "SOKUTATSU_SEQUENCER_TOPIC": TOPIC,
    "SOKUTATSU_SEQUENCER_DISTRIBUTION_INTERVAL_MS": str(DISTRIBUTION_INTERVAL_MS),
    "SOKUTATSU_SEQUENCER_FILL_AFTER_MS": "1000",
    # Subscribers attach after the group is up, before anything is published.
    "SOKUTATSU_SEQUENCER_FIRST_DISTRIBUTION": "on-demand",
}
READERS = 3
PUBLISHERS_PER_DOMAIN = 2
# After a fault the nemesis waits this long (every domain delivering again) before the next one.
SETTLE_SECONDS = 3.0
DRAIN_LIMIT_SECONDS = 120.0

KILL, PAUSE = "kill", "pause"


@dataclass(frozen=True)
class SequencerFault:
    kind: str  # kill or pause
    domain: str  # whose sequencer (LEADER's is the leader)
    delay: float  # seconds after the previous fault settled
    duration: float  # down or paused this long

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "leader": self.domain == LEADER}


def draw(seed: int, faults: int = 2, longest: float = 30.0) -> list[SequencerFault]:
    """``faults`` faults from ``seed``: leader and non-leader alternate (which first is drawn),
    kill or pause drawn, each down or paused 1 s to ``longest`` s."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible schedule, not security
    leader_first = rng.random() < 0.5
    out = []
    for i in range(faults):
        leader = (i % 2 == 0) == leader_first
        domain = LEADER if leader else rng.choice([d for d in DOMAINS if d != LEADER])
        kind = rng.choice((KILL, PAUSE))
        out.append(SequencerFault(kind, domain, round(rng.uniform(1.0, 3.0), 2), round(rng.uniform(1.0, longest), 2)))
    return out


# ----------------------------------------------------------------- the check --
Delivery = tuple[str, int, float]  # domain, seq, monotonic time of delivery


def stall_after(deliveries: Sequence[Delivery], back_at: float) -> dict[str, float | None]:
    """Per domain: seconds from ``back_at`` to its first delivery at or after it (None: none came)."""
    first: dict[str, float | None] = dict.fromkeys(DOMAINS)
    for domain, _, at in deliveries:
        if at >= back_at and first.get(domain) is None:
            first[domain] = round(at - back_at, 3)
    return first


@dataclass
class Verdict:
    acknowledged: int = 0
    delivered: list[int] = field(default_factory=list)  # per reader
    identical: bool = True
    lost: int = 0
    duplicates: int = 0
    unexpected: int = 0  # delivered, never acknowledged to a publisher


def check(acknowledged: Sequence[tuple[str, int]], readers: Sequence[Sequence[Delivery]]) -> Verdict:
    verdict = Verdict(acknowledged=len(acknowledged), delivered=[len(r) for r in readers])
    orders = [[(d, s) for d, s, _ in r] for r in readers]
    verdict.identical = all(o == orders[0] for o in orders[1:])
    wanted = set(acknowledged)
    for order in orders:
        got = set(order)
        verdict.lost = max(verdict.lost, len(wanted - got))
        verdict.duplicates = max(verdict.duplicates, len(order) - len(got))
        verdict.unexpected = max(verdict.unexpected, len(got - wanted))
    return verdict


# ---------------------------------------------------------------- the group --
class Group:
    """The broker pair and the three sequencers, processes of the launcher's Suite."""

    def __init__(self, folder: Path) -> None:
        self.suite = Suite(folder / "suite", pg_dsn="", fixed_ports=False, grace_seconds=2.0)
        self.specs: dict[str, SuiteProcess] = {}
        self.running: dict[str, Running] = {}
        self._never = asyncio.Event()

    def address(self, name: str) -> str:
        return self.running[name].address

    @property
    def brokers(self) -> list[str]:
        return [self.address("broker-a"), self.address("broker-b")]

    async def start(self) -> None:
        base = {s.name: s for s in suite()}
        ports = {d: free_port() for d in DOMAINS}
        for name in ("broker-a", "broker-b"):
            self.specs[name] = base[name]
        for domain in DOMAINS:
            env = {
                **SEQUENCER_SETTINGS,
                "SOKUTATSU_SEQUENCER_DOMAIN": domain,
                "SOKUTATSU_SEQUENCER_LEADER": "true" if domain == LEADER else "false",
                "SOKUTATSU_SEQUENCER_PEERS": ",".join(f"{d}=127.0.0.1:{p}" for d, p in ports.items() if d != domain),
            }
            self.specs[domain] = replace(
                base["seq-a"],
                name=f"seq-{domain}",
                fixed_port=ports[domain],
                env=env,
                links={"SOKUTATSU_SEQUENCER_BROKERS": "{broker-a},{broker-b}"},
                peer_links={},
                pinned=True,
            )
        for name in ("broker-a", "broker-b", *[d for d in DOMAINS if d != LEADER], LEADER):
            await self.spawn(name)

    async def spawn(self, name: str) -> float:
        """Start ``name`` (again: same port, journal and settings); the monotonic time it serves."""
        running = self.suite.spawn(self.specs[name])
        self.running[name] = running
        await self.suite.wait_ready(running, self._never)
        return time.monotonic()

    async def kill(self, name: str) -> None:
        await self.suite.kill(self.running[name])

    def signal(self, name: str, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.running[name].pid, sig)

    async def stop(self) -> list[tuple[str, int]]:
        return await self.suite.stop()  # a paused member is resumed first


# ---------------------------------------------------------------- the clients --
@dataclass
class Clients:
    readers: list[list[Delivery]] = field(default_factory=list)
    acknowledged: list[tuple[str, int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


async def _read(sub: OrderedSubscriber, into: list[Delivery]) -> None:
    async for message in sub:
        into.append((message.stamp.domain, message.stamp.seq, time.monotonic()))  # noqa: PERF401 - timed as it comes


async def _publish(pub: OrderedPublisher, rate: float, stop: asyncio.Event, clients: Clients) -> None:
    pending: set[asyncio.Future[Any]] = set()

    def done(future: asyncio.Future[Any]) -> None:
        pending.discard(future)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            clients.failures.append(f"{pub.client_id}: {error!r}")
        else:
            stamp = future.result()
            clients.acknowledged.append((stamp.domain, stamp.seq))

    n = 0
    while not stop.is_set():
        future = pub.publish_nowait("k", f"{pub.client_id}:{n}".encode())
        pending.add(future)
        future.add_done_callback(done)
        n += 1
        await asyncio.sleep(1.0 / rate)
    if pending:
        await asyncio.wait(pending, timeout=DRAIN_LIMIT_SECONDS)


# ----------------------------------------------------------------- a schedule --
async def run_schedule(  # noqa: PLR0912, PLR0915 - one schedule from start to verdict, kept in one piece
    seed: int, faults: list[SequencerFault], folder: Path, rate: float, progress: Callable[[str], None]
) -> dict[str, Any]:
    group = Group(folder)
    clients = Clients(readers=[[] for _ in range(READERS)])
    taken: list[dict[str, Any]] = []
    error = ""
    started = time.monotonic()
    subs: list[OrderedSubscriber] = []
    pubs: list[OrderedPublisher] = []
    tasks: list[asyncio.Task[None]] = []
    stop = asyncio.Event()
    try:
        await group.start()
        subs = [OrderedSubscriber(group.brokers, f"reader-{i}", TOPIC, config=client_config()) for i in range(READERS)]
        for sub in subs:
            await sub.start()
        readers = [asyncio.create_task(_read(s, into)) for s, into in zip(subs, clients.readers, strict=True)]
        pubs = [
            OrderedPublisher(
                group.address(d), group.brokers, TOPIC, domain=d, client_id=f"pub-{d}{i}", config=client_config()
            )
            for d in DOMAINS
            for i in range(PUBLISHERS_PER_DOMAIN)
        ]
        for pub in pubs:
            await pub.start()
        tasks = [asyncio.create_task(_publish(p, rate, stop, clients)) for p in pubs]
        await asyncio.sleep(SETTLE_SECONDS)
        for fault in faults:
            await asyncio.sleep(fault.delay)
            at = time.monotonic()
            if fault.kind == KILL:
                await group.kill(fault.domain)
                await asyncio.sleep(fault.duration)
                back = await group.spawn(fault.domain)
            else:
                group.signal(fault.domain, signal.SIGSTOP)
                await asyncio.sleep(fault.duration)
                group.signal(fault.domain, signal.SIGCONT)
                back = time.monotonic()
            taken.append({**fault.as_dict(), "t": round(at - started, 2), "back_t": round(back - started, 2)})
            progress(f"  seed {seed}: {fault.kind} of seq-{fault.domain} for {fault.duration:g} s")
            await asyncio.sleep(SETTLE_SECONDS)
        stop.set()
        await asyncio.gather(*tasks)
        for pub in pubs:
            await pub.close()
        expected = len(clients.acknowledged)
        deadline = time.monotonic() + DRAIN_LIMIT_SECONDS
        while any(len(r) < expected for r in clients.readers) and time.monotonic() < deadline:  # noqa: ASYNC110 - polling the readers' lists
            await asyncio.sleep(0.1)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    except Exception as exc:  # noqa: BLE001 - the harness's own failure is a finding of the schedule
        error = repr(exc)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        for pub in pubs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pub.close(), 10)
        for sub in subs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sub.close(), 10)
        stopped = await group.stop()
    verdict = check(clients.acknowledged, clients.readers)
    for record in taken:
        back = started + record["back_t"]
        per_reader = [stall_after(r, back) for r in clients.readers]
        stalls = {d: _worst([s[d] for s in per_reader]) for d in DOMAINS}
        record["stall_after_s"] = stalls
        others = [s for d, s in stalls.items() if d != record["domain"]]
        record["longest_other_domain_stall_s"] = _worst(others)
    result = {
        "seed": seed,
        "faults": taken,
        **asdict(verdict),
        "publisher_failures": clients.failures[:20],
        "distribution_interval_s": DISTRIBUTION_INTERVAL_MS / 1000,
        "unclean_stops": [f"{n} ({c})" for n, c in stopped if c not in (0, None)],
        "error": error,
    }
    result["violations"] = violations(result)
    return result


def _worst(values: Sequence[float | None]) -> float | None:
    """The longest stall; None (never resumed) beats any number."""
    if any(v is None for v in values):
        return None
    return max((v for v in values if v is not None), default=0.0)


def violations(result: dict[str, Any]) -> list[str]:
    out = []
    if not result["identical"]:
        out.append("subscribers delivered different orders")
    out.extend(f"{what} {result[what]}" for what in ("lost", "duplicates", "unexpected") if result[what])
    if result["publisher_failures"]:
        out.append(f"publishers failed: {result['publisher_failures'][0]}")
    for fault in result["faults"]:
        stall = fault["longest_other_domain_stall_s"]
        if stall is None:
            out.append(f"a domain never resumed after the {fault['kind']} of seq-{fault['domain']}")
    if result["error"]:
        out.append(f"harness error: {result['error']}")
    return out


def run_many(  # noqa: PLR0917 - the command's options, passed on
    seeds: list[int], faults: int, longest: float, rate: float, folder: Path, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    results = []
    for seed in seeds:
        steps = draw(seed, faults, longest)
        progress(f"sequencer schedule seed {seed}: {[(f.kind, f.domain, f.duration) for f in steps]}")
        (folder / f"seq-seed-{seed}").mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run_schedule(seed, steps, folder / f"seq-seed-{seed}", rate, progress))
        (folder / f"seq-seed-{seed}" / "result.json").write_text(json.dumps(result, indent=1, default=str))
        stalls = [f["longest_other_domain_stall_s"] for f in result["faults"]]
        progress(
            f"sequencer schedule seed {seed}: acknowledged {result['acknowledged']}, identical {result['identical']}, "
            f"lost {result['lost']}, duplicates {result['duplicates']}, other domains' stall after each fault "
            f"{stalls} s, violations {result['violations'] or 'none'}"
        )
        results.append(result)
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of a run: schedules, faults by kind and target, the verdicts, the stalls."""
    faults = [f for r in results for f in r["faults"]]
    stalls = [f["longest_other_domain_stall_s"] for f in faults]
    known = sorted(s for s in stalls if s is not None)
    own = sorted(
        s for f in faults if (s := f["stall_after_s"].get(f["domain"])) is not None
    )  # the faulted domain's own
    by = {
        f"{kind} {'leader' if leader else 'non-leader'}": sum(
            1 for f in faults if f["kind"] == kind and f["leader"] == leader
        )
        for kind in (KILL, PAUSE)
        for leader in (True, False)
    }
    return {
        "schedules": len(results),
        "failed": sum(1 for r in results if r["violations"]),
        "faults": by,
        "acknowledged": sum(r["acknowledged"] for r in results),
        "identical": all(r["identical"] for r in results),
        "lost": sum(r["lost"] for r in results),
        "duplicates": sum(r["duplicates"] for r in results),
        "other_domains_stall_max_s": known[-1] if known else None,
        "other_domains_stall_median_s": known[len(known) // 2] if known else None,
        "never_resumed": sum(1 for s in stalls if s is None),
        "faulted_domain_stall_max_s": own[-1] if own else None,
        "within_one_interval": sum(1 for s in known if s <= DISTRIBUTION_INTERVAL_MS / 1000),
        "distribution_interval_s": DISTRIBUTION_INTERVAL_MS / 1000,
    }

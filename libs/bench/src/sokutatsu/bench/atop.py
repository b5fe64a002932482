"""Discrete-event simulation of extended ATOP (seed 002 §4) with SimPy, on the shared ordering code.

The model of one configuration: ``clients`` clients split equally into ``domains``
domains, one FIFO sequencer per domain with a fixed service time per stamp request.

* **Workload.** Each client generates messages as a Poisson process (mean interval
  0.5 s); a burst event every ``burst_interval`` seconds picks 8 % of the clients at
  random and triples their rate for 10 s (a client in two overlapping bursts is still
  x3). The whole workload is drawn before the run, per client, exactly (the exponential
  is memoryless, so a rate change restarts the draw), from random streams named after
  the seed, so every configuration of a figure sees the same messages.
* **Stamping.** A message reaches its sequencer after the request delay, waits its turn,
  is stamped at the end of its service time with the sequencer's installed distribution
  id and the next number, and the client multicasts it after the response delay.
* **Distribution.** Every ``distribution_interval`` the leader (domain ``d000``'s
  sequencer) weighs the domains by the data messages each stamped over the interval
  (``weights_from_counts``), installs it at once and sends it to the other sequencers,
  which install it one inter-domain delay later; a sequencer passes each distribution on
  to its clients (one intra-domain delay).
* **Dummies.** Every ``check_interval`` each sequencer compares its slots under its
  installed distribution with the other domains' slots under the same distribution as
  stamped up to ``observe_delay`` (300 ms, the inter-domain mean) earlier, and sends
  ``share_deficit(weight, own, others)`` dummies, or one skip marker of that many slots.
  Fillers are stamped by the sequencer itself and do not queue behind client requests.
* **Receivers** run ``OrderedMerge`` on everything that was sent: see
  :mod:`sokutatsu.bench.atop_run`.
* **End.** Generation stops at ``duration``; the sequencers serve what is queued; then
  the leader issues a closing distribution and each sequencer stamps one filler with
  it, so the receivers can deliver every data message (nothing is left blocked).

Network delays are exponential with the seed's means (100 ms within a domain, 300 ms
between domains). The mean arrival time (seed §4.1: generation to reception, sequencer
round trip included) takes each message's simulated round trip plus the mean multicast
delay over its ``clients - 1`` receivers, so 100 receivers per message need no events.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from sokutatsu.ordering import (
    DEFAULT_MIN_PPM,
    Distribution,
    Entry,
    Kind,
    share_deficit,
    weights_from_counts,
)

LEADER = 0
EPOCH = 1  # no sequencer restarts in the simulation


@dataclass(frozen=True)
class AtopParams:
    """One configuration; the defaults are the seed's §4.1 parameters."""

    domains: int
    service_time: float = 0.001
    burst_interval: float | None = None  # seconds between burst events; None: no bursts
    markers: bool = False  # one skip marker of n slots instead of n dummies
    clients: int = 100
    mean_send_interval: float = 0.5
    distribution_interval: float = 5.0
    intra_delay: float = 0.100
    inter_delay: float = 0.300
    burst_fraction: float = 0.08
    burst_factor: float = 3.0
    burst_duration: float = 10.0
    check_interval: float = 0.1
    # A sequencer sees the other domains' stamps this late (the inter-domain delay's mean).
    observe_delay: float = 0.3
    duration: float = 300.0
    seed: int = 1
    receivers: int = 2
    min_ppm: int = DEFAULT_MIN_PPM

    def __post_init__(self) -> None:
        if self.domains < 1 or self.clients % self.domains:
            raise ValueError(f"{self.clients} clients do not split equally into {self.domains} domains")
        if self.duration <= 0 or self.check_interval <= 0 or self.service_time < 0 or self.observe_delay < 0:
            raise ValueError("duration and check interval must be positive, service time and delays not negative")
        if not 1 <= self.receivers <= 2:
            raise ValueError("one or two receivers (the first and the last client)")

    @property
    def clients_per_domain(self) -> int:
        return self.clients // self.domains

    @property
    def utilization(self) -> float:
        """Offered load on a sequencer without bursts: clients per domain x rate x service time."""
        return self.clients_per_domain / self.mean_send_interval * self.service_time

    @property
    def multicast_mean(self) -> float:
        """Mean delay from a sender to the other ``clients - 1`` clients."""
        n = self.clients_per_domain
        if self.clients == 1:
            return 0.0
        return ((n - 1) * self.intra_delay + (self.clients - n) * self.inter_delay) / (self.clients - 1)


def domain_name(index: int) -> str:
    return f"d{index:03d}"


def stream(params: AtopParams, *names: object) -> random.Random:
    """An independent random stream named after the seed (string seeds are hashed, stable across runs)."""
    return random.Random("/".join(str(part) for part in (params.seed, *names)))  # noqa: S311 - simulation


# ---------------------------------------------------------------- workload --
@dataclass(slots=True)
class Message:
    id: int
    client: int
    domain: int
    generated: float
    request_delay: float
    response_delay: float
    served: float = math.nan  # service start at the sequencer
    stamped: float = math.nan  # service end: the stamp is handed out


def burst_schedule(params: AtopParams) -> list[tuple[float, tuple[int, ...]]]:
    """``(start, clients)`` of every burst event in the generation window."""
    if params.burst_interval is None:
        return []
    rng = stream(params, "bursts", params.burst_interval)
    count = round(params.burst_fraction * params.clients)
    events: list[tuple[float, tuple[int, ...]]] = []
    start = params.burst_interval
    while start < params.duration:
        events.append((start, tuple(sorted(rng.sample(range(params.clients), count)))))
        start += params.burst_interval
    return events


def _burst_spans(params: AtopParams, bursts: Sequence[tuple[float, tuple[int, ...]]]) -> list[list[float]]:
    """Per client, the merged ``[start, end)`` spans of its bursts, flattened."""
    spans: list[list[float]] = [[] for _ in range(params.clients)]
    for start, chosen in bursts:
        end = min(start + params.burst_duration, params.duration)
        for client in chosen:
            own = spans[client]
            if own and start <= own[-1]:
                own[-1] = max(own[-1], end)
            else:
                own += [start, end]
    return spans


def workload(params: AtopParams) -> list[Message]:
    """Every message of the run, by generation time; ids from 0 in that order."""
    base = 1.0 / params.mean_send_interval
    times: list[tuple[float, int]] = []
    for client, spans in enumerate(_burst_spans(params, burst_schedule(params))):
        rng = stream(params, "client", client, params.burst_interval)
        edges = [0.0, *spans, params.duration]
        for i in range(len(edges) - 1):
            rate = base * (params.burst_factor if i % 2 else 1.0)
            t = edges[i] + rng.expovariate(rate)
            while t < edges[i + 1]:
                times.append((t, client))
                t += rng.expovariate(rate)
    times.sort()
    net = stream(params, "net")
    per_domain = params.clients_per_domain
    mean = params.intra_delay
    return [
        Message(i, client, client // per_domain, t, net.expovariate(1 / mean), net.expovariate(1 / mean))
        for i, (t, client) in enumerate(times)
    ]


# --------------------------------------------------------------- simulation --
@dataclass(slots=True)
class Sent:
    """One stamped message on the wire: ``at`` is when it left its sender (client or sequencer)."""

    at: float
    domain: int
    client: int  # -1: the sequencer itself (a filler)
    entry: Entry[int]


@dataclass(slots=True)
class _Series:
    times: list[float]
    totals: list[int]

    def add(self, at: float, slots: int) -> None:
        self.times.append(at)
        self.totals.append((self.totals[-1] if self.totals else 0) + slots)

    def at(self, moment: float) -> int:
        i = bisect.bisect_right(self.times, moment)
        return self.totals[i - 1] if i else 0


@dataclass(slots=True)
class _SlotLog:
    """Slots stamped under one distribution, over time: all domains, and each domain."""

    every: _Series
    each: list[_Series]

    @classmethod
    def empty(cls, domains: int) -> _SlotLog:
        return cls(_Series([], []), [_Series([], []) for _ in range(domains)])

    def add(self, at: float, domain: int, slots: int) -> None:
        self.every.add(at, slots)
        self.each[domain].add(at, slots)

    def others(self, domain: int, moment: float) -> int:
        """The other domains' slots stamped up to ``moment``."""
        return self.every.at(moment) - self.each[domain].at(moment)


@dataclass
class _Sequencer:
    index: int
    name: str
    installed: Distribution
    requests: list[Message]
    next_seq: int = 1
    data_in_interval: int = 0
    busy: float = 0.0
    # When each distribution reached this sequencer (it passes each on to its clients).
    heard: dict[int, float] = field(default_factory=dict)


class Simulation:
    """The SimPy model of one configuration: :meth:`run` it, then read what was sent (``sent``)."""

    def __init__(self, params: AtopParams, messages: list[Message]) -> None:
        self.p = params
        self.env = simpy.Environment()
        self.messages = messages
        names = [domain_name(i) for i in range(params.domains)]
        zero = dict.fromkeys(names, 0)
        first = Distribution(1, weights_from_counts(zero, params.min_ppm))
        self.distributions = [first]
        self.weights: dict[int, list[int]] = {1: [ppm for _, ppm in first.weights]}
        self.slots: dict[int, list[int]] = {1: [0] * params.domains}  # per distribution id, per domain
        by_domain: list[list[Message]] = [[] for _ in names]
        for message in messages:
            by_domain[message.domain].append(message)
        self.sequencers = [
            _Sequencer(i, name, first, sorted(own, key=lambda m: m.generated + m.request_delay), heard={1: 0.0})
            for i, (name, own) in enumerate(zip(names, by_domain, strict=True))
        ]
        self.sent: list[Sent] = []
        self.closing = False
        self.filler_messages = 0  # in the generation window
        self.filler_slots = 0
        self.closing_fillers = 0
        self.install_rng = stream(params, "install", params.domains)
        # Per distribution id: when slots were stamped under it, and the running totals, all
        # domains together and per domain; a check looks them up ``observe_delay`` back.
        self.stamp_log: dict[int, _SlotLog] = {1: _SlotLog.empty(params.domains)}

    # -- processes --
    def serve(self, seq: _Sequencer) -> Generator[simpy.Event, Any, None]:
        env, service = self.env, self.p.service_time
        for message in seq.requests:
            arrival = message.generated + message.request_delay
            if arrival > env.now:
                yield env.timeout(arrival - env.now)
            message.served = env.now
            yield env.timeout(service)
            seq.busy += service
            message.stamped = env.now
            entry = self._stamp(seq, Kind.DATA, 1, message.id)
            seq.data_in_interval += 1
            self.sent.append(Sent(env.now + message.response_delay, seq.index, message.client, entry))

    def distribute(self) -> Generator[simpy.Event, Any, None]:
        while True:
            yield self.env.timeout(self.p.distribution_interval)
            if self.closing:
                return
            counts = {seq.name: seq.data_in_interval for seq in self.sequencers}
            for seq in self.sequencers:
                seq.data_in_interval = 0
            total = sum(counts.values())
            self._announce(weights_from_counts(counts, self.p.min_ppm), total / self.p.distribution_interval)

    def check_shares(self) -> Generator[simpy.Event, Any, None]:
        env = self.env
        while not self.closing:
            yield env.timeout(self.p.check_interval)
            if self.closing:
                return
            seen_at = env.now - self.p.observe_delay
            for seq in self.sequencers:
                dist_id = seq.installed.id
                others = self.stamp_log[dist_id].others(seq.index, seen_at)
                own = self.slots[dist_id][seq.index]
                deficit = share_deficit(self.weights[dist_id][seq.index], own, others)
                if deficit:
                    self._fill(seq, deficit)
                    in_window = env.now <= self.p.duration
                    self.filler_messages += in_window * (1 if self.p.markers else deficit)
                    self.filler_slots += in_window * deficit

    def close(self, servers: list[simpy.Process]) -> Generator[simpy.Event, Any, None]:
        yield self.env.all_of(servers)
        self.closing = True  # no more distributions or dummies: the one announced now is the last
        names = [seq.name for seq in self.sequencers]
        self._announce(weights_from_counts(dict.fromkeys(names, 0), self.p.min_ppm), 0.0)

    # -- helpers --
    def _announce(self, weights: tuple[tuple[str, int], ...], rate: float) -> None:
        dist = Distribution(len(self.distributions) + 1, weights, total_rate=rate)
        self.distributions.append(dist)
        self.weights[dist.id] = [ppm for _, ppm in weights]
        self.slots[dist.id] = [0] * self.p.domains
        self.stamp_log[dist.id] = _SlotLog.empty(self.p.domains)
        for seq in self.sequencers:
            if seq.index == LEADER:
                self._install(seq, dist)
            else:
                delay = self.install_rng.expovariate(1 / self.p.inter_delay)
                self.env.timeout(delay).callbacks.append(functools.partial(self._arrived, seq, dist))

    def _arrived(self, seq: _Sequencer, dist: Distribution, _event: simpy.Event) -> None:
        self._install(seq, dist)

    def _install(self, seq: _Sequencer, dist: Distribution) -> None:
        seq.heard[dist.id] = self.env.now
        if dist.id > seq.installed.id:  # a late older one is passed on, never installed
            seq.installed = dist
        if self.closing and dist.id == self.distributions[-1].id:
            self._fill(seq, 1)
            self.closing_fillers += 1

    def _stamp(self, seq: _Sequencer, kind: Kind, slots: int, payload: int | None) -> Entry[int]:
        dist_id = seq.installed.id
        entry = Entry(dist_id, seq.name, EPOCH, seq.next_seq, kind, slots, payload)
        seq.next_seq += slots
        self.slots[dist_id][seq.index] += slots
        self.stamp_log[dist_id].add(self.env.now, seq.index, slots)
        return entry

    def _fill(self, seq: _Sequencer, slots: int) -> None:
        now = self.env.now
        if self.p.markers:
            self.sent.append(Sent(now, seq.index, -1, self._stamp(seq, Kind.SKIP, slots, None)))
        else:
            for _ in range(slots):
                self.sent.append(Sent(now, seq.index, -1, self._stamp(seq, Kind.DUMMY, 1, None)))

    def run(self) -> None:
        env = self.env
        servers = [env.process(self.serve(seq)) for seq in self.sequencers]
        env.process(self.distribute())
        env.process(self.check_shares())
        env.process(self.close(servers))
        env.run()

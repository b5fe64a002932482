"""The deterministic merge schedule of extended ATOP (seed 002 §3.2), integers only.

Every receiver must draw the same domain for the same slot on every machine, so the
schedule is a pure function of ``(distribution id, weights, position)``:

1. ``x = mix64(mix64(distribution_id) ^ position)`` where ``mix64`` is SplitMix64's
   finaliser (Steele, Lea and Flood, 2014) on unsigned 64-bit integers;
2. ``r = (x * 1_000_000) >> 64``, a number in ``[0, 1_000_000)``;
3. the domain is the first one, in domain-name order, whose cumulative weight in parts
   per million exceeds ``r``.

No floats, no ``random`` module state: Python integers make it exact, and the same
three lines in any language give the same sequence (test vectors in
``tests/ordering/schedule_vectors.json``).

Weights are parts per million summing to exactly 1,000,000; every domain of a
distribution has at least ``min_ppm`` so that a domain that starts sending is drawn
(a zero weight would leave its messages undeliverable under that distribution).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TOTAL_PPM = 1_000_000
MASK64 = (1 << 64) - 1
# Every domain keeps at least 0.5 % of the slots by default.
DEFAULT_MIN_PPM = 5_000


def mix64(value: int) -> int:
    """SplitMix64: one step of the generator, a bijection on 64-bit integers."""
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def draw_ppm(distribution_id: int, position: int) -> int:
    """The slot's draw in ``[0, TOTAL_PPM)``: counter-based, so any position is computed directly."""
    x = mix64(mix64(distribution_id & MASK64) ^ (position & MASK64))
    return (x * TOTAL_PPM) >> 64


@dataclass(frozen=True)
class Distribution:
    """Weights per domain (ppm, sorted by domain name, summing to ``TOTAL_PPM``) under one id."""

    id: int
    weights: tuple[tuple[str, int], ...]
    # Messages per second over all domains when it was computed (the dummy budget).
    total_rate: float = 0.0
    _cumulative: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _domains: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _seed: int = field(init=False, repr=False, compare=False)  # mix64(id), the same for every slot

    def __post_init__(self) -> None:
        if self.id < 1:
            raise ValueError(f"distribution id must be at least 1, got {self.id}")
        names = [name for name, _ in self.weights]
        if not names:
            raise ValueError("a distribution needs at least one domain")
        if names != sorted(names) or len(set(names)) != len(names):
            raise ValueError(f"distribution {self.id}: domains must be unique and sorted by name, got {names}")
        if any(ppm < 1 for _, ppm in self.weights):
            raise ValueError(f"distribution {self.id}: every weight must be at least 1 ppm")
        total = sum(ppm for _, ppm in self.weights)
        if total != TOTAL_PPM:
            raise ValueError(f"distribution {self.id}: weights sum to {total} ppm, not {TOTAL_PPM}")
        cumulative: list[int] = []
        running = 0
        for _, ppm in self.weights:
            running += ppm
            cumulative.append(running)
        object.__setattr__(self, "_cumulative", tuple(cumulative))
        object.__setattr__(self, "_domains", tuple(names))
        object.__setattr__(self, "_seed", mix64(self.id & MASK64))

    @property
    def domains(self) -> tuple[str, ...]:
        return self._domains

    def weight(self, domain: str) -> int:
        for name, ppm in self.weights:
            if name == domain:
                return ppm
        return 0

    def pick(self, position: int) -> str:
        """The domain drawn for slot ``position`` (0, 1, 2, ...) of this distribution.

        :func:`draw_ppm` inlined, with the distribution's half of it computed once: every
        receiver calls this for every slot."""
        z = ((self._seed ^ (position & MASK64)) + 0x9E3779B97F4A7C15) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        r = ((z ^ (z >> 31)) * TOTAL_PPM) >> 64
        return self._domains[bisect.bisect_right(self._cumulative, r)]


def schedule(distribution: Distribution, start: int, count: int) -> list[str]:
    """``count`` domains drawn from slot ``start`` on (for tests and tools)."""
    return [distribution.pick(position) for position in range(start, start + count)]


def weights_from_counts(counts: Mapping[str, int], min_ppm: int = DEFAULT_MIN_PPM) -> tuple[tuple[str, int], ...]:
    """Weights proportional to each domain's messages over the interval, integers only.

    Every domain gets ``min_ppm`` first; the rest is shared in proportion to the counts by
    the largest-remainder method (ties to the domain name), so the sum is exact. No
    messages at all gives equal weights.
    """
    names = sorted(counts)
    if not names:
        raise ValueError("no domains to weigh")
    if any(counts[name] < 0 for name in names):
        raise ValueError("message counts cannot be negative")
    if min_ppm < 1 or min_ppm * len(names) > TOTAL_PPM:
        raise ValueError(f"min_ppm {min_ppm} does not fit {len(names)} domains into {TOTAL_PPM} ppm")
    total = sum(counts[name] for name in names)
    shares = dict.fromkeys(names, 1) if total == 0 else {name: counts[name] for name in names}
    share_total = sum(shares.values())
    rest = TOTAL_PPM - min_ppm * len(names)
    base = {name: rest * shares[name] // share_total for name in names}
    remainders = sorted(names, key=lambda name: (-(rest * shares[name] % share_total), name))
    left = rest - sum(base.values())
    for name in remainders[:left]:
        base[name] += 1
    return tuple((name, min_ppm + base[name]) for name in names)


def equal_weights(domains: Sequence[str]) -> tuple[tuple[str, int], ...]:
    return weights_from_counts(dict.fromkeys(domains, 0), min_ppm=1)


def share_deficit(weight_ppm: int, own_slots: int, other_slots: int) -> int:
    """Slots a domain must add (dummies, or one skip marker) so that its share of every slot
    sent since the distribution was installed reaches its weight (seed 002 §3.3).

    ``own_slots`` counts this domain's numbers (data, dummies and skipped slots alike),
    ``other_slots`` every other domain's. Integers only: the smallest ``n`` with
    ``(own + n) * TOTAL_PPM >= weight * (own + n + other)``.
    """
    if not 0 < weight_ppm < TOTAL_PPM:
        return 0
    needed = -(-weight_ppm * other_slots // (TOTAL_PPM - weight_ppm))  # ceiling division
    return max(0, needed - own_slots)


def idle_deficit(weight_ppm: int, own_slots: int, other_slots: int) -> int:
    """Slots a domain that went quiet adds so receivers can deliver what the others sent.

    Beyond the seed. :func:`share_deficit` keeps the domain's *count* at its weight, but
    the schedule is random: to get through the others' ``other_slots`` a receiver draws
    this domain ``m = n w / (1 - w)`` times on average for the others' ``n`` slots, with a
    standard deviation of ``sqrt(m / (1 - w))`` (a negative binomial count). A domain at
    exactly its share that stops sending would leave receivers waiting at one of its
    slots until the next distribution. Four deviations above the mean cover the others'
    slots but for about 3 in 100,000 cases; the extra slots cost nothing while the domain
    is quiet (a skip marker's slots pass without waiting). Integers only.
    """
    if not 0 < weight_ppm < TOTAL_PPM:
        return 0
    rest = TOTAL_PPM - weight_ppm
    expected = -(-weight_ppm * other_slots // rest)
    spread = math.isqrt(expected * TOTAL_PPM // rest) + 1
    return max(0, expected + 4 * spread - own_slots)

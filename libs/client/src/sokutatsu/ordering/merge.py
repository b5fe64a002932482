"""The receiver's merge of extended ATOP (seed 002 §3.2.3), shared by the SDK and the simulator.

Messages arrive from every domain, in any interleaving. Each carries a stamp
``(distribution_id, domain, epoch, seq, kind, slots)``; within a domain the numbers
are dense from 1 (across epochs: a restarted sequencer continues after the last
number it handed out) and never carry an older distribution id than a lower number.

Delivery walks the slots of the *ordering distribution* ``d``: slot ``p`` draws domain
``D = d.pick(p)``, then

* if ``D`` already showed a message stamped with a newer distribution, the slot is
  skipped (nothing more of ``D`` belongs to ``d``);
* if ``D``'s next number has not arrived, delivery **blocks** (nothing is delivered
  until it arrives: that is what makes the order total);
* if it carries a newer distribution id, ``D`` is marked done with ``d`` and the slot
  skipped;
* otherwise the slot consumes it: a data message is delivered, a dummy is dropped, a
  skip marker of ``n`` slots is consumed one slot at a time.

When every domain of ``d`` is done with it, ordering moves to ``d + 1`` (whose weights
must be known by then) at slot 0. Every receiver that sees the same messages therefore
delivers them in the same order, whatever the arrival order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Generic, TypeVar

# The SDK's error (the OrderedSubscriber raises it to applications); the simulator and tests see the same.
from sokutatsu.client.errors import OrderingError
from sokutatsu.ordering.schedule import Distribution

T = TypeVar("T")


class Kind(IntEnum):
    """Mirrors ``sokutatsu.sequencer.v1.StampKind``."""

    DATA = 1
    DUMMY = 2
    SKIP = 3


@dataclass(slots=True)
class Entry(Generic[T]):
    distribution_id: int
    domain: str
    epoch: int
    seq: int
    kind: Kind = Kind.DATA
    slots: int = 1
    payload: T | None = None


@dataclass(slots=True)
class MergeCounters:
    delivered: int = 0
    dummies: int = 0
    skip_markers: int = 0
    skip_slots: int = 0
    skipped_slots: int = 0  # slots of a domain already done with the ordering distribution
    duplicates: int = 0
    distributions: int = 0


class OrderedMerge(Generic[T]):
    """Total-order merge of the domains' streams; feed it with :meth:`add`, take with :meth:`pop_ready`."""

    def __init__(self, first_distribution: int = 1) -> None:
        self.distributions: dict[int, Distribution] = {}
        self.ordering = first_distribution
        self.position = 0
        self.buffers: dict[str, dict[int, Entry[T]]] = {}
        self.next_seq: dict[str, int] = {}
        self.epochs: dict[str, int] = {}
        self.done: set[str] = set()  # domains that showed a newer distribution than `ordering`
        self.skip_left: dict[str, int] = {}  # slots left of the skip marker at a domain's head
        self.counters = MergeCounters()
        self.waiting_for = ""  # the domain (or "distribution N") delivery is blocked on
        self.newest_distribution = 0
        self._buffered = 0

    def add_distribution(self, distribution: Distribution) -> None:
        known = self.distributions.get(distribution.id)
        if known is not None and known.weights != distribution.weights:
            raise OrderingError(
                f"distribution {distribution.id} announced twice with different weights: "
                f"{known.weights} and {distribution.weights}"
            )
        if known is None and distribution.id >= self.ordering:  # older ones are done with: not kept
            self.distributions[distribution.id] = distribution
            self.newest_distribution = max(self.newest_distribution, distribution.id)
            self.counters.distributions += 1

    def add(self, entry: Entry[T]) -> None:
        """Buffer one stamped message. Raises :class:`OrderingError` for a stamp that cannot be ordered."""
        if entry.seq < 1 or entry.slots < 1:
            raise OrderingError(f"domain {entry.domain!r}: bad stamp seq={entry.seq} slots={entry.slots}")
        if entry.distribution_id > self.newest_distribution:
            raise OrderingError(
                f"domain {entry.domain!r} seq {entry.seq} carries distribution id {entry.distribution_id}, "
                f"but the newest distribution announced is {self.newest_distribution}: unknown distribution"
            )
        if entry.distribution_id < self.ordering and entry.seq >= self.next_seq.get(entry.domain, 1):
            raise OrderingError(
                f"domain {entry.domain!r} seq {entry.seq} carries distribution id {entry.distribution_id}, "
                f"older than distribution {self.ordering} this receiver already orders by"
            )
        next_seq = self.next_seq.setdefault(entry.domain, 1)
        buffer = self.buffers.setdefault(entry.domain, {})
        if entry.seq < next_seq or entry.seq in buffer:
            self.counters.duplicates += 1
            return
        buffer[entry.seq] = entry
        self._buffered += 1

    def add_all(self, entries: Iterable[Entry[T]]) -> None:
        for entry in entries:
            self.add(entry)

    def pop_ready(self) -> list[T]:  # noqa: PLR0912, PLR0915 - the receivers' hot loop, kept inline
        """Every data payload deliverable now, in the total order."""
        out: list[T] = []
        counters = self.counters
        buffers, next_seqs, done = self.buffers, self.next_seq, self.done
        while True:
            distribution = self.distributions.get(self.ordering)
            if distribution is None:
                self.waiting_for = f"distribution {self.ordering}"
                return out
            domains = distribution.domains
            if len(done) >= len(domains) and done.issuperset(domains):
                del self.distributions[self.ordering]
                self.ordering += 1
                self.position = 0
                done.clear()
                continue
            ordering, pick = self.ordering, distribution.pick
            # The inner loop stays within one distribution; it leaves to move to the next one.
            while True:
                domain = pick(self.position)
                if domain in done:
                    self.position += 1
                    counters.skipped_slots += 1
                    if len(done) >= len(domains) and done.issuperset(domains):
                        break
                    continue
                next_seq = next_seqs.get(domain, 1)
                buffer = buffers.get(domain)
                if buffer is None or (head := buffer.get(next_seq)) is None:
                    self.waiting_for = domain
                    return out
                if head.distribution_id > ordering:
                    done.add(domain)
                    self.position += 1
                    counters.skipped_slots += 1
                    if len(done) >= len(domains) and done.issuperset(domains):
                        break
                    continue
                if head.epoch < self.epochs.get(domain, 0):
                    raise OrderingError(
                        f"domain {domain!r} seq {head.seq} carries epoch {head.epoch}, but seq "
                        f"{next_seq - 1} already carried epoch {self.epochs[domain]}: stale epoch"
                    )
                if head.distribution_id < ordering:
                    raise OrderingError(
                        f"domain {domain!r} seq {head.seq} carries distribution id {head.distribution_id}, "
                        f"older than the ordering distribution {ordering}"
                    )
                self.epochs[domain] = head.epoch
                self.position += 1
                kind = head.kind
                if kind is Kind.SKIP:
                    self._consume_skip_slot(domain, head)
                    continue
                # _advance, inlined: this is the path of every data message.
                del buffer[head.seq]
                self._buffered -= 1
                next_seqs[domain] = head.seq + head.slots
                if kind is Kind.DUMMY:
                    counters.dummies += 1
                    continue
                counters.delivered += 1
                if head.payload is not None:
                    out.append(head.payload)

    def _consume_skip_slot(self, domain: str, head: Entry[T]) -> None:
        left = self.skip_left.pop(domain, 0)
        if not left:
            left = head.slots
            self.counters.skip_markers += 1
        self.counters.skip_slots += 1
        if left > 1:
            self.skip_left[domain] = left - 1
        else:
            self._advance(domain, head)

    def _advance(self, domain: str, head: Entry[T]) -> None:
        del self.buffers[domain][head.seq]
        self._buffered -= 1
        self.next_seq[domain] = head.seq + head.slots

    def buffered(self) -> int:
        return self._buffered

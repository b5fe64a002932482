"""One domain's sequencer (extended ATOP, seed 002 §3): numbers, distributions, fillers, epochs.

* **Numbers**: ranges, dense from 1 across epochs. A range is journaled before the
  answer leaves, so a restarted sequencer continues after the last number handed out.
* **Epochs**: every start is a new epoch. Ranges handed out and never reported
  published (an answer lost in the crash, a client that died) are *filled*: unless a
  client claims them within ``FILL_AFTER_MS``, one skip marker per range takes their
  slots, so receivers never wait for numbers nobody will send.
* **Distributions** (§3.2.2): the leader weighs the domains by the numbers each handed
  out over the last interval, publishes the distribution on the total-order topic (the
  brokers acknowledge it), installs it on every other sequencer and only then on itself;
  a sequencer stamps only with the distribution installed on it, so no newer number
  carries an older id.
* **Fillers** (§3.3): every ``SHARE_CHECK_MS`` the sequencer compares its domain's share
  of all slots handed out since the distribution was installed with the domain's weight
  and fills the deficit with dummies or one skip marker. Beyond the seed, a domain that
  handed out nothing since the last check while the others' clients sent tops up to
  ``idle_deficit`` (its expected draws plus three spreads), so receivers do not wait at
  one of its slots for the next distribution.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import grpc
from grpc import aio
from opentelemetry import trace

from sokutatsu.client import Publisher
from sokutatsu.core.errors import InvalidArgument, NotFound, Unavailable, echo
from sokutatsu.core.shutdown import stop_if_cancelled
from sokutatsu.core.tls import client_config, open_channel
from sokutatsu.ordering import Distribution, equal_weights, idle_deficit, share_deficit, weights_from_counts
from sokutatsu.ordering.wire import distribution_from_message as to_distribution
from sokutatsu.ordering.wire import distribution_message as to_message
from sokutatsu.sequencer.journal import HandedRange, Journal
from sokutatsu.sequencer.settings import Peer, SequencerSettings
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc, stamp_pb2

log = logging.getLogger("sokutatsu.sequencer")
_tracer = trace.get_tracer("sokutatsu.sequencer")

RPC_TIMEOUT = 2.0
# The highest Distribution.id InstallDistribution takes (as pair_state.py caps epochs).
MAX_DISTRIBUTION_ID = 2**62
# Routing keys of the messages sequencers publish themselves (ordered subscribers take every key).
DISTRIBUTION_KEY = "_sokutatsu.distribution"


@dataclass(slots=True)
class _Owned:
    """An unsettled range and who holds it: ``client`` is the holding *stream*
    (``<client id>#<n>``, see :func:`client_name`; empty: nobody, since ``orphaned_at``)."""

    handed: HandedRange
    client: str = ""
    orphaned_at: float | None = None
    # Who held it last (empty: it was handed out before this sequencer restarted), for the fill's log.
    last_client: str = ""
    # Its client's new stream neither claimed nor reported it: the answer never reached the client.
    disowned: bool = False


def client_name(holder: str) -> str:
    """The client id of a holding stream's key (``<client id>#<n>``)."""
    return holder.partition("#")[0]


@dataclass
class _ShareWindow:
    """Slot counts since the installed distribution, for the filler."""

    distribution_id: int = 0
    own_start: int = 0
    peer_start: dict[str, int] = field(default_factory=dict)
    peer_now: dict[str, int] = field(default_factory=dict)
    # Numbers the other domains handed out to clients, fillers not counted (for the idle top-up).
    peer_data: dict[str, int] = field(default_factory=dict)
    own_before: int = 0  # last_seq at the previous check
    topped_up_at: int = -1  # sum of peer_data when this domain last topped up while idle


class Sequencer:
    def __init__(self, settings: SequencerSettings) -> None:
        self.settings = settings
        self.domain = settings.domain
        self.journal = Journal(settings.state_dir / settings.domain, fsync=settings.fsync)
        self.epoch = 0
        self.last_seq = 0
        self.distribution: Distribution | None = None
        self.distribution_message: sequencer_pb2.Distribution | None = None
        self.owned: dict[int, _Owned] = {}
        self.dummy_slots = 0
        self.skip_markers = 0
        self.skip_slots = 0
        self.filled_ranges = 0
        self._changed = asyncio.Condition()
        self._window = _ShareWindow()
        self._publisher: Publisher | None = None
        self._channels: dict[str, aio.Channel] = {}
        self._leader_counts: dict[str, int] = {}
        self._rate_mark = (time.monotonic(), 0)
        self._filler_key = f"_sokutatsu.filler.{self.domain}"
        self._stamped_distribution = 0  # the distribution id of the last number handed out
        self._saved_id = 0  # leader: the id its journal held at start (announced or not)
        self.stamp_refused = False  # a stamp was asked for before any distribution was installed
        self._closed = False

    # ------------------------------------------------------------- lifecycle --
    async def start(self) -> None:
        recovered = self.journal.open()
        self.epoch = recovered.epoch + 1
        self.last_seq = recovered.last_seq
        self.journal.begin_epoch(self.epoch, self.last_seq)
        self._rate_mark = (time.monotonic(), self.last_seq)
        now = time.monotonic()
        self.owned = {first: _Owned(r, "", now) for first, r in recovered.unsettled.items()}
        saved = self.journal.load_distribution()
        if saved is not None:
            message = sequencer_pb2.Distribution.FromString(saved)
            if self.settings.leader:
                # The leader persists an id before publishing it: the saved one may never have
                # been published. It stamps nothing until it announced a newer one (run_leader).
                self._saved_id = message.id
            else:
                self._set_distribution(message)
        if self.settings.brokers:
            self._publisher = Publisher(
                list(self.settings.brokers),
                f"sequencer-{self.domain}-e{self.epoch}-{os.getpid()}",
                config=client_config(),
            )
            await self._publisher.start()
        log.info(
            "domain %s: epoch %d starts after seq %d; %d unsettled ranges to claim or fill; distribution %s",
            self.domain,
            self.epoch,
            self.last_seq,
            len(self.owned),
            self.distribution.id if self.distribution else "none yet",
        )

    async def close(self) -> None:
        self._closed = True
        await self._notify()
        if self._publisher is not None:
            with contextlib.suppress(Exception):
                await self._publisher.close()
        for channel in self._channels.values():
            await channel.close()
        self.journal.close()

    # -------------------------------------------------------------- stamping --
    def stamp(self, count: int, client: str, domain: str) -> sequencer_pb2.SequenceRange:
        if domain and domain != self.domain:
            raise NotFound(f"this sequencer hands out numbers for domain {self.domain!r}, not {echo(domain)}")
        if not 1 <= count <= self.settings.max_range:
            raise InvalidArgument(
                f"a stamp request asks for 1 to {self.settings.max_range} numbers (SOKUTATSU_SEQUENCER_MAX_RANGE), "
                f"not {count}"
            )
        distribution = self.distribution
        if distribution is None:
            self.stamp_refused = True
            raise Unavailable(f"domain {self.domain}: no distribution installed yet; the leader installs one")
        handed = HandedRange(self.last_seq + 1, count, distribution.id, self.epoch)
        self._stamped_distribution = distribution.id
        self.journal.handed(handed)
        self.last_seq = handed.last
        self.owned[handed.first] = _Owned(handed, client, last_client=client_name(client))
        return sequencer_pb2.SequenceRange(
            distribution_id=handed.distribution_id,
            domain=self.domain,
            epoch=handed.epoch,
            first_seq=handed.first,
            count=count,
        )

    def settle(self, firsts: Iterable[int]) -> None:
        done = [first for first in firsts if self.owned.pop(first, None) is not None]
        self.journal.settled(done)
        if self.journal.needs_compaction:
            self.journal.rewrite(self.epoch, self.last_seq, {f: o.handed for f, o in self.owned.items()})

    def claim(self, ranges: Iterable[sequencer_pb2.SequenceRange], client: str) -> None:
        for claimed in ranges:
            owned = self.owned.get(claimed.first_seq)
            if owned is not None and owned.handed.count == claimed.count:
                owned.client, owned.orphaned_at, owned.last_client = client, None, client_name(client)
                owned.disowned = False

    def disown_unclaimed(self, holder: str) -> None:
        """A new stream (``holder``) of a client began with everything the client holds (its
        claims and published reports, as the SDK sends them): a range of the client's earlier
        streams it did not claim never reached it (e.g. answered while this process was paused
        past the client's stamp timeout), so it is filled at once rather than ``FILL_AFTER_MS``
        later. (Client ids must be unique: two live publishers with one id would disown each
        other's ranges.)"""
        name, now = client_name(holder), time.monotonic()
        for owned in self.owned.values():
            if owned.last_client == name and owned.client != holder:
                owned.disowned = True
                if owned.orphaned_at is None:  # its stream's end not seen yet
                    owned.client, owned.orphaned_at = "", now

    def stream_ended(self, client: str) -> None:
        """The stream ``client`` (``<client id>#<n>``) ended: what it held and did not report
        published may never come (a new stream of the same client claims it back)."""
        now = time.monotonic()
        for owned in self.owned.values():
            if owned.client == client:
                owned.client, owned.orphaned_at = "", now

    # --------------------------------------------------------- distributions --
    def _set_distribution(self, message: sequencer_pb2.Distribution) -> None:
        distribution = to_distribution(message)
        # A point in time (the install), traced for the analysis of distribution changes per domain.
        _tracer.start_span(
            "sequencer.install_distribution",
            attributes={
                "sokutatsu.domain": self.domain,
                "sokutatsu.distribution.id": message.id,
                "sokutatsu.distribution.previous_id": self.distribution.id if self.distribution else 0,
                "sokutatsu.distribution.weights": json.dumps(dict(distribution.weights), sort_keys=True),
                "sokutatsu.seq.last": self.last_seq,
            },
        ).end()
        self.distribution = distribution
        self.distribution_message = message
        before = self._window
        self._window = _ShareWindow(
            message.id, self.last_seq, peer_data=before.peer_data, topped_up_at=before.topped_up_at
        )

    async def install(self, message: sequencer_pb2.Distribution) -> int:
        """Install ``message`` unless a newer one is in force; return the id in force."""
        if not 1 <= message.id <= MAX_DISTRIBUTION_ID:
            raise InvalidArgument(
                f"Distribution.id {echo(message.id)} is outside 1 to {MAX_DISTRIBUTION_ID} (2^62): a larger one "
                "would stop the leader's next distributions (ids increase by one) from ever being installed"
            )
        distribution = to_distribution(message)  # raises ValueError on bad weights
        if self.domain not in distribution.domains:
            raise InvalidArgument(f"distribution {message.id} has no weight for domain {self.domain!r}")
        if self.distribution is not None and message.id <= self.distribution.id:
            return self.distribution.id
        self.journal.save_distribution(message.SerializeToString())
        self._set_distribution(message)
        await self._notify()
        log.info("domain %s: distribution %d installed %s", self.domain, message.id, distribution.weights)
        return message.id

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def watch(self) -> AsyncIterator[sequencer_pb2.Distribution]:
        sent = 0
        while not self._closed:
            message = self.distribution_message
            if message is not None and message.id > sent:
                sent = message.id
                yield message
            async with self._changed:
                await self._changed.wait_for(functools.partial(self._changed_since, sent))

    def _changed_since(self, sent: int) -> bool:
        message = self.distribution_message
        return self._closed or (message is not None and message.id > sent)

    def send_rate(self) -> float:
        """Numbers per second handed out since the previous call."""
        now = time.monotonic()
        then, before = self._rate_mark
        self._rate_mark = (now, self.last_seq)
        return (self.last_seq - before) / max(1e-3, now - then)

    def status(self) -> sequencer_pb2.SequencerStatus:
        status = sequencer_pb2.SequencerStatus(
            domain=self.domain,
            leader=self.settings.leader,
            epoch=self.epoch,
            last_seq=self.last_seq,
            dummy_slots=self.dummy_slots,
            skip_markers=self.skip_markers,
            skip_slots=self.skip_slots,
            outstanding_ranges=len(self.owned),
            filled_ranges=self.filled_ranges,
            distribution_start_seq=self._window.own_start,
            stamp_refused=self.stamp_refused,
        )
        if self.distribution_message is not None:
            status.distribution.CopyFrom(self.distribution_message)
        return status

    def _stub(self, address: str) -> sequencer_pb2_grpc.SequencerAsyncStub:
        channel = self._channels.get(address)
        if channel is None:
            # gRPC's reconnect back-off grows to 120 s by default: a peer back after a long outage
            # would stay unreachable for that long (no install, no count). Capped well within one
            # distribution interval, so the leader's next install after the peer serves gets through.
            backoff_ms = max(50, min(1000, self.settings.distribution_interval_ms // 4))
            options = [
                ("grpc.initial_reconnect_backoff_ms", backoff_ms),
                ("grpc.min_reconnect_backoff_ms", backoff_ms),
                ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ]
            channel = self._channels[address] = open_channel(address, cluster=True, options=options)
        return sequencer_pb2_grpc.SequencerStub(channel)

    async def run_leader(self) -> None:
        """Every interval: weigh, publish, install on the others, then on itself."""
        interval = self.settings.distribution_interval_ms / 1000
        domains = sorted({self.domain, *(peer.domain for peer in self.settings.peers)})
        if self.distribution is None:
            # The first distribution (of the group, or of this run: see start()): equal weights,
            # so stamping can begin at once.
            highest = await self._highest_distribution_id()
            if highest == 0 and self.settings.first_distribution == "on-demand":
                await self._wait_for_demand()
                highest = await self._highest_distribution_id()
            await self._announce(Distribution(highest + 1, equal_weights(domains)))
        started = time.monotonic()
        while not self._closed:
            stop_if_cancelled()
            await asyncio.sleep(interval)
            counts = await self._interval_counts()
            elapsed = max(1e-3, time.monotonic() - started)
            started = time.monotonic()
            total_rate = sum(counts.values()) / elapsed
            current = self.distribution.id if self.distribution else 0
            highest = max(current, await self._highest_distribution_id())
            weights = weights_from_counts(counts, self.settings.min_weight_ppm)
            await self._announce(Distribution(highest + 1, weights, total_rate))

    async def _wait_for_demand(self) -> None:
        """Until a sequencer of the group (this one included) was asked for numbers."""
        log.info("leader: the first distribution is published once a sequencer of the group is asked for numbers")
        while not self._closed:
            stop_if_cancelled()
            if self.stamp_refused or any(s.stamp_refused for s in (await self._peer_statuses()).values()):
                return
            await asyncio.sleep(self.settings.share_check_ms / 1000)

    async def _highest_distribution_id(self) -> int:
        highest = max(self._saved_id, self.distribution.id if self.distribution else 0)
        for peer in self.settings.peers:
            with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
                status = await self._stub(peer.address).GetStatus(sequencer_pb2.GetStatusRequest(), timeout=RPC_TIMEOUT)
                highest = max(highest, status.distribution.id)
        return highest

    async def _interval_counts(self) -> dict[str, int]:
        """Numbers each domain handed out since the last call (0 for a domain that did not answer)."""
        now: dict[str, int] = {self.domain: self.last_seq}
        for peer in self.settings.peers:
            try:
                rate = await self._stub(peer.address).GetSendRate(
                    sequencer_pb2.GetSendRateRequest(interval_ms=self.settings.distribution_interval_ms),
                    timeout=RPC_TIMEOUT,
                )
                now[peer.domain] = rate.last_seq
            except (TimeoutError, grpc.RpcError) as error:
                log.warning("leader: sequencer of domain %s did not report its count: %s", peer.domain, error)
        counts = {}
        for domain in sorted({self.domain, *(peer.domain for peer in self.settings.peers)}):
            if domain in now:
                before = self._leader_counts.get(domain, now[domain])
                counts[domain] = max(0, now[domain] - before)
                self._leader_counts[domain] = now[domain]
            else:
                counts[domain] = 0
        return counts

    async def _announce(self, distribution: Distribution) -> None:
        message = to_message(distribution)
        # Persist the id first: a leader restarted after publishing never reuses it.
        self.journal.save_distribution(message.SerializeToString())
        if self._publisher is not None:
            stamp = stamp_pb2.Stamp(distribution_id=distribution.id, kind=stamp_pb2.STAMP_KIND_DISTRIBUTION)
            # Stamped messages go through the SDK's internal path (its public publish takes no stamp).
            await self._publisher.wait_for_room()
            seq = self._publisher._enqueue(
                self.settings.topic,
                DISTRIBUTION_KEY,
                message.SerializeToString(),
                None,
                True,
                stamp.SerializeToString(),
            )
            await self._publisher.wait_acked(seq)
        request = sequencer_pb2.InstallDistributionRequest(distribution=message, leader=self.domain)

        async def install_on(peer_domain: str, address: str) -> None:
            try:
                await self._stub(address).InstallDistribution(request, timeout=RPC_TIMEOUT)
            except (TimeoutError, grpc.RpcError) as error:
                log.warning(
                    "leader: distribution %d not installed on domain %s: %s", distribution.id, peer_domain, error
                )

        await asyncio.gather(*(install_on(p.domain, p.address) for p in self.settings.peers))
        self._set_distribution(message)  # on itself last (seed §3.2.2)
        await self._notify()
        log.info("leader: distribution %d in force %s", distribution.id, distribution.weights)

    # --------------------------------------------------------------- fillers --
    async def run_filler(self) -> None:
        """Keep the domain's share of slots at its weight (seed §3.3), and show every new
        distribution: a domain whose last number carries an older distribution id than the
        one installed sends one filler slot with the new id, so receivers learn it is done
        with the older one (otherwise an idle domain would hold them there for good)."""
        if self._publisher is None:
            return
        interval = self.settings.share_check_ms / 1000
        while not self._closed:
            stop_if_cancelled()
            await asyncio.sleep(interval)
            statuses = await self._peer_statuses()
            await self._catch_up(statuses)
            distribution = self.distribution
            if distribution is None:
                continue
            if self._stamped_distribution < distribution.id:
                await self._fill_share(1)
            if self.settings.filler == "off":
                continue
            others = self._peer_slots(distribution.id, statuses)
            if others is None:
                continue
            window = self._window
            own = self.last_seq - window.own_start
            weight = distribution.weight(self.domain)
            deficit = share_deficit(weight, own, others)
            peer_data = sum(window.peer_data.values())
            if deficit <= 0 and self.last_seq == window.own_before and peer_data > window.topped_up_at:
                # Quiet since the last check while the others sent: top up (see idle_deficit).
                deficit = idle_deficit(weight, own, others)
                window.topped_up_at = peer_data
            deficit = min(deficit, self.settings.max_range)
            if deficit > 0:
                await self._fill_share(deficit)
            window.own_before = self.last_seq

    async def _peer_statuses(self) -> dict[str, sequencer_pb2.SequencerStatus]:
        """Every peer's status that came within one share check (asked all at once)."""

        async def ask(peer: Peer) -> sequencer_pb2.SequencerStatus | None:
            try:
                status: sequencer_pb2.SequencerStatus = await self._stub(peer.address).GetStatus(
                    sequencer_pb2.GetStatusRequest(), timeout=self.settings.share_check_ms / 1000
                )
            except (TimeoutError, grpc.RpcError):
                return None
            return status

        peers = self.settings.peers
        answers = await asyncio.gather(*(ask(peer) for peer in peers))
        return {peer.domain: status for peer, status in zip(peers, answers, strict=True) if status is not None}

    async def _catch_up(self, statuses: dict[str, sequencer_pb2.SequencerStatus]) -> None:
        """Install the newest distribution a peer holds, when it is newer than this one's.

        Beyond the seed. A distribution is installed on a sequencer only after the leader
        published it, so any a peer holds is one receivers can know. The leader's install may
        not reach this sequencer (it was down, restarting, or paused when the leader sent it):
        without this, receivers could not leave the distribution this domain last stamped with
        until the leader's next install got through, and the other domains would stall."""
        if self.settings.leader or not statuses:
            return  # the leader is the source: it installs on itself after everyone else
        domain, newest = max(statuses.items(), key=lambda item: item[1].distribution.id)
        current = self.distribution.id if self.distribution else 0
        if newest.distribution.id <= current:
            return
        try:
            installed = await self.install(newest.distribution)
        except (InvalidArgument, ValueError) as error:  # a group whose members disagree on the domains
            log.warning("domain %s: distribution of domain %s's sequencer not taken: %s", self.domain, domain, error)
            return
        if installed == newest.distribution.id:
            log.info(
                "domain %s: caught up from domain %s's sequencer: distribution %d (the leader's install had not "
                "reached this one)",
                self.domain,
                domain,
                installed,
            )

    def _peer_slots(self, distribution_id: int, statuses: dict[str, sequencer_pb2.SequencerStatus]) -> int | None:
        """Slots the other domains handed out since this domain installed ``distribution_id``."""
        window = self._window
        if window.distribution_id != distribution_id:
            return None
        for peer in self.settings.peers:
            status = statuses.get(peer.domain)
            if status is None:
                continue
            if status.distribution.id < distribution_id:
                continue  # not installed there yet: its numbers so far belong to the older one
            # Counted from the peer's own install of this distribution (not from when this
            # sequencer first heard from it: under load that can be much later).
            window.peer_start[peer.domain] = status.distribution_start_seq
            window.peer_now[peer.domain] = status.last_seq
            window.peer_data[peer.domain] = status.last_seq - status.dummy_slots - status.skip_slots
        return sum(window.peer_now[d] - window.peer_start[d] for d in window.peer_now)

    async def _fill_share(self, slots: int) -> None:
        if self._publisher is None:
            return
        handed = self.stamp(slots, f"sequencer-{self.domain}", "")
        first, distribution_id = handed.first_seq, handed.distribution_id
        kind = "dummy" if self.settings.filler == "dummies" else "skip"
        with _tracer.start_as_current_span(
            "sequencer.fill",
            attributes={
                "sokutatsu.domain": self.domain,
                "sokutatsu.distribution.id": distribution_id,
                "sokutatsu.fill.kind": kind,
                "sokutatsu.fill.slots": slots,
                "sokutatsu.seq.first": first,
            },
        ):
            if kind == "skip":
                self.skip_markers += 1
                self.skip_slots += slots
                stamps = [self._filler_stamp(distribution_id, handed.epoch, first, stamp_pb2.STAMP_KIND_SKIP, slots)]
            else:
                self.dummy_slots += slots
                stamps = [
                    self._filler_stamp(distribution_id, handed.epoch, seq, stamp_pb2.STAMP_KIND_DUMMY, 1)
                    for seq in range(first, first + slots)
                ]
            await self._publish_fillers(stamps)
        self.settle([first])

    def _filler_stamp(
        self, distribution_id: int, epoch: int, seq: int, kind: stamp_pb2.StampKind.ValueType, slots: int
    ) -> stamp_pb2.Stamp:
        return stamp_pb2.Stamp(
            distribution_id=distribution_id, domain=self.domain, epoch=epoch, seq=seq, kind=kind, slots=slots
        )

    async def _publish_fillers(self, stamps: list[stamp_pb2.Stamp]) -> None:
        """Publish filler messages and wait until both brokers hold them."""
        assert self._publisher is not None  # noqa: S101 - callers return early without brokers
        last = 0
        for stamp in stamps:
            last = self._publisher._enqueue(
                self.settings.topic, self._filler_key, b"", None, True, stamp.SerializeToString()
            )
        await self._publisher.wait_acked(last)

    async def run_orphan_filler(self) -> None:
        """Fill ranges nobody claimed ``FILL_AFTER_MS`` after they were orphaned."""
        if self._publisher is None:
            return
        delay = self.settings.fill_after_ms / 1000
        while not self._closed:
            stop_if_cancelled()
            await asyncio.sleep(min(delay, 0.1))
            now = time.monotonic()
            due = [
                o
                for o in self.owned.values()
                if o.orphaned_at is not None and (o.disowned or now - o.orphaned_at >= delay)
            ]
            if not due:
                continue
            for owned in due:
                handed = owned.handed
                if owned.disowned:
                    what = (
                        f"client {owned.last_client!r} began a new stream without claiming it (the answer never "
                        "reached it)"
                    )
                elif owned.last_client:
                    what = (
                        f"the stream of client {owned.last_client!r} ended before it reported the range published, "
                        "and no stream claimed it back"
                    )
                else:
                    what = "it was handed out before this sequencer restarted, and no client claimed it"
                log.warning(
                    "domain %s: range %d..%d (epoch %d): %s: filled with a skip marker (should its client "
                    "publish it after all, receivers drop whichever of the two reaches them second)",
                    self.domain,
                    handed.first,
                    handed.last,
                    handed.epoch,
                    what if owned.disowned else f"{what} within {delay:.1f}s",
                )
            await self._publish_fillers(
                [
                    self._filler_stamp(
                        o.handed.distribution_id,
                        o.handed.epoch,
                        o.handed.first,
                        stamp_pb2.STAMP_KIND_SKIP,
                        o.handed.count,
                    )
                    for o in due
                ]
            )
            self.filled_ranges += len(due)
            self.settle([owned.handed.first for owned in due])

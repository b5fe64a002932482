"""One configuration of the extended-ATOP simulation run end to end: the model, the receivers, the summary.

The receivers (the first and the last client) run the shared ``OrderedMerge`` on every
stamped message, each with its own sampled network delays; a message whose distribution
the receiver has not been told yet (by its own sequencer) waits until it has. Receivers do
not act back on the senders, so they are replayed after the model's run, in arrival-time
order, which is the same as scheduling one SimPy event per arrival and far cheaper.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sokutatsu.bench.atop import AtopParams, Simulation, domain_name, stream, workload
from sokutatsu.ordering import Entry, OrderedMerge


@dataclass(frozen=True)
class ReceiverResult:
    client: int
    domain: str
    delivered: int
    delivered_each_once: bool
    mean_reception_ms: float  # generation → arrival of the data message at this receiver
    mean_delivery_ms: float  # generation → delivery in the total order
    p50_delivery_ms: float
    p99_delivery_ms: float
    max_delivery_ms: float


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def replay_receiver(run: Simulation, client: int) -> tuple[ReceiverResult, list[int]]:
    """Feed one client's ``OrderedMerge`` with everything, in arrival order; the delivered ids in order."""
    p = run.p
    home = client // p.clients_per_domain
    rng = stream(p, "receiver", client, p.domains)
    intra, inter = 1 / p.intra_delay, 1 / p.inter_delay
    by_id = {d.id: d for d in run.distributions}
    # (time, 0 = distribution / 1 = message, index); distributions first at equal times.
    arrivals: list[tuple[float, int, int]] = []
    for dist_id, at in run.sequencers[home].heard.items():
        delay = 0.0 if dist_id == 1 else rng.expovariate(intra)
        arrivals.append((at + delay, 0, dist_id))
    for i, sent in enumerate(run.sent):
        delay = 0.0 if sent.client == client else rng.expovariate(intra if sent.domain == home else inter)
        arrivals.append((sent.at + delay, 1, i))
    arrivals.sort()
    merge: OrderedMerge[int] = OrderedMerge()
    held: list[Entry[int]] = []
    generated = [m.generated for m in run.messages]
    delivered: list[int] = []
    latencies: list[float] = []
    reception: list[float] = []
    for at, what, index in arrivals:
        if what == 0:
            merge.add_distribution(by_id[index])
            newest = merge.newest_distribution
            ready = [e for e in held if e.distribution_id <= newest]
            held = [e for e in held if e.distribution_id > newest]
            merge.add_all(ready)
        else:
            entry = run.sent[index].entry
            if entry.payload is not None:
                reception.append(at - generated[entry.payload])
            if entry.distribution_id > merge.newest_distribution:
                held.append(entry)
                continue
            merge.add(entry)
        for message_id in merge.pop_ready():
            delivered.append(message_id)
            latencies.append(at - generated[message_id])
    latencies.sort()
    ms = 1000.0
    result = ReceiverResult(
        client=client,
        domain=domain_name(home),
        delivered=len(delivered),
        delivered_each_once=len(delivered) == len(run.messages) and len(set(delivered)) == len(run.messages),
        mean_reception_ms=statistics.fmean(reception) * ms if reception else math.nan,
        mean_delivery_ms=statistics.fmean(latencies) * ms if latencies else math.nan,
        p50_delivery_ms=_quantile(latencies, 0.5) * ms,
        p99_delivery_ms=_quantile(latencies, 0.99) * ms,
        max_delivery_ms=latencies[-1] * ms if latencies else math.nan,
    )
    return result, delivered


# ------------------------------------------------------------------- result --
@dataclass(frozen=True)
class AtopResult:
    domains: int
    clients_per_domain: int
    service_time_ms: float
    burst_interval_s: float | None
    markers: bool
    duration_s: float
    seed: int
    data_messages: int
    data_per_s: float
    distributions: int  # announced in the run, the closing one not included
    filler_messages: int  # dummies, or skip markers, stamped in the generation window
    filler_slots: int  # the slots they fill (= dummies without markers)
    dummies_per_s: float  # filler slots per second: what dummies alone would send
    filler_messages_per_s: float
    closing_fillers: int
    utilization: float  # offered load per sequencer without bursts
    saturated: bool
    busiest_sequencer: float  # busy fraction of the busiest sequencer over its run
    drained_at_s: float  # when the last data message was stamped
    mean_arrival_ms: float  # seed §4.1: generation → reception, sequencer round trip included
    mean_round_trip_ms: float  # generation → the client has its stamp
    p99_round_trip_ms: float
    mean_queue_wait_ms: float
    multicast_mean_ms: float
    receivers: tuple[ReceiverResult, ...]
    same_order: bool  # every receiver delivered the same sequence

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def simulate(params: AtopParams) -> AtopResult:
    """Run one configuration to the end (every data message delivered at the receivers)."""
    return simulate_with_orders(params)[0]


def simulate_with_orders(params: AtopParams) -> tuple[AtopResult, list[list[int]]]:
    """:func:`simulate`, and the message ids each receiver delivered, in its delivery order."""
    messages = workload(params)
    run = Simulation(params, messages)
    run.run()
    clients = [0, params.clients - 1][: params.receivers]
    replays = [replay_receiver(run, client) for client in clients]
    round_trips = sorted(m.stamped + m.response_delay - m.generated for m in messages)
    waits = [m.served - m.generated - m.request_delay for m in messages]
    drained = max((m.stamped for m in messages), default=0.0)
    ms = 1000.0
    mean_round_trip = statistics.fmean(round_trips) if round_trips else math.nan
    result = AtopResult(
        domains=params.domains,
        clients_per_domain=params.clients_per_domain,
        service_time_ms=params.service_time * ms,
        burst_interval_s=params.burst_interval,
        markers=params.markers,
        duration_s=params.duration,
        seed=params.seed,
        data_messages=len(messages),
        data_per_s=len(messages) / params.duration,
        distributions=len(run.distributions) - 1,
        filler_messages=run.filler_messages,
        filler_slots=run.filler_slots,
        dummies_per_s=run.filler_slots / params.duration,
        filler_messages_per_s=run.filler_messages / params.duration,
        closing_fillers=run.closing_fillers,
        utilization=params.utilization,
        saturated=params.utilization >= 1.0,
        busiest_sequencer=max(seq.busy for seq in run.sequencers) / max(drained, params.duration),
        drained_at_s=drained,
        mean_arrival_ms=(mean_round_trip + params.multicast_mean) * ms,
        mean_round_trip_ms=mean_round_trip * ms,
        p99_round_trip_ms=_quantile(round_trips, 0.99) * ms,
        mean_queue_wait_ms=statistics.fmean(waits) * ms if waits else math.nan,
        multicast_mean_ms=params.multicast_mean * ms,
        receivers=tuple(result for result, _ in replays),
        same_order=all(order == replays[0][1] for _, order in replays),
    )
    return result, [order for _, order in replays]

"""``sokutatsu bench sequencer``: how fast numbers are handed out, and ordered delivery end to end.

Two measurements, every service its own process:

* **stamps**: one sequencer (a leader alone in its group, no brokers), one client on one
  ``Stamp`` stream keeping ``window`` requests in flight and reporting each answered
  range published on its next request (so the sequencer settles as it would in use).
  For each range size: numbers handed out per second, and requests per second. One row
  repeats the largest size with ``FSYNC`` on (an fdatasync per request).
* **ordered**: a broker pair (active and standby), three sequencers (domains a, b, c;
  a leads), one ``OrderedPublisher`` process per domain publishing flat out, and
  ``readers`` ``OrderedSubscriber`` processes. msgs/s is data messages delivered in
  total order by a reader divided by the time from the first publish to its last
  delivery; every reader's order must be the same (compared by digest) and hold every
  message once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sokutatsu.bench.common import broker_pair, cpu_sample, started, steal_percent
from sokutatsu.cli.children import child_process, child_result, stdin_words, tell
from sokutatsu.cli.measure import machine
from sokutatsu.client import OrderedPublisher, OrderedSubscriber, Stamp
from sokutatsu.core.tls import client_config, open_channel
from sokutatsu.harness import settings
from sokutatsu.harness.sequencer import PREFIX, SequencerProcess, sequencer_group, start_order
from sokutatsu.sequencer.server import create_total_order_topic
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc

READY = "ready"
TOPIC = "bench-ordered"
DOMAINS = ("a", "b", "c")


@dataclass
class SequencerBenchConfig:
    stamp_seconds: float  # per range size
    ranges: tuple[int, ...]  # numbers per stamp request
    window: int  # stamp requests in flight on the stream
    messages: int  # per domain, for the ordered measurement
    readers: int
    size: int = 256


QUICK = SequencerBenchConfig(stamp_seconds=2.0, ranges=(1, 100, 1000), window=16, messages=5_000, readers=2)
FULL = SequencerBenchConfig(
    stamp_seconds=10.0, ranges=(1, 10, 100, 1000, 10_000), window=16, messages=40_000, readers=2
)


# ------------------------------------------------------------------- stamps --
async def stamp_rate(address: str, count: int, seconds: float, window: int) -> dict[str, Any]:
    """Ask for ``count`` numbers per request, ``window`` requests in flight, for ``seconds``."""
    room = asyncio.Semaphore(window)
    answered: list[int] = []  # first numbers, reported published on the next request
    numbers = requests = 0
    stop = time.monotonic() + seconds
    async with open_channel(address) as channel:
        call = sequencer_pb2_grpc.SequencerStub(channel).Stamp()

        async def write() -> None:
            request_id = 0
            while time.monotonic() < stop:
                await room.acquire()
                request_id += 1
                published, answered[:] = list(answered), []
                await call.write(
                    sequencer_pb2.StampRequest(
                        request_id=request_id, count=count, client_id="bench", domain="a", published=published
                    )
                )
            await call.done_writing()

        writer = asyncio.create_task(write())
        start = time.perf_counter()
        async for response in call:
            numbers += response.range.count
            requests += 1
            answered.append(response.range.first_seq)
            room.release()
        seconds_taken = time.perf_counter() - start
        await writer
    return {
        "range": count,
        "window": window,
        "requests": requests,
        "numbers": numbers,
        "seconds": round(seconds_taken, 3),
        "stamps_per_s": round(numbers / seconds_taken),
        "requests_per_s": round(requests / seconds_taken),
    }


async def measure_stamps(cfg: SequencerBenchConfig, folder: Path) -> dict[str, Any]:
    rows = []
    runs = [(count, False) for count in cfg.ranges] + [(max(cfg.ranges), True)]
    for count, fsync in runs:
        name = f"seq-{count}-{'fsync' if fsync else 'nofsync'}"
        sequencer = SequencerProcess(
            "a", folder / name, "127.0.0.1:0", settings(PREFIX, leader="true", fsync="true" if fsync else "false")
        )
        with started(sequencer):
            await sequencer.wait_installed()
            before = cpu_sample()
            row = await stamp_rate(sequencer.address, count, cfg.stamp_seconds, cfg.window)
        row["fsync"] = fsync
        row["cpu_steal_percent"] = steal_percent(before, cpu_sample())
        rows.append(row)
    best = max(r["stamps_per_s"] for r in rows if not r["fsync"])
    return {"stamps_per_s": best, "rows": rows}


# ------------------------------------------------------------------ ordered --
@contextlib.contextmanager
def ordered_group(folder: Path) -> Iterator[tuple[list[str], dict[str, SequencerProcess]]]:
    """A broker pair (started) and one sequencer per domain on it (the first leads; not started):
    (the brokers' addresses, the sequencers)."""
    with broker_pair(folder) as pair:
        yield pair.addresses, sequencer_group(folder, DOMAINS, pair.addresses, TOPIC)


async def measure_ordered(cfg: SequencerBenchConfig, folder: Path) -> dict[str, Any]:
    total = cfg.messages * len(DOMAINS)
    with ordered_group(folder) as (brokers, group):
        await create_total_order_topic(brokers, TOPIC)
        joined = ",".join(brokers)
        async with contextlib.AsyncExitStack() as stack:
            # Readers subscribe before the first distribution is published.
            readers = [
                await stack.enter_async_context(
                    child_process(__name__, "read", joined, f"reader-{i}", str(total), what="ordered reader")
                )
                for i in range(cfg.readers)
            ]
            with started(*start_order(group)):
                for member in group.values():
                    await member.wait_installed()
                publishers = [
                    await stack.enter_async_context(
                        child_process(
                            __name__,
                            "publish",
                            group[domain].address,
                            joined,
                            domain,
                            str(cfg.messages),
                            str(cfg.size),
                            what="ordered publisher",
                        )
                    )
                    for domain in DOMAINS
                ]
                before = cpu_sample()
                start_ns = time.time_ns()
                for publisher in publishers:
                    await tell(publisher, "go")
                sent = [await child_result(p, 600) for p in publishers]
                got = [await child_result(r, 600) for r in readers]
                steal = steal_percent(before, cpu_sample())
    digests = {r["digest"] for r in got}
    rates = [round(r["data"] / ((r["done_ns"] - start_ns) / 1e9)) for r in got]
    return {
        "msgs_per_s": min(rates),
        "per_reader_msgs_per_s": rates,
        "messages": total,
        "domains": list(DOMAINS),
        "readers": cfg.readers,
        "size": cfg.size,
        "publish_acked_msgs_per_s": [round(s["messages"] / ((s["done_ns"] - start_ns) / 1e9)) for s in sent],
        "stamp_ranges": [s["ranges"] for s in sent],
        # Seconds from "go": each publisher's last acknowledgement, each reader's first and last delivery.
        "publishers_done_s": [round((s["done_ns"] - start_ns) / 1e9, 3) for s in sent],
        "readers_first_s": [round((r["first_ns"] - start_ns) / 1e9, 3) for r in got],
        "readers_done_s": [round((r["done_ns"] - start_ns) / 1e9, 3) for r in got],
        "same_order": len(digests) == 1,
        "complete": all(r["data"] == total and r["unique"] == total for r in got),
        "fillers": [r["fillers"] for r in got],
        "cpu_steal_percent": steal,
    }


# ---------------------------------------------------------- child processes --
async def publish_main(sequencer: str, brokers: str, domain: str, count: int, size: int) -> dict[str, Any]:
    body = b"x" * size
    async with OrderedPublisher(
        sequencer, brokers.split(","), TOPIC, domain=domain, client_id=f"bench-{domain}", config=client_config()
    ) as pub:
        print(READY, flush=True)  # noqa: T201 - protocol with the parent process
        async for word in stdin_words():
            if word == "go":
                break
        last: asyncio.Future[Stamp] | None = None
        for i in range(count):
            last = pub.publish_nowait(f"{domain}{i % 100}", body)
            if i % 1000 == 999:
                await asyncio.sleep(0)  # let the stamping task and the links run
        if last is not None:
            await last
        await pub.flush()
        return {"messages": count, "done_ns": time.time_ns(), "ranges": pub.ranges}


async def read_main(brokers: str, name: str, count: int) -> dict[str, Any]:
    domains: list[str] = []
    seqs: list[int] = []
    first_ns = done_ns = 0
    async with OrderedSubscriber(brokers.split(","), name, TOPIC, config=client_config()) as reader:
        await asyncio.wait_for(reader.subscriber.connected.wait(), 30)
        print(READY, flush=True)  # noqa: T201 - protocol with the parent process
        async for message in reader:
            if not seqs:
                first_ns = time.time_ns()
            stamp = message.stamp
            domains.append(stamp.domain)
            seqs.append(stamp.seq)
            if len(seqs) == count:
                done_ns = time.time_ns()
                break
        counters = reader.merge.counters
    # The order, hashed after the clock stopped (the readers compare digests).
    digest = hashlib.sha256(";".join(f"{d}:{s}" for d, s in zip(domains, seqs, strict=True)).encode())
    return {
        "data": len(seqs),
        "unique": len(set(zip(domains, seqs, strict=True))),
        "fillers": {
            "skip_markers": counters.skip_markers,
            "skip_slots": counters.skip_slots,
            "dummies": counters.dummies,
            "distributions": counters.distributions,
        },
        "first_ns": first_ns,
        "done_ns": done_ns,
        "digest": digest.hexdigest(),
    }


async def run(cfg: SequencerBenchConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-seq-") as tmp:
        stamps = await measure_stamps(cfg, Path(tempfile.mkdtemp(prefix="stamps-", dir=tmp)))
        ordered = await measure_ordered(cfg, Path(tempfile.mkdtemp(prefix="ordered-", dir=tmp)))
    return {
        "benchmark": "sequencer",
        "stamps_per_s": stamps["stamps_per_s"],
        "ordered_msgs_per_s": ordered["msgs_per_s"],
        "stamps": stamps,
        "ordered": ordered,
        "setup": "stamps: 1 client process -> 1 sequencer process, one Stamp stream; ordered: 3 OrderedPublisher "
        "processes -> 3 sequencer processes + broker pair (2 processes) -> OrderedSubscriber processes; loopback",
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _child(argv: list[str]) -> dict[str, Any]:
    match argv:
        case ["publish", sequencer, brokers, domain, count, size]:
            return asyncio.run(publish_main(sequencer, brokers, domain, int(count), int(size)))
        case ["read", brokers, name, count]:
            return asyncio.run(read_main(brokers, name, int(count)))
    raise SystemExit(f"usage: python -m {__name__} publish|read ...")


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1:])))  # noqa: T201

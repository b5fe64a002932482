"""The client processes of ``sokutatsu chaos``: publishers, subscribers and a stream flood.

    python -m sokutatsu.cli.chaos_client '<JSON config>'

Publishers and subscribers use the SDK only (``sokutatsu.client``), as an application would.
Each prints ``ready`` once started and appends its history as JSON lines to ``config["out"]``
(see docs/chaos.md); lines on standard input steer it:

* publisher: ``stop`` (publish no more, wait for every acknowledgement, exit).
* subscriber: ``slow`` / ``fast`` (consume at most ``slow_rate`` messages per second, or as fast
  as they come), ``reopen SECONDS`` (close, wait, open again with the stored ``position``),
  ``stop`` (close and exit).
* flood: no steering; it opens ``count`` Subscribe streams on one channel with the generated
  stub, holds them ``seconds`` and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from typing import Any, Literal, TextIO

from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.cli.children import stdin_words
from sokutatsu.client import Publisher, Subscriber, SubscriberConnection
from sokutatsu.core.tls import client_config

READY = "ready"
FLUSH_SECONDS = 0.05


def body_size(rng: random.Random) -> int:
    """100 B to 256 KiB, mostly small: 90 % up to 2 KiB, 8 % up to 64 KiB, 2 % up to 256 KiB."""
    draw = rng.random()
    if draw < 0.90:
        return rng.randint(100, 2048)
    if draw < 0.98:
        return rng.randint(2049, 64 * 1024)
    return rng.randint(64 * 1024 + 1, 256 * 1024)


class Journal:
    """JSON lines appended to a file, written every ``FLUSH_SECONDS`` (and at the end)."""

    def __init__(self, path: str) -> None:
        self._file: TextIO = open(path, "a")  # noqa: SIM115 - closed by close()
        self._lines: list[str] = []

    def add(self, record: dict[str, Any]) -> None:
        self._lines.append(json.dumps(record, separators=(",", ":")))

    def flush(self) -> None:
        if self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines.clear()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            self.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()


def _now() -> float:
    return round(time.time(), 4)


# ---------------------------------------------------------------- publisher --
async def publisher(cfg: dict[str, Any], journal: Journal) -> None:
    rng = random.Random(f"{cfg['seed']}-{cfg['id']}-{os.getpid()}")  # noqa: S311 - sample data
    keys: list[str] = cfg["keys"]
    pub = Publisher(
        cfg["brokers"],
        cfg["id"],
        max_pending=cfg["max_pending"],
        ack_timeout=3600.0,
        connect_timeout=60.0,
        config=client_config(),
    )
    await pub.start()
    journal.add({"e": "start", "t": _now(), "pid": os.getpid(), "first": pub.last_seq + 1})
    journal.flush()
    print(READY, flush=True)  # noqa: T201 - protocol with the harness
    stop = asyncio.Event()
    sent: asyncio.Queue[tuple[int, str, float] | None] = asyncio.Queue()

    async def produce() -> None:
        interval = 1.0 / cfg["rate"]
        next_at = time.monotonic()
        while not stop.is_set():
            next_at = max(next_at + interval, time.monotonic() - 1.0)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await pub.wait_for_room()
            if stop.is_set():
                break
            key = rng.choice(keys)
            seq = pub.publish_nowait(cfg["topic"], key, rng.randbytes(body_size(rng)))
            sent.put_nowait((seq, key, time.time()))
        sent.put_nowait(None)

    async def record_acks() -> None:
        while (item := await sent.get()) is not None:
            seq, key, published = item
            await pub.wait_acked(seq)  # what publish() waits for
            journal.add({"e": "ack", "s": seq, "k": key, "pt": round(published, 4), "t": _now()})

    async def steer() -> None:
        async for word in stdin_words():
            if word == "stop":
                break
        stop.set()

    producing = asyncio.create_task(produce())
    recording = asyncio.create_task(record_acks())
    steering = asyncio.create_task(steer())
    try:
        # Either fails (the SDK gave up): the error is recorded below.
        await asyncio.gather(producing, recording)
        journal.add({"e": "end", "t": _now(), "last": pub.last_seq, "acked": pub.acked_seq})
    except Exception as exc:
        journal.add({"e": "error", "t": _now(), "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        steering.cancel()
        await pub.close()


# --------------------------------------------------------------- subscriber --
class SubscriberProcess:
    """One durable subscription, consumed (fast or slow) and reopened with its position when told.

    With ``connection``, it is one lane of a ``SubscribeMany`` stream (a ``SubscriberConnection``),
    sharing it with ``companions``: more durable subscriptions (``{"prefixes": [...]}`` or
    ``{"keys": [...]}``), consumed as fast as they come and not journaled. Their filters differ from
    the journaled one's, so a frame of one lane handed to another shows in the verdict as a message
    this subscriber should not have."""

    def __init__(self, cfg: dict[str, Any], journal: Journal) -> None:
        self.cfg = cfg
        self.journal = journal
        self.connection = SubscriberConnection(config=client_config()) if cfg.get("connection") else None
        self.companions: list[Subscriber] = []
        self.draining: list[asyncio.Task[None]] = []
        self.slow_rate = float(cfg.get("slow_rate", 10.0))
        self.rate = 0.0  # 0 = as fast as messages come
        self.sub: Subscriber | None = None
        self.gaps_seen = 0
        self.broker = ""
        self.connected = False
        self.position: dict[str, int] = {}
        self.consuming: asyncio.Task[None] | None = None

    def note_changes(self) -> None:
        """New gaps the SDK reported, and a change of broker."""
        sub = self.sub
        if sub is None:
            return
        for gap in sub.gaps[self.gaps_seen :]:
            self.journal.add(
                {"e": "gap", "t": _now(), "p": gap.publisher_id, "first": gap.first_missing, "last": gap.last_missing}
            )
        self.gaps_seen = len(sub.gaps)
        if sub.broker_id and sub.broker_id != self.broker:
            self.broker = sub.broker_id
            self.journal.add({"e": "broker", "t": _now(), "b": sub.broker_id})
        connected = sub.connected.is_set()
        if connected != self.connected:  # seen every FLUSH_SECONDS: a shorter flap can be missed
            self.connected = connected
            self.journal.add({"e": "connected" if connected else "disconnected", "t": _now(), "b": sub.broker_id})

    async def open(self) -> Subscriber:
        mode: Literal["flow-to-disk", "migrate"] | None = self.cfg.get("mode")
        sub = Subscriber(
            self.cfg["brokers"],
            self.cfg["id"],
            self.cfg["topic"],
            keys=self.cfg.get("keys", []),
            prefixes=self.cfg.get("prefixes", []),
            durable=True,
            mode=mode,
            memory_budget=int(self.cfg.get("budget", 0)),
            flow_limit=int(self.cfg.get("flow_limit", 1000)),
            position=self.position or None,
            on_gap="report",
            config=client_config(),
            connection=self.connection,
        )
        self.journal.add({"e": "open", "t": _now(), "position": self.position})
        await sub.start()
        self.sub, self.gaps_seen, self.broker, self.connected = sub, 0, "", False
        self.consuming = asyncio.create_task(self.consume(sub))
        return sub

    async def consume(self, sub: Subscriber) -> None:
        next_at = time.monotonic()
        try:
            async for message in sub:
                self.journal.add({"e": "msg", "p": message.publisher_id, "s": message.publisher_seq, "t": _now()})
                self.note_changes()
                if self.rate:
                    next_at = max(next_at + 1 / self.rate, time.monotonic())
                    await asyncio.sleep(next_at - time.monotonic())
                else:
                    next_at = time.monotonic()
        except Exception as exc:
            self.journal.add({"e": "error", "t": _now(), "error": f"{type(exc).__name__}: {exc}"})
            raise
        self.note_changes()

    async def close(self) -> None:
        if self.consuming is not None:
            self.consuming.cancel()
            await asyncio.gather(self.consuming, return_exceptions=True)
        sub = self.sub
        if sub is not None:
            await sub.close()
            self.note_changes()
            self.position = sub.position
            self.journal.add({"e": "close", "t": _now(), "position": self.position, "duplicates": sub.duplicates})
        self.sub = None

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            self.note_changes()

    async def open_companions(self) -> None:
        for i, settings in enumerate(self.cfg.get("companions", [])):
            companion = Subscriber(
                self.cfg["brokers"],
                f"{self.cfg['id']}-companion-{i}",
                self.cfg["topic"],
                keys=settings.get("keys", []),
                prefixes=settings.get("prefixes", []),
                durable=True,
                on_gap="report",
                config=client_config(),
                connection=self.connection,
            )
            await companion.start()
            self.companions.append(companion)
            self.draining.append(asyncio.create_task(_drain(companion)))

    async def close_companions(self) -> None:
        for task in self.draining:
            task.cancel()
        await asyncio.gather(*self.draining, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.companions), return_exceptions=True)
        if self.connection is not None:
            await self.connection.close()

    async def run(self) -> None:
        await self.open_companions()
        sub = await self.open()
        await asyncio.wait_for(sub.connected.wait(), 60)
        self.note_changes()
        self.journal.flush()
        print(READY, flush=True)  # noqa: T201 - protocol with the harness
        watching = asyncio.create_task(self.watch())
        try:
            async for line in stdin_words():
                word, _, arg = line.partition(" ")
                if word == "slow":
                    self.rate = self.slow_rate
                    self.journal.add({"e": "slow", "t": _now()})
                elif word == "fast":
                    self.rate = 0.0
                    self.journal.add({"e": "fast", "t": _now()})
                elif word == "reopen":
                    await self.close()
                    await asyncio.sleep(float(arg or 1.0))
                    await self.open()
                elif word == "stop":
                    break
        finally:
            watching.cancel()
            await self.close()
            await self.close_companions()
            self.journal.add({"e": "end", "t": _now(), "position": self.position})


async def _drain(sub: Subscriber) -> None:
    async for _ in sub:
        pass


# -------------------------------------------------------------------- flood --
async def flood(cfg: dict[str, Any], journal: Journal) -> None:
    """``count`` Subscribe streams from one client (one channel), held ``seconds``, then ended."""
    print(READY, flush=True)  # noqa: T201 - protocol with the harness
    accepted = refused = failed = 0
    calls: list[aio.StreamStreamCall[broker_pb2.SubscribeRequest, broker_pb2.SubscribeResponse]] = []
    async with aio.insecure_channel(cfg["address"]) as channel:
        stub = broker_pb2_grpc.BrokerStub(channel)

        async def one(i: int) -> None:
            nonlocal accepted, refused, failed
            call = stub.Subscribe()
            calls.append(call)
            subscription = broker_pb2.Subscription(subscriber_id=f"flood-{os.getpid()}-{i}", topic=cfg["topic"])
            try:
                await call.write(
                    broker_pb2.SubscribeRequest(open=broker_pb2.SubscribeOpen(subscription=subscription, credits=1))
                )
                reply = await asyncio.wait_for(call.read(), 30)
            except (aio.AioRpcError, TimeoutError, aio.UsageError):
                refused += 1
                return
            if isinstance(reply, broker_pb2.SubscribeResponse) and reply.WhichOneof("frame") == "subscribed":
                accepted += 1
            else:
                code = await call.code()
                refused += 1
                failed += code is None

        started = time.time()
        await asyncio.gather(*(one(i) for i in range(int(cfg["count"]))))
        journal.add({"e": "flood", "t": _now(), "started": started, "accepted": accepted, "refused": refused})
        journal.flush()
        await asyncio.sleep(float(cfg["seconds"]))
        for call in calls:
            call.cancel()
    journal.add({"e": "end", "t": _now()})


async def main(cfg: dict[str, Any]) -> None:
    journal = Journal(cfg["out"])
    flushing = asyncio.create_task(journal.run())
    try:
        role = cfg["role"]
        if role == "publisher":
            await publisher(cfg, journal)
        elif role == "subscriber":
            await SubscriberProcess(cfg, journal).run()
        else:
            await flood(cfg, journal)
    finally:
        flushing.cancel()
        journal.close()


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    # The SDK's warnings (reconnects, gaps) go to the process's own log, not the harness's terminal.
    log_fd = os.open(config["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(config))

"""Fuzzing every RPC of every service, on real service processes (issue #10).

For each RPC found in the generated descriptors (so a new RPC is fuzzed without a change here, and
``test_every_service_is_fuzzed`` fails for a new service until it is given a process), hypothesis
draws

* request messages from the RPC's input descriptor (``tests/security/fuzz_proto.py``): every
  field type at and past its edges, nested, repeated, maps, oneofs, unknown enum numbers, long and
  non-ASCII strings, bytes over the frame limit (4 MiB here); a stream RPC gets a sequence of frames;
* raw frames that are not a valid encoding of the request (random, truncated or bit-flipped
  bytes, impossible wire types), sent with identity serializers.

Every call runs under a gRPC deadline and must end with a documented status (``DOCUMENTED``),
never ``UNKNOWN`` or ``INTERNAL`` (an unhandled exception) nor ``DEADLINE_EXCEEDED`` (a hang). A
stream a valid open keeps open (``Subscribe``, the ``Watch*`` streams) is read until it ends, has
answered a few frames, or is quiet after the frames were sent, then cancelled: that is its
documented behaviour, not a hang. After each RPC's examples the process is alive, reports SERVING,
and its log has no traceback; on the broker a canary ``Publisher`` and ``Subscriber`` (the SDK's)
publish and receive throughout, and must have received every message exactly once, in order.

Run time: ``EXAMPLES`` requests and ``RAW_EXAMPLES`` raw frames per RPC, derandomized (the same
examples on every run).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import os
import random
import re
import string
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import psycopg
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import Publisher, Subscriber, SubscriberConnection
from sokutatsu.core.auth_rules import is_control
from sokutatsu.core.dsn import create_database, database_dsn
from sokutatsu.core.embedded_pg import free_port
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc
from sokutatsu.queuedb.schema import migrate
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc
from tests.broker.fix_broker import BrokerProcess
from tests.cluster_channel import cluster_channel
from tests.helpers import ServiceProc, ensure_stopped, start_service
from tests.monitor.fix_monitor import MonitorProcess, brokers_setting
from tests.security.fuzz_proto import malformed, messages, path, request_class
from tests.sequencer.fix_sequencer import SequencerProcess

pytestmark = pytest.mark.timeout(300)

# More for a longer local run: FUZZ_EXAMPLES=500 (raw frames get half as many).
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "20"))
RAW_EXAMPLES = max(1, EXAMPLES // 2)
# Bounds that only stop a hung call or test; nothing asserts on durations.
RPC_SECONDS = 10.0
QUIET_SECONDS = 0.2
CHECK_SECONDS = 30.0
MAX_FRAMES = 4

DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
# Documented for these processes only: the monitor when a broker it needs does not answer
# (docs/monitor.md), a sequencer before its first distribution (docs/sequencer.md).
ALSO_DOCUMENTED = {"monitor": {grpc.StatusCode.UNAVAILABLE}, "sequencer": {grpc.StatusCode.UNAVAILABLE}}
# The client cancelled a stream that stayed open (see the module docstring).
LEFT_OPEN = "left open"

# make protos writes the APIs the SDK speaks to libs/client, the others to libs/core.
PROTO_PACKAGES = [Path(__file__).parents[2] / "libs" / lib / "src" / "sokutatsu" for lib in ("client", "core")]

# Which process serves each service (a new service fails test_every_service_is_fuzzed until added).
SERVED_BY = {
    "sokutatsu.broker.v1.Broker": "broker",
    "sokutatsu.broker.v1.BrokerAdmin": "broker",
    # Its own broker: SetRole may make a broker standby, which the canary's broker must stay out of.
    "sokutatsu.broker.v1.BrokerControl": "control",
    "sokutatsu.monitor.v1.Monitor": "monitor",
    "sokutatsu.sequencer.v1.Sequencer": "sequencer",
    "sokutatsu.queuedb.v1.QueueService": "queuedb",
    "sokutatsu.queuedb.v1.Transfer": "queuedb",
    # Served by every process, from the shared bootstrap: fuzzed on the broker's.
    "sokutatsu.core.v1.Process": "broker",
}

CANARY_TOPIC = "fuzz.canary"
# The smallest frame limit a service takes (16 MiB by default), so that frames over it cost little.
FRAME_LIMIT = {"SOKUTATSU_MAX_FRAME_BYTES": "4MiB"}


def _proto_files() -> list[FileDescriptor]:
    """Every generated ``*_pb2`` module's file descriptor, found on disk."""
    files = []
    for module in sorted(m for packages in PROTO_PACKAGES for m in packages.glob("*/v1/*_pb2.py")):
        name = ".".join(module.relative_to(module.parents[3]).with_suffix("").parts)
        files.append(importlib.import_module(name).DESCRIPTOR)
    return files


def _all_methods() -> list[MethodDescriptor]:
    return [m for f in _proto_files() for s in f.services_by_name.values() for m in s.methods]


METHODS = _all_methods()


def test_every_service_is_fuzzed() -> None:
    services = {s.full_name for f in _proto_files() for s in f.services_by_name.values()}
    assert services == set(SERVED_BY), "give each service a process in SERVED_BY"
    assert len(METHODS) >= 40


# ------------------------------------------------------------------------------------------ loop --
T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a thread of its own: the canary runs there while hypothesis (synchronous)
    sends the fuzzed calls through it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], limit: float = 120.0) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(limit)
        except TimeoutError:
            raise TimeoutError(f"not done after {limit:g} s on the fuzz loop:\n{self.stacks()}") from None

    def stacks(self) -> str:
        """Where the loop's thread is now, and every task's stack: what a hung call waits on."""
        frame = sys._current_frames().get(self.thread.ident or 0)
        lines = ["the loop's thread:", *traceback.format_stack(frame)] if frame is not None else []
        for task in asyncio.all_tasks(self.loop):
            lines.append(f"{task.get_name()}:\n")
            awaited: Any = task.get_coro()
            while awaited is not None:  # the chain of awaits down to where it waits
                frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
                if frame is not None:
                    lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}\n")
                awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        return "".join(lines)

    def close(self) -> None:
        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


# ---------------------------------------------------------------------------------------- canary --
@dataclass
class Canary:
    """The SDK's Publisher and Subscriber on the broker, publishing and receiving all along."""

    address: str
    sent: list[int] = field(default_factory=list)
    received: list[int] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    subscriber: Subscriber | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    acked: asyncio.Event = field(default_factory=asyncio.Event)
    checked: int = 0  # messages published by the last check
    # The subscriber's on a SubscribeMany stream (which a broker with delivery workers moves to one).
    many: bool = False

    async def start(self) -> None:
        connection = await self.stack.enter_async_context(SubscriberConnection()) if self.many else None
        self.subscriber = await self.stack.enter_async_context(
            Subscriber(self.address, "fuzz-canary-sub", CANARY_TOPIC, connection=connection)
        )
        await asyncio.wait_for(self.subscriber.connected.wait(), CHECK_SECONDS)
        publisher = await self.stack.enter_async_context(Publisher(self.address, "fuzz-canary-pub"))
        self.tasks = [
            asyncio.create_task(self._publish(publisher)),
            asyncio.create_task(self._receive(self.subscriber)),
        ]

    async def _publish(self, publisher: Publisher) -> None:
        n = 0
        while True:
            await publisher.publish(CANARY_TOPIC, "K", str(n).encode())
            self.sent.append(n)
            self.acked.set()
            n += 1
            await asyncio.sleep(0.01)

    async def _receive(self, subscriber: Subscriber) -> None:
        async for message in subscriber:
            self.received.append(int(message.body))
            self.arrived.set()

    async def check(self) -> str:
        """Nothing lost, nothing twice, in order, so far; '' or what went wrong."""
        for task in self.tasks:
            if task.done():
                return f"a canary task ended: {task!r}"
        # The publisher goes on publishing (acknowledged) since the last check...
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CHECK_SECONDS):
                while len(self.sent) <= self.checked:
                    self.acked.clear()
                    await self.acked.wait()
        published = len(self.sent)
        if published <= self.checked:
            return f"the canary's publisher has had nothing acknowledged since message {published}"
        self.checked = published
        # ...and the subscriber receives all of it.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CHECK_SECONDS):
                while len(self.received) < published:
                    self.arrived.clear()
                    await self.arrived.wait()
        if self.received[:published] != self.sent[:published]:
            return f"the canary received {self.received[:published]} of {self.sent[:published]}"
        if self.received != list(range(len(self.received))):
            return f"the canary received {self.received}"
        assert self.subscriber is not None
        if self.subscriber.gaps:
            return f"the canary saw gaps {self.subscriber.gaps}"
        return ""

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.stack.aclose()


# --------------------------------------------------------------------------------------- targets --
@dataclass
class Target:
    """A started process that serves some of the services, and a channel to it (on the loop)."""

    name: str
    address: str
    alive: Callable[[], bool]
    log: Callable[[], str]
    loop: LoopThread
    channel: grpc.Channel | None = None  # control calls carry the cluster secret
    bare: grpc.Channel | None = None  # no cluster secret
    canary: Canary | None = None
    log_seen: int = 0  # how much of the log was checked already
    pid: int = 0

    def open(self) -> None:
        self.channel = cluster_channel(self.address)
        self.bare = grpc.insecure_channel(self.address)

    def unharmed(self) -> str:
        """'' when the process is alive, SERVING, has logged no traceback, and its canary is well."""
        if not self.alive():
            return f"{self.name} exited:\n{self.log()[-4000:]}"
        assert self.channel is not None
        reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_SECONDS)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"{self.name} is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        everything = self.log()
        log, self.log_seen = _without_known_noise(everything[self.log_seen :]), len(everything)
        if "Traceback" in log:
            return f"{self.name} logged a traceback:\n{log[max(0, log.index('Traceback') - 2000) :][:6000]}"
        if self.canary is not None:
            return self.loop.run(self.canary.check(), CHECK_SECONDS * 2)
        return ""


# OpenTelemetry's gRPC server interceptor logs this, with a traceback, when a client cancels a
# server stream (open-telemetry/opentelemetry-python-contrib#2357): the call ends as it should and
# nothing propagates, so it is no unhandled error of the service's.
KNOWN_NOISE = "opentelemetry.context: Failed to detach context"
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", re.MULTILINE)


def _without_known_noise(log: str) -> str:
    starts = [m.start() for m in RECORD.finditer(log)]
    records = [log[a:b] for a, b in itertools.pairwise([0, *starts, len(log)])]
    return "".join(r for r in records if KNOWN_NOISE not in r)


class Targets:
    """The processes, started when a test first needs them, stopped at the end of the module."""

    def __init__(self, folder: Path, request: pytest.FixtureRequest) -> None:
        self.folder = folder
        self.request = request
        self.loop = LoopThread()
        self.started: dict[str, Target] = {}
        self.failed: dict[str, BaseException] = {}
        self.cleanups: list[Callable[[], object]] = []

    def get(self, name: str) -> Target:
        if name in self.failed:
            pytest.fail(f"{name} did not start: {self.failed[name]}")
        if name not in self.started:
            try:
                target = getattr(self, f"_start_{name}")()
            except BaseException as exc:
                self.failed[name] = exc
                raise
            target.open()
            self.started[name] = target
        return self.started[name]

    def _broker(self, name: str, **env: str) -> BrokerProcess:
        folder = self.folder / name
        folder.mkdir()
        broker = BrokerProcess(
            folder=folder, env={**FRAME_LIMIT, **{f"SOKUTATSU_BROKER_{k.upper()}": v for k, v in env.items()}}
        )
        self.cleanups.append(broker.stop)
        broker.start()
        return broker

    def _of_broker(self, name: str, broker: BrokerProcess) -> Target:
        assert broker.process is not None
        process = broker.process
        return Target(name, broker.address, lambda: process.poll() is None, broker.log, self.loop, pid=process.pid)

    def _start_broker(self) -> Target:
        target = self._of_broker("broker", self._broker("broker"))
        canary = Canary(target.address)
        self.loop.run(canary.start())
        self.cleanups.append(lambda: self.loop.run(canary.close()))
        target.canary = canary
        return target

    def _start_worker(self) -> Target:
        """The delivery worker of a broker with one: the target is the worker's port; the canary
        subscribes through it (SubscribeMany, moved there) and publishes to the broker."""
        broker = self._broker("with-worker", delivery_workers="1")
        (worker,) = self.loop.run(broker.stats()).delivery_workers
        assert broker.process is not None
        process = broker.process

        def alive() -> bool:
            # The broker is up and its worker is the one it started (not started again after a crash).
            if process.poll() is not None:
                return False
            (now,) = self.loop.run(broker.stats()).delivery_workers
            return now.ready and now.pid == worker.pid and now.restarts == 0

        target = Target("delivery worker", worker.address, alive, broker.log, self.loop, pid=worker.pid)
        canary = Canary(broker.address, many=True)
        self.loop.run(canary.start())
        self.cleanups.append(lambda: self.loop.run(canary.close()))
        target.canary = canary
        return target

    def _start_control(self) -> Target:
        return self._of_broker("control broker", self._broker("control"))

    def _start_monitor(self) -> Target:
        a = self._broker("pair-a", instance="broker-a", role="active", peer_timeout_ms="500")
        b = self._broker("pair-b", instance="broker-b", role="standby", peer=a.address, peer_timeout_ms="500")
        folder = self.folder / "monitor"
        folder.mkdir()
        monitor = MonitorProcess(
            folder=folder, env={**FRAME_LIMIT, "SOKUTATSU_MONITOR_BROKERS": brokers_setting((a, b))}
        )
        self.cleanups.append(monitor.stop)
        monitor.start()
        assert monitor.process is not None
        process = monitor.process
        return Target(
            "monitor", monitor.address, lambda: process.poll() is None, monitor.log, self.loop, pid=process.pid
        )

    def _start_sequencer(self) -> Target:
        broker = self.get("broker")
        folder = self.folder / "sequencer"
        folder.mkdir()
        sequencer = SequencerProcess(
            "a",
            folder,
            f"127.0.0.1:{free_port()}",
            {
                "SOKUTATSU_SEQUENCER_BROKERS": broker.address,
                "SOKUTATSU_SEQUENCER_TOPIC": "fuzz.ordered",
                "SOKUTATSU_SEQUENCER_LEADER": "true",
                **FRAME_LIMIT,
            },
        )
        self.cleanups.append(sequencer.stop)
        sequencer.start()
        assert sequencer.process is not None
        process = sequencer.process
        return Target(
            "sequencer", sequencer.address, lambda: process.poll() is None, sequencer.log, self.loop, pid=process.pid
        )

    def _start_queuedb(self) -> Target:
        pg_dsn: str = self.request.getfixturevalue("pg_dsn")
        name = f"qdb_fuzz_{uuid.uuid4().hex[:12]}"
        create_database(pg_dsn, name)
        dsn = database_dsn(pg_dsn, name)
        self.cleanups.append(lambda: _drop_database(pg_dsn, name))
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
        folder = self.folder / "queuedb"
        folder.mkdir()
        proc: ServiceProc = start_service(
            "sokutatsu.queuedb",
            {
                "SOKUTATSU_QUEUEDB_LISTEN": "127.0.0.1:0",
                "SOKUTATSU_QUEUEDB_INSTANCE": "node1",
                "SOKUTATSU_QUEUEDB_DSN": dsn,
                "SOKUTATSU_GRACE_SECONDS": "1",
                **FRAME_LIMIT,
            },
            folder,
        )
        self.cleanups.append(lambda: ensure_stopped(proc.process))
        with grpc.insecure_channel(proc.address) as channel:  # queues the fuzzed names often hit
            for queue in ("q1", "fuzz"):
                queuedb_pb2_grpc.QueueServiceStub(channel).CreateQueue(
                    queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name=queue)), timeout=RPC_SECONDS
                )
        return Target(
            "queue-db", proc.address, lambda: proc.process.poll() is None, proc.output, self.loop, pid=proc.process.pid
        )

    def close(self) -> None:
        for target in self.started.values():
            for channel in (target.channel, target.bare):
                if channel is not None:
                    channel.close()
        # Every clean-up runs, so a hung one (reported) leaves no service process behind for later tests.
        failures: list[BaseException] = []
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception as exc:  # noqa: BLE001 - raised below, after the others ran
                failures.append(exc)
        self.loop.close()
        if failures:
            raise failures[0]


def _drop_database(pg_dsn: str, name: str) -> None:
    # Prepared transactions (Transfer/PrepareBatch) keep a database from being dropped.
    with psycopg.connect(database_dsn(pg_dsn, name), autocommit=True) as conn:
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall():
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Targets]:
    made = Targets(tmp_path_factory.mktemp("fuzz"), request)
    try:
        yield made
    finally:
        made.close()


# ----------------------------------------------------------------------------------------- calls --
Outcome = tuple[grpc.StatusCode | str, str]


def invoke(channel: grpc.Channel, method: MethodDescriptor, frames: list[bytes]) -> Outcome:
    """Send ``frames`` (already serialized: identity serializers) to ``method``; its outcome.

    grpcio's synchronous client, not its asyncio one: that one may report ``INTERNAL`` for a stream
    the server ended while the client was still writing (grpc/grpc#36066), hiding the server's status.
    """
    name = path(method)
    channel_: Any = channel  # identity serializers: bytes in, bytes out
    try:
        if not method.server_streaming:
            if method.client_streaming:
                channel_.stream_unary(name)(iter(frames), timeout=RPC_SECONDS)
            else:
                channel_.unary_unary(name)(frames[0], timeout=RPC_SECONDS)
            return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    sent = threading.Event()

    def requests() -> Iterator[bytes]:
        yield from frames
        sent.set()

    if method.client_streaming:
        call: Any = channel_.stream_stream(name)(requests(), timeout=RPC_SECONDS)
    else:
        sent.set()
        call = channel_.unary_stream(name)(frames[0], timeout=RPC_SECONDS)
    return _drain(call, sent)


def _drain(call: Any, sent: threading.Event) -> Outcome:
    """Read a response stream until it ends; a stream still open after a few answers, or quiet once
    the frames were sent, is cancelled (``LEFT_OPEN``)."""
    answered = threading.Event()
    left_open = threading.Event()

    def watch() -> None:
        while not call.done():
            answered.clear()
            if not answered.wait(QUIET_SECONDS) and sent.is_set() and not call.done():
                left_open.set()
                call.cancel()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for count, _ in enumerate(call, 1):
            answered.set()
            if count >= 3:
                left_open.set()
                call.cancel()
                break
    except grpc.RpcError:
        pass
    watcher.join()
    if left_open.is_set():
        return LEFT_OPEN, ""
    return call.code(), call.details() or ""


def _frames(method: MethodDescriptor, one: st.SearchStrategy[bytes]) -> st.SearchStrategy[list[bytes]]:
    if method.client_streaming:
        return st.lists(one, min_size=1, max_size=MAX_FRAMES)
    return st.lists(one, min_size=1, max_size=1)


def _valid_frames(method: MethodDescriptor) -> st.SearchStrategy[list[bytes]]:
    frames = _frames(method, messages(method.input_type).map(lambda m: m.SerializeToString()))
    repaired = REPAIRED.get(path(method))
    # Half the time the drawn frames made consistent (an opening frame, dense sequence numbers), so
    # that the fuzzed fields reach the body of the RPC rather than its first check.
    return frames if repaired is None else st.one_of(frames, repaired)


_fresh = itertools.count()  # a new publisher or sending node per example: their sequences start at 1


def _publish_stream(batches: list[Message]) -> list[bytes]:
    publisher = f"fuzz-pub-{next(_fresh)}"
    frames = [broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id=publisher)).SerializeToString()]
    seq = 0
    for batch in batches:
        assert isinstance(batch, broker_pb2.PublishBatch)
        for message in batch.messages:
            seq += 1
            message.publisher_id, message.publisher_seq = publisher, seq
        frames.append(broker_pb2.PublishRequest(batch=batch).SerializeToString())
    return frames


def _subscribe_stream(first: Message, rest: list[bytes]) -> list[bytes]:
    assert isinstance(first, broker_pb2.SubscribeOpen)
    first.credits = max(first.credits, 1)
    return [broker_pb2.SubscribeRequest(open=first).SerializeToString(), *rest]


def _transfer_batches(batches: list[Message]) -> list[queuedb_pb2.TransferBatch]:
    sender = f"fuzz-node-{next(_fresh)}"
    transfer_id = 0
    for batch in batches:
        assert isinstance(batch, queuedb_pb2.TransferBatch)
        batch.sender_node = sender
        for message in batch.messages:
            transfer_id += 1
            message.transfer_id = transfer_id
    return [b for b in batches if isinstance(b, queuedb_pb2.TransferBatch)]


def _prepare(batches: list[Message]) -> list[bytes]:
    (batch,) = _transfer_batches(batches)
    gid = f"sokutatsu:{batch.sender_node}:1"
    return [queuedb_pb2.PrepareBatchRequest(batch=batch, gid=gid).SerializeToString()]


def _serialized(batches: list[queuedb_pb2.TransferBatch]) -> list[bytes]:
    return [b.SerializeToString() for b in batches]


_BATCHES = st.lists(messages(queuedb_pb2.TransferBatch.DESCRIPTOR), min_size=1, max_size=MAX_FRAMES)
_BATCH = st.lists(messages(queuedb_pb2.TransferBatch.DESCRIPTOR), min_size=1, max_size=1)
_SUBSCRIBE_FRAMES = st.lists(
    messages(broker_pb2.SubscribeRequest.DESCRIPTOR).map(lambda m: m.SerializeToString()), max_size=MAX_FRAMES - 1
)
REPAIRED: dict[str, st.SearchStrategy[list[bytes]]] = {
    "/sokutatsu.broker.v1.Broker/Publish": st.lists(
        messages(broker_pb2.PublishBatch.DESCRIPTOR), min_size=1, max_size=MAX_FRAMES - 1
    ).map(_publish_stream),
    "/sokutatsu.broker.v1.Broker/Subscribe": st.builds(
        _subscribe_stream, messages(broker_pb2.SubscribeOpen.DESCRIPTOR), _SUBSCRIBE_FRAMES
    ),
    "/sokutatsu.queuedb.v1.Transfer/Deliver": _BATCH.map(_transfer_batches).map(_serialized),
    "/sokutatsu.queuedb.v1.Transfer/DeliverStream": _BATCHES.map(_transfer_batches).map(_serialized),
    "/sokutatsu.queuedb.v1.Transfer/PrepareBatch": _BATCH.map(_prepare),
}


def _shown(method: MethodDescriptor, frame: bytes) -> str:
    try:
        return repr(request_class(method).FromString(frame))[:1000]
    except DecodeError:
        return repr(frame[:200])


def _fuzz(
    targets: Targets,
    method: MethodDescriptor,
    frames: st.SearchStrategy[list[bytes]],
    examples: int,
    *,
    secret: bool = True,
    served_by: str = "",
) -> None:
    """``examples`` calls of ``frames``; each must end with a documented code. Without ``secret``
    (a caller without the cluster secret) a control RPC must be refused ``UNAUTHENTICATED``, every time.
    ``served_by``: another target than the one ``SERVED_BY`` names."""
    served_by = served_by or SERVED_BY[method.containing_service.full_name]
    target = targets.get(served_by)
    documented = DOCUMENTED | ALSO_DOCUMENTED.get(served_by, set())
    if not secret and is_control(path(method)):
        documented = {grpc.StatusCode.UNAUTHENTICATED}
    channel = target.channel if secret else target.bare
    assert channel is not None
    refused: list[str] = []

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(frames)
    def run(sent: list[bytes]) -> None:
        code, details = invoke(channel, method, sent)
        if code == LEFT_OPEN and method.server_streaming:
            return
        if code not in documented:
            refused.append(f"{code} {details!r} for {[_shown(method, f) for f in sent][:2]}"[:3000])

    # Collected rather than raised, so hypothesis does not shrink through many slow calls; the
    # first few are reported.
    run()
    problem = target.unharmed()  # first: it also takes this RPC's part of the log
    assert not refused, f"{path(method)}: {len(refused)} undocumented outcomes, e.g.\n" + "\n".join(refused[:3])
    assert not problem, problem


@pytest.mark.parametrize("method", METHODS, ids=path)
def test_fuzzed_requests(targets: Targets, method: MethodDescriptor) -> None:
    _fuzz(targets, method, _valid_frames(method), EXAMPLES)


@pytest.mark.parametrize("method", METHODS, ids=path)
def test_malformed_frames(targets: Targets, method: MethodDescriptor) -> None:
    _fuzz(targets, method, _frames(method, malformed(method.input_type)), RAW_EXAMPLES)


# What a delivery worker serves (docs/broker.md, Delivery workers): fuzzed on its own port too.
WORKER_METHODS = [m for m in METHODS if path(m) == "/sokutatsu.broker.v1.Broker/SubscribeMany"]


@pytest.mark.parametrize("method", WORKER_METHODS, ids=path)
def test_fuzzed_requests_on_a_delivery_worker(targets: Targets, method: MethodDescriptor) -> None:
    _fuzz(targets, method, _valid_frames(method), EXAMPLES, served_by="worker")


@pytest.mark.parametrize("method", WORKER_METHODS, ids=path)
def test_malformed_frames_on_a_delivery_worker(targets: Targets, method: MethodDescriptor) -> None:
    _fuzz(targets, method, _frames(method, malformed(method.input_type)), RAW_EXAMPLES, served_by="worker")


CONTROL_METHODS = [m for m in METHODS if is_control(path(m))]


@pytest.mark.parametrize("method", CONTROL_METHODS, ids=path)
def test_control_rpcs_need_the_cluster_secret(targets: Targets, method: MethodDescriptor) -> None:
    """Issue #20: the control plane was open to anyone reaching a port while auth was off. Without
    the cluster secret, or with another one, every control RPC is UNAUTHENTICATED, whatever is sent."""
    target = targets.get(SERVED_BY[method.containing_service.full_name])
    assert target.bare is not None
    assert target.channel is not None
    empty = [request_class(method)().SerializeToString()]
    code, details = invoke(target.bare, method, empty)
    assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
    assert "it needs the cluster secret" in details
    assert "clients never call it" in details
    wrong_secret = "not-the-cluster-secret-0123456789"  # noqa: S105 - a wrong one, on purpose
    with cluster_channel(target.address, secret=wrong_secret) as wrong:
        code, details = invoke(wrong, method, empty)
    assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
    assert "is not this service's" in details
    code, details = invoke(target.channel, method, empty)  # with the secret: through to the service
    assert code != grpc.StatusCode.UNAUTHENTICATED, details
    _fuzz(targets, method, _valid_frames(method), max(EXAMPLES // 4, 5), secret=False)


def test_a_fake_sender_cannot_inject_a_message(targets: Targets) -> None:
    """The issue's attack: a Deliver from outside the cluster created a queue and stored a message."""
    target = targets.get("queuedb")
    assert target.bare is not None
    assert target.channel is not None
    message = queuedb_pb2.TransferredMessage(transfer_id=1, queue="injected", body=b"x")
    with pytest.raises(grpc.RpcError) as refused:
        queuedb_pb2_grpc.TransferStub(target.bare).Deliver(
            queuedb_pb2.TransferBatch(sender_node="intruder", messages=[message]), timeout=RPC_SECONDS
        )
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    queues = queuedb_pb2_grpc.QueueServiceStub(target.bare).ListQueues(
        queuedb_pb2.ListQueuesRequest(), timeout=RPC_SECONDS
    )
    assert "injected" not in [q.name for q in queues.queues]


def test_transfer_numbers_over_a_bigint_are_refused(targets: Targets) -> None:
    """What the fuzzing found with more examples (PostgreSQL's bigint out of range was INTERNAL)."""
    target = targets.get("queuedb")
    assert target.channel is not None
    message = queuedb_pb2.TransferredMessage(transfer_id=1, queue="q1", enqueued_unix_nano=2**64 - 1)
    batch = queuedb_pb2.TransferBatch(sender_node="fuzz-bigint", messages=[message])
    with pytest.raises(grpc.RpcError) as refused:
        queuedb_pb2_grpc.TransferStub(target.channel).Deliver(batch, timeout=RPC_SECONDS)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].enqueued_unix_nano of 18446744073709551615 is over the limit" in (refused.value.details() or "")
    problem = target.unharmed()
    assert not problem, problem


# ---------------------------------------------------------------------------------------- health --
# One process per service (issue #20): grpc.health.v1 is served by every one, from the bootstrap.
SERVICES = ("broker", "monitor", "sequencer", "queuedb")
SERVING = health_pb2.HealthCheckResponse.SERVING
# A stock grpcio channel with client-side health checking (gRFC A17): it sends calls only to a
# server whose health Watch says SERVING, and fails them UNAVAILABLE "health check call failed" else.
CLIENT_SIDE_HEALTH = json.dumps(
    {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
)


@pytest.mark.parametrize("name", SERVICES)
def test_health_check_watch_and_list(targets: Targets, name: str) -> None:
    """Check, Watch (first answer: the current status; an unknown service: SERVICE_UNKNOWN, the
    call staying open) and List; Watch was UNKNOWN and List INTERNAL before."""
    target = targets.get(name)
    assert target.channel is not None
    health = health_pb2_grpc.HealthStub(target.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_SECONDS).status == SERVING
    for service, first in (("", SERVING), ("no.such.Service", health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)):
        watch = health.Watch(health_pb2.HealthCheckRequest(service=service), timeout=RPC_SECONDS)
        try:
            assert next(watch).status == first
        finally:
            watch.cancel()
    listed = health.List(health_pb2.HealthListRequest(), timeout=RPC_SECONDS)
    assert listed.statuses[""].status == SERVING
    assert all(s.status == SERVING for s in listed.statuses.values()), listed
    problem = target.unharmed()
    assert not problem, problem


@pytest.mark.parametrize("name", SERVICES)
def test_a_client_side_health_checking_channel_is_served(targets: Targets, name: str) -> None:
    target = targets.get(name)
    with grpc.insecure_channel(target.address, options=[("grpc.service_config", CLIENT_SIDE_HEALTH)]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_SECONDS)
    assert reply.status == SERVING
    problem = target.unharmed()
    assert not problem, problem


# -------------------------------------------------------------------------------------- oversize --
# A value far over every name limit and over gRPC's 16 KiB metadata limit if a refusal echoed it
# whole (RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" before, issue #20).
BIG = "x" * 2**20
OVERSIZE_TOPIC = "fuzz.oversize"


def _publish(channel: grpc.Channel, *frames: broker_pb2.PublishRequest) -> None:
    for _ in broker_pb2_grpc.BrokerStub(channel).Publish(iter(frames), timeout=RPC_SECONDS):
        pass


def _big_topic(channel: grpc.Channel) -> None:
    broker_pb2_grpc.BrokerAdminStub(channel).CreateTopic(
        broker_pb2.CreateTopicRequest(topic=broker_pb2.Topic(name=BIG)), timeout=RPC_SECONDS
    )


def _big_subscriber(channel: grpc.Channel) -> None:
    subscription = broker_pb2.Subscription(subscriber_id=BIG, topic=CANARY_TOPIC)
    broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
        broker_pb2.CreateSubscriptionRequest(subscription=subscription), timeout=RPC_SECONDS
    )


def _big_publisher(channel: grpc.Channel) -> None:
    _publish(channel, broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id=BIG)))


def _big_key(channel: grpc.Channel) -> None:
    with contextlib.suppress(grpc.RpcError):  # there already
        broker_pb2_grpc.BrokerAdminStub(channel).CreateTopic(
            broker_pb2.CreateTopicRequest(topic=broker_pb2.Topic(name=OVERSIZE_TOPIC)), timeout=RPC_SECONDS
        )
    publisher = f"fuzz-oversize-{next(_fresh)}"
    message = broker_pb2.Message(publisher_id=publisher, publisher_seq=1, key=BIG, body=b"x")
    _publish(
        channel,
        broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id=publisher)),
        broker_pb2.PublishRequest(batch=broker_pb2.PublishBatch(topic=OVERSIZE_TOPIC, messages=[message])),
    )


def _big_queue(channel: grpc.Channel) -> None:
    queuedb_pb2_grpc.QueueServiceStub(channel).CreateQueue(
        queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name=BIG)), timeout=RPC_SECONDS
    )


def _big_domain(channel: grpc.Channel) -> None:
    request = sequencer_pb2.StampRequest(request_id=1, count=1, client_id="fuzz-oversize", domain=BIG)
    for _ in sequencer_pb2_grpc.SequencerStub(channel).Stamp(iter([request]), timeout=RPC_SECONDS):
        pass


def _big_monitored_subscriber(channel: grpc.Channel) -> None:
    """GetAssignment of an unknown subscriber, once the monitor has its brokers' statistics (before
    that it answers UNAVAILABLE whatever is asked; this waits for that, bounded by the test's timeout)."""
    monitor = monitor_pb2_grpc.MonitorStub(channel)
    while True:
        try:
            monitor.GetAssignment(monitor_pb2.GetAssignmentRequest(subscriber_id=BIG), timeout=RPC_SECONDS)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or "statistics yet" not in (error.details() or ""):
                raise
        else:
            return


# (target, what the message names the value by, the call, the refusal's code)
OVERSIZE: dict[str, tuple[str, str, Callable[[grpc.Channel], None], grpc.StatusCode]] = {
    "topic": ("broker", "topic name", _big_topic, grpc.StatusCode.INVALID_ARGUMENT),
    "subscriber id": ("broker", "subscriber id", _big_subscriber, grpc.StatusCode.INVALID_ARGUMENT),
    "publisher id": ("broker", "publisher id", _big_publisher, grpc.StatusCode.INVALID_ARGUMENT),
    "key": ("broker", "key", _big_key, grpc.StatusCode.INVALID_ARGUMENT),
    "queue name": ("queuedb", "Queue.name", _big_queue, grpc.StatusCode.INVALID_ARGUMENT),
    # A sequencer of another domain, a monitor that knows no such subscriber: their documented codes.
    "sequencer domain": ("sequencer", "domain", _big_domain, grpc.StatusCode.NOT_FOUND),
    "monitor subscriber": ("monitor", "subscriber", _big_monitored_subscriber, grpc.StatusCode.NOT_FOUND),
}


@pytest.mark.parametrize("probe", OVERSIZE)
def test_an_oversize_value_is_refused_with_its_length(targets: Targets, probe: str) -> None:
    name, field_name, call, code = OVERSIZE[probe]
    target = targets.get(name)
    assert target.channel is not None
    with pytest.raises(grpc.RpcError) as refused:
        call(target.channel)
    details = refused.value.details() or ""
    assert refused.value.code() == code, details[:500]
    assert field_name in details, details
    assert f"({len(BIG)} characters)" in details, details
    assert "x" * 101 not in details, "the value is shown cut"
    problem = target.unharmed()
    assert not problem, problem


# ------------------------------------------------------------------------------- extreme numbers --
# Every numeric field of every request of the broker, monitor, sequencer and Process services, set
# alone to each extreme its type holds (issue #20 item 3): each answered with a documented code, the
# process unharmed. Frames are made consistent (an open before a batch, names a call needs) so that
# the number reaches the body of the RPC; docs/security.md, Caps on client-supplied amounts.
EXTREME_SERVICES = (
    "sokutatsu.broker.v1.Broker",
    "sokutatsu.broker.v1.BrokerAdmin",
    "sokutatsu.broker.v1.BrokerControl",
    "sokutatsu.monitor.v1.Monitor",
    "sokutatsu.sequencer.v1.Sequencer",
    "sokutatsu.core.v1.Process",
)
EXTREME_TOPIC = "fuzz.extreme"
_I32 = (0, -1, 2**31 - 1, -(2**31))
_I64 = (0, -1, 2**31, 2**32, 2**63 - 1, -(2**63))
_U32 = (0, 2**31, 2**32 - 1)
_U64 = (0, 2**31, 2**32, 2**63 - 1, 2**64 - 1)
_FLOATS = (0.0, -1.0, 1e308, float("inf"), float("nan"))
EXTREMES: dict[int, tuple[int | float, ...]] = {
    **dict.fromkeys((FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32), _I32),
    **dict.fromkeys((FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64), _I64),
    **dict.fromkeys((FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32), _U32),
    **dict.fromkeys((FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64), _U64),
    FieldDescriptor.TYPE_DOUBLE: _FLOATS,
    FieldDescriptor.TYPE_FLOAT: (0.0, -1.0, 3e38, float("inf"), float("nan")),
}
FieldPath = tuple[FieldDescriptor, ...]


def _numeric_paths(descriptor: Descriptor, depth: int = 0) -> Iterator[FieldPath]:
    for f in descriptor.fields:
        if f.message_type is not None:
            if depth < 5:
                for rest in _numeric_paths(f.message_type, depth + 1):
                    yield (f, *rest)
        elif f.type in EXTREMES:
            yield (f,)


def _set_path(message: Message, field_path: FieldPath, value: int | float) -> None:
    f, rest = field_path[0], field_path[1:]
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        entries: Any = getattr(message, f.name)
        if rest[0].name == "value" and len(rest) == 1:
            entries["k"] = value
        else:  # a message value (numeric map keys: none in these protos)
            _set_path(entries["k"], rest[1:], value)
    elif f.is_repeated:
        items: Any = getattr(message, f.name)
        if not rest:
            items.append(value)
        else:
            _set_path(items[0] if len(items) else items.add(), rest, value)
    elif not rest:
        setattr(message, f.name, value)
    else:
        _set_path(getattr(message, f.name), rest, value)


def _name(field_path: FieldPath) -> str:
    return ".".join(f.name for f in field_path)


def _extreme_frames(method: MethodDescriptor, field_path: FieldPath, value: int | float) -> list[bytes]:
    """The frames of one probe: a request that reaches the RPC's body, with the one number set."""
    fresh = f"fuzz-extreme-{next(_fresh)}"
    name = path(method)
    frames: list[Message]
    if name == "/sokutatsu.broker.v1.Broker/Publish":
        opening = broker_pb2.PublishRequest(open=broker_pb2.PublishOpen(publisher_id=fresh))
        one = broker_pb2.Message(publisher_id=fresh, publisher_seq=1, key="K", body=b"x", persistent=True)
        frames = [
            opening,
            broker_pb2.PublishRequest(batch=broker_pb2.PublishBatch(topic=EXTREME_TOPIC, messages=[one])),
        ]
    elif name == "/sokutatsu.broker.v1.Broker/Subscribe":
        subscription = broker_pb2.Subscription(subscriber_id=fresh, topic=EXTREME_TOPIC)
        opening_ = broker_pb2.SubscribeRequest(open=broker_pb2.SubscribeOpen(subscription=subscription, credits=10))
        frames = [opening_, broker_pb2.SubscribeRequest(credit=broker_pb2.SubscriberCredit(credits=1))]
    else:
        request = request_class(method)()
        if "subscription" in request.DESCRIPTOR.fields_by_name:
            request.subscription.CopyFrom(  # type: ignore[attr-defined]
                broker_pb2.Subscription(subscriber_id=fresh, topic=EXTREME_TOPIC, durable=True)
            )
        if name.endswith("/CreateTopic"):
            request.topic.name = fresh  # type: ignore[attr-defined]
        if name.endswith("/InstallDistribution"):  # a valid one for the fuzz sequencer's domain, "a"
            weight = sequencer_pb2.DomainWeight(domain="a", weight_ppm=1_000_000)
            request.distribution.CopyFrom(sequencer_pb2.Distribution(id=1, weights=[weight]))  # type: ignore[attr-defined]
        if name.endswith("/Stamp"):
            request.count, request.client_id = 1, fresh  # type: ignore[attr-defined]
        frames = [request]
    # The frame the field belongs to: the opening one, or the next (a batch, a credit).
    which = frames[0]
    oneof = which.DESCRIPTOR.oneofs_by_name.get("frame")
    if (
        oneof is not None
        and field_path[0].containing_oneof is oneof
        and field_path[0].name != which.WhichOneof("frame")
    ):
        which = frames[1]
    _set_path(which, field_path, value)
    if which is frames[0] and len(frames) > 1:
        frames = frames[:1]  # the open alone (its answer shows what the number did)
    return [f.SerializeToString() for f in frames]


EXTREME_METHODS = [m for m in METHODS if m.containing_service.full_name in EXTREME_SERVICES]
# Refusals the caps must give (docs/security.md, Caps on client-supplied amounts).
CAPPED = {
    ("/sokutatsu.broker.v1.BrokerAdmin/CreateSubscription", "subscription.memory_budget_bytes", 2**64 - 1),
    ("/sokutatsu.broker.v1.Broker/Subscribe", "open.subscription.memory_budget_bytes", 2**64 - 1),
    ("/sokutatsu.broker.v1.Broker/Subscribe", "open.credits", 2**32 - 1),
    ("/sokutatsu.broker.v1.Broker/Subscribe", "credit.credits", 2**32 - 1),
    ("/sokutatsu.broker.v1.Broker/Publish", "open.first_unacked_seq", 2**63 - 1),
    ("/sokutatsu.broker.v1.Broker/Publish", "open.first_unacked_seq", 2**64 - 1),
    ("/sokutatsu.broker.v1.Broker/Publish", "batch.messages.publisher_seq", 2**64 - 1),
    ("/sokutatsu.broker.v1.BrokerAdmin/WatchStats", "interval_ms", 2**32 - 1),
    ("/sokutatsu.sequencer.v1.Sequencer/InstallDistribution", "distribution.id", 2**64 - 1),
    ("/sokutatsu.sequencer.v1.Sequencer/Stamp", "count", 2**32 - 1),
}


def test_every_capped_field_is_probed() -> None:
    probed = {(path(m), _name(p)) for m in EXTREME_METHODS for p in _numeric_paths(m.input_type)}
    assert {(method, name) for method, name, _ in CAPPED} <= probed


@pytest.mark.parametrize("method", EXTREME_METHODS, ids=path)
def test_extreme_numbers(targets: Targets, method: MethodDescriptor) -> None:
    served_by = SERVED_BY[method.containing_service.full_name]
    target = targets.get(served_by)
    documented = DOCUMENTED | ALSO_DOCUMENTED.get(served_by, set())
    assert target.channel is not None
    wrong: list[str] = []
    probes = 0
    for field_path in _numeric_paths(method.input_type):
        for value in EXTREMES[field_path[-1].type]:
            probes += 1
            code, details = invoke(target.channel, method, _extreme_frames(method, field_path, value))
            shown = f"{_name(field_path)} = {value!r}: {code} {details[:300]!r}"
            if code == LEFT_OPEN and method.server_streaming:
                code = grpc.StatusCode.OK
            if code not in documented:
                wrong.append(shown)
            elif (path(method), _name(field_path), value) in CAPPED and code != grpc.StatusCode.INVALID_ARGUMENT:
                wrong.append(f"not refused: {shown}")
    problem = target.unharmed()
    assert not wrong, f"{path(method)}: {probes} probes, these wrong:\n" + "\n".join(wrong[:10])
    assert not problem, problem


# ---------------------------------------------------------------------------------- large frames --
# Issue #20: eight concurrent 15 MiB GetQueue calls took queue-db from 329 MiB to 1 GiB RSS, and the
# monitor and sequencer grew by hundreds of MiB. Each service gets rounds of CONCURRENT frames over
# its request limit (refused by gRPC from the length prefix) and just under it (decoded, then
# refused or answered), from fresh connections each round; its RSS may grow by at most
# RSS_GROWTH_BOUND over what it had after one warm-up round of the same.
LARGE_FRAME_METHODS = {
    "broker": "/sokutatsu.broker.v1.BrokerAdmin/ListTopics",
    "monitor": "/sokutatsu.monitor.v1.Monitor/GetAssignment",
    "sequencer": "/sokutatsu.sequencer.v1.Sequencer/GetStatus",
    "queuedb": "/sokutatsu.queuedb.v1.QueueService/GetQueue",
}
REQUEST_LIMITS = {"broker": 4 * 2**20, "monitor": 2 * 2**20, "sequencer": 2 * 2**20, "queuedb": 4 * 2**20}
CONCURRENT = 8
ROUNDS = 3
OVER_LIMIT = 15 * 10**6
RSS_GROWTH_BOUND = 192 * 2**20


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _string_field(size: int) -> bytes:
    """Field 1, a string of ``size`` bytes: what an oversize name is on the wire."""
    length, prefix = size, bytearray()
    while True:
        low, length = length & 0x7F, length >> 7
        prefix.append(low | (0x80 if length else 0))
        if not length:
            return b"\x0a" + bytes(prefix) + b"a" * size


def _large_round(address: str, method: str, size: int) -> list[grpc.StatusCode]:
    options = [("grpc.max_send_message_length", 64 * 2**20), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(address, options=options) for _ in range(CONCURRENT)]
    frame = _string_field(size)
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def one(channel: grpc.Channel) -> None:
        raw: Any = channel  # no serializers: bytes in, bytes out
        try:
            raw.unary_unary(method)(frame, timeout=RPC_SECONDS * 3)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=one, args=(c,)) for c in channels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for channel in channels:
        channel.close()
    return codes


@pytest.mark.parametrize("name", SERVICES)
def test_large_concurrent_frames_leave_memory_bounded(targets: Targets, name: str) -> None:
    target = targets.get(name)
    method, limit = LARGE_FRAME_METHODS[name], REQUEST_LIMITS[name]
    under = limit - 4096
    _large_round(target.address, method, OVER_LIMIT)
    _large_round(target.address, method, under)
    settled = _rss(target.pid)
    seen: set[grpc.StatusCode] = set()
    for _ in range(ROUNDS):
        over_codes = _large_round(target.address, method, OVER_LIMIT)
        assert set(over_codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, over_codes
        seen |= set(_large_round(target.address, method, under))
    grown = _rss(target.pid) - settled
    assert seen <= DOCUMENTED | ALSO_DOCUMENTED.get(name, set()), seen
    assert grown <= RSS_GROWTH_BOUND, f"{name} grew {grown / 2**20:.0f} MiB under large frames"


# ------------------------------------------------------------------------- issue #20, item 6 --
# 10,000 letters that do not compress: PostgreSQL compresses "x" * 10_000 enough to index it, but
# this one reached its btree ("index row requires 10016 bytes") and came back UNAVAILABLE with the DSN.
LONG_NAME = "".join(random.Random(20).choices(string.ascii_letters, k=10_000))  # noqa: S311 - test data


def _transfer_batch(sender: str, queue: str) -> queuedb_pb2.TransferBatch:
    message = queuedb_pb2.TransferredMessage(transfer_id=1, queue=queue, body=b"x")
    return queuedb_pb2.TransferBatch(sender_node=sender, messages=[message])


def _deliver(channel: grpc.Channel, batch: queuedb_pb2.TransferBatch) -> None:
    queuedb_pb2_grpc.TransferStub(channel).Deliver(batch, timeout=RPC_SECONDS)


def _deliver_stream(channel: grpc.Channel, batch: queuedb_pb2.TransferBatch) -> None:
    for _ in queuedb_pb2_grpc.TransferStub(channel).DeliverStream(iter([batch]), timeout=RPC_SECONDS):
        pass


@pytest.mark.parametrize("rpc", ["Deliver", "DeliverStream"])
@pytest.mark.parametrize("field_name", ["sender_node", "queue"])
def test_a_long_name_on_the_transfer_endpoint_is_invalid_argument_without_the_dsn(
    targets: Targets, rpc: str, field_name: str
) -> None:
    target = targets.get("queuedb")
    assert target.channel is not None
    sender = LONG_NAME if field_name == "sender_node" else f"fuzz-long-{next(_fresh)}"
    batch = _transfer_batch(sender, LONG_NAME if field_name == "queue" else "q1")
    with pytest.raises(grpc.RpcError) as refused:
        (_deliver if rpc == "Deliver" else _deliver_stream)(target.channel, batch)
    details = refused.value.details() or ""
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details[:500]
    assert field_name in details, details
    assert "is not a valid name" in details, details
    assert f"({len(LONG_NAME)} characters)" in details, details
    assert "dbname" not in details, details
    assert "user=" not in details, details
    problem = target.unharmed()
    assert not problem, problem


def test_create_queue_refuses_a_node_it_does_not_know(targets: Targets) -> None:
    target = targets.get("queuedb")
    assert target.channel is not None
    rule = queuedb_pb2.TransferRule(to_node="nowhere", immediate=True)
    request = queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name="fuzz-nowhere", transfer=rule))
    with pytest.raises(grpc.RpcError) as refused:
        queuedb_pb2_grpc.QueueServiceStub(target.channel).CreateQueue(request, timeout=RPC_SECONDS)
    details = refused.value.details() or ""
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "TransferRule.to_node 'nowhere' is not a node this node forwards to" in details, details
    assert "SOKUTATSU_QUEUEDB_PEERS" in details, details
    problem = target.unharmed()
    assert not problem, problem


def test_an_unknown_overflow_mode_is_invalid_argument(targets: Targets) -> None:
    target = targets.get("broker")
    assert target.channel is not None
    sub = broker_pb2.Subscription(subscriber_id="fuzz-mode-99", topic=CANARY_TOPIC, durable=True)
    sub.overflow_mode = 99  # type: ignore[assignment]
    with pytest.raises(grpc.RpcError) as refused:
        broker_pb2_grpc.BrokerAdminStub(target.channel).CreateSubscription(
            broker_pb2.CreateSubscriptionRequest(subscription=sub), timeout=RPC_SECONDS
        )
    details = refused.value.details() or ""
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "Subscription.overflow_mode 99 is not an OverflowMode" in details, details
    problem = target.unharmed()
    assert not problem, problem


# Every numeric field of a queue-db request message, at the end of its type (or an undefined enum
# number), in an otherwise valid request: refused INVALID_ARGUMENT naming the field.
U32, U64 = 2**32 - 1, 2**64 - 1


def _extreme_dequeue(**fields: int) -> Callable[[grpc.Channel], None]:
    def call(channel: grpc.Channel) -> None:
        request = queuedb_pb2.DequeueRequest(queue="q1", **fields)
        queuedb_pb2_grpc.QueueServiceStub(channel).Dequeue(request, timeout=RPC_SECONDS)

    return call


def _extreme_rule(**fields: int) -> Callable[[grpc.Channel], None]:
    def call(channel: grpc.Channel) -> None:
        rule = queuedb_pb2.TransferRule(to_node="node2", **fields)  # type: ignore[arg-type]
        request = queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name="fuzz-extreme", transfer=rule))
        queuedb_pb2_grpc.QueueServiceStub(channel).CreateQueue(request, timeout=RPC_SECONDS)

    return call


def _extreme_nack(channel: grpc.Channel) -> None:
    request = queuedb_pb2.NackRequest(queue="q1", delay_ms=U32)
    queuedb_pb2_grpc.QueueServiceStub(channel).Nack(request, timeout=RPC_SECONDS)


def _extreme_transferred(**fields: int) -> Callable[[grpc.Channel], None]:
    def call(channel: grpc.Channel) -> None:
        batch = _transfer_batch(f"fuzz-extreme-{next(_fresh)}", "q1")
        for name, value in fields.items():
            setattr(batch.messages[0], name, value)
        _deliver(channel, batch)

    return call


# (message.field, the call, what the refusal says)
EXTREME: dict[str, tuple[Callable[[grpc.Channel], None], str]] = {
    "DequeueRequest.max_messages": (_extreme_dequeue(max_messages=U32), "DequeueRequest.max_messages of 4,294,967,295"),
    "DequeueRequest.visibility_timeout_ms": (
        _extreme_dequeue(visibility_timeout_ms=U32),
        "DequeueRequest.visibility_timeout_ms of 4,294,967,295",
    ),
    "DequeueRequest.wait_ms": (_extreme_dequeue(wait_ms=U32), "DequeueRequest.wait_ms of 4,294,967,295"),
    "NackRequest.delay_ms": (_extreme_nack, "NackRequest.delay_ms of 4,294,967,295"),
    "TransferRule.min_batch": (_extreme_rule(min_batch=U32), "TransferRule.min_batch of 4,294,967,295"),
    "TransferRule.max_age_ms": (_extreme_rule(max_age_ms=U32), "TransferRule.max_age_ms of 4,294,967,295"),
    "TransferRule.durability": (_extreme_rule(durability=99), "TransferRule.durability 99 is not a RemoteDurability"),
    "TransferredMessage.transfer_id": (_extreme_transferred(transfer_id=U64), f"messages[0].transfer_id of {U64}"),
    "TransferredMessage.enqueued_unix_nano": (
        _extreme_transferred(enqueued_unix_nano=U64),
        f"messages[0].enqueued_unix_nano of {U64}",
    ),
    "TransferredMessage.durability": (
        _extreme_transferred(durability=99),
        "messages[0].durability 99 is not a Durability",
    ),
}


def _numeric_request_fields() -> set[str]:
    """Every numeric or enum field of the messages the queue-db services take, nested ones too."""
    numeric = {
        FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_ENUM, FieldDescriptor.TYPE_FLOAT,
        FieldDescriptor.TYPE_DOUBLE,
    }  # fmt: skip
    found: set[str] = set()
    seen: set[str] = set()
    pending = [
        m.input_type
        for name in ("QueueService", "Transfer")
        for m in queuedb_pb2.DESCRIPTOR.services_by_name[name].methods
    ]
    while pending:
        message = pending.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        for item in message.fields:
            if item.message_type is not None:
                pending.append(item.message_type)
            elif item.type in numeric:
                found.add(f"{message.name}.{item.name}")
    return found


def test_every_numeric_field_of_queuedb_requests_has_an_extreme_probe() -> None:
    assert set(EXTREME) == _numeric_request_fields()


@pytest.mark.parametrize("probe", EXTREME)
def test_an_extreme_number_in_a_queuedb_request_is_refused_naming_its_field(targets: Targets, probe: str) -> None:
    call, says = EXTREME[probe]
    target = targets.get("queuedb")
    assert target.channel is not None
    with pytest.raises(grpc.RpcError) as refused:
        call(target.channel)
    details = refused.value.details() or ""
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert says in details, details
    problem = target.unharmed()
    assert not problem, problem

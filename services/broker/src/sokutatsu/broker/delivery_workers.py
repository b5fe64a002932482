"""The broker's side of its delivery workers (docs/broker.md, Delivery workers).

The broker process stays the *core*: it owns every piece of state (topics, queues, credits,
acknowledgements, limits, the pair, spill). A delivery worker (``delivery_worker.py``) serves the
gRPC side of ``SubscribeMany`` streams and relays each one over its link (``delivery_link.py``).
For every relayed stream the core runs one :class:`~sokutatsu.broker.subscribe_many.ManyStream`,
exactly as for a stream it serves itself: the same ``hold`` (the client the worker named is counted
by the limits), the same attach, credit, detach and redirect; the stream's frames go to the link as
bytes. Auth was checked by the worker's interceptor, frame by frame, before it relayed a frame.

Memory: the core writes a lane's batches only within the lane's credits (``SubscriptionQueue.poll``),
and each relayed stream has a window on the link in each direction (``delivery_link.py``, flow
control): the core waits once ``WINDOW`` of a stream's bytes are not reported written to its client,
the worker once ``WINDOW`` of its requests are not reported taken here. A relayed stream also waits
while the link's buffer is over its high-water mark (:meth:`Link.drained`).

Faults: a worker that dies closes its link; the core ends that link's ManyStreams (their lanes are
detached once, as when a client's stream breaks: ManyStream's invariant 2) and starts the worker
again after a bounded backoff. While no worker is ready, the core serves SubscribeMany itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from sokutatsu.broker.delivery_link import (
    CANCEL,
    COUNT,
    DATA,
    END,
    HALF_CLOSE,
    HELLO,
    OPEN,
    REPORT_EVERY,
    TAKEN,
    WINDOW,
    WRITTEN,
    Link,
    encode,
)
from sokutatsu.broker.limits import Client
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.errors import InvalidArgument, SokutatsuError, StartupError

log = logging.getLogger(__name__)


class Plane(Protocol):
    """What a relayed stream needs of the broker's data plane (``service.DataPlane``, which holds the
    ``Workers``: this narrow interface keeps the two modules out of an import cycle)."""

    def many(
        self, client: Client | None, frames: AsyncIterator[broker_pb2.SubscribeManyRequest]
    ) -> AsyncGenerator[bytes, None]: ...


WORKER_MODULE = "sokutatsu.broker.delivery_worker"
# How long the broker waits at start for every worker to serve.
START_SECONDS = 60.0
# Restart backoff: doubles from the first to the last; back to the first after a worker served this long.
BACKOFF_FIRST = 0.1
BACKOFF_LAST = 5.0
HEALTHY_SECONDS = 10.0
# A client moved to a worker counts for it this long, until its stream opens there.
PROMISE_SECONDS = 5.0
# Environment a worker does not inherit: it announces nothing (the broker does) and traces nothing.
NOT_INHERITED = ("SOKUTATSU_ANNOUNCE_FILE", "SOKUTATSU_TRACE_DIR", "OTEL_EXPORTER_OTLP_ENDPOINT")


class Relayed:
    """One SubscribeMany stream a worker relays: the client's request frames, the task running
    its ManyStream, its bytes sent to the worker that it has not reported written (``WINDOW``), and
    the status it ends with (sent as ``END`` once the task is done)."""

    __slots__ = ("code", "message", "requests", "room", "taken", "task", "unwritten")

    def __init__(self) -> None:
        self.requests: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.task: asyncio.Task[None]  # set by CoreLink._open as the stream is made
        self.unwritten = 0
        self.room = asyncio.Event()
        # Request bytes the ManyStream took since the last TAKEN.
        self.taken = 0
        # Until the stream ends otherwise: the worker cancelled it (its client's stream ended there).
        self.code = grpc.StatusCode.CANCELLED
        self.message = "the stream was cancelled"


class CoreLink(Link):
    """The core's end of one worker's link."""

    def __init__(self, workers: Workers) -> None:
        super().__init__()
        self.workers = workers
        self.index = -1
        self.pid = 0
        self.address = ""
        self.streams: dict[int, Relayed] = {}
        self.promised: collections.deque[float] = collections.deque()

    def load(self) -> int:
        """Streams open and clients moved here that have not opened yet (the pick's measure)."""
        now = asyncio.get_running_loop().time()
        while self.promised and self.promised[0] < now - PROMISE_SECONDS:
            self.promised.popleft()
        return len(self.streams) + len(self.promised)

    def frame(self, kind: int, stream: int, payload: bytes) -> None:
        if kind == DATA:
            relayed = self.streams.get(stream)
            if relayed is not None:
                relayed.requests.put_nowait(payload)
        elif kind == WRITTEN:
            relayed = self.streams.get(stream)
            if relayed is not None:
                relayed.unwritten -= COUNT.unpack(payload)[0]
                if relayed.unwritten <= WINDOW:
                    relayed.room.set()
        elif kind == OPEN:
            self._open(stream, json.loads(payload))
        elif kind == HALF_CLOSE:
            relayed = self.streams.get(stream)
            if relayed is not None:
                relayed.requests.put_nowait(None)
        elif kind == CANCEL:
            relayed = self.streams.get(stream)
            if relayed is not None:
                relayed.task.cancel()
        elif kind == HELLO:
            hello = json.loads(payload)
            self.index, self.pid, self.address = int(hello["index"]), int(hello["pid"]), str(hello["address"])
            self.workers.ready(self)

    def lost(self) -> None:
        """End every stream of the link: each ManyStream detaches its lanes (once) as it unwinds."""
        for relayed in list(self.streams.values()):
            relayed.task.cancel()
        self.workers.gone(self)

    def _open(self, stream: int, who: dict[str, Any] | None) -> None:
        if self.promised:
            self.promised.popleft()
        client = None if who is None else Client(str(who["key"]), str(who["who"]), bool(who["per_connection"]))
        relayed = Relayed()
        self.streams[stream] = relayed
        relayed.task = asyncio.create_task(self._serve(stream, client, relayed), name=f"delivery-relay-{stream}")
        # The stream leaves the link when its task is done, however it ends: a CANCEL read together with its
        # OPEN cancels the task before it ran, when no clean-up of its own runs.
        relayed.task.add_done_callback(lambda _: self._finished(stream, relayed))

    def _finished(self, stream: int, relayed: Relayed) -> None:
        """After the stream's task, whether it ran or was cancelled before it started: the stream leaves
        the link; what it counted for the client's limits is released by now, and only then is the
        worker told to end the client's stream (``END``), so a client that opens another one at once
        is never refused for the one that ended, as with a stream the broker serves itself (the worker
        waits for this ``END`` after a ``CANCEL`` of its own)."""
        if self.streams.get(stream) is relayed:
            del self.streams[stream]
        self.send(END, stream, encode({"code": relayed.code.value[0], "message": relayed.message}))

    async def _serve(self, stream: int, client: Client | None, relayed: Relayed) -> None:
        """The stream's ManyStream (``DataPlane.many``, as for a stream served here); its end in ``relayed``."""
        try:
            responses = self.workers.plane.many(client, self._frames(stream, relayed))
            async with contextlib.aclosing(responses):
                async for response in responses:
                    self.send(DATA, stream, response)
                    relayed.unwritten += len(response)
                    # Past its window, this stream waits for its client (the worker says what it wrote).
                    while relayed.unwritten > WINDOW:
                        relayed.room.clear()
                        await relayed.room.wait()
                    if self.paused:
                        await self.drained()
            relayed.code, relayed.message = grpc.StatusCode.OK, ""
        except SokutatsuError as exc:
            relayed.code, relayed.message = exc.code, str(exc)
        except Exception:
            log.exception("a relayed SubscribeMany stream failed")
            relayed.code = grpc.StatusCode.INTERNAL
            relayed.message = "internal error in SubscribeMany; the broker log has it"

    async def _frames(self, stream: int, relayed: Relayed) -> AsyncIterator[broker_pb2.SubscribeManyRequest]:
        """The client's request frames, as the worker relayed them, until the client half-closed; what
        the ManyStream takes is reported to the worker (``TAKEN``), which relays more within its window."""
        while True:
            raw = await relayed.requests.get()
            if raw is None:
                return
            relayed.taken += len(raw)
            if relayed.taken >= REPORT_EVERY:
                self.send(TAKEN, stream, COUNT.pack(relayed.taken))
                relayed.taken = 0
            try:
                yield broker_pb2.SubscribeManyRequest.FromString(raw)
            except DecodeError as exc:
                raise InvalidArgument(f"a frame could not be decoded as SubscribeManyRequest: {exc}") from None


class Workers:
    """Starts ``count`` delivery workers, keeps them running, and moves SubscribeMany streams to them."""

    def __init__(self, plane: Plane, count: int, listen: str, host: str) -> None:
        self.plane = plane
        self.count = count
        self.listen = listen  # the first worker's host:port (port 0: any)
        self.host = host  # what moved_to names ("": the host the client reached)
        self.links: dict[int, CoreLink] = {}
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = [0] * count
        self._folder = Path(tempfile.mkdtemp(prefix="sokutatsu-delivery-"))  # mode 0700: ours alone
        self.path = self._folder / "link"
        self._server: asyncio.AbstractServer | None = None
        self._all_ready = asyncio.Event()
        self._next = 0

    # ------------------------------------------------------------ lifecycle --
    async def start(self) -> None:
        """Listen on the link socket (the supervisor starts the workers: :meth:`run`)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: CoreLink(self), str(self.path))

    async def wait_ready(self) -> None:
        try:
            await asyncio.wait_for(self._all_ready.wait(), START_SECONDS)
        except TimeoutError:
            raise StartupError(
                f"{self.count - len(self.links)} of {self.count} delivery workers did not start within "
                f"{START_SECONDS:g} s (SOKUTATSU_BROKER_DELIVERY_WORKERS; their output is in the broker's)"
            ) from None

    async def run(self) -> None:
        """Keep every worker running until cancelled; then stop them."""
        try:
            async with asyncio.TaskGroup() as group:
                for index in range(self.count):
                    group.create_task(self._supervise(index), name=f"delivery-worker-{index}")
        finally:
            await self.close()

    async def close(self) -> None:
        # The links first: each worker ends its clients' streams at once and exits (rather than waiting
        # out its grace period for streams only this process could end).
        for link in list(self.links.values()):
            link.close()
        for process in list(self.processes.values()):
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in list(self.processes.values()):
            try:
                await asyncio.wait_for(process.wait(), 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        self.processes.clear()
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _listen_of(self, index: int) -> str:
        host, _, port = self.listen.rpartition(":")
        return f"{host}:{int(port) + index}" if int(port) else self.listen

    async def _supervise(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        delay = BACKOFF_FIRST
        env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        env["SOKUTATSU_PARENT_PID"] = str(os.getpid())
        while True:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                WORKER_MODULE,
                str(self.path),
                str(index),
                self._listen_of(index),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
            )
            self.processes[index] = process
            started = loop.time()
            status = await process.wait()
            link = self.links.get(index)
            if link is not None and link.pid == process.pid:
                link.close()  # its streams end now, not when the socket's end is noticed
            if loop.time() - started > HEALTHY_SECONDS:
                delay = BACKOFF_FIRST
            log.warning("delivery worker %d (pid %d) exited with %s; starting it again", index, process.pid, status)
            self.restarts[index] += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_LAST)

    # --------------------------------------------------------------- links --
    def ready(self, link: CoreLink) -> None:
        old = self.links.get(link.index)
        if old is not None and old is not link:
            old.close()
        self.links[link.index] = link
        log.info("delivery worker %d (pid %d) serving on %s", link.index, link.pid, link.address)
        if len(self.links) == self.count:
            self._all_ready.set()

    def gone(self, link: CoreLink) -> None:
        if self.links.get(link.index) is link:
            del self.links[link.index]
            process = self.processes.get(link.index)
            if process is not None and process.pid == link.pid and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()  # a worker without its link serves nobody: the supervisor restarts it

    def pick(self) -> str | None:
        """Where a new SubscribeMany stream goes: the ready worker with the fewest streams (None: none)."""
        ready = [link for link in self.links.values() if not link.closed]
        if not ready:
            return None
        link = min(ready, key=lambda one: (one.load(), one.index))
        link.promised.append(asyncio.get_running_loop().time())
        port = link.address.rpartition(":")[2]
        return f"{self.host}:{port}" if self.host else f":{port}"

    def stats(self) -> list[broker_pb2.DeliveryWorkerStats]:
        out = []
        for index in range(self.count):
            link = self.links.get(index)
            process = self.processes.get(index)
            out.append(
                broker_pb2.DeliveryWorkerStats(
                    index=index,
                    ready=link is not None and not link.closed,
                    address=link.address if link is not None else "",
                    pid=process.pid if process is not None and process.returncode is None else 0,
                    streams=len(link.streams) if link is not None else 0,
                    link_frames=link.frames_sent if link is not None else 0,
                    link_writes=link.writes if link is not None else 0,
                    restarts=self.restarts[index],
                )
            )
        return out

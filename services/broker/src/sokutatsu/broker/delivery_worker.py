"""A delivery worker: a process of its broker that serves the gRPC side of ``SubscribeMany`` streams
(docs/broker.md, Delivery workers).

    python -m sokutatsu.broker.delivery_worker LINK_SOCKET INDEX HOST:PORT

The broker starts it (``delivery_workers.py``) with its own environment: the worker serves on
``HOST:PORT`` through the same bootstrap as every service (``core/server.py``: the same TLS, the
same auth and cluster-secret interceptors, request budget and domain error mapping), answers
``Broker.SubscribeMany`` only, and relays each stream to the broker over the link
(``delivery_link.py``): the client's request frames as they came (each already checked by the auth
interceptor), and the broker's response bytes back to the client. It holds no state of its own.

When the link ends (the broker stopped or died) every client stream ends with ``UNAVAILABLE`` and
the worker exits: the SDK reconnects to a broker, as when its broker's stream breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from sokutatsu.broker.delivery_link import (
    CANCEL,
    COUNT,
    DATA,
    END,
    HALF_CLOSE,
    HELLO,
    HOLD,
    OPEN,
    REPORT_EVERY,
    TAKEN,
    WINDOW,
    WRITTEN,
    Link,
    encode,
)
from sokutatsu.broker.limits import client_of
from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.auth import Policy, server_policy
from sokutatsu.core.cluster import load_secret
from sokutatsu.core.errors import SokutatsuError, Unavailable
from sokutatsu.core.runtime_settings import RuntimeSettings
from sokutatsu.core.server import ServiceContext, serve
from sokutatsu.core.settings import SettingsError, load
from sokutatsu.core.tls import check_plaintext, server_tls

log = logging.getLogger(__name__)

SERVICE = "sokutatsu.broker.v1.Broker"
# How long a stream the worker ends waits for the broker's END (a bound: a broker that is busy or gone).
CANCEL_ANSWER_SECONDS = 2.0


class Frames:
    """A client's request frame as received: relayed as these bytes; decoded only when the auth
    interceptor looks at it (``frames``). A frame that does not decode is refused by the broker."""

    __slots__ = ("_parsed", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._parsed: broker_pb2.SubscribeManyRequest | None = None

    @property
    def frames(self) -> Sequence[broker_pb2.SubscriptionRequest]:
        if self._parsed is None:
            try:
                self._parsed = broker_pb2.SubscribeManyRequest.FromString(self.raw)
            except DecodeError:
                return ()
        return self._parsed.frames


class Status(SokutatsuError):
    """A stream's end as the broker decided it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ClientStream:
    """One client stream: what the broker sent and the worker has not yet taken to write (``held``
    bytes; the response being written is no longer counted), the bytes written since the last
    ``WRITTEN``, the request bytes relayed and not reported ``TAKEN`` (``untaken``); ``room`` is set
    after each ``TAKEN`` and each write, when there may be room again (the relay checks)."""

    __slots__ = ("end", "held", "out", "room", "untaken", "wake", "written")

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.held = 0
        self.written = 0
        self.untaken = 0
        self.end: SokutatsuError | None = None
        self.wake = asyncio.Event()
        self.room = asyncio.Event()

    def may_relay(self) -> bool:
        return self.held < HOLD and self.untaken <= WINDOW


async def _cancel_on_broker(link: Link, stream: int, one: ClientStream) -> None:
    """A stream the worker ends (its client went, or a frame was refused): the broker releases what
    it counted for the client's limits, then ends it (``END``); the client's stream ends only after
    that (at most ``CANCEL_ANSWER_SECONDS``), as one the broker serves itself, so a client that opens
    another at once is not refused for this one."""
    if link.closed:
        return
    link.send(CANCEL, stream)

    async def ended() -> None:
        while one.end is None:
            one.wake.clear()
            await one.wake.wait()

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ended(), CANCEL_ANSWER_SECONDS)


class WorkerLink(Link):
    """The worker's end of the link."""

    def __init__(self, stop: asyncio.Event) -> None:
        super().__init__()
        self.stop = stop
        self.streams: dict[int, ClientStream] = {}

    def frame(self, kind: int, stream: int, payload: bytes) -> None:
        one = self.streams.get(stream)
        if one is None:
            return  # the client's stream is gone (the broker is told: CANCEL)
        if kind == DATA:
            one.out.append(payload)
            one.held += len(payload)
        elif kind == TAKEN:
            one.untaken -= COUNT.unpack(payload)[0]
            one.room.set()
            return
        elif kind == END:
            end = json.loads(payload)
            code = next((c for c in grpc.StatusCode if c.value[0] == end["code"]), grpc.StatusCode.UNKNOWN)
            one.end = Status(code, str(end["message"]))
        one.wake.set()

    def lost(self) -> None:
        for one in self.streams.values():
            one.end = Unavailable("the broker's delivery link closed (the broker stopped); reconnect to the broker")
            one.wake.set()
        self.stop.set()


class Relay:
    """``Broker.SubscribeMany`` on a worker: each client stream relayed to the broker."""

    def __init__(self, link: WorkerLink, policy: Policy | None, frame_cap: int) -> None:
        self.link = link
        self.policy = policy
        self.frame_cap = frame_cap
        self._ids = itertools.count(1)

    async def subscribe_many(self, requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]) -> Any:
        link = self.link
        if link.closed:
            raise Unavailable("this delivery worker's broker is gone; reconnect to the broker")
        stream = next(self._ids)
        one = ClientStream()
        link.streams[stream] = one
        client = client_of(self.policy, context)
        who = (
            None if client is None else {"key": client.key, "who": client.who, "per_connection": client.per_connection}
        )
        link.send(OPEN, stream, encode(who))
        failure: list[Exception] = []

        async def read() -> None:
            try:
                async for frame in requests:
                    # The client has not read what the broker answered, or the broker has not taken what
                    # was relayed: relay nothing more until it has (gRPC flow control holds the client).
                    while not one.may_relay():
                        one.room.clear()
                        await one.room.wait()
                    link.send(DATA, stream, frame.raw)
                    one.untaken += len(frame.raw)
                    if link.paused:
                        await link.drained()
                link.send(HALF_CLOSE, stream)
            except Exception as exc:  # noqa: BLE001 - the stream ends with it (the broker is told: CANCEL)
                # A frame over the request budget (SokutatsuError), or one auth refused (aio.AbortError:
                # the status is set already): neither is relayed.
                failure.append(exc)
                one.wake.set()

        reader = asyncio.create_task(read(), name=f"delivery-read-{stream}")
        ended = False
        try:
            while True:
                await one.wake.wait()
                one.wake.clear()
                while one.out:
                    response = self._take(one)
                    yield response
                    one.written += len(response)
                    if one.written >= REPORT_EVERY:
                        link.send(WRITTEN, stream, COUNT.pack(one.written))
                        one.written = 0
                    one.room.set()
                if one.end is not None:
                    ended = True
                    if one.end.code != grpc.StatusCode.OK:
                        raise one.end
                    return
                if failure:
                    raise failure[0]
        finally:
            reader.cancel()
            if not ended:
                await _cancel_on_broker(link, stream, one)
            del link.streams[stream]
            await asyncio.gather(reader, return_exceptions=True)

    def _take(self, one: ClientStream) -> bytes:
        """What the broker sent for the stream, as one response (serialised SubscribeManyResponse
        frames concatenate into one), up to about ``frame_cap`` bytes; the rest stays for the next."""
        out = one.out
        size = len(out[0])
        count = 1
        while count < len(out) and size + len(out[count]) <= self.frame_cap:
            size += len(out[count])
            count += 1
        one.held -= size
        if count == 1:
            return out.pop(0)
        taken = b"".join(out[:count])
        del out[:count]
        return taken

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {"SubscribeMany": grpc.stream_stream_rpc_method_handler(self.subscribe_many, Frames, lambda b: b)},
        )


def build(link_path: str, index: int, stop: asyncio.Event, policy: Policy | None, batch_bytes: int) -> Any:
    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(lambda: WorkerLink(stop), link_path)
        context.stack.callback(link.close)
        # A joined response holds about two of the broker's frames at most: well within what clients
        # accept (the SDK: 16 MiB), as the broker's own frames are (about BATCH_BYTES).
        cap = min(context.runtime.max_frame_bytes // 2, 2 * batch_bytes)
        server.add_generic_rpc_handlers((Relay(link, policy, cap).handler(),))
        context.untraced.add(f"/{SERVICE}/SubscribeMany")

        async def hello() -> None:
            while not context.address:  # noqa: ASYNC110 - set by serve() once it listens
                await asyncio.sleep(0.01)
            link.send(HELLO, 0, encode({"index": index, "pid": os.getpid(), "address": context.address}))
            await stop.wait()

        context.start_background(hello(), "delivery-hello")
        return [SERVICE]

    return register


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"sokutatsu-delivery-worker: error: {message}\n")
    sys.exit(2)


def main() -> NoReturn:
    if len(sys.argv) != 4:
        _fail("usage: python -m sokutatsu.broker.delivery_worker LINK_SOCKET INDEX HOST:PORT (the broker starts it)")
    link_path, index, listen = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    try:
        runtime = load(RuntimeSettings)
        broker = load(BrokerSettings)
        settings = dataclasses.replace(broker, listen=listen, instance=f"{broker.instance}-delivery-{index}")
        tls = server_tls()
        policy = server_policy()
        check_plaintext(listen, "SOKUTATSU_BROKER_DELIVERY_WORKER_LISTEN", tls, runtime.allow_plaintext)
        secret = load_secret(create=False)
    except SettingsError as exc:
        _fail(str(exc))
    logging.basicConfig(
        level=runtime.log_level,
        format="%(asctime)s %(levelname)s delivery-worker[%(process)d] %(name)s: %(message)s",
    )
    gc.freeze()
    stop = asyncio.Event()
    try:
        asyncio.run(
            serve(
                service="broker-delivery-worker",
                settings=settings,
                runtime=runtime,
                register=build(link_path, index, stop, policy, broker.batch_bytes),
                listen_var="SOKUTATSU_BROKER_DELIVERY_WORKER_LISTEN",
                stop=stop,
                tls=tls,
                auth=policy,
                reload_auth=server_policy,
                cluster_secret=secret,
                traced=False,
            )
        )
    except* ConnectionError as group:
        _fail(f"cannot reach the broker's link {link_path}: {group.exceptions[0]}")
    except* Exception as group:
        for error in group.exceptions:
            log.error("delivery worker failed", exc_info=error)  # noqa: TRY400 - each error of the group
        sys.exit(1)
    _tidy(Path(link_path), runtime.parent_pid)
    sys.exit(0)


def _tidy(link: Path, broker_pid: int) -> None:
    """A broker that died (kill -9) left its link's socket and private folder: the first of its workers to
    exit removes them (the folder only once empty)."""
    if broker_pid and os.getppid() != broker_pid:
        with contextlib.suppress(OSError):
            link.unlink(missing_ok=True)
            link.parent.rmdir()  # only when empty: nothing but the socket was ever in it


if __name__ == "__main__":
    main()

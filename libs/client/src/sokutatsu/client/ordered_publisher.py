"""Total-order publishing (extended ATOP, seed 002).

``OrderedPublisher`` stamps batches via its domain's sequencer (one request per batch)
and publishes the stamped messages to a total-order topic on the broker pair; once the
brokers acknowledged a range it tells the sequencer ("published"), so the sequencer
knows which numbers will never need filling. On a new sequencer stream it reports again
every recent range the brokers acknowledged (a report lost with a broken stream is not
lost for good) and claims the ones still being published, so a restarted sequencer does
not fill numbers this publisher sends. ``close`` ends the stream only after its last
report is written, by half-closing it. (Its subscribing side is
:mod:`sokutatsu.client.ordered_subscriber`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
from grpc import aio

from sokutatsu.client._retry import Backoff, StreamEnded, raise_status, reconnectable, write_frame
from sokutatsu.client._tracing import tracing_on
from sokutatsu.client._wire import varint
from sokutatsu.client.config import ClientConfig
from sokutatsu.client.errors import ClientError, Closed, SequencerError
from sokutatsu.client.publisher import Publisher
from sokutatsu.client.structs import Stamp
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc, stamp_pb2

if TYPE_CHECKING:
    from sokutatsu.client._spans import StampSpans

log = logging.getLogger("sokutatsu.client.ordered")

_StampCall = aio.StreamStreamCall[sequencer_pb2.StampRequest, sequencer_pb2.StampResponse]
_RECENT_RANGES = 1024
_SEQ_TAG = b"\x20"  # Stamp.seq = 4, varint


@dataclass(slots=True)
class _Waiting:
    key: str
    body: bytes
    headers: Mapping[str, str] | None
    done: asyncio.Future[Stamp]


class OrderedPublisher:
    """Publish to the total-order ``topic`` on the broker pair ``brokers``; every message is stamped
    by ``domain``'s sequencer at ``sequencer``. ``config``: TLS and token of both (default:
    plaintext, none); ``publisher``: a started :class:`Publisher` to publish through (default: one
    of its own)."""

    def __init__(
        self,
        sequencer: str,
        brokers: str | Sequence[str],
        topic: str,
        *,
        domain: str = "",
        client_id: str | None = None,
        max_batch: int = 10_000,
        stamp_timeout: float = 10.0,
        publisher: Publisher | None = None,
        config: ClientConfig | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.sequencer = sequencer
        self.topic = topic
        self.domain = domain
        self.client_id = client_id or f"ordered-{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.max_batch = max_batch
        self.stamp_timeout = stamp_timeout
        self._own_publisher = publisher is None
        self.config = config or ClientConfig()
        self.publisher = publisher or Publisher(brokers, self.client_id, config=self.config)
        self._queue: deque[_Waiting] = deque()
        self._wake = asyncio.Event()
        self._recent: deque[sequencer_pb2.SequenceRange] = deque(maxlen=_RECENT_RANGES)
        self._published: set[int] = set()  # first_seq of the ranges in _recent the brokers acknowledged
        self._unreported: list[int] = []
        self._stopping = asyncio.Event()  # set by close(): ends a back-off sleep at once
        self._acks: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._failure: Exception | None = None
        self._closed = False
        self._request_id = 0
        self._stamps: StampSpans | None = None  # set by start() when tracing is on
        self.ranges = 0

    async def __aenter__(self) -> OrderedPublisher:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        if self._own_publisher:
            await self.publisher.start()
        if tracing_on():
            from sokutatsu.client._spans import StampSpans  # noqa: PLC0415 - OpenTelemetry only when tracing

            self._stamps = StampSpans(self.client_id, self.sequencer)
        self._task = asyncio.create_task(self._run(), name=f"ordered-publisher-{self.client_id}")

    async def close(self) -> None:
        """Wait (up to the publisher's ``ack_timeout``) for what was handed over, then stop."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.publisher.ack_timeout):  # not wait_for: see Accumulator.wait_acked
                await self.flush()
        self._closed = True
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            # The stamping task writes its last report and half-closes the stream (see _session).
            await asyncio.wait({self._task}, timeout=self.stamp_timeout)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._stamps is not None:
            self._stamps.flush()
        if self._own_publisher:
            await self.publisher.close()

    def publish_nowait(
        self, key: str, body: bytes, *, headers: Mapping[str, str] | None = None
    ) -> asyncio.Future[Stamp]:
        """Queue one message; the future gives its stamp once the brokers hold it."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise Closed("ordered publisher closed")
        done: asyncio.Future[Stamp] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(key, body, headers, done))
        self._wake.set()
        return done

    async def publish(self, key: str, body: bytes, *, headers: Mapping[str, str] | None = None) -> Stamp:
        """Publish one message and wait until the brokers hold it; return its stamp."""
        return await self.publish_nowait(key, body, headers=headers)

    async def flush(self) -> None:
        """Wait until everything handed over is stamped and acknowledged."""
        while self._queue or self._acks:
            if self._failure is not None:
                raise self._failure
            # Futures the caller cancelled are done, but their messages still go out.
            pending = [w.done for w in self._queue if not w.done.done()] + [t for t in self._acks if not t.done()]
            if pending:
                await asyncio.wait(pending, return_when=asyncio.ALL_COMPLETED)
            else:
                self._wake.set()
                await asyncio.sleep(0.01)

    # ---------------------------------------------------------------- stamping --
    async def _run(self) -> None:
        backoff = Backoff()
        while not self._closed:
            try:
                async with self.config.channel(self.sequencer) as channel:
                    call: _StampCall = sequencer_pb2_grpc.SequencerStub(channel).Stamp()
                    await self._session(call, backoff)
            except StreamEnded:
                pass
            except aio.AioRpcError as error:
                if not reconnectable(error) and error.code() != grpc.StatusCode.INTERNAL:
                    self._fail(SequencerError(error.code(), error.details() or ""))
                    return
                log.info("sequencer %s: %s; reconnecting", self.sequencer, error.code().name)
            except (aio.UsageError, asyncio.InvalidStateError, ConnectionError) as error:
                # The stream died under a read or write in a way grpc.aio does not report as a status.
                log.info("sequencer %s: stream broke (%r); reconnecting", self.sequencer, error)
            except ClientError as error:
                # The broker publisher failed for good (closed, or refused the topic).
                self._fail(error)
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff.next_delay()):  # not wait_for: see Accumulator.wait_acked
                    await self._stopping.wait()

    async def _session(self, call: _StampCall, backoff: Backoff) -> None:
        if self._recent:
            # Report again what the brokers acknowledged (an earlier report may have been lost with
            # the stream it was written to; settling twice is harmless) and claim what is still
            # being published, so a restarted sequencer fills neither.
            self._unreported = []
            await write_frame(
                call,
                sequencer_pb2.StampRequest(
                    client_id=self.client_id,
                    domain=self.domain,
                    claims=[r for r in self._recent if r.first_seq not in self._published],
                    published=[r.first_seq for r in self._recent if r.first_seq in self._published],
                ),
            )
        await self._stamp_until_closed(call, backoff)
        # Closing: the last report, then a half-close, so the sequencer reads every frame before the
        # stream ends (cancelling the call could drop what was just written).
        if self._unreported:
            await write_frame(call, sequencer_pb2.StampRequest(client_id=self.client_id, published=self._unreported))
            self._unreported = []
        await call.done_writing()
        await call.code()

    async def _stamp_until_closed(self, call: _StampCall, backoff: Backoff) -> None:
        while not self._closed:
            if not self._queue:
                if self._unreported:
                    await write_frame(
                        call,
                        sequencer_pb2.StampRequest(client_id=self.client_id, published=self._take_unreported()),
                    )
                    continue  # messages may have come during the write: look again before sleeping
                self._wake.clear()
                await self._wake.wait()
                continue
            # Stamp no more than the publisher takes now: stamped numbers must go out at once.
            await self.publisher.wait_for_room()
            batch = [self._queue[i] for i in range(min(self.max_batch, len(self._queue), self.publisher.room))]
            self._request_id += 1
            request = sequencer_pb2.StampRequest(
                request_id=self._request_id,
                count=len(batch),
                client_id=self.client_id,
                domain=self.domain,
                published=self._take_unreported(),
            )
            sent_ns = time.time_ns() if self._stamps is not None else 0
            await write_frame(call, request)
            try:
                async with asyncio.timeout(self.stamp_timeout):  # not wait_for: see Accumulator.wait_acked
                    response = await call.read()
            except TimeoutError:
                # A sequencer that stops answering is treated like one that went away: the
                # range it may have handed out is filled for lack of a claim, and the batch is
                # stamped again on a new stream.
                call.cancel()
                log.warning("sequencer %s: no stamp within %gs; reconnecting", self.sequencer, self.stamp_timeout)
                raise StreamEnded from None
            if response is aio.EOF:
                await raise_status(call)
                raise StreamEnded
            if not isinstance(response, sequencer_pb2.StampResponse):  # pragma: no cover - typed by the stub
                raise StreamEnded
            backoff.reset()
            if self._stamps is not None:
                stamped = response.range
                self._stamps.stamped(stamped.domain, stamped.distribution_id, len(batch), sent_ns, time.time_ns())
            for _ in batch:
                self._queue.popleft()
            self._publish_range(response.range, batch)

    def _publish_range(self, stamped: sequencer_pb2.SequenceRange, batch: list[_Waiting]) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._published.discard(self._recent[0].first_seq)
        self._recent.append(stamped)
        self.ranges += 1
        # The range's fields once; per message only its seq is appended (a field may come in any order).
        shared = stamp_pb2.Stamp(
            distribution_id=stamped.distribution_id,
            domain=stamped.domain,
            epoch=stamped.epoch,
            kind=stamp_pb2.STAMP_KIND_DATA,
            slots=1,
        ).SerializeToString()
        last = 0
        publish, topic = self.publisher._enqueue, self.topic
        for offset, waiting in enumerate(batch):
            stamp = shared + _SEQ_TAG + varint(stamped.first_seq + offset)
            last = publish(topic, waiting.key, waiting.body, waiting.headers, True, stamp)
        task = asyncio.create_task(self._acknowledged(stamped, last, batch))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _acknowledged(self, stamped: sequencer_pb2.SequenceRange, last: int, batch: list[_Waiting]) -> None:
        try:
            await self.publisher.wait_acked(last)
        except Exception as error:  # noqa: BLE001 - handed to every waiting caller
            for waiting in batch:
                if not waiting.done.done():
                    waiting.done.set_exception(error)
            return
        for offset, waiting in enumerate(batch):
            if not waiting.done.done():
                waiting.done.set_result(
                    Stamp(
                        domain=stamped.domain,
                        seq=stamped.first_seq + offset,
                        distribution_id=stamped.distribution_id,
                        epoch=stamped.epoch,
                    )
                )
        self._published.add(stamped.first_seq)
        self._unreported.append(stamped.first_seq)
        self._wake.set()

    def _take_unreported(self) -> list[int]:
        taken, self._unreported = self._unreported, []
        return taken

    def _fail(self, error: Exception) -> None:
        self._failure = error
        while self._queue:
            waiting = self._queue.popleft()
            if not waiting.done.done():
                waiting.done.set_exception(error)

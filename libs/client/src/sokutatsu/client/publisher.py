"""``Publisher``: publish to the broker pair with acknowledgements, batching and retries.

    async with Publisher(["127.0.0.1:7201", "127.0.0.1:7202"], "feed-1") as pub:
        await pub.publish("prices", "7203.T", b"2890")   # acknowledged by both brokers

Every message gets the next number of this publisher's sequence and goes to every broker
address given (the active/standby pair), in frames (:mod:`._link`, one stream per broker, with
its go-back-N); a message is acknowledged once every broker holds it, or once the brokers that
say their peer is down hold it (:mod:`._accumulator`). This module is the API over the two.

* ``publish`` waits for the acknowledgement; ``publish_nowait`` returns the number at once
  (:meth:`Publisher.wait_acked`, :meth:`Publisher.flush` wait later), raising
  :class:`~sokutatsu.client.errors.BufferFull` past ``max_pending`` unacknowledged messages.
* A message a broker limit refuses is sent again until ``ack_timeout``, then the wait raises
  :class:`~sokutatsu.client.errors.PublishTimeout` naming the limit; a refusal for bad input is
  final: waiting calls and later publishes raise :class:`~sokutatsu.client.errors.BrokerError`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from sokutatsu.client._accumulator import Accumulator
from sokutatsu.client._link import Batching, BrokerLink, Counters
from sokutatsu.client._tracing import TRACEPARENT, tracing_on
from sokutatsu.client._wire import encode_message, message_element, publisher_field
from sokutatsu.client.config import ClientConfig
from sokutatsu.client.errors import BufferFull, Closed, Unreachable

if TYPE_CHECKING:
    from sokutatsu.client._spans import SendSpans

# How long a busy link waits for a fuller frame (seconds; docs/broker.md, Publishing).
DEFAULT_LINGER = 0.001
# Frames a link has unacknowledged before it holds a frame that is not full, and the longest it
# holds one (seconds; docs/broker.md, Publishing).
DEFAULT_MAX_IN_FLIGHT = 1
DEFAULT_MAX_HOLD = 0.05


def default_publisher_id() -> str:
    """Unique per process: host, pid and a random part."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}".replace(".", "-")


class Publisher:
    """Publish to topics on the broker pair ``brokers``; ``publisher_id`` names the sequence
    (default: unique per process). ``config``: TLS and token (default: plaintext, none)."""

    def __init__(
        self,
        brokers: str | Sequence[str],
        publisher_id: str | None = None,
        *,
        config: ClientConfig | None = None,
        batch_messages: int = 500,
        batch_bytes: int = 1 * 2**20,
        linger: float = DEFAULT_LINGER,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_hold: float = DEFAULT_MAX_HOLD,
        max_pending: int = 100_000,
        ack_timeout: float = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        addresses = [brokers] if isinstance(brokers, str) else list(brokers)
        if not addresses:
            raise ValueError("give at least one broker address (host:port)")
        if max_in_flight < 0:
            raise ValueError("max_in_flight must be 0 (no limit) or more")
        if max_hold < 0:
            raise ValueError("max_hold must be 0 seconds or more")
        self.publisher_id = publisher_id or default_publisher_id()
        self.config = config or ClientConfig()
        self.connect_timeout = connect_timeout
        self._publisher_field = publisher_field(self.publisher_id)
        self._accumulator = Accumulator(max_pending, ack_timeout)
        self._counters = Counters()
        batching = Batching(batch_messages, batch_bytes, linger, max_in_flight, max_hold)
        self._links = [
            BrokerLink(a, self.publisher_id, self.config, batching, self._accumulator, self._counters)
            for a in addresses
        ]
        for link in self._links:
            link.links = self._links
        self._tasks: list[asyncio.Task[None]] = []
        self._spans: SendSpans | None = None  # set by start() when tracing is on

    # ------------------------------------------------------------- lifecycle --
    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None and self._accumulator.failure is None:
                await self.flush()
        finally:
            await self.close()

    async def start(self) -> None:
        """Connect to the brokers and learn where this publisher's sequence continues.

        Raises :class:`~sokutatsu.client.errors.Unreachable` when no broker answers within
        ``connect_timeout``, or the error a broker refused the stream with.
        """
        if tracing_on():
            from sokutatsu.client._spans import SendSpans  # noqa: PLC0415 - OpenTelemetry only when tracing

            self._spans = SendSpans(self.publisher_id)
            for link in self._links:
                link.spans = self._spans
        self._tasks = [asyncio.create_task(link.run(), name=f"publish-{link.address}") for link in self._links]
        waits = [asyncio.ensure_future(link.opened.wait()) for link in self._links]
        done, pending = await asyncio.wait(waits, timeout=self.connect_timeout, return_when=asyncio.ALL_COMPLETED)
        for waiter in pending:
            waiter.cancel()
        failure = self._accumulator.failure
        if failure is not None:
            await self.close()
            raise failure
        if not done:
            await self.close()
            why = "; ".join(f"{link.address}: {link.last_error}" for link in self._links if link.last_error)
            raise Unreachable(
                f"no broker answered within {self.connect_timeout:g}s: {self.addresses}" + (f" ({why})" if why else "")
            )
        last = max(link.broker_last_seq for link in self._links)
        self._accumulator.continue_after(last)
        for link in self._links:
            if link.connected and link.broker_last_seq < last:
                # Its stream opened before the larger number was known (first_unacked_seq 1), and this
                # process does not hold what lies between: left where its broker is, its next send
                # finds that gone (Accumulator.unsent_index) and opens the stream again from last + 1,
                # so the broker records the hole instead of refusing last + 1 as a gap (chaos seed 508077).
                continue
            link.sent_through = max(link.sent_through, last)
            link.acked_through = max(link.acked_through, last)

    async def close(self) -> None:
        """Stop without waiting for acknowledgements (``async with`` flushes first)."""
        self._accumulator.closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._spans is not None:
            self._spans.close()
        self._accumulator.close()

    @property
    def addresses(self) -> list[str]:
        return [link.address for link in self._links]

    @property
    def acked_seq(self) -> int:
        """Every message up to this number is acknowledged."""
        return self._accumulator.acked

    @property
    def last_seq(self) -> int:
        """The number of the last message handed to this publisher."""
        return self._accumulator.next_seq - 1

    @property
    def ack_timeout(self) -> float:
        return self._accumulator.ack_timeout

    @property
    def max_pending(self) -> int:
        return self._accumulator.max_pending

    @property
    def dropped(self) -> int:
        """Messages the brokers dropped (a topic nobody subscribes to with non-persistent messages)."""
        return self._counters.dropped

    @property
    def duplicates(self) -> int:
        """Messages the brokers already held when they arrived again (after a reconnect)."""
        return self._counters.duplicates

    @property
    def frames(self) -> int:
        """Publish frames written, summed over the brokers' streams (frames sent again after a
        reconnect or a refusal included)."""
        return self._counters.frames

    @property
    def refused(self) -> int:
        """Messages a broker limit refused for a while (each was sent again)."""
        return self._counters.refused

    # ------------------------------------------------------------ publishing --
    def publish_nowait(
        self, topic: str, key: str, body: bytes, *, headers: Mapping[str, str] | None = None, persistent: bool = True
    ) -> int:
        """Queue one message for sending; return its sequence number.

        Raises :class:`~sokutatsu.client.errors.BufferFull` when ``max_pending`` messages wait
        for acknowledgement (:meth:`wait_for_room` waits until one more fits).
        """
        return self._enqueue(topic, key, body, headers, persistent, b"")

    async def publish(
        self, topic: str, key: str, body: bytes, *, headers: Mapping[str, str] | None = None, persistent: bool = True
    ) -> int:
        """Publish one message and wait until the brokers hold it; return its sequence number."""
        await self.wait_for_room()
        seq = self._enqueue(topic, key, body, headers, persistent, b"")
        await self.wait_acked(seq)
        return seq

    def _enqueue(  # noqa: PLR0917 - the one internal path of every publish
        self, topic: str, key: str, body: bytes, headers: Mapping[str, str] | None, persistent: bool, stamp: bytes
    ) -> int:
        """Queue one message; ``stamp`` is a serialised sequencer ``Stamp`` (total-order topics: the
        :class:`~sokutatsu.client.OrderedPublisher` publishes through here), else empty."""
        accumulator = self._accumulator
        if accumulator.failure is not None:
            raise accumulator.failure
        if accumulator.closed:
            raise Closed("publisher closed")
        if accumulator.room <= 0:
            raise BufferFull(f"{accumulator.max_pending} messages are waiting for acknowledgement; await flush()")
        seq = accumulator.next_seq
        fields = dict(headers) if headers else None
        now = time.time_ns()
        trace_field = b""
        if self._spans is not None:
            if fields:
                fields.pop(TRACEPARENT, None)  # the SDK's send span is the message's creation context
            trace_field = self._spans.traceparent(topic, seq, len(body), now)
        payload = encode_message(self._publisher_field, seq, key, body, fields, persistent, now, stamp, trace_field)
        accumulator.append(topic, message_element(payload))
        for link in self._links:
            link.wake.set()
        return seq

    @property
    def room(self) -> int:
        """How many more messages :meth:`publish_nowait` takes before it raises ``BufferFull``."""
        return self._accumulator.room

    async def wait_for_room(self) -> None:
        """Wait until fewer than ``max_pending`` messages wait for acknowledgement, so that
        :meth:`publish_nowait` will not raise ``BufferFull`` (back-pressure without a drain)."""
        while self.room <= 0:
            await self.wait_acked(self._accumulator.first_unacked())

    async def flush(self) -> None:
        """Wait until every message handed over so far is acknowledged."""
        await self.wait_acked(self.last_seq)

    async def wait_acked(self, seq: int) -> None:
        """Wait until message ``seq`` (a number :meth:`publish_nowait` returned) is acknowledged;
        :class:`~sokutatsu.client.errors.PublishTimeout` after ``ack_timeout``."""
        await self._accumulator.wait_acked(seq)

"""The sending side towards one receiving node, as both protocols have it (:mod:`.onephase`,
:mod:`.twophase`): a :class:`Link` and the batches it sends.

A batch fits one gRPC frame: the longest prefix of the messages picked whose bodies fit
``MAX_BATCH_BYTES``, at least one message. Triggers (seed §3.3.1): ``NOTIFY`` from immediate
enqueues wakes the link after the enqueuing transaction commits; otherwise every ``POLL_MS`` it
checks the deferred queues' thresholds (``min_batch`` messages waiting or the oldest ``max_age_ms``
old).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from opentelemetry import trace

from sokutatsu.queuedb import store
from sokutatsu.queuedb.enqueue import FLUSH_SENDER
from sokutatsu.queuedb.faults import CrashPoints
from sokutatsu.queuedb.settings import Peer, TransferSettings
from sokutatsu.queuedb.store import transfer
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc

log = logging.getLogger("sokutatsu.queuedb.transfer")
tracer = trace.get_tracer("sokutatsu.queuedb.transfer")

RPC_TIMEOUT = 30.0
# Largest batch on the wire, bodies included (gRPC frames are limited to 16 MiB).
MAX_BATCH_BYTES = 8 * 2**20


class Session(Protocol):
    """One protocol's session on a connection to this node's database and a stub to the receiver."""

    wake: asyncio.Event

    async def recover(self, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        """Settle what the last session left (on every (re)connection)."""

    async def send(self, conn: store.Conn, stub: queuedb_pb2_grpc.TransferAsyncStub) -> None:
        """Send batches until the session fails."""


class Link:
    """What both protocols know of the link: its settings, the receiver, the crash points, the wake-up."""

    def __init__(self, settings: TransferSettings, peer: Peer, crash: CrashPoints) -> None:
        self.settings = settings
        self.peer = peer
        self.crash = crash
        self.wake = asyncio.Event()

    @property
    def link_attributes(self) -> dict[str, str]:
        """Every transfer span's: which link, which protocol."""
        return {
            "sokutatsu.transfer.from_node": self.settings.node,
            "sokutatsu.transfer.to_node": self.peer.node,
            "sokutatsu.transfer.mode": self.settings.mode,
        }

    def recover_span(self) -> contextlib.AbstractContextManager[trace.Span]:
        """The span of a session's recovery."""
        return tracer.start_as_current_span("transfer.recover", attributes=self.link_attributes)

    @property
    def poll(self) -> float:
        return self.settings.poll_ms / 1000

    async def pick(self, conn: store.Conn) -> list[tuple[Any, ...]]:
        """The next messages not in a batch yet, locked: as many as fit one batch."""
        return within_bytes(await transfer.pick_new(conn, self.peer.node, self.settings.batch))

    async def wait_for_work(self, conn: store.Conn, *, once: bool = False) -> bool:
        """Until a NOTIFY names this receiver, or a deferred queue's threshold is reached (True);
        ``once``: give up after one ``POLL_MS`` without either (False)."""
        poll = self.poll
        while True:
            self.wake.clear()  # before looking: a NOTIFY during the query must still wake the wait
            if await transfer.deferred_due(conn, self.peer.node):
                return True
            try:
                await asyncio.wait_for(self.wake.wait(), poll)
            except TimeoutError:
                if once:
                    return False
                continue
            return True


def batch(sender: str, rows: Sequence[tuple[Any, ...]]) -> queuedb_pb2.TransferBatch:
    """A batch of outbox rows (columns as ``store.transfer``'s picks), each with its transfer id."""
    return queuedb_pb2.TransferBatch(
        sender_node=sender,
        messages=[
            queuedb_pb2.TransferredMessage(
                transfer_id=r[7],
                queue=r[2],
                body=bytes(r[3]),
                headers=r[4] or {},
                key=r[5],
                enqueued_unix_nano=r[6] or 0,
                durability=queuedb_pb2.DURABILITY_SENDER if r[8] == FLUSH_SENDER else queuedb_pb2.DURABILITY_RECEIVER,
            )
            for r in rows
        ],
    )


def within_bytes(rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The longest prefix of ``rows`` whose bodies fit one frame (at least one row)."""
    out: list[tuple[Any, ...]] = []
    size = 0
    for row in rows:
        size += len(row[3]) + 256
        if out and size > MAX_BATCH_BYTES:
            break
        out.append(row)
    return out

"""The transfer daemon: moves forwarding queues' messages to other nodes, exactly once, with the
one-phase protocol of seed 004 (:mod:`.onephase`, :mod:`.recovery`) or the two-phase commit
baseline (:mod:`.twophase`); this module is its process: one link per receiving node, each a
session after another, and the ``LISTEN`` that wakes them.

One daemon per (node, receiver) at a time: a session advisory lock per receiver; a second
daemon waits for it. After a session fails the link watches the receiver's health and starts the
next as soon as it serves (:meth:`PeerLink.run`).

Run it as ``python -m sokutatsu.queuedb.transferd`` (serves gRPC health only).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as the daemon: gRPC's environment, before the imports below load grpc
    from sokutatsu.core.grpc_environment import apply

    apply()

import asyncio
import os
from collections.abc import Sequence
from typing import NoReturn

import grpc
import psycopg
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

from sokutatsu.client._retry import broken_write
from sokutatsu.core.dsn import PostgresError, check_dsn, error_line
from sokutatsu.core.server import Register, ServiceContext, run_service
from sokutatsu.core.settings import SettingsError
from sokutatsu.core.tls import open_channel
from sokutatsu.queuedb.enqueue import TRANSFER_CHANNEL
from sokutatsu.queuedb.faults import CrashPoints
from sokutatsu.queuedb.onephase import OnePhase
from sokutatsu.queuedb.sender import Session, log
from sokutatsu.queuedb.settings import Peer, TransferSettings
from sokutatsu.queuedb.store import transfer
from sokutatsu.queuedb.twophase import TwoPhase
from sokutatsu.queuedb.v1 import queuedb_pb2_grpc

# How often the health channel to a receiver that is down tries to connect (gRPC's default back-off
# grows to 120 s), and the longest wait between failed sessions.
RECONNECT_MS = 100
MAX_BACKOFF = 5.0
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MS),
]


class PeerLink:
    """The sending side towards one receiving node: its sessions, one after another."""

    def __init__(self, settings: TransferSettings, peer: Peer, crash: CrashPoints) -> None:
        self.settings = settings
        self.peer = peer
        self.protocol: Session = (OnePhase if settings.mode == "1pc" else TwoPhase)(settings, peer, crash)
        self.wake = self.protocol.wake
        self._failures = 0  # sessions failed in a row since the last one that recovered

    async def run(self) -> None:
        """Sessions, one after another, for as long as the daemon runs.

        After a session fails it watches the receiver's health (a health ``Watch`` on a channel
        that retries its connection every ``RECONNECT_MS``): a receiver seen down is sent to again
        as soon as it answers ``SERVING``, never after a back-off grown during its outage. Failures
        in a row with the receiver serving all along (this node's database down, a receiver that
        refuses) back off exponentially, to ``MAX_BACKOFF``.
        """
        async with open_channel(self.peer.address, cluster=True, options=_RECONNECT_OPTIONS) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    await self._session()
                except Exception as exc:
                    if not _transient(exc):
                        raise
                    self._failures += 1
                    log.warning("transfer to %s: %s; retrying", self.peer.node, _said(exc, self.settings.dsn))
                else:
                    return
                if await self._until_serving(channel, health):
                    self._failures = 1  # it was down and is back: go now
                if self._failures > 1:
                    await asyncio.sleep(min(MAX_BACKOFF, 0.05 * 2 ** (self._failures - 2)))

    async def _until_serving(self, channel: aio.Channel, health: health_pb2_grpc.HealthStub) -> bool:
        """Until the receiver's health answers ``SERVING``; whether it was seen down first (not
        connected, or another status). A receiver seen down is watched for as long as it takes
        (each watch bounded by ``MAX_BACKOFF``, then renewed); one that serves but gives no answer
        in time (or has no health service) is left to the next session's own failure."""
        down = channel.get_state() != grpc.ChannelConnectivity.READY
        while True:
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True, timeout=MAX_BACKOFF)
            try:
                async for answer in watch:
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return down
                    down = True
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    return False  # no health service: the next session's own failure says why
            finally:
                watch.cancel()
            if channel.get_state() != grpc.ChannelConnectivity.READY:
                down = True
            if not down:
                return False

    async def _session(self) -> None:
        async with (
            await psycopg.AsyncConnection.connect(self.settings.dsn, autocommit=True, connect_timeout=5) as conn,
            open_channel(self.peer.address, cluster=True) as channel,
        ):
            # One sender per receiver: a second daemon waits here until this one is gone.
            await transfer.lock_link(conn, self.peer.node)
            stub: queuedb_pb2_grpc.TransferAsyncStub = queuedb_pb2_grpc.TransferStub(channel)
            await self.protocol.recover(conn, stub)
            self._failures = 0  # connected and recovered: the next failure retries as soon as the receiver serves
            await self.protocol.send(conn, stub)


def _said(error: BaseException | None, dsn: str) -> str:
    """An error for the log: a database error's first line with any password of ``dsn`` masked."""
    if isinstance(error, psycopg.Error):
        return error_line(error, dsn)
    return str(error)


def _transient(error: BaseException) -> bool:
    if isinstance(error, aio.AioRpcError):
        # A write on a stream whose receiver just died can surface as INTERNAL (grpc/grpc#36066).
        return broken_write(error) or error.code() in {
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.FAILED_PRECONDITION,  # a gap: recovery on the next session settles it
            grpc.StatusCode.CANCELLED,
        }
    return isinstance(error, psycopg.OperationalError | OSError)


async def listen(dsn: str, links: dict[str, PeerLink]) -> None:
    """Wake the link a NOTIFY names (sent by immediate enqueues when they commit)."""
    async for attempt in AsyncRetrying(retry=retry_if_exception(_transient), wait=wait_exponential(0.05, max=5)):
        with attempt:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                await transfer.listen(conn, TRANSFER_CHANNEL)
                for link in links.values():
                    link.wake.set()  # anything that came while not listening
                async for note in conn.notifies():
                    woken = links.get(note.payload)
                    if woken is not None:
                        woken.wake.set()


def build(settings: TransferSettings) -> Register:
    if not settings.dsn:
        raise SettingsError(f"{TransferSettings.env_prefix}DSN is not set: give this node's PostgreSQL DSN")
    try:
        check_dsn(settings.dsn)
    except PostgresError as exc:  # before any connection: libpq's parse errors quote the DSN, password too
        raise SettingsError(f"{TransferSettings.env_prefix}DSN: {exc}") from None
    if not settings.peers:
        raise SettingsError(f"{TransferSettings.env_prefix}PEERS is empty: name the receiving nodes, node=host:port")

    async def register(server: aio.Server, context: ServiceContext) -> Sequence[str]:
        crash = CrashPoints(settings.crash_at)
        links = {peer.node: PeerLink(settings, peer, crash) for peer in settings.peers}
        context.start_background(listen(settings.dsn, links), "listen")
        for node, link in links.items():
            context.start_background(link.run(), f"transfer-{node}")
        log.info("transfer from %s to %s (pid %d)", settings.node, ", ".join(links), os.getpid())
        return []

    return register


def main() -> NoReturn:
    run_service("transfer", TransferSettings, build)


if __name__ == "__main__":
    main()

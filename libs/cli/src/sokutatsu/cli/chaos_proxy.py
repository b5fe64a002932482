"""A TCP proxy the chaos harness puts between the two brokers of the pair.

Each broker is told ``SOKUTATSU_BROKER_PEER_LINK=<a proxy to the other>``, so the pair's own
stream (watermarks and heartbeats) goes through it while clients and control calls go to the
brokers directly. :meth:`LinkProxy.cut` closes every connection and drops new ones as soon as
they are accepted until :meth:`LinkProxy.heal`: to each broker its peer looks gone, although
both run. The harness puts one more in front of each broker for the monitor's own calls
(``SOKUTATSU_MONITOR_BROKER_LINKS``): a cut there leaves the broker running and serving its
clients and peer, out of the monitor's reach. :meth:`LinkProxy.mute` instead forwards what
the caller sends and drops every answer: the broker acts on the monitor's calls (a grant, a
``SetRole``) while the monitor hears nothing back, a lost answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

CHUNK = 256 * 1024


class LinkProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` both ways, in this process's event loop."""

    def __init__(self, target: str, port: int = 0) -> None:
        self.target = target
        self.port = port
        self.is_cut = False
        self.is_muted = False
        self.accepted = 0
        self.dropped = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def cut(self) -> None:
        """Close every connection through the proxy; drop new ones until :meth:`heal`."""
        self.is_cut = True
        self._close_all()

    def mute(self) -> None:
        """Forward what callers send, drop what comes back, until :meth:`heal`."""
        self.is_muted = True

    def heal(self) -> None:
        """Forward both ways again; after a mute, connections close (their streams lost bytes)."""
        if self.is_muted:
            self._close_all()
        self.is_cut = False
        self.is_muted = False

    def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut:
            self.dropped += 1
            writer.transport.abort()
            return
        host, port = self.target.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.transport.abort()
            return
        if self.is_cut:  # cut while connecting
            self.dropped += 1
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self.accepted += 1
        self._writers.update((writer, up_writer))
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, lambda: False)),
            asyncio.create_task(self._pump(up_reader, writer, lambda: self.is_muted)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, drop: Callable[[], bool]) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(CHUNK):
                if drop():
                    continue
                writer.write(data)
                await writer.drain()

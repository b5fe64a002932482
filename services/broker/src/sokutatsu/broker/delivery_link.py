"""The link between a broker (the *core*) and one of its delivery workers: a Unix socket carrying
frames tagged with a stream id (docs/broker.md, Delivery workers).

A frame is a header (``HEADER``: payload length, stream id, kind) and its payload. What a worker
sends: ``HELLO`` (stream 0: its index, pid and port, JSON) once it serves; ``OPEN`` (the client
the broker's limits count the stream for, JSON) when a client opens a SubscribeMany stream on it;
``DATA`` (the bytes of one ``SubscribeManyRequest``, as the client sent them); ``HALF_CLOSE``
(the client is done writing); ``CANCEL`` (the client's stream is gone); ``WRITTEN`` (``COUNT``: how
many of the stream's bytes it has written to the client since its last ``WRITTEN``). What the core
sends: ``DATA`` (the bytes of ``SubscribeManyResponse`` frames, written to the client as they are),
``END`` (the stream's status, JSON: the worker ends the client's stream with it; also the answer to
every ``CANCEL``, which the worker waits for, at most ``CANCEL_ANSWER_SECONDS``) and ``TAKEN``
(``COUNT``: how many of the stream's request bytes its ManyStream has taken since the last ``TAKEN``).

Flow control per stream, in both directions, as gRPC's own holds a stream the core serves itself:

* the core has at most ``WINDOW`` bytes of a stream sent and not reported ``WRITTEN`` (one more
  frame past it, then it waits), as a gRPC write waits for a client that does not read; the worker
  reports every ``REPORT_EVERY`` bytes, and relays none of the client's frames while it holds
  ``HOLD`` bytes or more for the stream;
* the worker has at most ``WINDOW`` bytes of a stream's requests relayed and not reported
  ``TAKEN`` (one more frame past it, then it reads no more of the client's frames), as gRPC reads a
  frame only when the handler asks for it; the core reports every ``REPORT_EVERY`` bytes.

So a client that sends and never reads is held back by gRPC flow control, and neither its frames nor
the answers to them pile up in the core or the worker. One stream's wait is its own: the others on
the link go on.

Writes are coalesced: everything :meth:`Link.send` is given during one iteration of the event loop
goes out in one ``write`` at the start of the next (one ``call_soon``). On the core, that is every
stream's frames for that worker produced by one wake-up of the streams: one system call where each
stream would have made its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from typing import Any

log = logging.getLogger(__name__)

HEADER = struct.Struct("!IIB")  # payload length, stream id, kind
# A frame larger than this is a broken link (a response frame is at most about BATCH_BYTES plus one
# batch, a request frame at most SOKUTATSU_MAX_FRAME_BYTES).
MAX_PAYLOAD = 2**30

HELLO = 1
OPEN = 2
DATA = 3
HALF_CLOSE = 4
CANCEL = 5
END = 6
WRITTEN = 7
TAKEN = 8

COUNT = struct.Struct("!Q")
WINDOW = 4 * 2**20
REPORT_EVERY = WINDOW // 4
# Below WINDOW less what may be written and not yet reported: a core that waits has the worker hold
# back the client's frames.
HOLD = WINDOW // 2


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class Link(asyncio.Protocol):
    """One end of a link. Subclasses handle frames (:meth:`frame`) and the link's end (:meth:`lost`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._flush_due = False
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        # Frames sent and the writes they went out in (BrokerStats.delivery_workers).
        self.frames_sent = 0
        self.writes = 0

    # ----------------------------------------------------------- to override --
    def frame(self, kind: int, stream: int, payload: bytes) -> None:
        raise NotImplementedError

    def lost(self) -> None:
        """The link ended (either side closed it, or it broke)."""

    # ------------------------------------------------------------- protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment] # a Unix socket's: a full Transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        size = len(buffer)
        at = 0
        try:
            while size - at >= HEADER.size:
                length, stream, kind = HEADER.unpack_from(buffer, at)
                if length > MAX_PAYLOAD:
                    log.error("delivery link: a frame of %d bytes; closing the link", length)
                    self.close()
                    return
                end = at + HEADER.size + length
                if end > size:
                    break
                payload = bytes(buffer[at + HEADER.size : end])
                at = end
                self.frame(kind, stream, payload)
        finally:
            del buffer[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._out.clear()
        self._wake_writers()
        self.lost()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writers()

    def _wake_writers(self) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --------------------------------------------------------------- writing --
    def send(self, kind: int, stream: int, payload: bytes = b"") -> None:
        """Queue one frame; it goes out with everything else queued in this loop iteration."""
        if self.closed:
            return
        self._out.append(HEADER.pack(len(payload), stream, kind))
        self._out.append(payload)
        self.frames_sent += 1
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self.closed or self.transport is None or not self._out:
            return
        data = b"".join(self._out)
        self._out.clear()
        self.transport.write(data)
        self.writes += 1

    @property
    def paused(self) -> bool:
        """Whether the transport's buffer is over its high-water mark (await :meth:`drained`)."""
        return self._paused and not self.closed

    async def drained(self) -> None:
        """Return once the transport's buffer is below its low-water mark, or the link is gone."""
        while self.paused:
            if self._drained is None:
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self._flush()
            self.transport.close()

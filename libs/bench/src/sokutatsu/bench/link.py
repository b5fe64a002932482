"""A TCP relay that delays everything it carries, in each direction: a link between two sites,
on loopback. The benchmarks put it between a sender and a receiver to measure what a
protocol's round trips cost where they cost something (seed 004 compares its one-phase
protocol with 2PC for transfer over a wide-area network).

It runs its own event loop in a thread, so synchronous benchmark code can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

CHUNK = 65536


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Forward bytes in order, each chunk ``delay`` seconds after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, due - loop.time()))
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(CHUNK):
            queue.put_nowait((loop.time() + delay, data))
    except OSError:
        pass
    finally:
        queue.put_nowait((loop.time() + delay, b""))
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await sender


@contextlib.contextmanager
def delayed_link(target: str, one_way_ms: float) -> Iterator[str]:
    """A loopback address that relays to ``target`` (host:port) with ``one_way_ms`` each way."""
    host, _, port = target.rpartition(":")
    delay = one_way_ms / 1000
    ready = threading.Event()
    address: list[str] = []
    loop = asyncio.new_event_loop()

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, server_writer, delay), _pipe(server_reader, client_writer, delay))

    stop = asyncio.Event()
    connections: set[asyncio.Task[None]] = set()

    async def serve() -> None:
        server = await asyncio.start_server(track, "127.0.0.1", 0)
        address.append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        ready.set()
        await stop.wait()
        server.close()
        for task in connections:
            task.cancel()
        # Everything ends inside the loop: nothing escapes the thread.
        await asyncio.gather(*connections, return_exceptions=True)
        await server.wait_closed()

    async def track(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # noqa: S101 - called by the server as a task
        connections.add(task)
        try:
            await handle(reader, writer)
        finally:
            connections.discard(task)

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        finally:
            loop.close()

    thread = threading.Thread(target=run, daemon=True, name="delayed-link")
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the delayed link did not start")
    try:
        yield address[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)

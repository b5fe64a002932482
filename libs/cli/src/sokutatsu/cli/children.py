"""Child processes steered over their standard input, reporting on their standard output
(``ready`` when up, a JSON object last): the benchmarks', the demo's and the chaos runs' clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any


@contextlib.asynccontextmanager
async def child_process(module: str, *args: str, what: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``python -m module args`` with stdin and stdout piped; waits for its ``ready`` line; killed on exit."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None  # noqa: S101 - stdout=PIPE above
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if line.decode().strip() != "ready":
            raise RuntimeError(f"{what} did not start: {line!r}")
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def stdin_words() -> AsyncIterator[str]:
    """The steering lines a child process is told on its standard input (see :func:`tell`)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        yield line.decode().strip()


async def tell(process: asyncio.subprocess.Process, word: str) -> None:
    """One steering line to a child's standard input."""
    assert process.stdin is not None  # noqa: S101 - stdin=PIPE
    process.stdin.write(f"{word}\n".encode())
    await process.stdin.drain()


async def child_result(process: asyncio.subprocess.Process, limit: float) -> dict[str, Any]:
    """The JSON object a child prints last, once it has exited."""
    assert process.stdout is not None  # noqa: S101 - stdout=PIPE
    out = await asyncio.wait_for(process.stdout.read(), limit)
    await process.wait()
    lines = out.decode().strip().splitlines()
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark process exited with status {process.returncode}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result

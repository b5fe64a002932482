"""One service process: started, announced, killed, paused, stopped, started again.

A service started with ``SOKUTATSU_ANNOUNCE_FILE`` writes ``{"address": "host:port", ...}`` there
once it serves (``sokutatsu.core.server``), so a caller that asked for port 0 learns the port and
knows the service is up. Every bound here only stops a hung start or stop; nothing is timed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_LIMIT_SECONDS = 30.0
STOP_LIMIT_SECONDS = 30.0
_POLL_SECONDS = 0.02


class HarnessError(RuntimeError):
    """A service process did not start, or did not stop within its bound."""


def spawn(
    module: str, env: Mapping[str, str], log: Path, *, announce: Path | None = None, **popen: Any
) -> subprocess.Popen[bytes]:
    """``python -m module`` with ``env`` over this process's environment, its output appended to
    ``log``; with ``announce``, the file it writes its address to (removed first)."""
    full_env = {**os.environ, **env}
    if announce is not None:
        announce.unlink(missing_ok=True)
        full_env["SOKUTATSU_ANNOUNCE_FILE"] = str(announce)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-m", module], env=full_env, stdout=out, stderr=subprocess.STDOUT, **popen
        )


def read_announce(announce: Path) -> str | None:
    """The address in an announce file, or None while there is none (or it is half written)."""
    try:
        return str(json.loads(announce.read_text())["address"])
    except (FileNotFoundError, ValueError, KeyError):
        return None


def wait_announced(
    process: subprocess.Popen[Any], announce: Path, log: Path, *, limit: float = START_LIMIT_SECONDS
) -> str:
    """The address ``process`` announces; :class:`HarnessError` with its log if it exits first or
    takes longer than ``limit`` (the process is then killed)."""
    deadline = time.monotonic() + limit
    while (address := read_announce(announce)) is None:
        if process.poll() is not None:
            raise HarnessError(f"{_name(process)} exited with {process.returncode} before serving:\n{_tail(log)}")
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise HarnessError(f"{_name(process)} did not announce itself within {limit:g} s:\n{_tail(log)}")
        time.sleep(_POLL_SECONDS)
    return address


def settings(prefix: str, **values: str) -> dict[str, str]:
    """``settings("SOKUTATSU_BROKER_", peer_timeout_ms="500")``: the variables, named as the service reads them."""
    return {f"{prefix}{name.upper()}": value for name, value in values.items()}


def stop_process(process: subprocess.Popen[Any], *, limit: float = STOP_LIMIT_SECONDS) -> int:
    """SIGTERM, then SIGKILL if it has not exited within ``limit``; its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill9(process)
    return int(process.returncode)


async def stop_process_async(process: subprocess.Popen[Any], *, limit: float = STOP_LIMIT_SECONDS) -> int:
    """:func:`stop_process` without blocking the event loop (it polls the process)."""
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + limit
        while process.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a child process
            await asyncio.sleep(_POLL_SECONDS)
        if process.poll() is None:
            await asyncio.to_thread(kill9, process)
    return int(process.returncode)


def kill9(process: subprocess.Popen[Any]) -> None:
    """SIGKILL (a crash), and wait for it to be gone."""
    if process.poll() is None:
        process.kill()
        process.wait(timeout=STOP_LIMIT_SECONDS)


def freeze(process: subprocess.Popen[Any]) -> None:
    """SIGSTOP: it holds its connections but answers nothing (a hung process)."""
    if process.poll() is None:
        process.send_signal(signal.SIGSTOP)


def thaw(process: subprocess.Popen[Any]) -> None:
    """SIGCONT after :func:`freeze`."""
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)


async def until(check: Callable[[], Awaitable[bool]], what: str, limit: float = START_LIMIT_SECONDS) -> None:
    """Poll ``check`` until it is true; :class:`HarnessError` naming ``what`` after ``limit`` (a hung wait)."""
    deadline = time.monotonic() + limit
    while not await check():
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {limit:g} s waiting for {what}")
        await asyncio.sleep(_POLL_SECONDS)


@dataclass
class ServiceProcess:
    """``python -m module`` in ``folder``: each start has its own log (``<name>-<n>.log``) and writes
    its address to ``<name>.announce.json``; ``env`` holds across starts. It stops by itself when
    the process that started it is gone (``SOKUTATSU_PARENT_PID``, unless ``env`` names another)."""

    module: str
    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    name: str = ""
    process: subprocess.Popen[bytes] | None = None
    address: str = ""
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = self.name or self.module.rsplit(".", 1)[-1]
        self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def announce(self) -> Path:
        return self.folder / f"{self.name}.announce.json"

    def start(self, **env: str) -> str:
        """Start (again), with ``env`` over :attr:`env` for this start only; wait until it serves."""
        self.starts += 1
        log = self.folder / f"{self.name}-{self.starts}.log"
        self.logs.append(log)
        parent = {"SOKUTATSU_PARENT_PID": str(os.getpid())}
        self.process = spawn(self.module, {**parent, **self.env, **env}, log, announce=self.announce)
        try:
            self.address = wait_announced(self.process, self.announce, log)
        except BaseException:  # e.g. KeyboardInterrupt: never leave the process behind
            stop_process(self.process, limit=0)
            raise
        return self.address

    @property
    def pid(self) -> int:
        if self.process is None:
            raise HarnessError(f"{self.name} was never started")
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill9(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        if self.process is not None:
            kill9(self.process)

    def freeze(self) -> None:
        """SIGSTOP: it holds its connections but answers nothing (a hung process)."""
        if self.process is not None:
            freeze(self.process)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        if self.process is not None:
            thaw(self.process)

    def stop(self, *, limit: float = STOP_LIMIT_SECONDS) -> int | None:
        """SIGTERM (graceful), SIGKILL after ``limit``; the exit status, None if never started."""
        return None if self.process is None else stop_process(self.process, limit=limit)

    def output(self) -> str:
        """Every start's log, oldest first."""
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def tail(self, chars: int = 2000) -> str:
        """The end of the last two starts' logs (for a failure message)."""
        return "\n".join(_tail(p, chars) for p in self.logs[-2:])


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now (from ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "(no log)"


def _name(process: subprocess.Popen[Any]) -> str:
    args = process.args if isinstance(process.args, list) else [str(process.args)]
    return f"{args[-1]} (pid {process.pid})"

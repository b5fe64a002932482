"""Runs the whole suite as local processes on an embedded PostgreSQL.

Start: the state folder's lock (one launcher per folder), PostgreSQL (or
``SOKUTATSU_PG_DSN``), its databases, then each service in topology order as
``python -m sokutatsu.<service>``; each is waited for until it reports SERVING
on gRPC health. Stop (Ctrl-C, SIGTERM, or one service dying): every service
gets SIGTERM in reverse order and its grace period, then SIGKILL; PostgreSQL
stops last. SIGINT and SIGTERM are handled by :class:`StopSignals` for the
launcher's whole life, so an interruption while PostgreSQL or a service is
starting still stops everything that started.

Each service gets ``SOKUTATSU_PARENT_PID`` (this process) and stops by itself
if the launcher disappears without stopping it (e.g. SIGKILL).

Services announce their address in ``<state>/run/<name>.json`` (so port 0
works) and log to ``<state>/logs/<name>.log``; ``<state>/endpoints.json``
lists the running suite (written atomically).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Any

from sokutatsu.cli.topology import SuiteProcess
from sokutatsu.core.dsn import create_database, database_dsn, dsn_without_password, redact_dsn
from sokutatsu.core.errors import StartupError
from sokutatsu.core.health import check
from sokutatsu.harness import kill9, read_announce, spawn, stop_process_async

READY_TIMEOUT_SECONDS = 60.0
STOP_MARGIN_SECONDS = 5.0
HEALTH_RPC_TIMEOUT_SECONDS = 5.0


class Ports(StrEnum):
    """Where the suite listens: ``fixed``, the documented ports (7101...); ``auto``, free ones."""

    fixed = "fixed"
    auto = "auto"


class LaunchError(StartupError):
    """A service did not come up; the message says which and why."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived before the suite was up.

    A ``BaseException`` (like ``KeyboardInterrupt``), so no ``except Exception``
    on the way swallows it; the command turns it into one line.
    """


@dataclass
class StopSignals:
    """SIGINT and SIGTERM for the launcher's whole life (a context manager).

    While the suite is being prepared (PostgreSQL, databases) the first signal
    raises :class:`Interrupted` where the program is, so ``finally`` blocks
    stop what started. From :meth:`calm` on, signals only set the running
    event loop's stop event (see :meth:`attach`), so clean-up is never
    interrupted. Later signals are only recorded.
    """

    received: int | None = None
    raising: bool = True
    _wake: Callable[[], None] | None = None
    _saved: dict[int, Any] = field(default_factory=dict)

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if self._wake is not None:
            self._wake()
        elif first and self.raising:
            raise Interrupted

    def calm(self) -> None:
        """From now on, never raise: only record (and wake an attached loop)."""
        self.raising = False

    def attach(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        """Signals set ``stop`` (from the signal handler, safely, through the loop)."""
        self.calm()

        def wake() -> None:
            loop.call_soon_threadsafe(stop.set)

        self._wake = wake
        if self.received is not None:
            stop.set()

    def detach(self) -> None:
        self._wake = None


@contextlib.contextmanager
def state_lock(state_dir: Path) -> Iterator[None]:
    """Hold ``<state_dir>/.lock`` (flock) for the block; refuse if another launcher holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise LaunchError(
                f"another sokutatsu{who} is already running on the state folder {state_dir}: "
                "stop it first, or set SOKUTATSU_STATE_DIR to another folder"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def connect_hint(pg_dsn: str, external: bool) -> str:
    """How a person reaches the suite's PostgreSQL: the command, and a DSN without a password."""
    if external:
        return f"PostgreSQL: the server of SOKUTATSU_PG_DSN ({redact_dsn(pg_dsn)}); psql on it: sokutatsu queuedb psql"
    return (
        f'PostgreSQL: sokutatsu queuedb psql, or psql "{dsn_without_password(pg_dsn)}" '
        "(password logins only: the password is in the passfile it names)"
    )


def prepare_databases(pg_dsn: str, specs: list[SuiteProcess]) -> None:
    """Create the databases the services need (PostgresError, one line, when the server cannot)."""
    for spec in specs:
        if spec.database:
            create_database(pg_dsn, spec.database)


@dataclass
class Running:
    spec: SuiteProcess
    process: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ": error: " in ln]
    return (errors or lines or [""])[-1]


class Suite:
    """The running processes of the suite."""

    def __init__(self, state_dir: Path, pg_dsn: str, fixed_ports: bool, grace_seconds: float) -> None:
        self.state_dir = state_dir
        self.pg_dsn = pg_dsn
        self.fixed_ports = fixed_ports
        self.grace_seconds = grace_seconds
        self.running: list[Running] = []
        # The pinned processes' addresses, known before they start (SuiteProcess.pinned).
        self.pinned: dict[str, str] = {}
        (state_dir / "logs").mkdir(parents=True, exist_ok=True)
        (state_dir / "run").mkdir(parents=True, exist_ok=True)

    @property
    def endpoints_file(self) -> Path:
        return self.state_dir / "endpoints.json"

    def _env(self, spec: SuiteProcess) -> dict[str, str]:
        env = dict(spec.env)
        env["SOKUTATSU_GRACE_SECONDS"] = str(self.grace_seconds)
        env["SOKUTATSU_PARENT_PID"] = str(os.getpid())
        env[spec.prefix + "INSTANCE"] = spec.name
        port = spec.fixed_port if self.fixed_ports or spec.pinned else 0
        env[spec.prefix + "LISTEN"] = f"127.0.0.1:{port}"
        if spec.keeps_state:
            env[spec.prefix + "STATE_DIR"] = str(self.state_dir / spec.name)
        if spec.database:
            env[spec.prefix + "DSN"] = database_dsn(self.pg_dsn, spec.database)
        env.update(spec.linked_env({**self.pinned, **{r.spec.name: r.address for r in self.running if r.address}}))
        return env

    def pin(self, specs: list[SuiteProcess]) -> None:
        """Know the pinned processes' addresses before they start."""
        self.pinned.update({s.name: f"127.0.0.1:{s.fixed_port}" for s in specs if s.pinned})

    def spawn(self, spec: SuiteProcess) -> Running:
        announce = self.state_dir / "run" / f"{spec.name}.json"
        log_path = self.state_dir / "logs" / f"{spec.name}.log"
        self.pin([spec])
        # Its own session: a terminal's Ctrl-C reaches the launcher only, which stops the
        # services in order.
        process = spawn(
            spec.module,
            self._env(spec),
            log_path,
            announce=announce,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        running = Running(spec=spec, process=process, log_path=log_path)
        self.running.append(running)
        return running

    async def wait_ready(self, running: Running, stop: asyncio.Event) -> None:
        announce = self.state_dir / "run" / f"{running.spec.name}.json"
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline and not stop.is_set():
            code = running.process.poll()
            if code is not None:
                reason = _last_line(running.log_path)
                if self.fixed_ports and "already in use" in reason:
                    reason += "; free the port or run `sokutatsu up --ports auto`"
                raise LaunchError(f"{running.spec.name} exited with status {code}: {reason} (log: {running.log_path})")
            if not running.address:
                running.address = read_announce(announce) or ""
            if running.address and await check(running.address, rpc_timeout=1.0) == "SERVING":
                return
            await asyncio.sleep(0.05)
        if stop.is_set():
            raise Interrupted
        raise LaunchError(
            f"{running.spec.name} did not report SERVING within {READY_TIMEOUT_SECONDS:g}s (log: {running.log_path})"
        )

    async def start(self, specs: list[SuiteProcess], stop: asyncio.Event, progress: Callable[[Running], None]) -> None:
        self.pin(specs)
        for spec in specs:
            if stop.is_set():
                raise Interrupted
            running = self.spawn(spec)
            await self.wait_ready(running, stop)
            progress(running)
        self.write_endpoints()

    def write_endpoints(self) -> None:
        """``endpoints.json``, replaced atomically: a reader sees the old file or the whole new one."""
        payload = [
            {"name": r.spec.name, "role": r.spec.role, "address": r.address, "pid": r.pid, "log": str(r.log_path)}
            for r in self.running
        ]
        tmp = self.endpoints_file.with_name(f".{self.endpoints_file.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(self.endpoints_file)

    async def unhealthy(self) -> list[str]:
        """Every (process, gRPC service) that does not report SERVING, as ``"name service: STATUS"``."""
        problems = []
        for r in self.running:
            for service in ("", *r.spec.services):
                status = await check(r.address, service, rpc_timeout=HEALTH_RPC_TIMEOUT_SECONDS)
                if status != "SERVING":
                    problems.append(f"{r.spec.name} {service or '(server)'}: {status}")
        return problems

    def exited(self) -> Running | None:
        """A service that stopped on its own, if any."""
        return next((r for r in self.running if r.process.poll() is not None), None)

    async def kill(self, running: Running) -> None:
        """SIGKILL (a crash), wait for it to be gone, and forget it (:meth:`spawn` starts it again)."""
        await asyncio.to_thread(kill9, running.process)
        self.running.remove(running)

    async def stop(self) -> list[tuple[str, int]]:
        """SIGTERM each service in reverse order (a paused one is resumed first); SIGKILL after its
        grace. Return (name, exit status)."""
        results = []
        for running in reversed(self.running):
            code = await stop_process_async(running.process, limit=self.grace_seconds + STOP_MARGIN_SECONDS)
            results.append((running.spec.name, code))
        self.running.clear()
        self.endpoints_file.unlink(missing_ok=True)
        return results

"""Runs the whole suite as local processes on an embedded PostgreSQL.

Start: PostgreSQL (or ``SOKUTATSU_PG_DSN``), its databases, then each service
in topology order as ``python -m sokutatsu.<service>``; each is waited for
until it reports SERVING on gRPC health. Stop (Ctrl-C, SIGTERM, or one
service dying): every service gets SIGTERM in reverse order and its grace
period, then SIGKILL; PostgreSQL stops last.

Services announce their address in ``<state>/run/<name>.json`` (so port 0
works) and log to ``<state>/logs/<name>.log``; ``<state>/endpoints.json``
lists the running suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sokutatsu.cli.topology import ServiceProcess
from sokutatsu.core.embedded_pg import create_database, database_dsn
from sokutatsu.core.errors import StartupError
from sokutatsu.core.health import check

READY_TIMEOUT_SECONDS = 60.0
STOP_MARGIN_SECONDS = 5.0


class LaunchError(StartupError):
    """A service did not come up; the message says which and why."""


@dataclass
class Running:
    spec: ServiceProcess
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    address: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies, and ignore the terminal's Ctrl-C."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


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
        (state_dir / "logs").mkdir(parents=True, exist_ok=True)
        (state_dir / "run").mkdir(parents=True, exist_ok=True)

    def _env(self, spec: ServiceProcess, announce: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(spec.env)
        env["SOKUTATSU_ANNOUNCE_FILE"] = str(announce)
        env["SOKUTATSU_GRACE_SECONDS"] = str(self.grace_seconds)
        env[spec.prefix + "INSTANCE"] = spec.name
        port = spec.fixed_port if self.fixed_ports else 0
        env[spec.prefix + "LISTEN"] = f"127.0.0.1:{port}"
        if spec.database:
            create_database(self.pg_dsn, spec.database)
            env[spec.prefix + "DSN"] = database_dsn(self.pg_dsn, spec.database)
        return env

    def spawn(self, spec: ServiceProcess) -> Running:
        announce = self.state_dir / "run" / f"{spec.name}.json"
        announce.unlink(missing_ok=True)
        log_path = self.state_dir / "logs" / f"{spec.name}.log"
        log = log_path.open("ab")
        process = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-m", spec.module],
            env=self._env(spec, announce),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, no locks taken
        )
        running = Running(spec=spec, process=process, log_path=log_path, log=log)
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
            if not running.address and announce.exists():
                running.address = json.loads(announce.read_text())["address"]
            if running.address and await check(running.address, rpc_timeout=1.0) == "SERVING":
                return
            await asyncio.sleep(0.05)
        if stop.is_set():
            raise LaunchError("interrupted while starting")
        raise LaunchError(
            f"{running.spec.name} did not report SERVING within {READY_TIMEOUT_SECONDS:g}s (log: {running.log_path})"
        )

    async def start(
        self, specs: list[ServiceProcess], stop: asyncio.Event, progress: Callable[[Running], None]
    ) -> None:
        for spec in specs:
            running = self.spawn(spec)
            await self.wait_ready(running, stop)
            progress(running)
        self.write_endpoints()

    def write_endpoints(self) -> None:
        payload = [
            {"name": r.spec.name, "role": r.spec.role, "address": r.address, "pid": r.pid, "log": str(r.log_path)}
            for r in self.running
        ]
        (self.state_dir / "endpoints.json").write_text(json.dumps(payload, indent=2))

    def exited(self) -> Running | None:
        """A service that stopped on its own, if any."""
        return next((r for r in self.running if r.process.poll() is not None), None)

    async def stop(self) -> list[tuple[str, int]]:
        """SIGTERM each service in reverse order; SIGKILL after its grace. Return (name, exit status)."""
        results = []
        for running in reversed(self.running):
            proc = running.process
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + self.grace_seconds + STOP_MARGIN_SECONDS
                while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a child process
                    await asyncio.sleep(0.05)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            running.log.close()
            results.append((running.spec.name, proc.returncode))
        self.running.clear()
        (self.state_dir / "endpoints.json").unlink(missing_ok=True)
        return results

"""Running service processes in tests.

Every process started here is stopped by the caller's ``finally`` or fixture
(:func:`ensure_stopped`); a process that does not exit in time is killed, so a
failing test never leaves one behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sokutatsu.core.auth import Policy
from sokutatsu.core.runtime_settings import RuntimeSettings, ServiceSettings
from sokutatsu.core.server import Register, serve
from sokutatsu.core.tls import ServerTls
from sokutatsu.harness import ServiceProcess, kill9, stop_process

# Generous bounds that only stop a hung test (well under pytest's 120 s timeout); nothing asserts on durations.
from sokutatsu.harness.process import START_LIMIT_SECONDS, STOP_LIMIT_SECONDS

__all__ = ["START_LIMIT_SECONDS", "ServiceProc", "ensure_stopped", "run_once", "start_service", "stop"]


class ServiceProc(ServiceProcess):
    """The harness's service process as :func:`start_service` returns it: started."""

    process: subprocess.Popen[bytes]


def run_once(module: str, env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module`` to completion (for processes expected to fail at start).

    On ``TimeoutExpired`` the process is killed and waited for (``subprocess.run`` does it) before the error
    propagates.
    """
    return subprocess.run(
        [sys.executable, "-m", module],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def stop(process: subprocess.Popen[Any], sig: signal.Signals = signal.SIGTERM) -> int:
    """Send ``sig`` and return the exit status; a process that does not exit within the bound
    fails the test (unlike the harness's stop, which then kills it and goes on)."""
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout=STOP_LIMIT_SECONDS)
    except subprocess.TimeoutExpired:
        kill9(process)
        raise AssertionError(f"pid {process.pid} did not exit within {STOP_LIMIT_SECONDS:g}s of {sig.name}") from None


def ensure_stopped(process: subprocess.Popen[Any]) -> None:
    """Clean-up: SIGTERM a process still running, then SIGKILL if it does not exit."""
    stop_process(process, limit=STOP_LIMIT_SECONDS)


def start_service(module: str, env: dict[str, str], folder: Path) -> ServiceProc:
    """Start ``python -m module`` on a free port and wait for its announce file
    (:class:`~sokutatsu.harness.HarnessError` with its log if it exits first)."""
    service = ServiceProc(module, folder, env, name=module)
    service.start()
    return service


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def raw_spans(folder: Path) -> list[dict[str, Any]]:
    """Every span in the OTLP/JSON-lines files under ``folder``, as its JSON object, with its
    ``attributes`` as a dict of values."""
    found = []
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            for resource in json.loads(line)["resourceSpans"]:
                for scope in resource["scopeSpans"]:
                    for span in scope["spans"]:
                        span["attributes"] = {
                            a["key"]: _attribute_value(a["value"]) for a in span.get("attributes", [])
                        }
                        found.append(span)
    return found


def trace_spans(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, attributes) of every span in the OTLP/JSON-lines files under ``folder``."""
    return [(span["name"], span["attributes"]) for span in raw_spans(folder)]


def _attribute_value(value: dict[str, Any]) -> Any:
    kind, raw = next(iter(value.items()))
    if kind == "arrayValue":
        return [_attribute_value(v) for v in raw.get("values", [])]
    return int(raw) if kind == "intValue" else raw


@contextlib.asynccontextmanager
async def served(
    tmp_path: Path,
    register: Register,
    *,
    grace: float = 0.5,
    tls: ServerTls | None = None,
    auth: Policy | None = None,
    stop: asyncio.Event | None = None,
    limit: float = 30.0,
    runtime: dict[str, Any] | None = None,
) -> AsyncIterator[str]:
    """The shared bootstrap's ``serve()`` in this event loop on 127.0.0.1:0 with ``register``
    (``runtime`` overrides RuntimeSettings fields); its address (from the announce file); stopped
    (``stop`` set, also by the caller to stop it earlier), and awaited up to ``limit``, on exit."""
    stop = stop or asyncio.Event()
    announce = tmp_path / f"announce-{id(stop)}.json"
    task = asyncio.create_task(
        serve(
            service="probe",
            settings=ServiceSettings(listen="127.0.0.1:0", instance="probe"),
            runtime=RuntimeSettings(grace_seconds=grace, announce_file=announce, **(runtime or {})),
            register=register,
            listen_var="SOKUTATSU_PROBE_LISTEN",
            stop=stop,
            tls=tls,
            auth=auth,
        )
    )
    try:
        while not announce.exists():
            assert not task.done(), task
            await asyncio.sleep(0.01)
        yield str(json.loads(announce.read_text())["address"])
    finally:
        stop.set()
        await asyncio.wait_for(task, limit)


# Figures tests measure and report, never assert (timing is not a test's verdict: issue #21's
# "report the resume delay"); printed in the session's summary, under "figures measured by the tests".
FIGURES: list[str] = []


def report_figure(line: str) -> None:
    """Print ``line`` in the session's summary."""
    FIGURES.append(line)

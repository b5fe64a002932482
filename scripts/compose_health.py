"""Run a compose project's health checks on their schedule, where podman cannot (no systemd).

podman runs a container's health check from a systemd timer; on a machine without systemd
(this kind of machine) no timer is made, the checks never run and every container stays
"starting", so `docker compose up --wait` and ``depends_on: condition: service_healthy``
would wait for ever. scripts/compose_check.sh runs this beside the project instead: it runs
``podman healthcheck run <container>`` for each running container of the project whose
service has a health check, on the schedule the compose file gives (Docker Engine's rule:
every ``start_interval`` until the first success or the end of ``start_period``, then every
``interval``). podman itself judges each run (timeout, retries, start period) and records the
status that compose reads; this only says when.

``python3 scripts/compose_health.py PROJECT CONFIG.json`` (CONFIG: ``docker compose config
--format json``); it stops on SIGTERM or SIGINT, and prints each status change.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLL_SECONDS = 1.0
WORKERS = 4
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|ns)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def seconds(value: str | None, default: float) -> float:
    """A compose duration ("1m30s", "2s", "500ms") in seconds."""
    if not value:
        return default
    parts = _DURATION.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"not a duration: {value!r}")
    return sum(float(n) * _UNIT[u] for n, u in parts)


@dataclass(frozen=True)
class Schedule:
    interval: float
    start_period: float
    start_interval: float
    timeout: float


@dataclass
class Tracked:
    service: str
    started: float
    next_run: float = 0.0
    running: bool = False
    status: str = "not run"
    runs: int = 0
    passed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def schedules(config: dict[str, Any]) -> dict[str, Schedule]:
    """Per service with an enabled health check: when to run it (Docker's defaults where unset)."""
    found = {}
    for name, spec in config.get("services", {}).items():
        check = spec.get("healthcheck")
        if not check or check.get("disable") or check.get("test", [""])[0] == "NONE":
            continue
        interval = seconds(check.get("interval"), 30.0)
        found[name] = Schedule(
            interval=interval,
            start_period=seconds(check.get("start_period"), 0.0),
            start_interval=seconds(check.get("start_interval"), 5.0),
            timeout=seconds(check.get("timeout"), 30.0),
        )
    return found


def running(project: str) -> dict[str, tuple[str, float]]:
    """Container id -> (service, start time) for the project's running containers."""
    out = subprocess.run(
        ["podman", "ps", "--filter", f"label=com.docker.compose.project={project}", "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = {}
    for entry in json.loads(out or "[]"):
        service = (entry.get("Labels") or {}).get("com.docker.compose.service")
        if service and entry.get("State") == "running":
            found[entry["Id"]] = (service, float(entry.get("StartedAt") or time.time()))
    return found


def run_check(container: str, tracked: Tracked, schedule: Schedule) -> None:
    try:
        result = subprocess.run(
            ["podman", "healthcheck", "run", container],
            capture_output=True,
            text=True,
            timeout=schedule.timeout + 10,
            check=False,
        )
        status = "passed" if result.returncode == 0 else f"failed ({result.stdout.strip() or result.returncode})"
    except subprocess.TimeoutExpired:
        status = "failed (no answer from podman healthcheck run)"
    now = time.time()
    with tracked.lock:
        tracked.runs += 1
        tracked.passed = tracked.passed or status == "passed"
        in_start = not tracked.passed and now - tracked.started < schedule.start_period
        tracked.next_run = now + (schedule.start_interval if in_start else schedule.interval)
        tracked.running = False
        if status != tracked.status:
            print(
                f"compose_health: {tracked.service} ({container[:12]}): {status} after {tracked.runs} runs", flush=True
            )
            tracked.status = status


def main(argv: list[str]) -> int:
    project, config_path = argv[1], Path(argv[2])
    plan = schedules(json.loads(config_path.read_text()))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    tracked: dict[str, Tracked] = {}
    print(f"compose_health: running the health checks of {', '.join(sorted(plan))}", flush=True)
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        while not stop.is_set():
            try:
                now_running = running(project)
            except (subprocess.CalledProcessError, json.JSONDecodeError) as exc:
                print(f"compose_health: podman ps failed: {exc}", flush=True)
                now_running = {}
            for gone in tracked.keys() - now_running.keys():
                del tracked[gone]
            now = time.time()
            for container, (service, started) in now_running.items():
                schedule = plan.get(service)
                if schedule is None:
                    continue
                first = started + (schedule.start_interval if schedule.start_period > 0 else schedule.interval)
                entry = tracked.setdefault(container, Tracked(service, started, next_run=first))
                with entry.lock:
                    if entry.running or now < entry.next_run:
                        continue
                    entry.running = True
                pool.submit(run_check, container, entry, schedule)
            stop.wait(POLL_SECONDS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

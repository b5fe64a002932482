"""Running service processes in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Generous bounds that only stop a hung test; nothing asserts on durations.
START_LIMIT_SECONDS = 30.0


@dataclass
class ServiceProc:
    process: subprocess.Popen[str]
    address: str
    log: Path

    def output(self) -> str:
        return self.log.read_text()


def run_once(module: str, env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module`` to completion (for processes expected to fail at start)."""
    return subprocess.run(
        [sys.executable, "-m", module],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def start_service(module: str, env: dict[str, str], folder: Path) -> ServiceProc:
    """Start ``python -m module`` on a free port and wait for its announce file."""
    announce = folder / f"{module}.announce.json"
    log = folder / f"{module}.log"
    full_env = {**os.environ, "SOKUTATSU_ANNOUNCE_FILE": str(announce), **env}
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", module], env=full_env, stdout=out, stderr=subprocess.STDOUT, text=True
        )
    deadline = time.monotonic() + START_LIMIT_SECONDS
    while not announce.exists():
        if process.poll() is not None:
            raise AssertionError(f"{module} exited with {process.returncode}: {log.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{module} did not announce itself: {log.read_text()}")
        time.sleep(0.02)
    address = json.loads(announce.read_text())["address"]
    return ServiceProc(process=process, address=address, log=log)

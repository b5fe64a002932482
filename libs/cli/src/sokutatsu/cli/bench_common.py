"""Shared pieces of the benchmarks: a broker process of our own, percentiles, machine facts, JSON output."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sokutatsu.harness import spawn, stop_process, wait_announced


def settle_collector() -> None:
    """Collect once, then leave everything made so far (imports, set-up) out of the cyclic
    collector, as the services do (docs/broker.md). This process hosts the publisher: a full
    collection over its imports paused it for 14-24 ms, and every message stamped before the
    pause carried it as latency, charged to the broker (bench/README, slow-subscriber)."""
    gc.collect()
    gc.freeze()


@dataclass
class BrokerRun:
    address: str
    process: subprocess.Popen[bytes]
    folder: Path


@contextmanager
def service_process(module: str, prefix: str, folder: Path, name: str, **settings: str) -> Iterator[BrokerRun]:
    """``python -m <module>`` on a free loopback port, state under ``folder``; stopped (SIGTERM) on exit."""
    env = {
        f"{prefix}LISTEN": "127.0.0.1:0",
        f"{prefix}INSTANCE": name,
        "SOKUTATSU_LOG_LEVEL": "WARNING",
        **{f"{prefix}{k.upper()}": v for k, v in settings.items()},
    }
    announce, log = folder / f"{name}.json", folder / f"{name}.log"
    process = spawn(module, env, log, announce=announce)
    try:
        yield BrokerRun(wait_announced(process, announce, log), process, folder)
    finally:
        stop_process(process)


@contextmanager
def broker_process(**settings: str) -> Iterator[BrokerRun]:
    """A broker on a free loopback port with a throw-away state folder; stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-") as tmp:
        folder = Path(tmp)
        settings.setdefault("state_dir", str(folder / "state"))
        with service_process("sokutatsu.broker", "SOKUTATSU_BROKER_", folder, "broker-a", **settings) as run:
            yield run


@dataclass
class PairRun:
    """A broker pair and the monitor watching it, each its own process."""

    active: BrokerRun
    standby: BrokerRun
    monitor: BrokerRun

    @property
    def addresses(self) -> list[str]:
        return [self.active.address, self.standby.address]


@contextmanager
def pair_with_monitor(
    folder: Path, broker: dict[str, str] | None = None, monitor: dict[str, str] | None = None
) -> Iterator[PairRun]:
    """broker-a (active), broker-b (standby, told broker-a's address) and a monitor, with extra settings."""
    broker = broker or {}
    broker_module, broker_prefix = "sokutatsu.broker", "SOKUTATSU_BROKER_"
    with (
        service_process(
            broker_module, broker_prefix, folder, "broker-a", role="active", state_dir=str(folder / "a"), **broker
        ) as a,
        service_process(
            broker_module,
            broker_prefix,
            folder,
            "broker-b",
            role="standby",
            state_dir=str(folder / "b"),
            peer=a.address,
            **broker,
        ) as b,
        service_process(
            "sokutatsu.monitor",
            "SOKUTATSU_MONITOR_",
            folder,
            "monitor",
            brokers=f"broker-a={a.address},broker-b={b.address}",
            **(monitor or {}),
        ) as m,
    ):
        yield PairRun(a, b, m)


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(fraction * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


@dataclass
class CpuSample:
    """Jiffies of all CPUs from /proc/stat: total and stolen by the hypervisor."""

    total: int
    steal: int


def cpu_sample() -> CpuSample:
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return CpuSample(0, 0)
    steal = fields[7] if len(fields) > 7 else 0
    return CpuSample(sum(fields[:8]), steal)


def steal_percent(before: CpuSample, after: CpuSample) -> float | None:
    """Share of CPU time the hypervisor took between two samples (None where unknown).

    On a virtual machine, steal stalls every process at once; a latency tail measured
    while it is high says more about the host than about the code.
    """
    total = after.total - before.total
    if total <= 0:
        return None
    return round(100 * (after.steal - before.steal) / total, 1)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        memory = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_bytes": memory,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


# ------------------------------------------------------------ child processes --
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

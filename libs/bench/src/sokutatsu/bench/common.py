"""Shared pieces of the benchmarks: service processes of our own, CPU steal (percentiles, machine facts and
JSON output are :mod:`sokutatsu.cli.measure`'s, shared with the demo and the chaos runs)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sokutatsu.harness import spawn, stop_process, wait_announced


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

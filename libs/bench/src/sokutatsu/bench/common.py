"""Shared pieces of the benchmarks: service processes of our own, CPU steal (percentiles, machine facts and
JSON output are :mod:`sokutatsu.cli.measure`'s, shared with the demo and the chaos runs)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from sokutatsu.harness import ServiceProcess, settings
from sokutatsu.harness.broker import BrokerProcess, Pair
from sokutatsu.harness.monitor import MonitorProcess

# Services a benchmark starts log warnings only (their logs are kept beside the run's figures).
QUIET = {"SOKUTATSU_LOG_LEVEL": "WARNING"}


@contextmanager
def started(*processes: ServiceProcess) -> Iterator[None]:
    """Start ``processes`` in order, each quiet; stop them all (SIGTERM, last first) on exit."""
    with ExitStack() as stack:
        for process in processes:
            process.env.update(QUIET)
            stack.callback(process.stop)
            process.start()
        yield


@contextmanager
def service_process(module: str, prefix: str, folder: Path, name: str, **values: str) -> Iterator[ServiceProcess]:
    """``python -m <module>`` on a free loopback port (``<prefix>LISTEN``, ``<prefix>INSTANCE`` ``name``,
    more ``<prefix>*`` settings from ``values``), under ``folder``; stopped on exit."""
    process = ServiceProcess(module, folder, settings(prefix, listen="127.0.0.1:0", instance=name, **values), name)
    with started(process):
        yield process


@contextmanager
def broker_process(**values: str) -> Iterator[BrokerProcess]:
    """A broker on a free loopback port with a throw-away state folder; stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="sokutatsu-bench-") as tmp:
        broker = BrokerProcess.with_settings(Path(tmp), instance="broker-a", **values)
        with started(broker):
            yield broker


@dataclass
class PairRun(Pair):
    """A broker pair and the monitor watching it, each its own process."""

    monitor: MonitorProcess


@contextmanager
def broker_pair(folder: Path, **values: str) -> Iterator[Pair]:
    """broker-a (active) and broker-b (standby, told broker-a's address) under ``folder``, with these
    ``SOKUTATSU_BROKER_*`` settings; stopped on exit."""
    pair = Pair.in_folder(folder, **values)
    with ExitStack() as stack:
        for process in pair.brokers:
            process.env.update(QUIET)
        stack.callback(pair.stop)
        yield pair.start()


@contextmanager
def pair_with_monitor(
    folder: Path, broker: dict[str, str] | None = None, monitor: dict[str, str] | None = None
) -> Iterator[PairRun]:
    """:func:`broker_pair` and a monitor watching it, with extra settings."""
    with broker_pair(folder, **(broker or {})) as pair:
        watcher = MonitorProcess.watching(folder / "monitor", pair.brokers, **(monitor or {}))
        with started(watcher):
            yield PairRun(pair.active, pair.standby, watcher)


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

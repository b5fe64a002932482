"""What the benchmarks, the demo and the chaos runs share when they measure: percentiles,
machine facts, JSON output, and a cyclic collector settled before measuring."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def settle_collector() -> None:
    """Collect once, then leave everything made so far (imports, set-up) out of the cyclic
    collector, as the services do (docs/broker.md). This process hosts the publisher: a full
    collection over its imports paused it for 14-24 ms, and every message stamped before the
    pause carried it as latency, charged to the broker (bench/README, slow-subscriber)."""
    gc.collect()
    gc.freeze()


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(fraction * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


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

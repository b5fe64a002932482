"""py-spy profiles of the active broker during ``sokutatsu bench fanout`` (issue 23, item 1).

``py-spy record --native --threads --format raw`` samples the broker (``RATE`` a second, native
frames included, so gRPC's C layer and ``sendmsg`` show) while the publisher runs, into a
folded-stacks file: one line per distinct stack, ``frame;frame;...;frame count``, the first frame
naming the thread. :func:`breakdown` sorts each sample by its innermost frame that belongs to one
of ``CATEGORIES`` (matching, queueing, encoding, the gRPC write, the event loop), and says per
thread how much of the time it was on a CPU (samples / (``RATE`` x seconds): py-spy records only
threads that are running, without ``--idle``).

py-spy is not a dependency of the project: install it into the virtual environment
(``uv pip install py-spy``) or put it on the PATH; without it no profile is recorded.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import re
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

RATE = 100

# A sample belongs to its innermost frame that one of these matches (tried in this order on each
# frame; frames that match none, such as libc's unnamed addresses, pass to their caller).
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "matching (SubscriptionSpec.matches, Broker._route, key index)",
        re.compile(r"\.matches \(|\._route \(|key_index"),
    ),
    ("queueing (subscription_queue.py)", re.compile(r"subscription_queue\.py")),
    (
        "encoding (batch_response, delivery_element, protobuf)",
        re.compile(r"batch_response|delivery_element|SerializeToString|messages\.py|protobuf|upb"),
    ),
    ("gRPC write: sendmsg", re.compile(r"^sendmsg ")),
    ("event loop: waiting in epoll", re.compile(r"^epoll_wait |select_epoll|EpollSelector\.select")),
    ("write() to a wake-up fd or file", re.compile(r"^(eventfd_)?write ")),
    ("gRPC C layer (cygrpc, other)", re.compile(r"cygrpc|libgrpc|grpc_core")),
    (
        "asyncio: task wake-ups, callbacks, futures",
        re.compile(r"asyncio/|_asynciomodule|contextvars|^(task_|future_|TaskObj|FutureObj)"),
    ),
    ("broker Python (other)", re.compile(r"\(\S+\.py:\d+\)")),
)


# Inclusive shares: samples with this frame anywhere in the stack (the time under it).
INCLUSIVE = (
    "Broker.publish",
    "Broker._route",
    "SubscriptionSpec.matches",
    "SubscriptionQueue.enqueue",
    "SubscriptionQueue.next_batch",
    "DataPlane._subscribe",
    "Broker.credit",
    "batch_response",
    "delivery_element",
    "SerializeToString",
    "sendmsg",
    "BaseEventLoop._run_once",
)


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass
class Recording:
    process: asyncio.subprocess.Process | None
    out: Path
    seconds: float

    async def finish(self) -> str | None:
        """The folded-stacks file once py-spy is done (None: no profile)."""
        if self.process is None:
            return None
        try:
            await asyncio.wait_for(self.process.wait(), self.seconds + 60)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        return str(self.out) if self.out.exists() else None


async def start_recording(pid: int, seconds: float, out: Path) -> Recording:
    """Start py-spy on ``pid`` for ``seconds`` (nothing when py-spy is not installed)."""
    binary = py_spy()
    if binary is None:
        return Recording(None, out, seconds)
    out.parent.mkdir(parents=True, exist_ok=True)
    process = await asyncio.create_subprocess_exec(
        binary,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, int(seconds))),
        "--rate",
        str(RATE),
        "--native",
        "--threads",
        "--format",
        "raw",
        "--output",
        str(out),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await asyncio.sleep(0.3)  # let it attach before the publisher starts
    return Recording(process, out, seconds)


def category(stack: list[str]) -> str:
    for frame in reversed(stack[1:]):  # innermost first; the first frame names the thread
        for name, pattern in CATEGORIES:
            if pattern.search(frame):
                return name
    return "other"


@dataclass
class Breakdown:
    samples: int
    by_category: Counter[str]
    by_thread: Counter[str]
    main_thread: str
    by_category_main: Counter[str]
    top_leaves: Counter[str]
    inclusive: Counter[str]


def parse(text: str) -> Breakdown:
    by_category: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    stacks: list[tuple[list[str], int]] = []
    for line in text.splitlines():
        folded, _, number = line.rpartition(" ")
        if not folded or not number.isdigit():
            continue
        stack = folded.split(";")
        stacks.append((stack, int(number)))
        by_thread[stack[0]] += int(number)
    # The event-loop thread: the one whose stacks run asyncio's loop most.
    loop_samples: Counter[str] = Counter()
    for stack, count in stacks:
        if any("_run_once" in f for f in stack):
            loop_samples[stack[0]] += count
    main = (loop_samples or by_thread).most_common(1)[0][0] if by_thread else ""
    by_category_main: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for stack, count in stacks:
        for name in INCLUSIVE:
            if any(frame.startswith(f"{name} ") for frame in stack):
                inclusive[name] += count
        name = category(stack)
        by_category[name if stack[0] == main else "other threads"] += count
        if stack[0] == main:
            by_category_main[name] += count
        leaves[_short(stack[-1])] += count
    return Breakdown(sum(by_thread.values()), by_category, by_thread, main, by_category_main, leaves, inclusive)


def _short(frame: str) -> str:
    return re.sub(r"\s+\(.*/", " (", frame)


def breakdown_markdown(label: str, path: Path, seconds: float) -> str:
    """A section on one profile: categories as shares of all samples, threads' time on a CPU."""
    found = parse(gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text())
    if not found.samples:
        return f"### {label}\n\nno samples in {path.name}\n"
    lines = [f"### {label}", "", f"{found.samples:,} samples at {RATE}/s over {seconds:g}s (`{path.name}`)", ""]
    main = sum(found.by_category_main.values()) or 1
    lines += ["| where | share of all samples | of the event-loop thread's |", "|---|---|---|"]
    for name, count in found.by_category.most_common():
        own = f"{100 * found.by_category_main[name] / main:.1f} %" if name != "other threads" else ""
        lines.append(f"| {name} | {100 * count / found.samples:.1f} % | {own} |")
    lines += ["", "| thread | on a CPU (samples / (rate x seconds)) |", "|---|---|"]
    for thread, count in found.by_thread.most_common(6):
        mark = " (event loop)" if thread == found.main_thread else ""
        lines.append(f"| {thread}{mark} | {100 * count / (RATE * seconds):.0f} % |")
    lines += ["", "| function (time under it, inclusive) | share of all samples |", "|---|---|"]
    lines += [f"| `{n}` | {100 * found.inclusive[n] / found.samples:.1f} % |" for n in INCLUSIVE if found.inclusive[n]]
    lines += ["", "| innermost frame (top 12) | share |", "|---|---|"]
    for leaf, count in found.top_leaves.most_common(12):
        lines.append(f"| `{leaf[:90]}` | {100 * count / found.samples:.1f} % |")
    return "\n".join(lines) + "\n"


def write_breakdown(folder: Path, seconds: float, rows: list[dict[str, object]]) -> Path:
    """``breakdown.md`` in ``folder``: one section per profile the run recorded, beside its figures."""
    parts = [
        "# Where a delivery's time goes: the brokers under `bench fanout`",
        "",
        f"py-spy {RATE}/s with native frames (`--native --threads --format raw`), the active broker of the pair "
        "and its standby (which stores every message too), while the publisher ran. Shares are of all samples of "
        "the process; a sample belongs to the innermost frame that names a category (see "
        "`sokutatsu.bench.fanout_profile.CATEGORIES`). py-spy pauses the process for each native sample, so the "
        "figures of a profiled run are worse than an unprofiled one's.",
        "",
    ]
    for row, (key, which) in itertools.product(rows, (("profile", "the active"), ("profile_standby", "the standby"))):
        profile = row.get(key)
        if not isinstance(profile, str):
            continue
        label = f"N={row['subscribers']}, {'1/16 of the keys' if row['filtered'] else 'every key'}"
        label += f", {row['delivery_workers']} delivery workers" if row.get("delivery_workers") else ""
        label += f", publisher linger {row['publisher_linger_ms']:g} ms" if "publisher_linger_ms" in row else ""
        figures = (
            f"{row['deliveries_per_s']:,} of {row['offered_deliveries_per_s']:,} deliveries/s, p50 {row['p50_ms']} / "
            f"p99 {row['p99_ms']} ms, broker CPU {row['broker_cpu_ms_per_1000_deliveries']} ms per 1,000"
        )
        parts += [
            breakdown_markdown(f"{label}: {which}", Path(profile), seconds),
            f"Figures of this run: {figures}.",
            "",
        ]
    path = folder / "breakdown.md"
    path.write_text("\n".join(parts))
    return path


def compress(rows: list[dict[str, object]]) -> None:
    """Each row's folded stacks gzipped in place (a tenth of the size), the row told the new name."""
    for row in rows:
        for key in ("profile", "profile_standby"):
            profile = row.get(key)
            if isinstance(profile, str) and not profile.endswith(".gz"):
                raw = Path(profile)
                Path(f"{profile}.gz").write_bytes(gzip.compress(raw.read_bytes()))
                raw.unlink()
                row[key] = f"{profile}.gz"

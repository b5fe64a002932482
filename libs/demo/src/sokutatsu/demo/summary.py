"""What ``sokutatsu demo`` prints at the end, and the checks that decide its exit status.

Every figure comes from the run: sequence numbers counted at the receivers against what was
sent, the monitor's switchover records, the replicas' orders, node 2's deliveries. A check
that fails is named in the summary and makes the demo exit with status 1.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from sokutatsu.demo.market import MarketResult, Move
from sokutatsu.demo.order import OrderResult, shown
from sokutatsu.demo.queuedb import QueueResult


@dataclass
class Outcome:
    """Everything the run produced; a part is None when the run stopped before it."""

    market: MarketResult | None = None
    order: OrderResult | None = None
    queue: QueueResult | None = None
    report: Path | None = None
    spans: int | None = None
    analysis_skipped: bool = False
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    stopped: list[tuple[str, int]] = field(default_factory=list)  # (process, exit status)

    @property
    def delivered(self) -> int:
        total = sum(d.received for d in self.market.desks) if self.market else 0
        total += sum(len(set(m.order)) for m in self.order.members) if self.order else 0
        return total + (self.queue.received if self.queue else 0)

    @property
    def lost(self) -> int:
        return sum(p.lost for p in (self.market, self.order, self.queue) if p is not None)

    @property
    def duplicates(self) -> int:
        return sum(p.duplicates for p in (self.market, self.order, self.queue) if p is not None)


def failures(o: Outcome) -> list[str]:
    """Every check the run did not pass, in words."""
    bad = list(o.errors)
    missing = [n for n, p in (("market", o.market), ("order", o.order), ("queue", o.queue)) if p is None]
    if missing:
        bad.append(f"did not finish: {', '.join(missing)}")
    if o.market is not None:
        bad += _market_failures(o.market)
    if o.order is not None:
        bad += _order_failures(o.order)
    if o.queue is not None:
        bad += _queue_failures(o.queue)
    if not o.analysis_skipped and o.report is None:
        bad.append("no report.html")
    return bad


def _market_failures(m: MarketResult) -> list[str]:
    bad = [
        f"{d.spec.id}: lost {d.lost}, duplicates {d.duplicates}, outside its filter {d.unexpected}, "
        f"gaps {d.gaps}{', ' + d.error if d.error else ''}"
        for d in m.desks
        if d.lost or d.duplicates or d.unexpected or d.gaps or d.error
    ]
    if m.move("SLOW") is None:
        bad.append(f"the monitor never moved {m.slow_desk} to the standby")
    if m.move("RECOVERED") is None:
        bad.append(f"the monitor never moved {m.slow_desk} back")
    return bad


def _order_failures(r: OrderResult) -> list[str]:
    bad = []
    if not r.agree:
        errors = "; ".join(f"{m.name}: {m.error}" for m in r.members if m.error)
        bad.append("the replicas disagree on the order" + (f" ({errors})" if errors else ""))
    if r.lost or r.duplicates:
        bad.append(f"total order: lost {r.lost}, duplicates {r.duplicates}")
    return bad


def _queue_failures(q: QueueResult) -> list[str]:
    bad = []
    if q.lost or q.duplicates or q.rolled_back_arrived:
        bad.append(
            f"queue-db: lost {q.lost}, duplicates {q.duplicates}, rolled back yet arrived {q.rolled_back_arrived}"
        )
    if not q.crashes:
        bad.append("the transfer daemon never crashed: the exactly-once claim was not put to the test")
    elif not q.crashes[-1].endswith("restarted"):
        bad.append("the transfer daemon was not started again after its crash")
    if q.business_rows != q.committed:
        bad.append(f"node 1 holds {q.business_rows} orders but {q.committed} were committed")
    return bad


def _move(m: Move | None, since_ns: int, what: str) -> str:
    if m is None:
        return "did not happen"
    steps = " · ".join(f"{k} {v:.1f}" for k, v in m.steps_ms.items())
    after = (m.started_ns - since_ns) / 1e9
    return f"{m.from_broker} → {m.to_broker} {after:.1f} s after it {what}: {m.total_ms:.1f} ms ({steps})"


def _latency(phases: dict[str, dict[str, float]]) -> str:
    return "  ·  ".join(f"{name} {p['p50']:.1f} / {p['p99']:.1f}" for name, p in phases.items())


def _rows(o: Outcome) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if (m := o.market) is not None:
        expected = sum(d.expected for d in m.desks)
        got = sum(d.received for d in m.desks)
        rows.append(
            (
                "market data",
                f"{m.sent:,} ticks, {m.symbols} symbols, {len(m.desks)} filtered desks: delivered {got:,} of "
                f"{expected:,} · lost {m.lost} · duplicates {m.duplicates}",
            )
        )
        slow = next(d for d in m.desks if d.spec.id == m.slow_desk)
        rows.append(("switchover", f"{m.slow_desk} {_move(m.move('SLOW'), m.slow_at_ns, 'turned slow')}"))
        away = m.move("SLOW")
        if away is not None:
            rows.append(("", f"queue {away.depth:,} > threshold {away.threshold:,} when the monitor moved it"))
        rows.append(("", f"back {_move(m.move('RECOVERED'), m.fast_at_ns, 'recovered')}"))
        rows.append(("", f"served by {' → '.join(slow.brokers)} (as its SDK saw it)"))
        normal = {tuple(d.brokers) for d in m.desks if d.spec.id != m.slow_desk}
        rows.append(
            (
                "normal desks",
                f"latency p50 / p99 ms: {_latency(m.latency)}; served by {' / '.join(map('→'.join, normal))}",
            )
        )
    if (r := o.order) is not None:
        heads = shown(r)
        same = len(set(heads.values())) == 1
        digests = {mem.digest for mem in r.members}
        verdict = f"same order (sha256 {digests.pop()})" if r.agree and len(digests) == 1 else "ORDERS DIFFER"
        rows.append(
            (
                "total order",
                f"{len(r.members)} replicas x {r.sent:,} orders from domains {', '.join(r.stamps)}: {verdict}"
                f" · lost {r.lost} · duplicates {r.duplicates}",
            )
        )
        if same:
            rows.append(("", f"each replica begins: {next(iter(heads.values()))} …"))
        else:
            rows.extend(("", f"{name} begins: {head} …") for name, head in heads.items())
    if (q := o.queue) is not None:
        rows.append(
            (
                "queue-db",
                f"{q.committed:,} orders committed on node 1 ({q.rolled_back} rolled back): node 2 delivered "
                f"{q.received:,} · lost {q.lost} · duplicates {q.duplicates} · "
                f"rolled back yet arrived {q.rolled_back_arrived}",
            )
        )
        rows.append(("", _crash_line(q)))
    if o.analysis_skipped:
        rows.append(("traces", "analysis skipped (--no-analyze)"))
    elif o.report is not None:
        rows.append(("traces", f"{o.spans:,} spans analysed → {o.report}"))
    return rows


def _crash_line(q: QueueResult) -> str:
    if not q.crashes:
        return "the transfer daemon did not crash"
    line = "; ".join(q.crashes)
    after = [r for r in q.recoveries if r.get("sokutatsu.transfer.marked_sent")]
    if after:
        r: dict[str, Any] = after[-1]
        line += (
            f"; its recovery found node 2 at transfer id {r.get('sokutatsu.transfer.receiver_last_id')} and marked "
            f"{r['sokutatsu.transfer.marked_sent']} sent without sending them again"
        )
    return line


def write_summary(path: Path, o: Outcome, bad: list[str]) -> None:
    """The same figures as JSON (``OUT/summary.json``), for scripts and the demo's test."""
    body = {
        **asdict(o),
        "delivered": o.delivered,
        "lost": o.lost,
        "duplicates": o.duplicates,
        "failures": bad,
        "passed": not bad,
    }
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")


def print_summary(console: Console, o: Outcome) -> list[str]:
    """Print the summary; return the failed checks (none = the demo passed)."""
    bad = failures(o)
    console.print(f"\n[bold]Sokutatsu demo: what was measured[/] ({o.seconds:.0f} s)")
    for name, text in _rows(o):
        console.print(f"[bold]{name:<13}[/]", end="")
        console.print(text, markup=False)
    verdict = "[green]PASS[/]" if not bad else "[red]FAIL[/]"
    console.print(
        f"[bold]{'RESULT':<13}[/]{verdict}: delivered {o.delivered:,} · lost = {o.lost} · duplicates = {o.duplicates}"
    )
    for problem in bad:
        console.print("  [red]✗[/] ", end="")
        console.print(problem, markup=False)
    if o.report is not None:
        console.print(f"report: {o.report}", markup=False)
    return bad

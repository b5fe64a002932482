"""``sokutatsu status``: the broker pair as the monitor sees it."""

from __future__ import annotations

import asyncio
import datetime
import json
from typing import Annotated

import typer
from google.protobuf.json_format import MessageToDict
from grpc import aio
from rich.console import Console
from rich.table import Table

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.core.tls import open_channel
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc

console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

DEFAULT_MONITOR = "127.0.0.1:7301"


def status(
    monitor: Annotated[str, typer.Option("--monitor", "-m", help="Monitor host:port.")] = DEFAULT_MONITOR,
    as_json: Annotated[bool, typer.Option("--json", help="Print GetStatus as JSON (proto field names).")] = False,
    recent: Annotated[int, typer.Option(help="Recent switchovers to show (0 = all the monitor keeps).")] = 10,
    basis: Annotated[bool, typer.Option("--basis", help="Say what each subscriber's threshold comes from.")] = False,
) -> None:
    """Brokers and roles, subscribers (broker, depth, threshold, migrated), recent switchovers with step timings.

    Tables fit the terminal (cells wrap, nothing is cut); --json gives everything for scripts.
    """

    async def fetch() -> tuple[monitor_pb2.MonitorStatus, list[broker_pb2.BrokerStats]]:
        async with open_channel(monitor) as channel:
            reply: monitor_pb2.MonitorStatus = await monitor_pb2_grpc.MonitorStub(channel).GetStatus(
                monitor_pb2.GetStatusRequest(recent_switchovers=max(0, recent)), timeout=10
            )
        brokers = await asyncio.gather(*(_broker_stats(b.address) for b in reply.brokers if not b.error))
        return reply, [b for b in brokers if b is not None]

    try:
        reply, broker_stats = asyncio.run(fetch())
    except aio.AioRpcError as exc:
        err.print(f"sokutatsu: error: monitor at {monitor}: {exc.code().name}: {exc.details()}", markup=False)
        raise typer.Exit(1) from None
    if as_json:
        body = MessageToDict(reply, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
        body["retention"] = [_retention_dict(b) for b in broker_stats]
        print(json.dumps(body, indent=2))  # noqa: T201 - the command's output, for machines
        return
    console.print(brokers_table(reply, monitor))
    console.print(subscribers_table(reply))
    console.print(f"thresholds: {reply.threshold_basis}", markup=False)
    if basis:
        for a in reply.assignments:
            console.print(f"  {a.subscriber_id} on {a.topic}: {a.threshold_basis}", markup=False)
    console.print(switchovers_table(reply))
    console.print(retention_table(broker_stats))


async def _broker_stats(address: str) -> broker_pb2.BrokerStats | None:
    """A broker's own statistics (retention per subscription); None when it does not answer."""
    try:
        async with open_channel(address) as channel:
            stats: broker_pb2.BrokerStats = await broker_pb2_grpc.BrokerAdminStub(channel).GetStats(
                broker_pb2.GetStatsRequest(), timeout=5
            )
            return stats
    except aio.AioRpcError:
        return None


def _policy(retention: broker_pb2.Retention) -> str:
    return broker_pb2.RetentionPolicy.Name(retention.policy).removeprefix("RETENTION_POLICY_").lower()


def _limit(value: float, unit: str) -> str:
    return "none" if not value else f"{value:g} {unit}"


def _age(millis: int) -> str:
    return "" if not millis else f"{millis / 1000:.1f} s"


def _retention_dict(stats: broker_pb2.BrokerStats) -> dict[str, object]:
    return {
        "broker_id": stats.broker_id,
        "defaults": MessageToDict(stats.retention, preserving_proto_field_name=True),
        "subscription_expiry_s": stats.subscription_expiry_s,
        "subscriptions_expired": stats.subscriptions_expired,
        "subscribers": [
            {
                "subscriber_id": s.subscriber_id,
                "topic": s.topic,
                "disk_bytes": s.disk_bytes,
                "oldest_age_ms": s.oldest_age_ms,
                "max_bytes": s.retention.max_bytes,
                "max_age_ms": s.retention.max_age_ms,
                "policy": _policy(s.retention),
                "dropped_retention_bytes": s.dropped_retention_bytes,
                "dropped_retention_age": s.dropped_retention_age,
                "refused_publishes": s.refused_publishes,
            }
            for s in stats.subscribers
        ],
    }


def retention_table(brokers: list[broker_pb2.BrokerStats]) -> Table:
    """Per broker and subscription: disk held, oldest age, the limits in force, what they discarded."""
    title = "retention (per subscription, on each broker)"
    for b in brokers:
        r = b.retention
        title += (
            f"\n  {b.broker_id}: defaults max {_limit(r.max_bytes / 2**20, 'MiB')}, "
            f"age {_limit(r.max_age_ms / 1000, 's')}, {_policy(r)}; "
            f"expiry {_limit(b.subscription_expiry_s, 's')}, {b.subscriptions_expired} expired"
        )
    table = Table(title=title, title_justify="left")
    left = ("broker", "subscriber", "topic", "policy")
    for column in (*left[:3], "disk MiB", "max MiB", "oldest", "max age", "policy", "dropped bytes", "dropped age"):
        table.add_column(column, justify="left" if column in left else "right", overflow="fold")
    table.add_column("refused", justify="right")
    for b in brokers:
        for s in b.subscribers:
            table.add_row(
                b.broker_id,
                s.subscriber_id,
                s.topic,
                _mib(s.disk_bytes),
                _limit(s.retention.max_bytes / 2**20, ""),
                _age(s.oldest_age_ms),
                _limit(s.retention.max_age_ms / 1000, "s"),
                _policy(s.retention),
                str(s.dropped_retention_bytes),
                str(s.dropped_retention_age),
                str(s.refused_publishes),
            )
    return table


def _role(role: broker_pb2.BrokerRole.ValueType) -> str:
    return broker_pb2.BrokerRole.Name(role).removeprefix("BROKER_ROLE_").lower().replace("unspecified", "?")


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def brokers_table(reply: monitor_pb2.MonitorStatus, monitor: str) -> Table:
    table = Table(
        title=(
            f"monitor {monitor}  active {reply.active_broker_id or '(none)'}  "
            f"switch time assumed {reply.switch_estimate_micros / 1000:.1f} ms"
        ),
        title_justify="left",
    )
    for column in (
        "broker",
        "address",
        "role",
        "epoch",
        "up",
        "peer up",
        "held msgs",
        "held MiB",
        "disk MiB",
        "rss MiB",
    ):
        table.add_column(column, justify="right" if "msgs" in column or "MiB" in column else "left", overflow="fold")
    table.add_column("problem", overflow="fold")
    for b in reply.brokers:
        table.add_row(
            b.broker_id,
            b.address,
            _role(b.role),
            str(b.epoch),
            _yes(b.serving),
            _yes(b.peer_up),
            str(b.held_count),
            _mib(b.held_bytes),
            _mib(b.spilled_bytes),
            _mib(b.rss_bytes),
            b.error,
        )
    return table


def subscribers_table(reply: monitor_pb2.MonitorStatus) -> Table:
    table = Table(title="subscribers", title_justify="left")
    left = ("subscriber", "topic", "broker", "migrated", "conn", "mode")
    for column in (*left[:5], "depth", "threshold", "back at", "in/s", "out/s", "mode"):
        table.add_column(column, justify="left" if column in left else "right", overflow="fold")
    for a in reply.assignments:
        broker = a.broker_id or "(none)"
        if a.switching:
            broker += " (switching)"
        table.add_row(
            a.subscriber_id,
            a.topic,
            broker,
            _yes(a.migrated),
            _yes(a.connected),
            str(a.depth),
            str(a.threshold),
            str(a.migrate_back_depth),
            f"{a.inflow_per_second:.0f}",
            f"{a.outflow_per_second:.0f}",
            broker_pb2.OverflowMode.Name(a.overflow_mode).removeprefix("OVERFLOW_MODE_").lower().replace("_", "-"),
        )
    return table


def _steps(record: monitor_pb2.Switchover) -> str:
    return "  ".join(
        f"{monitor_pb2.SwitchoverStep.Name(s.step).removeprefix('SWITCHOVER_STEP_').lower()} "
        f"{s.duration_micros / 1000:.1f}"
        for s in record.steps
    )


def _when(unix_nano: int) -> str:
    if not unix_nano:
        return ""
    moment = datetime.datetime.fromtimestamp(unix_nano / 1e9, tz=datetime.UTC).astimezone()
    return moment.strftime("%H:%M:%S.%f")[:-3]


def switchovers_table(reply: monitor_pb2.MonitorStatus) -> Table:
    table = Table(title="recent switchovers (newest first; times in ms)", title_justify="left")
    for column in ("id", "started", "subscriber", "topic", "from -> to", "reason", "steps", "total", "result"):
        table.add_column(column, justify="right" if column == "total" else "left", overflow="fold")
    for r in reply.recent_switchovers:
        reason = monitor_pb2.SwitchoverReason.Name(r.reason).removeprefix("SWITCHOVER_REASON_").lower()
        if r.depth:
            reason += f" (depth {r.depth} > {r.threshold})" if r.reason == monitor_pb2.SWITCHOVER_REASON_SLOW else ""
        result = "running" if not r.finished else (r.error or "ok")
        if r.note:
            result += f" ({r.note})"
        table.add_row(
            r.id,
            _when(r.started_unix_nano),
            r.subscriber_id or "(every one)",
            r.topic,
            f"{r.from_broker_id} -> {r.to_broker_id}",
            reason,
            _steps(r),
            f"{r.total_micros / 1000:.1f}" if r.finished else "",
            result,
        )
    return table

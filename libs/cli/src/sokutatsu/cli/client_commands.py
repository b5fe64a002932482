"""``sokutatsu publish | subscribe | metrics``: the SDK and the broker by hand."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Annotated

import typer
from grpc import aio
from rich.console import Console
from rich.table import Table

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client import ClientError, Publisher, Subscriber
from sokutatsu.core.tls import client_config, open_channel
from sokutatsu.core.v1 import process_pb2, process_pb2_grpc

console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

DEFAULT_BROKER = "127.0.0.1:7201"
Brokers = Annotated[list[str], typer.Option("--broker", "-b", help="Broker host:port; repeat for the pair.")]


def _run(coro: object) -> None:
    try:
        asyncio.run(coro)  # type: ignore[arg-type]
    except ClientError as exc:  # Unreachable included: no broker answered
        err.print(f"sokutatsu: error: {exc}", markup=False)
        raise typer.Exit(1) from None
    except aio.AioRpcError as exc:
        err.print(f"sokutatsu: error: {exc.code().name}: {exc.details()}", markup=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def publish(
    topic: Annotated[str, typer.Argument(help="Topic to publish to.")],
    key: Annotated[str, typer.Argument(help="Routing key, e.g. a symbol.")],
    body: Annotated[str | None, typer.Argument(help="Message body; omitted = one message per line of stdin.")] = None,
    broker: Brokers = [DEFAULT_BROKER],  # noqa: B006 - typer reads the default
    publisher_id: Annotated[str | None, typer.Option(help="Publisher id (default: unique per process).")] = None,
    transient: Annotated[
        bool, typer.Option("--transient", help="Non-persistent: dropped, not refused, at limits.")
    ] = False,
    connect_timeout: Annotated[
        float, typer.Option("--connect-timeout", min=0.1, help="Seconds to wait for a broker to answer.")
    ] = 10.0,
) -> None:
    """Publish one message (or each line of stdin) and wait for the acknowledgement."""

    async def main() -> None:
        async with Publisher(broker, publisher_id, config=client_config(), connect_timeout=connect_timeout) as pub:
            lines = [body] if body is not None else (line.rstrip("\n") for line in sys.stdin)
            count = 0
            for line in lines:
                pub.publish_nowait(topic, key, line.encode(), persistent=not transient)
                count += 1
            await pub.flush()
            console.print(f"published {count} message(s) as {pub.publisher_id} (acknowledged through {pub.acked_seq})")

    _run(main())


def subscribe(
    topic: Annotated[str, typer.Argument(help="Topic to subscribe to.")],
    subscriber_id: Annotated[str, typer.Option("--id", help="Subscriber id.")] = "cli",
    key: Annotated[list[str], typer.Option("--key", "-k", help="Only these keys (repeatable).")] = [],  # noqa: B006
    prefix: Annotated[list[str], typer.Option("--prefix", "-p", help="Keys with this prefix (repeatable).")] = [],  # noqa: B006
    durable: Annotated[bool, typer.Option(help="Keep the subscription (and its messages) when disconnected.")] = False,
    count: Annotated[int, typer.Option(help="Stop after this many messages (0 = until Ctrl-C).")] = 0,
    broker: Brokers = [DEFAULT_BROKER],  # noqa: B006
) -> None:
    """Print messages as they arrive: publisher, seq, key, latency, body."""

    async def main() -> None:
        async with Subscriber(
            broker, subscriber_id, topic, keys=key, prefixes=prefix, durable=durable, config=client_config()
        ) as sub:
            seen = 0
            async for m in sub:
                latency = (time.time_ns() - m.publish_time_unix_nano) / 1e6
                console.print(
                    f"{m.publisher_id}#{m.publisher_seq} {m.key} {latency:.2f}ms {m.body.decode(errors='replace')}",
                    markup=False,
                )
                seen += 1
                if count and seen >= count:
                    break

    _run(main())


def metrics_broker(
    broker: Annotated[str, typer.Option("--broker", "-b", help="Broker host:port.")] = DEFAULT_BROKER,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes (0 = print once).")] = 0.0,
) -> None:
    """Broker and per-subscriber metrics as a table (like seed 003's `imqcmd metrics`)."""

    async def main() -> None:
        async with open_channel(broker) as channel:
            admin = broker_pb2_grpc.BrokerAdminStub(channel)
            while True:
                console.print(metrics_table(await admin.GetStats(broker_pb2.GetStatsRequest(), timeout=10)))
                if not interval:
                    return
                await asyncio.sleep(interval)

    _run(main())


def metrics_process(
    address: Annotated[
        list[str], typer.Option("--address", "-a", help="Any service's host:port; repeat for several.")
    ] = [DEFAULT_BROKER],  # noqa: B006 - typer reads the default
) -> None:
    """Each service's process figures: pid, uptime, RSS, auth refusals (any Sokutatsu service)."""

    async def main() -> None:
        # One line per process (a table would be cut to the width of a terminal, or of no terminal).
        for target in address:
            async with open_channel(target) as channel:
                p = await process_pb2_grpc.ProcessStub(channel).GetProcessStats(
                    process_pb2.GetProcessStatsRequest(), timeout=10
                )
            security = ("TLS" if p.tls else "plaintext") + (", auth on" if p.auth else "")
            refusals = (
                f"  auth refusals {p.auth_refusals} (unauthenticated {p.unauthenticated}, "
                f"permission denied {p.permission_denied})"
                if p.auth
                else ""
            )
            console.print(
                f"{target}  {p.service} {p.instance}  pid {p.pid}  up {p.uptime_seconds:.0f} s  "
                f"rss {_mib(p.rss_bytes)} MiB  {security}{refusals}",
                markup=False,
            )

    _run(main())


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}"


def _limit_refusals(limits: broker_pb2.ClientLimits) -> str:
    """The per-client limits' refusals and throttles, when there were any (docs/security.md)."""
    counts = {
        "batch": limits.batch_refusals,
        "streams": limits.stream_refusals,
        "subscriptions": limits.subscription_refusals,
        "throttled batches": limits.throttled_batches,
    }
    if not any(counts.values()):
        return ""
    return "  limits: " + ", ".join(f"{name} {n}" for name, n in counts.items() if n)


def metrics_table(s: broker_pb2.BrokerStats) -> Table:
    role = broker_pb2.BrokerRole.Name(s.role).removeprefix("BROKER_ROLE_").lower()
    table = Table(
        title=(
            f"broker {s.broker_id} ({role})  rss {_mib(s.rss_bytes)} MiB  held {s.held_count} msgs / "
            f"{_mib(s.held_bytes)} MiB (limits {s.max_count or '-'} / "
            f"{_mib(s.max_bytes) if s.max_bytes else '-'} MiB)  "
            f"on disk {s.spilled_count} msgs  streams pub {s.publisher_streams} sub {s.subscriber_streams}  "
            f"published {s.published_total} dup {s.duplicates_total} dropped {s.dropped_total} "
            f"refused {s.rejected_total}"
            + (f"  auth refusals {s.auth_refusals}" if s.auth_refusals else "")
            + _limit_refusals(s.client_limits)
        ),
        title_justify="left",
    )
    for column in (
        "subscriber",
        "topic",
        "conn",
        "depth",
        "mem MiB",
        "budget MiB",
        "disk msgs",
        "disk MiB",
        "in flight",
        "credits",
        "in/s",
        "out/s",
    ):
        table.add_column(column, justify="left" if column in ("subscriber", "topic", "conn") else "right")
    for sub in s.subscribers:
        table.add_row(
            sub.subscriber_id,
            sub.topic,
            "yes" if sub.connected else "no",
            str(sub.depth),
            _mib(sub.memory_bytes),
            _mib(sub.memory_budget_bytes),
            str(sub.spilled_count),
            _mib(sub.spilled_bytes),
            str(sub.in_flight),
            str(sub.credits),
            f"{sub.inflow_per_second:.0f}",
            f"{sub.outflow_per_second:.0f}",
        )
    return table

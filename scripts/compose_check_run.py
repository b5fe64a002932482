"""The checks of `make compose-check`, run from the host against the suite `docker compose up` started.

scripts/compose_check.sh builds the images, starts docker-compose.yml with ``up -d --wait``
and then runs this with the project's environment (the SDK talks to the published ports on
127.0.0.1). ``COMPOSE`` holds the compose command line as a JSON list (front end, file,
project); ``OTEL_EXPORTER_OTLP_ENDPOINT`` points at the stand-in receiver, so this process's
own SDK spans (``send``/``process``) arrive there beside the services'.

Each check prints one line, ``check: NAME: PASS|FAIL (what it saw)``; the exit status is 1
when one failed. Waits are bounded (the suite is given time to deliver), and no check asserts
on a duration: the durations printed are figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from compose_check_spans import span_report

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.client import Message, OrderedMessage, OrderedPublisher, OrderedSubscriber, Publisher, Subscriber
from sokutatsu.core.health import check as grpc_health
from sokutatsu.core.telemetry import Telemetry, setup_telemetry
from sokutatsu.core.tls import open_channel
from sokutatsu.monitor.v1 import monitor_pb2, monitor_pb2_grpc
from sokutatsu.queuedb.v1 import queuedb_pb2, queuedb_pb2_grpc

BROKERS = ["127.0.0.1:7201", "127.0.0.1:7202"]
BROKER_SERVICES = {"127.0.0.1:7201": "broker-a", "127.0.0.1:7202": "broker-b"}
MONITOR = "127.0.0.1:7301"
SEQUENCERS = {"a": "127.0.0.1:7101", "b": "127.0.0.1:7102"}
QUEUEDB = ("127.0.0.1:7401", "127.0.0.1:7402")
SPANS_URL = "http://127.0.0.1:16686/spans"
DELIVERY_LIMIT = 60.0  # seconds the suite gets to deliver what a check sent
PUBSUB_MESSAGES = 500
ORDERED_PER_DOMAIN = 20
QUEUE_MESSAGES = 50
FAILOVER_MESSAGES = 1500
KILL_AFTER = 500
STOP_GRACE = 10  # docker-compose.yml's stop_grace_period
ANALYTICS_CONTAINER = "sokutatsu-compose-check-analytics"
PROJECT = "sokutatsu"  # docker-compose.yml's name
# What the analysis must find in the check's own spans: subscriber -> messages its publisher sent.
AUDITED = {"compose-check-desk": 500, "compose-check-failover-desk": 1500}


class CheckFailed(Exception):
    pass


def compose(*args: str, check: bool = True, capture: bool = True) -> str:
    command = [*json.loads(os.environ["COMPOSE"]), *args]
    result = subprocess.run(command, capture_output=capture, text=True, check=False)
    if check and result.returncode != 0:
        raise CheckFailed(f"{' '.join(args)}: exit {result.returncode}: {(result.stderr or '').strip()[-400:]}")
    return result.stdout or ""


def compose_config() -> dict[str, Any]:
    config: dict[str, Any] = json.loads(compose("config", "--format", "json"))
    return config


def containers() -> list[dict[str, Any]]:
    """`compose ps --all` as records (JSON lines, or one JSON array from older front ends)."""
    out = compose("ps", "--all", "--format", "json").strip()
    if out.startswith("["):
        records: list[dict[str, Any]] = json.loads(out)
        return records
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def jobs(config: dict[str, Any]) -> set[str]:
    return {
        other
        for spec in config["services"].values()
        for other, condition in (spec.get("depends_on") or {}).items()
        if condition.get("condition") == "service_completed_successfully"
    }


def long_running(config: dict[str, Any]) -> list[str]:
    return sorted(
        name for name, spec in config["services"].items() if not spec.get("profiles") and name not in jobs(config)
    )


def instances(config: dict[str, Any]) -> dict[str, str]:
    """Compose service -> the instance name its spans carry (SOKUTATSU_*_INSTANCE)."""
    found = {}
    for name in long_running(config):
        for key, value in (config["services"][name].get("environment") or {}).items():
            if key.startswith("SOKUTATSU_") and key.endswith("_INSTANCE"):
                found[name] = str(value)
    return found


# ------------------------------------------------------------------- checks --


async def check_health(config: dict[str, Any]) -> str:
    records = {r["Service"]: r for r in containers()}
    wanted = long_running(config)
    bad = [
        f"{name}: {records.get(name, {}).get('State', 'missing')}/{records.get(name, {}).get('Health', '')}"
        for name in wanted
        if records.get(name, {}).get("State") != "running" or records.get(name, {}).get("Health") != "healthy"
    ]
    for job in sorted(jobs(config)):
        record = records.get(job, {})
        if record.get("State") != "exited" or record.get("ExitCode") != 0:
            bad.append(f"{job}: {record.get('State', 'missing')} exit {record.get('ExitCode')}")
    published = {
        name: f"127.0.0.1:{port['published']}"
        for name in instances(config)
        for port in config["services"][name].get("ports", [])[:1]
    }
    answers = await asyncio.gather(*(grpc_health(address, rpc_timeout=5.0) for address in published.values()))
    bad += [f"{name} at {address}: {answer}" for (name, address), answer in zip(published.items(), answers, strict=True)
            if answer != "SERVING"]  # fmt: skip
    if bad:
        raise CheckFailed("; ".join(bad))
    return (
        f"{len(wanted)} services running and healthy, {', '.join(sorted(jobs(config)))} exited 0, "
        f"gRPC health SERVING from the host on {len(published)} published ports"
    )


def volume(name: str) -> Path:
    """Where a named volume of the project lives on the host (rootful podman)."""
    out = subprocess.run(
        ["podman", "volume", "inspect", f"{PROJECT}_{name}", "--format", "{{.Mountpoint}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(out)


def check_cluster_secret() -> str:
    mountpoint = volume("cluster")
    secret = Path(mountpoint) / "secret"
    info = secret.stat()
    mode = info.st_mode & 0o777
    if mode != 0o600 or info.st_uid != 10001 or info.st_size == 0:
        raise CheckFailed(f"{secret}: mode {mode:o}, uid {info.st_uid}, {info.st_size} bytes")
    return f"made by the cluster-secret job in the cluster volume: mode 600, uid 10001, {info.st_size} bytes"


async def monitor_status() -> monitor_pb2.MonitorStatus:
    async with open_channel(MONITOR) as channel:
        reply: monitor_pb2.MonitorStatus = await monitor_pb2_grpc.MonitorStub(channel).GetStatus(
            monitor_pb2.GetStatusRequest(), timeout=10
        )
    return reply


def roles(status: monitor_pb2.MonitorStatus) -> dict[str, str]:
    return {
        b.broker_id: (broker_pb2.BrokerRole.Name(b.role) if b.serving else "DOWN").removeprefix("BROKER_ROLE_")
        for b in status.brokers
    }


async def check_pair() -> str:
    # A broker is healthy once it serves; its link to the peer, and the monitor's view of it
    # (polled), may follow a moment later: wait for them, within the limit.
    deadline = time.monotonic() + DELIVERY_LIMIT
    polls = 0
    while True:
        status = await monitor_status()
        polls += 1
        seen = roles(status)
        peers = {b.broker_id: b.peer_up for b in status.brokers}
        paired = sorted(seen.values()) == ["ACTIVE", "STANDBY"] and all(peers.values())
        if paired or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    if not paired:
        raise CheckFailed(f"monitor sees roles {seen}, peer links {peers}")
    return (
        f"monitor sees {seen}, each with its peer up (the pair's control RPCs carry the cluster secret; "
        f"{polls} GetStatus polls)"
    )


async def _receive(subscriber: Subscriber | OrderedSubscriber, count: int, into: list[Message]) -> None:
    async def take() -> None:
        async for message in subscriber:
            into.append(message)
            if len(into) >= count:
                return

    with contextlib.suppress(TimeoutError):  # the audit says what did not arrive
        await asyncio.wait_for(take(), DELIVERY_LIMIT)


def _audit(messages: list[Message], publisher: str, sent: int) -> tuple[int, int, bool]:
    """(lost, duplicates, in order) of ``publisher``'s numbers 1..sent among ``messages``."""
    seqs = [m.publisher_seq for m in messages if m.publisher_id == publisher]
    counts = Counter(seqs)
    lost = sum(1 for seq in range(1, sent + 1) if seq not in counts)
    duplicates = sum(n - 1 for n in counts.values())
    return lost, duplicates, seqs == sorted(seqs)


async def check_pubsub() -> str:
    topic, publisher_id = "compose-check", "compose-check-pub"
    received: list[Message] = []
    async with Subscriber(BROKERS, "compose-check-desk", topic, durable=True) as subscriber:
        receiving = asyncio.create_task(_receive(subscriber, PUBSUB_MESSAGES, received))
        async with Publisher(BROKERS, publisher_id) as publisher:
            for i in range(PUBSUB_MESSAGES):
                publisher.publish_nowait(topic, f"{7000 + i % 50}.T", f"tick {i}".encode())
                await publisher.wait_for_room()
            await publisher.flush()
        await receiving
    lost, duplicates, ordered = _audit(received, publisher_id, PUBSUB_MESSAGES)
    bodies_ok = all(m.body == f"tick {m.publisher_seq - 1}".encode() for m in received)
    if lost or duplicates or not ordered or not bodies_ok:
        raise CheckFailed(f"lost {lost}, duplicates {duplicates}, in order {ordered}, bodies intact {bodies_ok}")
    return (
        f"{PUBSUB_MESSAGES} published (acknowledged by the pair), {len(received)} received: "
        "lost 0, duplicates 0, in order"
    )


async def check_ordered() -> str:
    topic = "ordered"
    total = 2 * ORDERED_PER_DOMAIN
    seen: list[list[Message]] = [[], []]
    async with (
        OrderedSubscriber(BROKERS, "compose-check-ordered-1", topic) as first,
        OrderedSubscriber(BROKERS, "compose-check-ordered-2", topic) as second,
    ):
        receiving = [
            asyncio.create_task(_receive(sub, total, into)) for sub, into in zip((first, second), seen, strict=True)
        ]
        async with (
            OrderedPublisher(SEQUENCERS["a"], BROKERS, topic, domain="a") as a,
            OrderedPublisher(SEQUENCERS["b"], BROKERS, topic, domain="b") as b,
        ):
            for i in range(ORDERED_PER_DOMAIN):
                await asyncio.gather(a.publish(f"a{i}", f"a-{i}".encode()), b.publish(f"b{i}", f"b-{i}".encode()))
        await asyncio.gather(*receiving)
    orders = [[m.body.decode() for m in into] for into in seen]
    problems = []
    for n, order in enumerate(orders, 1):
        if sorted(order) != sorted(
            [f"a-{i}" for i in range(ORDERED_PER_DOMAIN)] + [f"b-{i}" for i in range(ORDERED_PER_DOMAIN)]
        ):
            problems.append(f"subscriber {n} got {len(order)} of {total} (or some twice)")
        for domain in "ab":
            mine = [body for body in order if body.startswith(f"{domain}-")]
            if mine != [f"{domain}-{i}" for i in range(ORDERED_PER_DOMAIN)]:
                problems.append(f"subscriber {n}: domain {domain} out of its publish order")
    if orders[0] != orders[1]:
        problems.append("the two ordered subscribers disagree on the order")
    stamped = [m for m in seen[0] if isinstance(m, OrderedMessage)]
    if len(stamped) != len(seen[0]):
        problems.append("an ordered subscriber delivered a message without its stamp")
    stamps = {(m.stamp.domain, m.stamp.seq) for m in stamped}
    if len(stamps) != len(stamped):
        problems.append("a stamp was given twice")
    if problems:
        raise CheckFailed("; ".join(problems))
    return (
        f"{total} messages stamped by seq-a and seq-b, both ordered subscribers got all {total} "
        f"in the same total order, each domain in publish order"
    )


async def check_queuedb() -> str:
    queue = "compose-check"
    async with open_channel(QUEUEDB[0]) as ch1, open_channel(QUEUEDB[1]) as ch2:
        q1, q2 = queuedb_pb2_grpc.QueueServiceStub(ch1), queuedb_pb2_grpc.QueueServiceStub(ch2)
        await q2.CreateQueue(queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name=queue)), timeout=10)
        rule = queuedb_pb2.TransferRule(to_node="queuedb-2", to_queue=queue, immediate=True)
        await q1.CreateQueue(
            queuedb_pb2.CreateQueueRequest(queue=queuedb_pb2.Queue(name=queue, transfer=rule)), timeout=10
        )
        messages = [queuedb_pb2.NewMessage(body=f"order {i}".encode(), key=f"k{i % 5}") for i in range(QUEUE_MESSAGES)]
        await q1.Enqueue(queuedb_pb2.EnqueueRequest(queue=queue, messages=messages), timeout=10)
        received: list[str] = []
        deadline = time.monotonic() + DELIVERY_LIMIT
        while len(received) < QUEUE_MESSAGES and time.monotonic() < deadline:
            answer = await q2.Dequeue(
                queuedb_pb2.DequeueRequest(queue=queue, max_messages=100, visibility_timeout_ms=30_000, wait_ms=500),
                timeout=30,
            )
            if answer.messages:
                received.extend(m.body.decode() for m in answer.messages)
                await q2.Ack(queuedb_pb2.AckRequest(queue=queue, lease_ids=[m.lease_id for m in answer.messages]))
        stats = await q1.GetQueueStats(queuedb_pb2.GetQueueStatsRequest(queue=queue), timeout=10)
    counts = Counter(received)
    lost = QUEUE_MESSAGES - len(counts)
    duplicates = sum(n - 1 for n in counts.values())
    if lost or duplicates:
        raise CheckFailed(f"node 2 got {len(counts)} of {QUEUE_MESSAGES} (duplicates {duplicates})")
    return (
        f"{QUEUE_MESSAGES} enqueued on queuedb-1, all dequeued once on queuedb-2 through transfer-1; "
        f"node 1 outbox pending {stats.transfer_pending}, sending {stats.transfer_sending}"
    )


async def check_failover(killed: list[str]) -> str:
    topic, publisher_id = "compose-check-failover", "compose-check-failover-pub"
    before = roles(await monitor_status())
    active = next(broker for broker, role in before.items() if role == "ACTIVE")
    received: list[Message] = []
    async with Subscriber(BROKERS, "compose-check-failover-desk", topic, durable=True) as subscriber:
        receiving = asyncio.create_task(_receive(subscriber, FAILOVER_MESSAGES, received))
        async with Publisher(BROKERS, publisher_id) as publisher:
            for i in range(FAILOVER_MESSAGES):
                if i == KILL_AFTER:
                    await publisher.flush()
                    compose("kill", "-s", "SIGKILL", active)
                    killed.append(active)
                await publisher.publish(topic, f"k{i % 10}", f"m {i}".encode())
        await receiving
    after = roles(await monitor_status())
    lost, duplicates, ordered = _audit(received, publisher_id, FAILOVER_MESSAGES)
    if lost or duplicates or not ordered or after.get(active) != "DOWN" or "ACTIVE" not in after.values():
        raise CheckFailed(
            f"lost {lost}, duplicates {duplicates}, in order {ordered}; roles before {before}, after {after}"
        )
    return (
        f"SIGKILL of the active broker ({active}) after {KILL_AFTER} of {FAILOVER_MESSAGES} messages; "
        f"roles after: {after}; received {len(received)}: lost 0, duplicates 0, in order"
    )


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 - the stand-in receiver on loopback
        text: str = answer.read().decode()
    return text


async def check_spans(config: dict[str, Any], telemetry: Telemetry) -> str:
    if telemetry.provider is not None:
        telemetry.provider.force_flush()
    wanted = instances(config)
    deadline = time.monotonic() + DELIVERY_LIMIT
    while True:
        lines = (await asyncio.to_thread(_fetch, SPANS_URL)).splitlines()
        requests = [json.loads(line) for line in lines if line.strip()]
        report = span_report(requests, set(wanted.values()), "host")
        if not report.missing_instances or time.monotonic() > deadline:
            break
        await asyncio.sleep(2)
    if report.problems:
        raise CheckFailed("; ".join(report.problems))
    return report.summary


async def check_rejoin(killed: list[str]) -> str:
    """The broker the failover check killed, started again, comes back as the standby."""
    if not killed:
        raise CheckFailed("no broker was killed (the failover check failed first)")
    broker = killed[0]
    compose("up", "-d", "--wait", "--no-build", "--pull", "never", "--no-deps", broker)
    deadline = time.monotonic() + DELIVERY_LIMIT
    while True:
        seen = roles(await monitor_status())
        if seen.get(broker) == "STANDBY" or time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    if seen.get(broker) != "STANDBY" or list(seen.values()).count("ACTIVE") != 1:
        raise CheckFailed(f"after `up -d --wait --no-deps {broker}` the monitor sees {seen}")
    return f"`up -d --wait --no-deps {broker}`: healthy again, and the monitor sees {seen}"


def check_stop(out: Path, telemetry: Telemetry) -> str:
    if telemetry.provider is not None:
        telemetry.provider.force_flush()  # the check's spans, to the receiver and the traces volume
    compose("stop")
    codes = {r["Service"]: r.get("ExitCode") for r in containers()}
    (out / "logs.txt").write_text(compose("logs", "--no-color", "--timestamps"))
    compose("down")
    left = containers()
    text = (
        f"exit codes after `stop` (SIGTERM, SIGINT for PostgreSQL; {STOP_GRACE} s grace): "
        f"{dict(sorted(codes.items()))}; `down` left {len(left)} containers"
    )
    if any(code != 0 for code in codes.values()) or left:
        raise CheckFailed(text)
    return text


def _csv_rows(path: Path) -> list[dict[str, str]]:
    """A table the job wrote as CSV: one file, or Spark's folder of part files."""
    files = sorted(path.glob("part-*.csv")) if path.is_dir() else [path]
    rows: list[dict[str, str]] = []
    for file in files:
        with file.open(newline="") as handle:
            rows.extend(csv.DictReader(handle))
    return rows


def check_analytics(out: Path) -> str:
    subprocess.run(["podman", "rm", "-f", ANALYTICS_CONTAINER], capture_output=True, check=False)
    compose("--profile", "analytics", "run", "-T", "--name", ANALYTICS_CONTAINER, "analytics", capture=False)
    subprocess.run(["podman", "rm", ANALYTICS_CONTAINER], capture_output=True, check=False)
    # From the reports volume: podman 4.3's `cp` of a folder on a volume of a stopped container copies
    # nothing and exits 0 (a single file it copies).
    reports = out / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    shutil.copytree(volume("reports"), reports)
    html = (reports / "report.html").read_text(errors="replace")
    if "<html" not in html.lower() or len(html) < 1000:
        raise CheckFailed(f"{reports / 'report.html'}: {len(html)} characters, not a report")
    audit = {row["subscriber"]: row for row in _csv_rows(reports / "loss_audit.csv")}
    problems = []
    for subscriber, sent in AUDITED.items():
        row = audit.get(subscriber)
        if row is None:
            problems.append(f"{subscriber}: not in the loss audit")
        elif (int(row["sent"]), int(row["processed"]), int(row["lost"]), int(row["duplicates"])) != (sent, sent, 0, 0):
            problems.append(f"{subscriber}: {row}")
    if problems:
        raise CheckFailed("; ".join(problems))
    audited = ", ".join(f"{s} sent {AUDITED[s]} processed {AUDITED[s]} lost 0 duplicates 0" for s in AUDITED)
    return (
        f"report.html ({len(html):,} characters) and tables in {reports}; loss audit from the traces volume: {audited}"
    )


# ---------------------------------------------------------------- the runner --


async def run(out: Path) -> int:
    # The check's own SDK spans go to the receiver (OTEL_EXPORTER_OTLP_ENDPOINT) and, as a file, to
    # the traces volume beside the services' files: the analytics job audits its deliveries.
    telemetry = setup_telemetry("compose-check", "host", volume("traces"))
    config = compose_config()
    killed: list[str] = []
    steps: list[tuple[str, Callable[[], Awaitable[str]] | Callable[[], str]]] = [
        ("health", lambda: check_health(config)),
        ("cluster secret", check_cluster_secret),
        ("broker pair", check_pair),
        ("publish and receive", check_pubsub),
        ("ordered publish", check_ordered),
        ("queue-db transfer", check_queuedb),
        ("spans", lambda: check_spans(config, telemetry)),
        ("failover", lambda: check_failover(killed)),
        ("rejoin", lambda: check_rejoin(killed)),
        ("stop and down", lambda: check_stop(out, telemetry)),
        ("analytics", lambda: check_analytics(out)),
    ]
    results: list[tuple[str, bool, str, float]] = []
    for name, step in steps:
        started = time.monotonic()
        try:
            outcome = step()
            detail = await outcome if not isinstance(outcome, str) else outcome
            passed = True
        except Exception as exc:  # noqa: BLE001 - any failure of a check is reported as that check's
            detail, passed = f"{type(exc).__name__}: {exc}", False
        elapsed = time.monotonic() - started
        results.append((name, passed, detail, elapsed))
        print(f"check: {name}: {'PASS' if passed else 'FAIL'} ({elapsed:.1f} s) {detail}", flush=True)
    telemetry.shutdown()
    failed = [name for name, passed, _, _ in results if not passed]
    (out / "checks.json").write_text(
        json.dumps([{"check": n, "passed": p, "detail": d, "seconds": round(s, 1)} for n, p, d, s in results], indent=1)
    )
    print(f"checks: {len(results) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where report.html and checks.json go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(run(args.out))


if __name__ == "__main__":
    sys.exit(main())

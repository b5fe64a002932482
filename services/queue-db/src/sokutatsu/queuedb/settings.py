"""Queue-db settings: the service's (``SOKUTATSU_QUEUEDB_*``) and the transfer daemon's (``SOKUTATSU_TRANSFER_*``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from sokutatsu.core.runtime_settings import ServiceSettings
from sokutatsu.core.settings import (
    SettingsError,
    choice,
    named_addresses,
    parse_address,
    parse_name,
    parse_positive_float,
    setting,
    whole,
)
from sokutatsu.queuedb.enqueue import MAX_BODY_BYTES


def parse_crash_at(raw: str) -> str:
    """``step@n`` (die at the n-th time the process reaches ``step``), or empty."""
    if raw:
        step, _, n = raw.partition("@")
        if not step or not n.isdigit() or int(n) < 1:
            raise SettingsError("expected step@n with n >= 1, e.g. sender:assigned@3")
    return raw


def parse_peer_names(raw: str) -> tuple[str, ...]:
    """Node names, comma-separated; ``node=host:port`` items (the transfer daemon's PEERS) give their name."""
    names = [parse_name(item.partition("=")[0].strip()) for item in raw.split(",") if item.strip()]
    if len(set(names)) != len(names):
        raise SettingsError(f"a node is named twice in {names}")
    return tuple(names)


# The most a millisecond cap may be set to (a week).
_WEEK_MS = 7 * 24 * 3_600_000
# TransferRule.min_batch and max_age_ms are PostgreSQL integers.
MAX_INT4 = 2**31 - 1


@dataclass(frozen=True)
class QueueDbSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_QUEUEDB_"

    listen: str = setting(
        "LISTEN", "127.0.0.1:7401", "host:port to serve gRPC on (port 0 = any free port).", parse_address
    )
    instance: str = setting(
        "INSTANCE",
        "node1",
        "This node's name in logs, traces and error messages (nothing is keyed on it): give it the name the "
        "other nodes use for it (SOKUTATSU_TRANSFER_NODE of its daemon, PEERS, TransferRule.to_node).",
        parse_name,
    )
    dsn: str = setting(
        "DSN", "", "PostgreSQL connection string of this node's database (required), e.g. postgresql://u@host/db."
    )
    db_check_seconds: float = setting(
        "DB_CHECK_SECONDS",
        5.0,
        "How often the database is checked (at once when a call finds it not answering, every 0.25 s while "
        "it does not answer); while it does not answer, health reports NOT_SERVING.",
        parse_positive_float,
    )
    pool_size: int = setting(
        "POOL_SIZE",
        0,
        "Database connections the node keeps open for its RPCs; 0: two per CPU core (at least 4). Grouped "
        "commits (GROUP_COMMIT_*) need few: each group in flight holds one.",
        whole(0, 1000, "connections"),
    )
    group_commit_window_us: int = setting(
        "GROUP_COMMIT_WINDOW_US",
        1_000,
        "Group commit: how long a group waits, in microseconds, for the Enqueue and Ack calls already inside "
        "this node on their way to a group (as PostgreSQL's commit_delay with commit_siblings, counted "
        "exactly): a lone call never waits. 0: no wait; the calls that arrive while groups commit form the next.",
        whole(0, 1_000_000, "microseconds"),
    )
    group_commit_max_calls: int = setting(
        "GROUP_COMMIT_MAX_CALLS",
        256,
        "Group commit: most Enqueue and Ack calls in one transaction (one WAL flush). 1: each call commits "
        "alone, as before group commit.",
        whole(1, 100_000, "calls"),
    )
    group_commit_max_messages: int = setting(
        "GROUP_COMMIT_MAX_MESSAGES",
        10_000,
        "Group commit: most messages (and lease ids) in one transaction; a single call over it commits alone.",
        whole(1, 1_000_000, "messages"),
    )
    group_commit_in_flight: int = setting(
        "GROUP_COMMIT_IN_FLIGHT",
        2,
        "Group commit: groups committing at once, each on its own pooled connection (the next group forms "
        "while they commit).",
        whole(1, 64, "groups"),
    )
    peers: tuple[str, ...] = setting(
        "PEERS",
        (),
        "The nodes this node's queues may forward to: CreateQueue refuses a TransferRule.to_node not named here "
        "with FAILED_PRECONDITION (naming these). Node names, comma-separated; the transfer daemon's "
        "SOKUTATSU_TRANSFER_PEERS value (node=host:port, ...) is taken as it is. Empty: no forwarding queue.",
        parse_peer_names,
    )
    visibility_timeout_ms: int = setting(
        "VISIBILITY_TIMEOUT_MS",
        30_000,
        "How long a dequeued message stays invisible to other consumers unless the request says otherwise; "
        "not acked by then, it is delivered again.",
        whole(1, _WEEK_MS, "milliseconds"),
    )
    max_visibility_timeout_ms: int = setting(
        "MAX_VISIBILITY_TIMEOUT_MS",
        12 * 3_600_000,
        "Longest DequeueRequest.visibility_timeout_ms a client may ask for (INVALID_ARGUMENT above); "
        "VISIBILITY_TIMEOUT_MS must not be above it.",
        whole(1, _WEEK_MS, "milliseconds"),
    )
    max_nack_delay_ms: int = setting(
        "MAX_NACK_DELAY_MS",
        12 * 3_600_000,
        "Longest NackRequest.delay_ms a client may ask for (INVALID_ARGUMENT above).",
        whole(0, _WEEK_MS, "milliseconds"),
    )
    max_wait_ms: int = setting(
        "MAX_WAIT_MS",
        20_000,
        "Longest DequeueRequest.wait_ms (a Dequeue waiting for a message holds a call open and polls the "
        "database every 50 ms): INVALID_ARGUMENT above; clients wait less and call again.",
        whole(0, 600_000, "milliseconds"),
    )
    max_transfer_min_batch: int = setting(
        "MAX_TRANSFER_MIN_BATCH",
        100_000,
        "Largest TransferRule.min_batch CreateQueue accepts (INVALID_ARGUMENT above): messages a deferred "
        "queue may hold back in this node's outbox before they go.",
        whole(1, MAX_INT4, "messages"),
    )
    max_transfer_age_ms: int = setting(
        "MAX_TRANSFER_AGE_MS",
        3_600_000,
        "Largest TransferRule.max_age_ms CreateQueue accepts (INVALID_ARGUMENT above): how long a deferred "
        "queue may hold a message back before it goes.",
        whole(1, MAX_INT4, "milliseconds"),
    )
    max_body_bytes: int = setting(
        "MAX_BODY_BYTES",
        1_048_576,
        f"Largest message body the API accepts (INVALID_ARGUMENT above); at most {MAX_BODY_BYTES}.",
        whole(1, MAX_BODY_BYTES, "bytes"),
    )
    max_batch: int = setting(
        "MAX_BATCH",
        10_000,
        "Most messages one Enqueue, Dequeue (DequeueRequest.max_messages), Ack or Nack (lease ids) or transfer "
        "batch (Deliver, DeliverStream, PrepareBatch) may carry or ask for: INVALID_ARGUMENT above.",
        whole(1, 1_000_000, "messages"),
    )
    alternate_wait_ms: int = setting(
        "ALTERNATE_WAIT_MS",
        1_000,
        "Queues with alternating durability: how long an Enqueue whose turn is the receiver's waits for the "
        "receiving node to confirm it flushed the messages; then this node flushes them itself and answers, "
        "and flushes every request to that node itself for a while.",
        whole(1, 600_000, "milliseconds"),
    )
    crash_at: str = setting(
        "CRASH_AT",
        "",
        "Fault injection for tests: kill this process with SIGKILL the n-th time it reaches a step, as step@n "
        "(receiver steps: receiver:stored, receiver:committed). Empty in production.",
        parse_crash_at,
    )


def pool_connections(settings: QueueDbSettings) -> int:
    """The pool's size: POOL_SIZE, or two per core (at least 4) when it is 0."""
    return settings.pool_size or max(4, 2 * (os.cpu_count() or 1))


@dataclass(frozen=True)
class Peer:
    node: str
    address: str


def parse_peers(raw: str) -> tuple[Peer, ...]:
    return tuple(Peer(node, address) for node, address in named_addresses(raw, "node"))


@dataclass(frozen=True)
class TransferSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_TRANSFER_"

    listen: str = setting("LISTEN", "127.0.0.1:7411", "host:port for gRPC health (port 0 = any).", parse_address)
    instance: str = setting("INSTANCE", "transfer-1", "Name of this daemon in logs and traces.", parse_name)
    node: str = setting(
        "NODE", "node1", "The sending node's name: receivers keep their recovery row under it.", parse_name
    )
    dsn: str = setting("DSN", "", "PostgreSQL connection string of this node's database (required).")
    peers: tuple[Peer, ...] = setting(
        "PEERS", (), "Receiving nodes as node=host:port of their queue-db service, comma-separated.", parse_peers
    )
    batch: int = setting("BATCH", 1000, "Most messages per transfer batch.", whole(1, 100_000, "messages"))
    pipeline: int = setting(
        "PIPELINE",
        4,
        "1pc: batches in flight to a receiver before the first is confirmed (the receiver's recovery row "
        "keeps them exactly once); 1 sends one at a time.",
        whole(1, 64, "batches"),
    )
    poll_ms: int = setting(
        "POLL_MS",
        200,
        "How often deferred queues' thresholds are checked (immediate queues wake the daemon at once).",
        whole(10, 3_600_000, "milliseconds"),
    )
    mode: str = setting(
        "MODE",
        "1pc",
        "1pc: the one-phase protocol with the receiver's recovery table (seed 004); 2pc: the same batches "
        "with PostgreSQL two-phase commit on both nodes (the baseline it is measured against).",
        choice("1pc", "2pc"),
    )
    crash_at: str = setting(
        "CRASH_AT",
        "",
        "Fault injection for tests: SIGKILL this process the n-th time it reaches a step, as step@n "
        "(1pc: sender:assigned, sender:acked, sender:marked; 2pc: sender:prepared, sender:both-prepared, "
        "sender:committed, sender:finished). Empty in production.",
        parse_crash_at,
    )

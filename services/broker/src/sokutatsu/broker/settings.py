"""Broker settings (environment variables ``SOKUTATSU_BROKER_*``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sokutatsu.core.runtime_settings import ServiceSettings
from sokutatsu.core.settings import SettingsError, choice, parse_address, parse_bool, parse_name, parse_size, setting

parse_mode = choice("flow-to-disk", "migrate")
parse_policy = choice("drop_oldest", "refuse_publish")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(raw: str) -> float:
    """Seconds from e.g. "7d", "12h", "30m", "45s", "500ms" or a plain number of seconds (0 = none)."""
    text = raw.strip().lower()
    unit = next((u for u in ("ms", "s", "m", "h", "d") if text.endswith(u)), "")
    try:
        value = float(text.removesuffix(unit)) * _UNITS.get(unit, 1.0)
    except ValueError:
        raise SettingsError("expected a duration, e.g. 7d, 12h, 30m, 45s or 500ms (0 = none)") from None
    if not math.isfinite(value) or value < 0:
        raise SettingsError("expected 0 (none) or a positive duration")
    return value


parse_role = choice("active", "standby")


def parse_count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError("expected a whole number (0 = no limit)") from None
    if value < 0:
        raise SettingsError("expected 0 (no limit) or more")
    return value


def parse_positive_count(raw: str) -> int:
    value = parse_count(raw)
    if value < 1:
        raise SettingsError("expected 1 or more")
    return value


def parse_rate(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError("expected messages per second, e.g. 50000 (0 = no limit)") from None
    if not math.isfinite(value) or value < 0:
        raise SettingsError("expected 0 (no limit) or more messages per second")
    return value


def parse_peer(raw: str) -> str:
    """host:port of the peer broker, or empty for none."""
    if not raw:
        return ""
    address = parse_address(raw)
    if address.endswith(":0"):
        raise SettingsError("the peer's port must be a real one, not 0")
    return address


def parse_timeout_millis(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError("expected milliseconds, e.g. 1000") from None
    if not 10 <= value <= 60_000:
        raise SettingsError("expected 10 to 60000 milliseconds")
    return value


def parse_millis(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError("expected milliseconds, e.g. 1 or 0.5") from None
    if not 0 <= value <= 1000:
        raise SettingsError("expected 0 to 1000 milliseconds")
    return value


@dataclass(frozen=True)
class BrokerSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_BROKER_"

    listen: str = setting(
        "LISTEN", "127.0.0.1:7201", "host:port to serve gRPC on (port 0 = any free port).", parse_address
    )
    instance: str = setting("INSTANCE", "broker-a", "Broker id, unique within the pair.", parse_name)
    role: str = setting("ROLE", "active", "Role at start: active or standby (the monitor may change it).", parse_role)
    state_dir: Path = setting(
        "STATE_DIR",
        Path(".sokutatsu/broker"),
        "Folder for topics, durable subscriptions and flow-to-disk segments; survives restarts.",
        Path,
    )
    max_count: int = setting(
        "MAX_COUNT",
        1_000_000,
        "Broker-wide limit on messages held in memory (0 = none). Over it, persistent publishes are "
        "refused with RESOURCE_EXHAUSTED and non-persistent ones dropped.",
        parse_count,
    )
    max_bytes: int = setting(
        "MAX_BYTES",
        1024 * 2**20,
        "Broker-wide limit on message bytes held in memory (0 = none), e.g. 512MiB; same effect as MAX_COUNT.",
        parse_size,
    )
    queue_budget: int = setting(
        "QUEUE_BUDGET",
        64 * 2**20,
        "Default memory budget of one subscriber queue; over it, flow-to-disk spills the oldest messages.",
        parse_size,
    )
    default_mode: str = setting(
        "DEFAULT_MODE",
        "flow-to-disk",
        "What a queue over its budget does when its subscription does not say: flow-to-disk or migrate.",
        parse_mode,
    )
    max_queue_budget: int = setting(
        "MAX_QUEUE_BUDGET",
        256 * 2**20,
        "Largest memory budget a client may ask for one subscriber queue (Subscription.memory_budget_bytes), "
        "e.g. 256MiB; more is refused with INVALID_ARGUMENT. It keeps a subscriber that never reads from holding "
        "MAX_BYTES alone and starving every other publisher's persistent messages: keep it well under MAX_BYTES. "
        "A subscription asking 0 gets QUEUE_BUDGET, which this does not bound.",
        parse_size,
    )
    max_body: int = setting(
        "MAX_BODY", 1 * 2**20, "Largest message body accepted; larger ones are refused (INVALID_ARGUMENT).", parse_size
    )
    batch_messages: int = setting(
        "BATCH_MESSAGES", 500, "Delivery frames hold at most this many messages.", parse_positive_count
    )
    batch_bytes: int = setting(
        "BATCH_BYTES", 1 * 2**20, "Delivery frames hold at most about this many bytes.", parse_size
    )
    delivery_workers: int = setting(
        "DELIVERY_WORKERS",
        0,
        "Delivery worker processes (0 = none: this process serves every stream). With k > 0 the broker "
        "starts k workers that serve the gRPC side of SubscribeMany streams on ports of their own (the "
        "broker's host, same TLS and auth) and relay them to this process over a Unix socket; a "
        "SubscribeMany opened on the broker is told to move to the worker with the fewest streams "
        "(docs/broker.md, Delivery workers).",
        parse_count,
    )
    delivery_worker_listen: str = setting(
        "DELIVERY_WORKER_LISTEN",
        "",
        "host:port the first delivery worker listens on (the next ones on the ports after it); empty = the "
        "broker's host, any free port.",
        lambda raw: parse_address(raw) if raw else "",
    )
    linger_ms: float = setting(
        "LINGER_MS",
        0.2,
        "Adaptive batching: a subscriber stream that sent a frame less than this long ago waits this long "
        "for a fuller frame; an idle stream sends at once (0 = never wait).",
        parse_millis,
    )
    auto_create_topics: bool = setting(
        "AUTO_CREATE_TOPICS", True, "Create a topic with default limits on first publish or subscription.", parse_bool
    )
    peer: str = setting(
        "PEER",
        "",
        "host:port of the other broker of the pair (empty = none yet: a broker learns its peer from the "
        "peer's first watermark frame, or from the monitor's SetRole). With a peer, a broker streams its "
        "subscribers' acknowledgements to it and acknowledges publishes alone only while it is not heard from.",
        parse_peer,
    )
    peer_link: str = setting(
        "PEER_LINK",
        "",
        "host:port this broker uses for the pair's own stream to its peer (watermarks and heartbeats), when it "
        "differs from PEER (a separate network between the brokers, or a proxy); empty = PEER. Clients are "
        "always redirected to PEER.",
        parse_peer,
    )
    peer_timeout_ms: float = setting(
        "PEER_TIMEOUT_MS",
        1000.0,
        "The peer counts as down when no watermark frame arrived for this long: publishes are then "
        "acknowledged by this broker alone (single_copy; with MONITORED, only by an active under the monitor's "
        "lease), and subscribers of the peer are served here.",
        parse_timeout_millis,
    )
    monitored: bool = setting(
        "MONITORED",
        False,
        "true when a monitor (SOKUTATSU_MONITOR_BROKERS) decides this pair's failovers; set it on both brokers. "
        "An active then acknowledges publishes alone (its peer not heard) only under the monitor's lease, "
        "steps down when it hears neither its peer nor the monitor for a lease, and a standby neither "
        "acknowledges alone nor promotes itself. false (a pair without a monitor): a broker that does not "
        "hear its peer acknowledges alone and a standby a subscriber comes to promotes itself; a pair cut "
        "in two may then have two actives "
        "(docs/broker.md, The monitor's lease).",
        parse_bool,
    )
    watermark_interval_ms: float = setting(
        "WATERMARK_INTERVAL_MS",
        5.0,
        "How often acknowledged positions go to the peer when they changed (a frame at least every "
        "100 ms in any case, so the peer knows this broker is up).",
        parse_millis,
    )
    # Retention (docs/broker.md, Retention and expiry). Each is the default of a durable
    # subscription's queue and its maximum: CreateSubscription may only ask for less.
    retention_max_bytes: int = setting(
        "RETENTION_MAX_BYTES",
        8 * 2**30,
        "Most bytes of segment files one subscription's queue may hold on disk (0 = no limit), e.g. 64MiB; "
        "the default and the maximum of Subscription.retention.max_bytes. Over it, RETENTION_POLICY applies. "
        "8GiB is about four hours of a subscriber that stopped reading at the soak's rate (952 MB in 30 "
        "minutes); memory (QUEUE_BUDGET) is not counted. Replaces QUEUE_DISK_LIMIT (off by default; it dropped "
        "the newest, told as a plain gap).",
        parse_size,
    )
    retention_max_age: float = setting(
        "RETENTION_MAX_AGE",
        7 * 86400.0,
        "Messages a subscription's queue holds longer than this after they were published "
        "(Message.publish_time_unix_nano) are discarded, whatever the policy, and the subscriber is told "
        "(0 = no limit), e.g. 7d, 12h, 30s; the default and the maximum of Subscription.retention.max_age_ms. "
        "7 days, as Kafka's retention.ms: a week-long outage of a consumer loses nothing.",
        parse_duration,
    )
    retention_policy: str = setting(
        "RETENTION_POLICY",
        "drop_oldest",
        "What a queue at RETENTION_MAX_BYTES does when its subscription does not say: drop_oldest (discard the "
        "oldest messages on disk; the subscriber's next delivery carries a gap naming the reason and the "
        "count) or refuse_publish (new persistent publishes to its topic are refused with RESOURCE_EXHAUSTED "
        "naming the subscription and the limit, until it has room).",
        parse_policy,
    )
    subscription_expiry: float = setting(
        "SUBSCRIPTION_EXPIRY",
        7 * 86400.0,
        "A durable subscription nobody attached to for this long is deleted, on both brokers of the pair, its "
        "disk freed (0 = never), e.g. 7d, 12h. The time counts from its last stream's end, or from the "
        "broker's start for one that never had a stream since (a restart postpones expiry, never hastens it).",
        parse_duration,
    )
    away_tail: int = setting(
        "AWAY_TAIL",
        4 * 2**20,
        "While the standby serves a subscriber, the active keeps only its newest messages, up to this many "
        "bytes: the newest part of the backlog it held at the move, then what comes (trimmed by what the "
        "subscriber acknowledges there). Enough for a subscriber that caught up to move back at once, and to "
        "lose nothing if the standby dies while the subscriber is within the tail (0 = keep nothing).",
        parse_size,
    )
    away_wait: float = setting(
        "AWAY_WAIT",
        30.0,
        "A subscriber the standby served comes to the active while the standby is down, from before the "
        "newest messages the active kept (AWAY_TAIL): the active refuses it (UNAVAILABLE, retry) for up to "
        "this long after it last heard the standby, since a standby that comes back serves it again from its "
        "disk with nothing lost; after that it serves it from its tail, telling the subscriber what it lacks "
        "as a gap (the standby's disk may be gone). E.g. 30s, 2m; 0 = serve at once.",
        parse_duration,
    )
    # Limits per client (docs/security.md, Limits per connection). A client is the authenticated
    # principal when auth is on (principals with service = true, the suite's own links, are not
    # limited), else one gRPC connection (the peer's host:port).
    max_batch_messages: int = setting(
        "MAX_BATCH_MESSAGES",
        10_000,
        "Most messages one PublishBatch frame may hold (0 = no limit); more is refused with INVALID_ARGUMENT. "
        "The broker tells publishers its limit when their stream opens and the SDK keeps its batches within it.",
        parse_count,
    )
    max_streams_per_client: int = setting(
        "MAX_STREAMS_PER_CLIENT",
        1000,
        "Most Publish and Subscribe streams one client may hold open at once (0 = no limit); one more is "
        "refused with RESOURCE_EXHAUSTED.",
        parse_count,
    )
    max_subscriptions_per_client: int = setting(
        "MAX_SUBSCRIPTIONS_PER_CLIENT",
        1000,
        "Most subscriptions one client may hold: durable ones it created that still exist plus its live "
        "non-durable ones (0 = no limit); one more is refused with RESOURCE_EXHAUSTED.",
        parse_count,
    )
    max_credits: int = setting(
        "MAX_CREDITS",
        100_000,
        "Most credit one Subscribe stream may hold (SubscribeOpen.credits, and the outstanding credit after a "
        "SubscriberCredit): more is refused with INVALID_ARGUMENT. Credit is how many messages the broker may send "
        "before the subscriber acknowledges, so it bounds what one stream keeps in flight. The SDK's flow_limit "
        "(1000 by default) must stay within it.",
        parse_positive_count,
    )
    max_first_seq: int = setting(
        "MAX_FIRST_SEQ",
        2**53,
        "Highest sequence number a publisher this broker has not seen yet may start at (PublishOpen."
        "first_unacked_seq and its first message's publisher_seq); more is refused with INVALID_ARGUMENT. "
        "2^53 is 285 years of a million messages a second, exact in a double and far from any 64-bit overflow: "
        "a publisher cannot start next to 2^64, where its numbers (and the broker's arithmetic on them) would run out.",
        parse_positive_count,
    )
    max_publish_rate: float = setting(
        "MAX_PUBLISH_RATE",
        0.0,
        "Messages per second one client may publish, over all its Publish streams (0 = no limit). Over it the "
        "broker reads the client's next batch only when the rate allows (a token bucket holding one second's "
        "worth): the publisher is slowed by gRPC flow control and later acknowledgements, nothing is refused.",
        parse_rate,
    )

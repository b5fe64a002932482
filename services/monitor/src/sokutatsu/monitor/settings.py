"""Monitor settings (environment variables ``SOKUTATSU_MONITOR_*``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from sokutatsu.core.runtime_settings import SMALL_REQUESTS, ServiceSettings, request_setting
from sokutatsu.core.settings import SettingsError, named_addresses, parse_address, parse_bool, parse_name, setting


@dataclass(frozen=True)
class BrokerEndpoint:
    """One broker of the pair: its id (``SOKUTATSU_BROKER_INSTANCE``) and host:port."""

    broker_id: str
    address: str

    def __str__(self) -> str:
        return f"{self.broker_id}={self.address}"


def parse_brokers(raw: str) -> tuple[BrokerEndpoint, ...]:
    """``broker-a=127.0.0.1:7201,broker-b=127.0.0.1:7202``: the two brokers of the pair."""
    endpoints = []
    for item in raw.split(","):
        broker_id, sep, address = item.strip().partition("=")
        if not sep:
            raise SettingsError(f"expected id=host:port, got {item.strip()!r}")
        endpoints.append(BrokerEndpoint(parse_name(broker_id.strip()), parse_address(address.strip())))
    if len(endpoints) != 2:
        raise SettingsError(f"expected the two brokers of the pair, got {len(endpoints)}")
    if endpoints[0].broker_id == endpoints[1].broker_id:
        raise SettingsError("the two brokers need different ids")
    return tuple(endpoints)


def _number(raw: str, low: float, high: float, unit: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"expected {unit}, e.g. {low:g}") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise SettingsError(f"expected {low:g} to {high:g} {unit}")
    return value


def parse_seconds(raw: str) -> float:
    return _number(raw, 0.01, 3600, "seconds")


def parse_interval_ms(raw: str) -> int:
    """Stats interval: the broker accepts 10 ms or more."""
    value = _number(raw, 10, 60_000, "milliseconds")
    if value != int(value):
        raise SettingsError("expected whole milliseconds")
    return int(value)


def parse_lease_ms(raw: str) -> int:
    value = _number(raw, 100, 60_000, "milliseconds")
    if value != int(value):
        raise SettingsError("expected whole milliseconds")
    return int(value)


def parse_millis(raw: str) -> float:
    return _number(raw, 0.1, 60_000, "milliseconds")


def parse_messages(raw: str) -> int:
    value = _number(raw, 0, 10**12, "messages")
    if value != int(value):
        raise SettingsError("expected a whole number of messages")
    return int(value)


def parse_safety(raw: str) -> float:
    return _number(raw, 1, 100, "(a factor)")


def parse_recent(raw: str) -> int:
    value = _number(raw, 1, 100_000, "switchovers")
    if value != int(value):
        raise SettingsError("expected a whole number of switchovers")
    return int(value)


DEFAULT_BROKERS = parse_brokers("broker-a=127.0.0.1:7201,broker-b=127.0.0.1:7202")


@dataclass(frozen=True)
class MonitorSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_MONITOR_"

    listen: str = setting(
        "LISTEN", "127.0.0.1:7301", "host:port to serve gRPC on (port 0 = any free port).", parse_address
    )
    instance: str = setting("INSTANCE", "monitor", "Name of this monitor in logs and traces.", parse_name)
    max_request_bytes: int = request_setting(SMALL_REQUESTS)
    brokers: tuple[BrokerEndpoint, ...] = setting(
        "BROKERS",
        DEFAULT_BROKERS,
        "The broker pair to watch, as id=host:port,id=host:port; each id is that broker's SOKUTATSU_BROKER_INSTANCE.",
        parse_brokers,
    )
    broker_links: tuple[tuple[str, str], ...] = setting(
        "BROKER_LINKS",
        (),
        "Where the monitor's own calls to a broker go, as id=host:port,... (a management network, a proxy); "
        "a broker not named here is called at its SOKUTATSU_MONITOR_BROKERS address, which is also the one "
        "subscribers are redirected to and brokers are told for their peer.",
        lambda raw: named_addresses(raw, "broker"),
    )
    stats_interval_ms: int = setting(
        "STATS_INTERVAL_MS",
        100,
        "How often each broker streams its statistics (and its health is checked), in milliseconds (10 or more).",
        parse_interval_ms,
    )
    failover_after: float = setting(
        "FAILOVER_AFTER_SECONDS",
        1.0,
        "How long no broker may answer as active (its statistics stream broken or silent, or its health not "
        "SERVING) before the monitor promotes the standby.",
        parse_seconds,
    )
    failover_behind_after: float = setting(
        "FAILOVER_BEHIND_AFTER_SECONDS",
        10.0,
        "How long no broker may answer as active before the monitor promotes a standby that is not caught up "
        "(BrokerStats.caught_up false: it lacks messages the lost active may hold alone, and promoting it loses "
        "them, its subscribers told of a gap); a caught-up standby is promoted after FAILOVER_AFTER_SECONDS. "
        "Longer keeps what a slow, not dead, active acknowledged alone; shorter restores publishing sooner "
        "when the active is dead.",
        parse_seconds,
    )
    lease_ms: int = setting(
        "LEASE_MS",
        1000,
        "The lease the monitor grants the active broker each stats interval, in milliseconds (100 to 60000; "
        "keep it several stats intervals long). A monitored active that does not hear its peer acknowledges "
        "alone only under it, and steps down once it lapsed; the monitor promotes the standby only once the "
        "old active's lease lapsed on its own clock plus a margin (10 %, at least 100 ms), so a failover "
        "takes at least this long after the monitor last reached the active (docs/monitor.md, The lease).",
        parse_lease_ms,
    )
    switch_timeout: float = setting(
        "SWITCH_TIMEOUT_SECONDS",
        5.0,
        "Step 2 of a switchover waits at most this long for the subscriber's acknowledged position to reach "
        "what the taking broker holds; then the switchover is aborted and the subscriber stays where it was.",
        parse_seconds,
    )
    auto_switch: bool = setting(
        "AUTO_SWITCH",
        True,
        "Move slow subscribers (overflow mode migrate) to the standby and back on their own; false = only "
        "RequestSwitchover moves them (failover stays automatic).",
        parse_bool,
    )
    slow_min: int = setting(
        "SLOW_THRESHOLD_MIN",
        2000,
        "Lower bound of the adaptive slow-subscriber threshold, in messages; keep it above the SDK's credit "
        "window (flow limit, default 1000), which a healthy subscriber may have in flight.",
        parse_messages,
    )
    slow_max: int = setting(
        "SLOW_THRESHOLD_MAX",
        0,
        "Upper bound of the adaptive threshold, in messages (0 = none but the subscriber's memory budget).",
        parse_messages,
    )
    safety_factor: float = setting(
        "SAFETY_FACTOR",
        2.0,
        "The threshold leaves room for this many times the messages expected to arrive during a switchover.",
        parse_safety,
    )
    switch_estimate_ms: float = setting(
        "SWITCH_ESTIMATE_MS",
        200.0,
        "Switchover duration assumed until five have been measured (and the least assumed until then); "
        "the seed measured 62-184 ms.",
        parse_millis,
    )
    migrate_back_depth: int = setting(
        "MIGRATE_BACK_DEPTH",
        500,
        "A migrated subscriber counts as recovered while its depth stays at or under this many messages "
        "(and under a quarter of its threshold).",
        parse_messages,
    )
    migrate_back_after: float = setting(
        "MIGRATE_BACK_SECONDS",
        5.0,
        "How long a migrated subscriber must stay recovered (and connected) before it returns to the active; "
        "doubled each time a returned subscriber turns slow again soon after (up to 16 times).",
        parse_seconds,
    )
    min_move_interval: float = setting(
        "MIN_MOVE_SECONDS",
        10.0,
        "Least time between two automatic moves of one subscriber back to the active (hysteresis); "
        "a move to the standby because of depth is never delayed.",
        parse_seconds,
    )
    recent_switchovers: int = setting(
        "RECENT_SWITCHOVERS", 100, "How many recent switchovers (and failovers) the monitor keeps.", parse_recent
    )

    def __post_init__(self) -> None:
        ids = [e.broker_id for e in self.brokers]
        for broker_id, _ in self.broker_links:
            if broker_id not in ids:
                raise SettingsError(
                    f"SOKUTATSU_MONITOR_BROKER_LINKS names {broker_id!r}, which is not a broker of "
                    f"SOKUTATSU_MONITOR_BROKERS ({', '.join(ids)})"
                )

    def link_of(self, broker_id: str) -> str:
        """Where the monitor's calls to ``broker_id`` go (``BROKER_LINKS``, else its address)."""
        links = dict(self.broker_links)
        return links.get(broker_id) or next(e.address for e in self.brokers if e.broker_id == broker_id)

    @property
    def stats_interval(self) -> float:
        return self.stats_interval_ms / 1000

    @property
    def lease(self) -> float:
        return self.lease_ms / 1000

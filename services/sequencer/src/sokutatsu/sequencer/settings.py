"""Sequencer settings (environment variables ``SOKUTATSU_SEQUENCER_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sokutatsu.core.runtime_settings import SMALL_REQUESTS, ServiceSettings, request_setting
from sokutatsu.core.settings import choice, named_addresses, parse_address, parse_bool, parse_name, setting, whole
from sokutatsu.ordering import DEFAULT_MIN_PPM

MAX_RANGE_LIMIT = 1_000_000


@dataclass(frozen=True)
class Peer:
    """Another domain's sequencer: its domain name and host:port."""

    domain: str
    address: str

    def __str__(self) -> str:
        return f"{self.domain}={self.address}"


def parse_peers(raw: str) -> tuple[Peer, ...]:
    """``b=127.0.0.1:7102,c=127.0.0.1:7103``: the other domains' sequencers (empty = none)."""
    return tuple(Peer(domain, address) for domain, address in named_addresses(raw, "domain"))


def parse_addresses(raw: str) -> tuple[str, ...]:
    """``127.0.0.1:7201,127.0.0.1:7202`` (empty = none)."""
    return tuple(parse_address(item.strip()) for item in raw.split(",") if item.strip())


def parse_interval_ms(raw: str) -> int:
    return whole(10, 3_600_000, "milliseconds")(raw)


def parse_max_range(raw: str) -> int:
    return whole(1, MAX_RANGE_LIMIT, "numbers")(raw)


def parse_min_ppm(raw: str) -> int:
    return whole(1, 100_000, "parts per million")(raw)


@dataclass(frozen=True)
class SequencerSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_SEQUENCER_"

    listen: str = setting(
        "LISTEN", "127.0.0.1:7101", "host:port to serve gRPC on (port 0 = any free port).", parse_address
    )
    instance: str = setting("INSTANCE", "seq-a", "Name of this sequencer in logs and traces.", parse_name)
    max_request_bytes: int = request_setting(SMALL_REQUESTS)
    domain: str = setting("DOMAIN", "a", "The domain whose sequence numbers this sequencer hands out.", parse_name)
    leader: bool = setting(
        "LEADER",
        False,
        "This sequencer computes every distribution from all domains' send rates and installs it on the others "
        "(exactly one sequencer of a group is the leader).",
        parse_bool,
    )
    peers: tuple[Peer, ...] = setting(
        "PEERS",
        (),
        "The other domains' sequencers, domain=host:port comma-separated: the leader weighs and installs "
        "distributions on them, every sequencer reads their counts to keep its share.",
        parse_peers,
    )
    brokers: tuple[str, ...] = setting(
        "BROKERS",
        (),
        "host:port of the broker pair, comma-separated: where this sequencer publishes distributions (leader), "
        "dummies, skip markers and fills on the total-order topic. Empty = it publishes nothing.",
        parse_addresses,
    )
    topic: str = setting("TOPIC", "ordered", "The total-order topic this group orders.", parse_name)
    state_dir: Path = setting(
        "STATE_DIR",
        Path(".sokutatsu/sequencer"),
        "Folder for the journal of handed-out ranges and the installed distribution (a restarted sequencer "
        "continues after the last number it handed out).",
        Path,
    )
    fsync: bool = setting(
        "FSYNC",
        False,
        "fdatasync the journal before answering each stamp request. Off: the journal survives the process "
        "being killed (it is written before the answer) but not an OS crash.",
        parse_bool,
    )
    distribution_interval_ms: int = setting(
        "DISTRIBUTION_INTERVAL_MS", 5000, "Leader: compute a new distribution this often.", parse_interval_ms
    )
    min_weight_ppm: int = setting(
        "MIN_WEIGHT_PPM",
        DEFAULT_MIN_PPM,
        "Leader: every domain's least weight in parts per million, so a domain that starts sending is drawn.",
        parse_min_ppm,
    )
    filler: str = setting(
        "FILLER",
        "markers",
        "How a domain short of its weight fills the gap: markers (one skip marker of n slots), dummies "
        "(n dummy messages) or off.",
        choice("markers", "dummies", "off"),
    )
    share_check_ms: int = setting(
        "SHARE_CHECK_MS",
        100,
        "How often the domain's share of all slots is checked against its weight.",
        parse_interval_ms,
    )
    fill_after_ms: int = setting(
        "FILL_AFTER_MS",
        2000,
        "Ranges handed out but not reported published are filled with skip markers this long after their "
        "client's stream ended (or this sequencer restarted) unless a client claims them.",
        parse_interval_ms,
    )
    first_distribution: str = setting(
        "FIRST_DISTRIBUTION",
        "at-start",
        "Leader: when to publish the group's first distribution: at-start, or on-demand (once a sequencer of "
        "the group is first asked for numbers), so ordered subscribers that subscribe before the first publish "
        "receive everything (`sokutatsu up` uses on-demand). A group that ran before announces at once.",
        choice("at-start", "on-demand"),
    )
    max_range: int = setting("MAX_RANGE", 100_000, "The most numbers one stamp request may ask for.", parse_max_range)

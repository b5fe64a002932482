"""The fan-out benchmark's machinery: a tiny real run on Sokutatsu alone (the tests never depend on
NATS, which they did not start), the consumer's per-delivery checks, and the profile breakdown.
The figures themselves come from `sokutatsu bench fanout`."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections import Counter
from pathlib import Path

import pytest
import typer

from sokutatsu.bench import fanout
from sokutatsu.bench.commands import _lingers
from sokutatsu.bench.fanout import FanoutConfig, measure, percentile_of, ratios, split
from sokutatsu.bench.fanout_clients import GROUPS, KEYS, REPLICAS, expected, group_of, key_of
from sokutatsu.bench.fanout_consumer import Latencies, Track, bucket_ms, bucket_of
from sokutatsu.bench.fanout_profile import breakdown_markdown, category
from sokutatsu.bench.peers_clients import make_body

pytestmark = pytest.mark.timeout(120)
TINY = FanoutConfig(counts=(3,), rate=400, seconds=1.0, drain_seconds=10.0)
FIGURES = (
    "deliveries_per_s",
    "offered_deliveries_per_s",
    "delivered_percent_of_offered",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "publish_msgs_per_s",
    "publish_acked_msgs_per_s",
    "broker_cpu_ms_per_1000_deliveries",
    "active_cpu_ms_per_1000_deliveries",
    "cpu_steal_percent",
)


def test_keys_fall_in_sixteen_groups_that_share_a_prefix() -> None:
    assert key_of(1) == "G00.K000"
    assert key_of(KEYS + 18) == "G01.K017"
    assert all(key_of(s).startswith(f"G{group_of(s):02d}.") for s in range(1, 2 * KEYS))
    # Every message goes to exactly one group: the groups' shares add up to what was published.
    assert sum(expected(1000, g) for g in range(GROUPS)) == 1000
    assert expected(1000, None) == 1000
    assert split(7, 2) == [(0, 4), (4, 3)]
    assert fanout.processes_for(1) == 1
    assert fanout.processes_for(64) == 2
    assert fanout.processes_for(256) == 8


def _track(group: int | None, total: int) -> Track:
    return Track("fan-000", group, total, Latencies(), asyncio.Event(), [1])


def test_the_consumer_counts_holes_duplicates_reordering_and_strays() -> None:
    track = _track(None, 6)
    for seq in (1, 3, 3, 2, 5):
        track.take(make_body(seq, 64))
    figures = track.figures()
    # 2 came after 3 (reordered, no longer a hole); 4 was skipped (a hole); 6 never came.
    assert (figures["received"], figures["duplicates"], figures["reordered"]) == (4, 1, 1)
    assert (figures["lost"], figures["undelivered"]) == (1, 1)
    assert not track.all_done.is_set()
    filtered = _track(group_of(2), 20)  # group 1: of messages 1..20, keys 1 and 17 (messages 2 and 18)
    filtered.take(make_body(1, 64))  # another group's key: not for this subscriber
    filtered.take(make_body(2, 64))
    filtered.take(make_body(18, 64))
    assert filtered.figures()["unexpected"] == 1
    assert filtered.figures()["received"] == filtered.wanted == 2
    assert filtered.all_done.is_set()
    # The publisher stopped early after message 3: only 1..3 are wanted, and they have all come.
    early = _track(None, 6)
    for seq in (1, 2, 3):
        early.take(make_body(seq, 64))
    assert not early.all_done.is_set()
    early.published(3)
    assert early.all_done.is_set()
    assert (early.figures()["wanted"], early.figures()["undelivered"]) == (3, 0)


def test_latency_buckets_are_one_percent_wide_and_percentiles_come_from_them() -> None:
    for ms in (0.05, 0.6, 7.3, 450.0, 6000.0):
        assert bucket_ms(bucket_of(int(ms * 1e6))) == pytest.approx(ms, rel=0.01)
    histogram = Counter({bucket_of(1_000_000): 98, bucket_of(50_000_000): 2})
    assert percentile_of(histogram, 0.5) == pytest.approx(1.0, rel=0.01)
    assert percentile_of(histogram, 0.99) == pytest.approx(50.0, rel=0.01)
    assert percentile_of(Counter(), 0.5) is None


def test_profile_samples_go_to_their_innermost_known_frame(tmp_path: Path) -> None:
    loop = "thread (0x1);_run_once (asyncio/base_events.py:1922)"
    folded = tmp_path / "p.txt"
    folded.write_text(
        f"{loop};Broker._route (sokutatsu/broker/broker.py:600);"
        "SubscriptionSpec.matches (sokutatsu/broker/subscription.py:79) 3\n"
        f"{loop};_deliver (sokutatsu/broker/server.py:1);batch_response (sokutatsu/broker/messages.py:52) 2\n"
        f"{loop};cygrpc_write (grpc/_cython/cygrpc.pyx:1);sendmsg (libc.so.6) 4\n"
        "thread (0x2);poll (libc.so.6) 1\n"
    )
    queued = f"{loop};SubscriptionQueue.enqueue (sokutatsu/broker/subscription_queue.py:226);0x7f01 (libc.so.6)"
    assert category(queued.split(";")).startswith("queueing")
    assert category(f"{loop};Broker.credit (sokutatsu/broker/broker.py:472)".split(";")) == "broker Python (other)"
    text = breakdown_markdown("test", folded, 1.0)
    assert "| matching (SubscriptionSpec.matches, Broker._route, key index) | 30.0 % |" in text
    assert "| encoding (batch_response, delivery_element, protobuf) | 20.0 % |" in text
    assert "| gRPC write: sendmsg | 40.0 % | 44.4 % |" in text
    assert "| other threads | 10.0 % |" in text
    assert "| thread (0x1) (event loop) | 9 % |" in text


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_tiny_run_on_sokutatsu_has_every_figure_and_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "NATS_PORT", _closed_port())
    said: list[str] = []
    result = await measure(TINY, ["sokutatsu", "nats-push"], say=said.append)
    assert "nothing answers on 127.0.0.1" in result["skipped"]["nats-push"]
    assert len(result["rows"]) == 2  # every key, then 1/16 of the keys
    published = int(TINY.rate * TINY.seconds)
    for row in result["rows"]:
        assert "error" not in row, row
        assert [k for k in FIGURES if row.get(k) is None] == []
        assert (row["lost"], row["duplicates"], row["reordered"], row["unexpected"], row["undelivered"]) == (
            0,
            0,
            0,
            0,
            0,
        )
        assert row["complete"]
        assert row["consumer_processes"] == 2
        assert row["p50_ms"] <= row["p99_ms"] <= row["max_ms"] * 1.01
        assert set(row["broker_cpu_seconds"]) == {"broker-a", "broker-b"}
        # The SDK's frames on each broker's stream: at least one, at most one per message.
        assert 1 <= row["publish_frames_per_s_per_link"] <= row["publish_acked_msgs_per_s"]
        assert "frames/s" in result["table"]
    every, filtered = result["rows"]
    assert every["deliveries"] == every["offered_deliveries"] == 3 * published
    # Three subscribers on groups 0, 1 and 2: each gets its own group's messages.
    assert filtered["deliveries"] == filtered["offered_deliveries"] == sum(expected(published, g) for g in range(3))
    assert "| sokutatsu | 3 | every key | 2 |" in result["table"]
    assert "| nats-push | skipped" in result["table"]
    assert any(line.startswith("nats-push: skipped") for line in said)


async def test_each_publisher_linger_is_a_scenario_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "NATS_PORT", _closed_port())
    cfg = dataclasses.replace(TINY, filters=(True,), linger_ms=(None, 5.0))
    result = await measure(cfg, ["sokutatsu"], say=lambda _: None)
    default, lingered = result["rows"]
    assert "publisher_linger_ms" not in default
    assert lingered["publisher_linger_ms"] == 5.0
    for row in (default, lingered):
        assert row["complete"], row
        assert (
            row["deliveries"]
            == row["offered_deliveries"]
            == sum(expected(int(cfg.rate * cfg.seconds), g) for g in range(3))
        )
    assert "| sokutatsu | 3 | 1/16 keys |" in result["table"]
    assert "| sokutatsu, linger 5 ms | 3 | 1/16 keys |" in result["table"]


def _row(system: str, p50: float, **variant: float) -> dict[str, object]:
    return {
        "system": system,
        "subscribers": 64,
        "filtered": True,
        "deliveries_per_s": 8000,
        "p50_ms": p50,
        "p99_ms": 4 * p50,
        "broker_cpu_ms_per_1000_deliveries": 70.0,
        **variant,
    }


def test_ratios_name_each_sokutatsu_variant_against_each_nats_mode() -> None:
    rows = [
        _row("sokutatsu", 1.0, delivery_workers=0),
        _row("sokutatsu", 1.5, delivery_workers=1),
        _row("sokutatsu", 3.0, delivery_workers=0, publisher_linger_ms=2.0),
        {"system": "sokutatsu", "subscribers": 64, "filtered": True, "publisher_linger_ms": 5.0, "error": "boom"},
        _row("nats-push", 0.5),
    ]
    found = ratios(rows)
    assert sorted(found) == [
        "64-filtered-1-workers-vs-nats-push",
        "64-filtered-linger-2-ms-vs-nats-push",
        "64-filtered-vs-nats-push",
    ]
    assert found["64-filtered-vs-nats-push"]["p50_sokutatsu_over_peer"] == 2.0
    assert found["64-filtered-1-workers-vs-nats-push"]["p50_sokutatsu_over_peer"] == 3.0
    assert found["64-filtered-linger-2-ms-vs-nats-push"]["p50_sokutatsu_over_peer"] == 6.0


def test_linger_values_are_milliseconds_each_given_once() -> None:
    assert _lingers(None) == (None,)
    assert _lingers("1,2.5") == (1.0, 2.5)
    for bad in ("", "1,x", "-1", "1001", "2,2", "nan"):
        with pytest.raises(typer.BadParameter):
            _lingers(bad)


def test_the_replicated_nats_peer_s_servers_route_to_each_other_each_with_its_own_store(tmp_path: Path) -> None:
    ports = [(4001, 6001), (4002, 6002), (4003, 6003)]
    configs = [fanout.cluster_config(i, ports, tmp_path) for i in range(3)]
    routes = "routes: [nats-route://127.0.0.1:6001, nats-route://127.0.0.1:6002, nats-route://127.0.0.1:6003]"
    for i, config in enumerate(configs):
        assert f"server_name: n{i + 1}\n" in config
        assert f"listen: 127.0.0.1:{4001 + i}\n" in config
        assert f"listen: 127.0.0.1:{6001 + i}\n" in config
        assert routes in config
        assert f'store_dir: "{tmp_path / f"js{i + 1}"}"' in config
    assert REPLICAS["nats-push-r3"] == fanout.CLUSTER == 3

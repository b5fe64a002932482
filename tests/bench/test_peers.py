"""The peers benchmark's machinery: a tiny real run on Sokutatsu alone (the project's tests never
depend on RabbitMQ or NATS, which they did not start), a peer that does not answer, and the
ratios. The figures themselves come from `make bench`."""

from __future__ import annotations

import socket

import pytest

from sokutatsu.bench import peers
from sokutatsu.bench.peers import PeersConfig, markdown_table, measure, ratios
from sokutatsu.bench.peers_clients import make_body, read_body

pytestmark = pytest.mark.timeout(240)
TINY = PeersConfig(messages=3000, rate=500, latency_seconds=1.0, before_seconds=1.0, slow_seconds=2.0)


def test_a_body_carries_its_sequence_number_and_publish_time() -> None:
    body = make_body(42, 1024)
    assert len(body) == 1024
    seq, published = read_body(body)
    assert seq == 42
    assert published > 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_tiny_run_on_sokutatsu_and_a_peer_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(peers.PORTS, "rabbitmq", _closed_port())
    said: list[str] = []
    result = await measure(TINY, ["sokutatsu", "rabbitmq"], say=said.append)
    assert "nothing answers on 127.0.0.1" in result["systems"]["rabbitmq"]["skipped"]
    assert any(line.startswith("rabbitmq: skipped") for line in said)
    ours = result["systems"]["sokutatsu"]
    assert ours["throughput"]["messages"] == TINY.messages
    assert ours["throughput"]["audit"] == {"lost": 0, "duplicates": 0, "reordered": 0}
    assert ours["latency"]["audit"] == {"lost": 0, "duplicates": 0, "reordered": 0}
    assert ours["latency"]["p50_ms"] <= ours["latency"]["p99_ms"] <= ours["latency"]["max_ms"]
    slow = ours["slow_consumer"]
    assert slow["normal_audit"] == {"lost": 0, "duplicates": 0, "reordered": 0}
    assert slow["slow_audit"] == {"duplicates": 0, "reordered": 0}
    # The slow consumer fell behind: it received less than was published.
    assert 0 < slow["slow_received"] < slow["messages"]
    assert "| sokutatsu | " in result["table"]
    assert "| rabbitmq | skipped" in result["table"]
    # With Sokutatsu, the references in the same run: one broker alone, and the bare gRPC relay.
    for reference in ("sokutatsu-single", "grpc-floor"):
        latency = result["systems"][reference]["latency"]
        assert latency["audit"] == {"lost": 0, "duplicates": 0, "reordered": 0}
        assert latency["messages"] == int(TINY.rate * TINY.latency_seconds)
        assert f"| {reference} | n/a | " in result["table"]
    assert "latency_p50_sokutatsu_over_grpc_floor" in result["ratios"]


def test_ratios_are_ours_over_theirs_for_throughput_and_theirs_over_ours_for_latency() -> None:
    def system(msgs: int, p99_after: float, mean_after: float) -> dict[str, object]:
        return {
            "throughput": {"msgs_per_s": msgs},
            "slow_consumer": {"normal_after": {"p99_ms": p99_after, "mean_ms": mean_after}},
        }

    out = {
        "sokutatsu": system(30_000, 4.0, 2.0),
        "rabbitmq": system(15_000, 40.0, 5.0),
        "nats": {"skipped": "nothing answers"},
    }
    out_floor = {
        "sokutatsu": {"latency": {"p50_ms": 0.6}},
        "nats": {"latency": {"p50_ms": 0.5}},
        "grpc-floor": {"latency": {"p50_ms": 0.4}},
    }
    assert ratios(out_floor) == {
        "latency_p50_sokutatsu_over_grpc_floor": 1.5,
        "latency_p50_nats_over_grpc_floor": 1.25,
    }
    assert ratios(out) == {
        "throughput_sokutatsu_over_rabbitmq": 2.0,
        "slow_consumer_normal_p99_after_rabbitmq_over_sokutatsu": 10.0,
        "slow_consumer_normal_mean_after_rabbitmq_over_sokutatsu": 2.5,
    }
    assert "| nats | skipped: nothing answers" in markdown_table(out)

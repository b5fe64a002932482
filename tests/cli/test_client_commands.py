"""`sokutatsu publish / subscribe / metrics broker / bench throughput` against a real broker process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.broker.fix_broker import BrokerProcess

pytestmark = pytest.mark.timeout(180)


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sokutatsu.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_publish_subscribe_and_metrics(broker: BrokerProcess) -> None:
    subscriber = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sokutatsu.cli",
            "subscribe",
            "prices",
            "--id",
            "desk",
            "--durable",
            "--prefix",
            "72",
            "--count",
            "2",
            "-b",
            broker.address,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "desk" not in _cli("metrics", "broker", "-b", broker.address).stdout:
            assert subscriber.poll() is None, subscriber.communicate()
            assert time.monotonic() < deadline, "the subscriber never appeared in the metrics"
            time.sleep(0.2)
        one = _cli("publish", "prices", "7203.T", "toyota 2890", "-b", broker.address, "--publisher-id", "feed")
        assert one.returncode == 0, one.stderr
        assert "published 1 message(s) as feed (acknowledged through 1)" in one.stdout
        lines = _cli("publish", "prices", "9984.T", "-b", broker.address, "--publisher-id", "feed", stdin="a\nb\n")
        assert "published 2 message(s) as feed (acknowledged through 3)" in lines.stdout
        honda = _cli("publish", "prices", "7267.T", "honda", "-b", broker.address, "--publisher-id", "feed")
        assert honda.returncode == 0  # 7267.T matches the prefix 72 too
        out, err = subscriber.communicate(timeout=60)
    finally:
        if subscriber.poll() is None:
            subscriber.kill()
            subscriber.communicate()
    assert subscriber.returncode == 0, err
    received = out.strip().splitlines()
    assert [line.split()[0] for line in received] == ["feed#1", "feed#4"]
    assert received[0].endswith("toyota 2890")
    metrics = _cli("metrics", "broker", "-b", broker.address)
    assert metrics.returncode == 0
    assert "broker broker-a (active)" in metrics.stdout
    assert "published 4" in metrics.stdout


def test_publish_to_a_broker_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    result = _cli("publish", "t", "k", "body", "-b", "127.0.0.1:1", "--connect-timeout", "1.5")
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    # The last answer gRPC gave says why.
    assert line.startswith(
        "sokutatsu: error: no broker answered within 1.5s: ['127.0.0.1:1'] (127.0.0.1:1: UNAVAILABLE"
    )
    assert "Connection refused" in line


def test_metrics_process_shows_each_services_figures(broker: BrokerProcess) -> None:
    assert broker.process is not None
    result = _cli("metrics", "process", "-a", broker.address)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith(f"{broker.address}  broker broker-a  pid {broker.process.pid}  up ")
    assert line.endswith(" MiB  plaintext")


def test_bad_key_is_refused_with_the_brokers_message(broker: BrokerProcess) -> None:
    result = _cli("publish", "t", "two words", "x", "-b", broker.address)
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr
    assert "invalid key 'two words'" in result.stderr


@pytest.mark.slow
def test_bench_throughput_quick_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    result = _cli("bench", "throughput", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert {"msgs_per_s", "p50_ms", "p99_ms", "rate", "size"} <= set(figures)
    assert figures["size"] == 1024
    assert figures["rate"] == 5000
    assert figures["throughput"]["gaps"] == 0
    assert figures["throughput"]["duplicates"] == 0
    assert figures["latency"]["messages"] == 15000
    for phase in ("throughput", "latency"):
        assert 0 <= figures[phase]["cpu_steal_percent"] <= 100

"""Real service processes with TLS settings (SOKUTATSU_TLS_*), and the ones they must refuse.

A broker process started with mTLS serves the SDK's Publisher and Subscriber end to end, and
refuses a plaintext client; a broker on a non-loopback address without TLS, or with unusable
certificate files, does not start: one line on stderr, exit status 2.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sokutatsu.client import ClientConfig, Publisher, Subscriber, Unreachable
from sokutatsu.core.health import check
from sokutatsu.core.tls import is_loopback, open_channel
from tests.broker.fix_broker import BrokerProcess
from tests.security.fix_tls import Certs

LIMIT_SECONDS = 30.0

pytestmark = pytest.mark.slow


def _tls_env(certs: Certs, *, client_auth: str = "none") -> dict[str, str]:
    return {
        "SOKUTATSU_TLS_CERT": str(certs.server.cert),
        "SOKUTATSU_TLS_KEY": str(certs.server.key),
        "SOKUTATSU_TLS_CA": str(certs.ca),
        "SOKUTATSU_TLS_CLIENT_AUTH": client_auth,
    }


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("CERT", "KEY", "CA", "CLIENT_AUTH"):
        monkeypatch.delenv(f"SOKUTATSU_TLS_{name}", raising=False)
    monkeypatch.delenv("SOKUTATSU_ALLOW_PLAINTEXT", raising=False)
    return monkeypatch


@pytest.fixture
def mtls_broker(tmp_path: Path, certs: Certs, clean_env: pytest.MonkeyPatch) -> Iterator[BrokerProcess]:
    """A broker with mTLS on every address (0.0.0.0: TLS is what lets it leave loopback)."""
    folder = tmp_path / "broker"
    folder.mkdir()
    broker = BrokerProcess(
        folder=folder, env={**_tls_env(certs, client_auth="require"), "SOKUTATSU_BROKER_LISTEN": "0.0.0.0:0"}
    )
    broker.start()
    yield broker
    broker.stop()


async def test_sdk_publishes_and_receives_over_mtls(mtls_broker: BrokerProcess, certs: Certs) -> None:
    tls = certs.client_tls(client=certs.client)
    async with Subscriber(mtls_broker.address, "tls-sub", "ticks", config=ClientConfig(tls=tls)) as subscriber:
        await asyncio.wait_for(subscriber.connected.wait(), LIMIT_SECONDS)
        async with Publisher(mtls_broker.address, "tls-pub", config=ClientConfig(tls=tls)) as publisher:
            seq = await asyncio.wait_for(publisher.publish("ticks", "7203.T", b"over TLS"), LIMIT_SECONDS)
        message = await asyncio.wait_for(anext(subscriber), LIMIT_SECONDS)
    assert (message.publisher_id, message.publisher_seq, message.key, message.body) == (
        "tls-pub",
        seq,
        "7203.T",
        b"over TLS",
    )
    assert "serving on 127.0.0.1" in mtls_broker.log()  # 0.0.0.0 is announced as 127.0.0.1
    assert "(mTLS)" in mtls_broker.log()


async def test_mtls_broker_refuses_plaintext_and_certificateless_clients(
    mtls_broker: BrokerProcess, certs: Certs
) -> None:
    for tls in (None, certs.client_tls(), certs.client_tls(client=certs.other_client)):
        async with open_channel(mtls_broker.address, tls=tls) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, (tls, caught.value)


async def test_clients_take_tls_from_the_environment(
    mtls_broker: BrokerProcess, certs: Certs, clean_env: pytest.MonkeyPatch
) -> None:
    """open_channel without tls= (the health check, the CLI, the services' own links) reads SOKUTATSU_TLS_*;
    the SDK reads it only when asked to (ClientConfig.from_env())."""
    assert await check(mtls_broker.address) == "UNREACHABLE"  # plaintext: no handshake
    for name, value in _tls_env(certs).items():
        clean_env.setenv(name, value)  # the broker's own files: its certificate is a client certificate too
    assert await check(mtls_broker.address) == "SERVING"
    with pytest.raises(Unreachable):  # ClientConfig() is plaintext, whatever the environment says
        async with Publisher(mtls_broker.address, "plain-pub", connect_timeout=2):
            pass
    async with Publisher(mtls_broker.address, "env-pub", config=ClientConfig.from_env()) as publisher:
        assert await asyncio.wait_for(publisher.publish("ticks", "k", b"x"), LIMIT_SECONDS) == 1


def _run_broker(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A broker that is expected not to start: its exit status and output."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SOKUTATSU_TLS_", "SOKUTATSU_ALLOW_"))}
    return subprocess.run(
        [sys.executable, "-m", "sokutatsu.broker"],
        env={**base, "SOKUTATSU_BROKER_STATE_DIR": str(tmp_path / "state"), **env},
        capture_output=True,
        text=True,
        timeout=LIMIT_SECONDS,
        check=False,
    )


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sokutatsu-broker: error: "), lines
    return lines[0]


def test_plaintext_on_a_non_loopback_address_is_refused(tmp_path: Path) -> None:
    line = _one_line_error(_run_broker(tmp_path, {"SOKUTATSU_BROKER_LISTEN": "0.0.0.0:0"}))
    assert "SOKUTATSU_BROKER_LISTEN=0.0.0.0:0 is not a loopback address and TLS is off" in line
    assert "SOKUTATSU_ALLOW_PLAINTEXT=true" in line


def test_plaintext_on_a_non_loopback_address_when_allowed(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    broker = BrokerProcess(
        folder=tmp_path, env={"SOKUTATSU_BROKER_LISTEN": "0.0.0.0:0", "SOKUTATSU_ALLOW_PLAINTEXT": "true"}
    )
    try:
        broker.start()
        assert asyncio.run(check(broker.address)) == "SERVING"
        assert "(plaintext)" in broker.log()
    finally:
        broker.stop()


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"SOKUTATSU_TLS_CERT": "server.pem", "SOKUTATSU_TLS_KEY": "client-key.pem"},
            "SOKUTATSU_TLS_KEY='{d}/client-key.pem' is not the private key of SOKUTATSU_TLS_CERT='{d}/server.pem'",
            id="key-of-another-certificate",
        ),
        pytest.param(
            {"SOKUTATSU_TLS_CERT": "missing.pem", "SOKUTATSU_TLS_KEY": "server-key.pem"},
            "SOKUTATSU_TLS_CERT='{d}/missing.pem': cannot read it: No such file or directory",
            id="missing-file",
        ),
        pytest.param(
            {"SOKUTATSU_TLS_CERT": "server.pem"},
            "SOKUTATSU_TLS_CERT is set but SOKUTATSU_TLS_KEY is not",
            id="certificate-without-key",
        ),
        pytest.param(
            {
                "SOKUTATSU_TLS_CERT": "server.pem",
                "SOKUTATSU_TLS_KEY": "server-key.pem",
                "SOKUTATSU_TLS_CA": "server-key.pem",
            },
            "SOKUTATSU_TLS_CA='{d}/server-key.pem': not a CA bundle",
            id="ca-that-is-a-key",
        ),
        pytest.param(
            {
                "SOKUTATSU_TLS_CERT": "server.pem",
                "SOKUTATSU_TLS_KEY": "server-key.pem",
                "SOKUTATSU_TLS_CLIENT_AUTH": "require",
            },
            "SOKUTATSU_TLS_CLIENT_AUTH=require needs",
            id="mtls-without-ca",
        ),
        pytest.param(
            {"SOKUTATSU_TLS_CLIENT_AUTH": "yes"},
            "SOKUTATSU_TLS_CLIENT_AUTH='yes': expected none or require",
            id="unknown-client-auth",
        ),
    ],
)
def test_unusable_tls_settings_stop_the_service_at_start(
    tmp_path: Path, certs: Certs, files: dict[str, str], expected: str
) -> None:
    env = {k: v if k == "SOKUTATSU_TLS_CLIENT_AUTH" else str(certs.folder / v) for k, v in files.items()}
    line = _one_line_error(_run_broker(tmp_path, env))
    assert expected.format(d=certs.folder) in line


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("[::1]", True),
        ("0.0.0.0", False),  # noqa: S104 - a host to classify, nothing is bound
        ("[::]", False),
        ("10.0.0.5", False),
        ("broker-a", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback

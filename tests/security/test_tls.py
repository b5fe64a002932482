"""TLS and mTLS on the shared server bootstrap and the shared client channel, in process.

A real ``serve()`` on 127.0.0.1:0 with :class:`ServerTls`; clients made by ``open_channel``
ask gRPC health. Every refusal is checked against a control on the same server that succeeds
(the right certificates), so a server or client that silently spoke plaintext fails the test:
a plaintext server refuses every TLS client, a plaintext client is refused by every TLS server.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sokutatsu.client import ChannelTls
from sokutatsu.core.server import ServiceContext
from sokutatsu.core.settings import SettingsError
from sokutatsu.core.tls import ServerTls, client_tls, open_channel, server_tls
from tests.helpers import served
from tests.security.fix_tls import Certs

LIMIT_SECONDS = 30.0
# A refused handshake is seen well within this; only a hung test would reach it.
RPC_SECONDS = 10.0


@contextlib.asynccontextmanager
async def tls_server(tmp_path: Path, tls: ServerTls | None) -> AsyncIterator[str]:
    """serve() in this event loop (health only) with ``tls``; its address."""

    async def register(srv: aio.Server, context: ServiceContext) -> Sequence[str]:
        return []

    async with served(tmp_path, register, tls=tls, limit=LIMIT_SECONDS) as address:
        yield address


async def health(address: str, tls: ChannelTls | None) -> str:
    """The server's health over a channel from open_channel (``tls`` None: plaintext, no TLS_* set)."""
    async with open_channel(address, tls=tls) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_SECONDS)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def refused(address: str, tls: ChannelTls | None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await health(address, tls)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    return caught.value


@pytest.fixture(autouse=True)
def _no_tls_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The channels here get their TLS from the test, never from the environment."""
    for name in ("CERT", "KEY", "CA", "CLIENT_AUTH"):
        monkeypatch.delenv(f"SOKUTATSU_TLS_{name}", raising=False)


async def test_tls_client_reaches_tls_server(tmp_path: Path, certs: Certs) -> None:
    async with tls_server(tmp_path, certs.server.server()) as address:
        assert await health(address, certs.client_tls()) == "SERVING"


async def test_plaintext_client_is_refused_by_tls_server(tmp_path: Path, certs: Certs) -> None:
    async with tls_server(tmp_path, certs.server.server()) as address:
        await refused(address, None)
        assert await health(address, certs.client_tls()) == "SERVING"


async def test_tls_client_refuses_plaintext_server(tmp_path: Path, certs: Certs) -> None:
    """The other way round: a client with TLS never falls back to plaintext."""
    async with tls_server(tmp_path, None) as address:
        await refused(address, certs.client_tls())
        assert await health(address, None) == "SERVING"


async def test_client_trusting_another_ca_is_refused(tmp_path: Path, certs: Certs) -> None:
    async with tls_server(tmp_path, certs.server.server()) as address:
        error = await refused(address, certs.client_tls(ca=certs.other_ca))
        assert "handshake" in (error.details() or "").lower(), error.details()
        assert await health(address, certs.client_tls()) == "SERVING"


async def test_server_with_certificate_of_another_ca_is_refused(tmp_path: Path, certs: Certs) -> None:
    async with tls_server(tmp_path, certs.other_server.server()) as address:
        await refused(address, certs.client_tls())
        assert await health(address, certs.client_tls(ca=certs.other_ca)) == "SERVING"


async def test_expired_server_certificate_is_refused(tmp_path: Path, certs: Certs) -> None:
    async with (
        tls_server(tmp_path, certs.expired_server.server()) as expired,
        tls_server(tmp_path, certs.server.server()) as valid,
    ):
        error = await refused(expired, certs.client_tls())
        assert "handshake" in (error.details() or "").lower(), error.details()
        assert await health(valid, certs.client_tls()) == "SERVING"


async def test_server_certificate_for_another_host_is_refused(tmp_path: Path, certs: Certs) -> None:
    async with (
        tls_server(tmp_path, certs.wrong_host_server.server()) as wrong,
        tls_server(tmp_path, certs.server.server()) as right,
    ):
        await refused(wrong, certs.client_tls())
        assert await health(right, certs.client_tls()) == "SERVING"


async def test_mtls_server_accepts_only_clients_of_its_ca(tmp_path: Path, certs: Certs) -> None:
    async with tls_server(tmp_path, certs.server.server(client_ca=certs.ca)) as address:
        assert await health(address, certs.client_tls(client=certs.client)) == "SERVING"
        # A service's own certificate is a client certificate too (services dial each other with it).
        assert await health(address, certs.client_tls(client=certs.server)) == "SERVING"
        await refused(address, certs.client_tls())  # no client certificate
        await refused(address, certs.client_tls(client=certs.other_client))  # signed by another CA
        await refused(address, None)  # plaintext


async def test_tls_server_without_client_auth_accepts_a_client_certificate(tmp_path: Path, certs: Certs) -> None:
    """One set of settings serves both sides: a client presenting its certificate to a TLS-only server."""
    async with tls_server(tmp_path, certs.server.server()) as address:
        assert await health(address, certs.client_tls(client=certs.client)) == "SERVING"


def test_settings_give_both_sides_from_one_set_of_files(certs: Certs) -> None:
    env = {"SOKUTATSU_TLS_CERT": str(certs.server.cert), "SOKUTATSU_TLS_KEY": str(certs.server.key)}
    env["SOKUTATSU_TLS_CA"] = str(certs.ca)
    server, client = server_tls(env), client_tls(env)
    assert server is not None
    assert client is not None
    assert not server.require_client_auth
    assert server_tls({**env, "SOKUTATSU_TLS_CLIENT_AUTH": "require"}).require_client_auth  # type: ignore[union-attr]
    assert client.root_certificates == certs.ca.read_bytes()
    assert client.certificate_chain == certs.server.cert.read_bytes()
    # Only a CA: clients speak TLS, servers do not (they have nothing to present).
    assert server_tls({"SOKUTATSU_TLS_CA": str(certs.ca)}) is None
    assert client_tls({"SOKUTATSU_TLS_CA": str(certs.ca)}) is not None
    assert server_tls({}) is None
    assert client_tls({}) is None


def test_a_misspelt_tls_variable_is_refused_with_a_hint(certs: Certs) -> None:
    with pytest.raises(
        SettingsError, match=r"^SOKUTATSU_TLS_CERTS: unknown variable; did you mean SOKUTATSU_TLS_CERT\?$"
    ):
        server_tls({"SOKUTATSU_TLS_CERTS": str(certs.server.cert)})

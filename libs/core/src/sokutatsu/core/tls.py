"""TLS and mutual TLS for every gRPC server and client, from ``SOKUTATSU_TLS_*`` (docs/security.md).

One set of files serves both sides of a process:

* ``SOKUTATSU_TLS_CERT`` and ``SOKUTATSU_TLS_KEY``: the certificate (chain) and key a
  server presents, and a client presents when the server asks for one (mTLS);
* ``SOKUTATSU_TLS_CA``: the CA bundle that verifies the peer (a client's view of the
  server, a mTLS server's view of its clients);
* ``SOKUTATSU_TLS_CLIENT_AUTH``: ``require`` makes servers refuse clients without a
  certificate signed by that CA.

A server serves TLS when it has a certificate and key; a client speaks TLS when it
has a CA (or a certificate). Without any of them both sides are plaintext, which a
server accepts only on a loopback address (:func:`check_plaintext`).

The files are read and checked once per distinct setting (a missing file, a key that
does not match the certificate, a CA bundle with no certificate are one-line
:class:`SettingsError` messages naming the variable); :func:`open_channel` is the one place
that makes the services' and the operator tools' client channels. The client side itself
(:class:`~sokutatsu.client.ChannelTls`, reading and checking its files, the bearer token on a
channel) is the SDK's (:mod:`sokutatsu.client.config`), which reads no environment on its own.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import grpc
from grpc import aio

from sokutatsu.client.config import ChannelTls, ClientConfig, read_channel_tls
from sokutatsu.client.errors import ConfigError
from sokutatsu.core.auth import client_token
from sokutatsu.core.cluster import control_interceptors, load_secret
from sokutatsu.core.settings import Settings, SettingsError, choice, load, parse_optional_path, setting

PREFIX = "SOKUTATSU_TLS_"
# The variable that lets a server listen in plaintext on a non-loopback address (RuntimeSettings).
ALLOW_PLAINTEXT_VAR = "SOKUTATSU_ALLOW_PLAINTEXT"


@dataclass(frozen=True)
class TlsSettings(Settings):
    """Certificates of this process, for the gRPC servers it runs and the channels it opens."""

    env_prefix: ClassVar[str] = PREFIX
    check_unknown: ClassVar[bool] = True

    cert: Path | None = setting(
        "CERT",
        None,
        "PEM certificate (chain) this process serves gRPC with and presents as a client certificate "
        "(mTLS); with KEY, servers speak TLS. Unset = plaintext (loopback only).",
        parse_optional_path,
    )
    key: Path | None = setting("KEY", None, "PEM private key of CERT (keep it mode 0600).", parse_optional_path)
    ca: Path | None = setting(
        "CA",
        None,
        "PEM CA bundle that verifies peers: clients check servers against it (set = clients speak TLS), "
        "mTLS servers check clients.",
        parse_optional_path,
    )
    client_auth: str = setting(
        "CLIENT_AUTH",
        "none",
        "none or require: with require, servers accept only clients presenting a certificate signed by CA (mTLS).",
        choice("none", "require"),
    )


@dataclass(frozen=True)
class ServerTls:
    """What a server presents, and (mTLS) the CA its clients' certificates must chain to."""

    private_key: bytes
    certificate_chain: bytes
    client_ca: bytes | None = None
    require_client_auth: bool = False

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.require_client_auth,
        )


@lru_cache(maxsize=8)
def _from_values(values: tuple[tuple[str, str], ...]) -> tuple[ChannelTls | None, ServerTls | None]:
    settings = load(TlsSettings, dict(values))
    server: ServerTls | None = None
    client: ChannelTls | None = None
    if settings.client_auth == "require" and (settings.cert is None or settings.ca is None):
        raise SettingsError(
            f"{PREFIX}CLIENT_AUTH=require needs {PREFIX}CERT and {PREFIX}KEY (the server's) "
            f"and {PREFIX}CA (what client certificates must be signed by)"
        )
    if settings.cert is not None or settings.key is not None or settings.ca is not None:
        try:
            client = read_channel_tls(settings.ca, settings.cert, settings.key, PREFIX)
        except ConfigError as exc:
            raise SettingsError(str(exc)) from None
    if client is not None and client.certificate_chain is not None and client.private_key is not None:
        server = ServerTls(
            private_key=client.private_key,
            certificate_chain=client.certificate_chain,
            client_ca=client.root_certificates,
            require_client_auth=settings.client_auth == "require",
        )
    return client, server


def _values(environ: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    # Read at each call, so a test or a launcher may change it; the files are read once per value.
    env = os.environ if environ is None else environ
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(PREFIX)))


def client_tls(environ: Mapping[str, str] | None = None) -> ChannelTls | None:
    """The client side from ``SOKUTATSU_TLS_*`` (``None`` = plaintext). Raises :class:`SettingsError`."""
    return _from_values(_values(environ))[0]


def server_tls(environ: Mapping[str, str] | None = None) -> ServerTls | None:
    """The server side from ``SOKUTATSU_TLS_*`` (``None`` = plaintext). Raises :class:`SettingsError`."""
    return _from_values(_values(environ))[1]


# ------------------------------------------------------------------- channels --


def open_channel(
    address: str,
    *,
    tls: ChannelTls | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    token: str | None = None,
    cluster: bool = False,
) -> aio.Channel:
    """A client channel to ``address``: TLS with ``tls``, else with the environment's settings, else plaintext.

    Every call carries ``token`` (else ``SOKUTATSU_AUTH_TOKEN``, if set) as a bearer token. With
    ``cluster`` (the services' links to each other, tools of the operator) control calls carry the
    cluster secret (:mod:`sokutatsu.core.cluster`; :class:`SettingsError` when there is none).
    """
    chosen = tls if tls is not None else client_tls()
    bearer = token if token is not None else client_token()
    interceptors = control_interceptors(load_secret(create=False)) if cluster else []
    return ClientConfig(tls=chosen, token=bearer).channel(address, options=options, interceptors=interceptors)


# --------------------------------------------------------------- plaintext -----


def is_loopback(host: str) -> bool:
    """Whether ``host`` (of a listen address) is only reachable from this machine."""
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def check_plaintext(listen: str, listen_var: str, tls: ServerTls | None, allow_plaintext: bool) -> None:
    """Refuse plaintext on an address other machines can reach, unless explicitly allowed."""
    if tls is not None or allow_plaintext:
        return
    host = listen.rpartition(":")[0]
    if is_loopback(host):
        return
    raise SettingsError(
        f"{listen_var}={listen} is not a loopback address and TLS is off: set {PREFIX}CERT and {PREFIX}KEY "
        f"(docs/security.md), or {ALLOW_PLAINTEXT_VAR}=true to serve plaintext on a trusted network"
    )


def client_config(environ: Mapping[str, str] | None = None) -> ClientConfig:
    """The SDK's configuration for the services' and the ``sokutatsu`` command's own publishers and
    subscribers: ``SOKUTATSU_TLS_*`` (checked as the services check them, :class:`SettingsError`)
    and ``SOKUTATSU_AUTH_TOKEN``, as their other channels (:func:`open_channel`) take them."""
    return ClientConfig(tls=client_tls(environ), token=client_token(environ))

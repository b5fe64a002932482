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
that makes client channels.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import grpc
from grpc import aio

from sokutatsu.core.auth import client_token
from sokutatsu.core.auth_client import bearer_credentials, bearer_interceptors
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
class ChannelTls:
    """What a client channel verifies the server with, and the certificate it presents (mTLS).

    ``root_certificates`` ``None`` means the system's roots. Make one from files with
    :meth:`from_files`, or from the environment with :func:`client_tls`.
    """

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    @classmethod
    def from_files(
        cls, ca: str | Path | None, cert: str | Path | None = None, key: str | Path | None = None
    ) -> ChannelTls:
        """Read and check PEM files, as the environment's are (a :class:`SettingsError` if unusable)."""
        ca_path, cert_path, key_path = (Path(p) if p is not None else None for p in (ca, cert, key))
        return _client_tls(ca_path, cert_path, key_path, PREFIX)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


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


# -------------------------------------------------------------------- reading --


def _read(path: Path, var: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SettingsError(f"{var}={str(path)!r}: cannot read it: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise SettingsError(f"{var}={str(path)!r}: not a PEM file (no -----BEGIN line)")
    return data


def _check_pair(cert: Path, key: Path, prefix: str) -> None:
    """The key must be the certificate's (what gRPC would otherwise report as a failed handshake)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc) or reason == "KEY_VALUES_MISMATCH":
            raise SettingsError(
                f"{prefix}KEY={str(key)!r} is not the private key of {prefix}CERT={str(cert)!r}"
            ) from None
        raise SettingsError(
            f"{prefix}CERT={str(cert)!r} / {prefix}KEY={str(key)!r}: unusable certificate or key ({reason})"
        ) from None


def _check_ca(ca: Path, prefix: str) -> None:
    try:
        ssl.create_default_context(cafile=ca)
    except ssl.SSLError as exc:
        raise SettingsError(f"{prefix}CA={str(ca)!r}: not a CA bundle ({exc.reason or exc})") from None


def _pair(cert: Path | None, key: Path | None, prefix: str) -> tuple[bytes, bytes] | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = ("KEY", "CERT") if cert is None else ("CERT", "KEY")
        raise SettingsError(f"{prefix}{given} is set but {prefix}{missing} is not: set both (or neither)")
    chain, private = _read(cert, prefix + "CERT"), _read(key, prefix + "KEY")
    _check_pair(cert, key, prefix)
    return chain, private


def _root(ca: Path | None, prefix: str) -> bytes | None:
    if ca is None:
        return None
    data = _read(ca, prefix + "CA")
    _check_ca(ca, prefix)
    return data


def _client_tls(ca: Path | None, cert: Path | None, key: Path | None, prefix: str) -> ChannelTls:
    pair = _pair(cert, key, prefix)
    root = _root(ca, prefix)
    return ChannelTls(
        root_certificates=root,
        certificate_chain=pair[0] if pair else None,
        private_key=pair[1] if pair else None,
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
        client = _client_tls(settings.ca, settings.cert, settings.key, PREFIX)
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
    if chosen is None:
        if bearer:
            interceptors = [*bearer_interceptors(bearer), *interceptors]
        return aio.insecure_channel(address, options=options, interceptors=interceptors or None)
    credentials = chosen.credentials()
    if bearer:
        credentials = bearer_credentials(credentials, bearer)
    return aio.secure_channel(address, credentials, options=options, interceptors=interceptors or None)


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

"""How the SDK connects: TLS (``ChannelTls``) and a bearer token, in one explicit ``ClientConfig``.

Nothing here reads the environment unless asked: ``ClientConfig()`` is plaintext without a
token (what a broker on a loopback address accepts), and :meth:`ClientConfig.from_env` reads
the variables the services and the ``sokutatsu`` command use (docs/security.md):

* ``SOKUTATSU_TLS_CA``: the CA bundle that verifies the brokers (set: TLS);
* ``SOKUTATSU_TLS_CERT`` and ``SOKUTATSU_TLS_KEY``: the certificate and key presented when a
  server asks for one (mTLS);
* ``SOKUTATSU_AUTH_TOKEN``: the bearer token sent on every call.

PEM files are read and checked when the configuration is made, so a missing file or a key
that does not match its certificate is a one-line :class:`~sokutatsu.client.errors.ConfigError`
there, not a failed handshake later.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from sokutatsu.client._auth import bearer_credentials, bearer_interceptors
from sokutatsu.client.errors import ConfigError

TLS_PREFIX = "SOKUTATSU_TLS_"
TOKEN_VAR = "SOKUTATSU_AUTH_TOKEN"  # noqa: S105 - the variable's name, not a token


@dataclass(frozen=True)
class ChannelTls:
    """What a client channel verifies the server with, and the certificate it presents (mTLS).

    ``root_certificates`` ``None`` means the system's roots. Make one from PEM files with
    :meth:`from_files`.
    """

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    @classmethod
    def from_files(
        cls, ca: str | Path | None, cert: str | Path | None = None, key: str | Path | None = None
    ) -> ChannelTls:
        """Read and check PEM files (a :class:`ConfigError` naming the file if one is unusable)."""
        ca_path, cert_path, key_path = (Path(p) if p is not None else None for p in (ca, cert, key))
        return read_channel_tls(ca_path, cert_path, key_path, "")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


@dataclass(frozen=True)
class ClientConfig:
    """TLS and the bearer token of every channel a publisher or subscriber opens.

    ``tls`` ``None``: plaintext (brokers accept it on loopback addresses only). ``token``
    ``None``: no ``authorization`` metadata.
    """

    tls: ChannelTls | None = None
    token: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientConfig:
        """The configuration ``SOKUTATSU_TLS_CA``/``_CERT``/``_KEY`` and ``SOKUTATSU_AUTH_TOKEN`` give
        (``environ``, else ``os.environ``); unset or empty variables leave their part off."""
        env = os.environ if environ is None else environ
        ca, cert, key = (_path(env.get(TLS_PREFIX + name)) for name in ("CA", "CERT", "KEY"))
        tls = None
        if ca is not None or cert is not None or key is not None:
            tls = read_channel_tls(ca, cert, key, TLS_PREFIX)
        return cls(tls=tls, token=env.get(TOKEN_VAR) or None)

    def channel(
        self,
        address: str,
        *,
        options: Sequence[tuple[str, Any]] | None = None,
        interceptors: Sequence[aio.ClientInterceptor] = (),
    ) -> aio.Channel:
        """A ``grpc.aio`` channel to ``address`` with this TLS and token (and ``interceptors`` after the token's)."""
        chosen = list(interceptors)
        if self.tls is None:
            if self.token:
                chosen = [*bearer_interceptors(self.token), *chosen]
            return aio.insecure_channel(address, options=options, interceptors=chosen or None)
        credentials = self.tls.credentials()
        if self.token:
            credentials = bearer_credentials(credentials, self.token)
        return aio.secure_channel(address, credentials, options=options, interceptors=chosen or None)


# -------------------------------------------------------------------- reading --


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def read_channel_tls(ca: Path | None, cert: Path | None, key: Path | None, prefix: str) -> ChannelTls:
    """A :class:`ChannelTls` from PEM files, checked; errors name the files as ``{prefix}CA`` (``CERT``, ``KEY``)."""
    pair = _pair(cert, key, prefix)
    root = _root(ca, prefix)
    return ChannelTls(
        root_certificates=root,
        certificate_chain=pair[0] if pair else None,
        private_key=pair[1] if pair else None,
    )


def _read(path: Path, var: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{var}={str(path)!r}: cannot read it: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{var}={str(path)!r}: not a PEM file (no -----BEGIN line)")
    return data


def _check_pair(cert: Path, key: Path, prefix: str) -> None:
    """The key must be the certificate's (what gRPC would otherwise report as a failed handshake)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc) or reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(
                f"{prefix}KEY={str(key)!r} is not the private key of {prefix}CERT={str(cert)!r}"
            ) from None
        raise ConfigError(
            f"{prefix}CERT={str(cert)!r} / {prefix}KEY={str(key)!r}: unusable certificate or key ({reason})"
        ) from None


def _check_ca(ca: Path, prefix: str) -> None:
    try:
        ssl.create_default_context(cafile=ca)
    except ssl.SSLError as exc:
        raise ConfigError(f"{prefix}CA={str(ca)!r}: not a CA bundle ({exc.reason or exc})") from None


def _pair(cert: Path | None, key: Path | None, prefix: str) -> tuple[bytes, bytes] | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = ("KEY", "CERT") if cert is None else ("CERT", "KEY")
        raise ConfigError(f"{prefix}{given} is set but {prefix}{missing} is not: set both (or neither)")
    chain, private = _read(cert, prefix + "CERT"), _read(key, prefix + "KEY")
    _check_pair(cert, key, prefix)
    return chain, private


def _root(ca: Path | None, prefix: str) -> bytes | None:
    if ca is None:
        return None
    data = _read(ca, prefix + "CA")
    _check_ca(ca, prefix)
    return data

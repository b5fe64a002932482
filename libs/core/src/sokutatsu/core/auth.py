"""Who a caller is and what it may do, from ``SOKUTATSU_AUTH_FILE`` (docs/security.md).

Off unless ``SOKUTATSU_AUTH_FILE`` names a TOML file; then every RPC but health and
reflection must come from a known principal: a bearer token (``authorization: Bearer
<token>`` metadata, matched by its SHA-256) or, under mTLS, a client certificate whose
common name the file lists. The file grants each principal permissions:

* ``publish``/``subscribe``: topic patterns; ``enqueue``/``dequeue``: queue patterns
  (a pattern is a name, or a prefix ending in ``*``; ``"*"`` is everything);
* ``admin = true``: the administrative RPCs (topics, subscriptions, queues, switchovers);
* ``service = true``: everything, for the services' own links to each other.

A subscriber id belongs to a principal when it equals its name or starts with one of its
``subscriber_prefixes`` (default ``"<name>-"``); only its owner (or an admin or service
principal) may attach to, acknowledge for, look up or move it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from sokutatsu.core.settings import Settings, SettingsError, load, parse_optional_path, setting

PREFIX = "SOKUTATSU_AUTH_"
TOKEN_VAR = PREFIX + "TOKEN"
FILE_VAR = PREFIX + "FILE"

PUBLISH = "publish"
SUBSCRIBE = "subscribe"
ENQUEUE = "enqueue"
DEQUEUE = "dequeue"
ADMIN = "admin"
SERVICE = "service"
PATTERN_PERMISSIONS = (PUBLISH, SUBSCRIBE, ENQUEUE, DEQUEUE)
_PRINCIPAL_KEYS = frozenset({*PATTERN_PERMISSIONS, ADMIN, SERVICE, "token_sha256", "cert_cn", "subscriber_prefixes"})


@dataclass(frozen=True)
class AuthSettings(Settings):
    """Authentication and authorisation: the server's policy file and the client's token."""

    env_prefix: ClassVar[str] = PREFIX
    check_unknown: ClassVar[bool] = True

    file: Path | None = setting(
        "FILE",
        None,
        "TOML file of principals (token hashes, certificate names) and their grants; set = every "
        "gRPC server of this process authenticates and authorises each call. Unset = auth off.",
        parse_optional_path,
    )
    token: str = setting(
        "TOKEN",
        "",
        "Bearer token this process sends on every gRPC call it makes (clients, and the services' "
        "links to each other); make one with `sokutatsu auth token`.",
    )


def hash_token(token: str) -> str:
    """What the policy file stores for ``token``: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> tuple[str, str]:
    """A new random token and its hash."""
    token = secrets.token_urlsafe(32)
    return token, hash_token(token)


def matches(pattern: str, name: str) -> bool:
    """``pattern`` is a name, or a prefix followed by ``*``."""
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return pattern == name


@dataclass(frozen=True)
class Principal:
    name: str
    grants: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    admin: bool = False
    service: bool = False
    subscriber_prefixes: tuple[str, ...] = ()

    @property
    def privileged(self) -> bool:
        return self.admin or self.service

    def may(self, permission: str, resource: str | None = None) -> bool:
        """Whether this principal holds ``permission`` (on ``resource``, for pattern permissions)."""
        if self.service:
            return True
        if permission == ADMIN:
            return self.admin
        if permission == SERVICE:
            return False
        patterns = self.grants.get(permission, ())
        if resource is None:
            return bool(patterns)
        return any(matches(p, resource) for p in patterns)

    def owns(self, subscriber_id: str) -> bool:
        """Whether ``subscriber_id`` is this principal's (admins and services own every id)."""
        if self.privileged:
            return True
        return subscriber_id == self.name or any(subscriber_id.startswith(p) for p in self.subscriber_prefixes)


@dataclass(frozen=True)
class Policy:
    """The principals of a policy file, indexed by token hash and certificate common name."""

    by_token: Mapping[str, Principal]
    by_cn: Mapping[str, Principal]

    def by_token_value(self, token: str) -> Principal | None:
        return self.by_token.get(hash_token(token))


def _strings(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SettingsError(f"{where}: expected a list of non-empty strings")
    return tuple(value)


def _principal(name: str, body: object, where: str) -> tuple[Principal, tuple[str, ...], tuple[str, ...]]:
    if not isinstance(body, dict):
        raise SettingsError(f"{where}: expected a table [principals.{name}]")
    unknown = sorted(set(body) - _PRINCIPAL_KEYS)
    if unknown:
        raise SettingsError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_PRINCIPAL_KEYS))})")
    for flag in (ADMIN, SERVICE):
        if not isinstance(body.get(flag, False), bool):
            raise SettingsError(f"{where}.{flag}: expected true or false")
    hashes = tuple(h.lower() for h in _strings(body.get("token_sha256", []), f"{where}.token_sha256"))
    for digest in hashes:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise SettingsError(f"{where}.token_sha256: {digest!r} is not a SHA-256 in hex (sokutatsu auth token)")
    cns = _strings(body.get("cert_cn", []), f"{where}.cert_cn")
    principal = Principal(
        name=name,
        grants={p: _strings(body.get(p, []), f"{where}.{p}") for p in PATTERN_PERMISSIONS},
        admin=body.get(ADMIN, False),
        service=body.get(SERVICE, False),
        subscriber_prefixes=_strings(body.get("subscriber_prefixes", [f"{name}-"]), f"{where}.subscriber_prefixes"),
    )
    return principal, hashes, cns


def parse_policy(data: Mapping[str, Any], source: str) -> Policy:
    """The policy in a decoded TOML document; :class:`SettingsError` (one line) when malformed."""
    unknown = sorted(set(data) - {"principals"})
    if unknown:
        raise SettingsError(f"{source}: unknown table {unknown[0]!r} (expected [principals.<name>])")
    principals = data.get("principals", {})
    if not isinstance(principals, dict) or not principals:
        raise SettingsError(f"{source}: no [principals.<name>] table")
    by_token: dict[str, Principal] = {}
    by_cn: dict[str, Principal] = {}
    for name, body in principals.items():
        where = f"{source}: principals.{name}"
        principal, hashes, cns = _principal(name, body, where)
        if not hashes and not cns:
            raise SettingsError(f"{where}: has neither token_sha256 nor cert_cn, so nobody can be it")
        for index, keys in ((by_token, hashes), (by_cn, cns)):
            for key in keys:
                if key in index:
                    raise SettingsError(f"{where}: {key!r} is also {index[key].name}'s")
                index[key] = principal
    return Policy(by_token=by_token, by_cn=by_cn)


def read_policy(path: Path) -> Policy:
    """Read and check a policy file (:class:`SettingsError` naming ``SOKUTATSU_AUTH_FILE``)."""
    source = f"{FILE_VAR}={str(path)!r}"
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise SettingsError(f"{source}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{source}: not valid TOML: {exc}") from None
    return parse_policy(data, source)


@lru_cache(maxsize=4)
def _policy_at(path: Path, mtime_ns: int) -> Policy:
    del mtime_ns  # part of the cache key only
    return read_policy(path)


def server_policy(environ: Mapping[str, str] | None = None) -> Policy | None:
    """The policy servers enforce (``None`` = auth off). Raises :class:`SettingsError`."""
    settings = load(AuthSettings, os.environ if environ is None else environ)
    if settings.file is None:
        return None
    try:
        mtime = settings.file.stat().st_mtime_ns
    except OSError:
        mtime = 0
    return _policy_at(settings.file, mtime)


def client_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The token outgoing calls carry (``None`` = none), from ``SOKUTATSU_AUTH_TOKEN``."""
    token = load(AuthSettings, os.environ if environ is None else environ).token
    return token or None

"""The cluster secret: what the suite's services show each other on control RPCs.

The control plane (every RPC whose rule in :mod:`sokutatsu.core.auth_rules` is ``service``:
``BrokerControl/*``, the sequencers' ``WatchDistributions``/``InstallDistribution``/
``GetSendRate``, queue-db's ``Transfer/*``) changes roles, installs distributions and injects
messages, so it is closed to anyone without the cluster's secret, whether client auth is on or
off, as RabbitMQ's Erlang cookie or NATS's cluster route authorization keep inter-node traffic
closed. Clients (the SDK, whose RPCs are none of these) never need it.

Where the secret comes from, first found wins:

1. ``SOKUTATSU_CLUSTER_SECRET``, the value itself;
2. the file ``SOKUTATSU_CLUSTER_SECRET_FILE`` (default ``~/.sokutatsu/cluster-secret``). A
   service that finds no file makes one (32 random bytes, URL-safe base64, mode 0600), as RabbitMQ
   makes its cookie, so every process of one user on one machine shares it without setup. A file
   others may read (any group or other permission bit) is refused, as ssh refuses such a key.

A secret is at least :data:`MIN_LENGTH` characters. Services send it as metadata
:data:`HEADER` on their control calls only (:func:`control_interceptors`); a server refuses a
control call without it, or with another value, ``UNAUTHENTICATED`` (:class:`ClusterGuard`).
Over plaintext the secret can be read on the wire, as a bearer token can: use TLS anywhere but
loopback or a private network (docs/security.md).
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import grpc
from grpc import aio

from sokutatsu.client._auth import header_interceptors
from sokutatsu.core.auth_rules import is_control
from sokutatsu.core.settings import Settings, SettingsError, load, parse_optional_path, setting

log = logging.getLogger(__name__)

PREFIX = "SOKUTATSU_CLUSTER_"
SECRET_VAR = PREFIX + "SECRET"
FILE_VAR = PREFIX + "SECRET_FILE"
DEFAULT_FILE = Path("~/.sokutatsu/cluster-secret")
HEADER = "sokutatsu-cluster-secret"
MIN_LENGTH = 16
# How many distinct (reason, method) refusals are logged once each.
LOGGED_LIMIT = 10_000

MISSING = (
    "{method} is a control RPC between Sokutatsu's services: it needs the cluster secret ({header} metadata, "
    "sent by the services from {secret} or {file}); clients never call it"
)
WRONG = (
    "the cluster secret sent to {method} is not this service's: give every service of the cluster the same "
    "{secret} or {file}"
)


@dataclass(frozen=True)
class ClusterSettings(Settings):
    """The cluster secret every service requires on control RPCs and sends on its own."""

    env_prefix: ClassVar[str] = PREFIX
    check_unknown: ClassVar[bool] = True

    secret: str = setting(
        "SECRET",
        "",
        "The cluster secret itself (at least 16 characters), shown by the services to each other on control RPCs "
        "(pair links, switchover steps, sequencer distributions, queue-db transfer). Unset = read "
        "SOKUTATSU_CLUSTER_SECRET_FILE. Clients never need it (docs/security.md, The cluster secret).",
    )
    secret_file: Path | None = setting(
        "SECRET_FILE",
        None,
        "File holding the cluster secret, mode 0600 (default ~/.sokutatsu/cluster-secret). A service that finds "
        "none makes one with 32 random bytes, so the processes of one user share it; `sokutatsu up` and "
        "docker-compose.yml use one of their own. A file others may read is refused.",
        parse_optional_path,
    )


def secret_file(environ: Mapping[str, str] | None = None) -> Path:
    """Where the secret file is (whether or not it exists)."""
    settings = load(ClusterSettings, os.environ if environ is None else environ)
    return (settings.secret_file or DEFAULT_FILE).expanduser()


def cluster_secret_source(environ: Mapping[str, str] | None = None) -> str:
    """Where this process's secret comes from, in words (never the secret)."""
    env = os.environ if environ is None else environ
    if load(ClusterSettings, env).secret:
        return SECRET_VAR
    return str(secret_file(env))


def _checked(secret: str, source: str) -> str:
    if len(secret) < MIN_LENGTH:
        raise SettingsError(
            f"{source}: the cluster secret is {len(secret)} characters, under the minimum of {MIN_LENGTH} "
            "(`sokutatsu cluster-secret` makes one)"
        )
    return secret


def _read(path: Path) -> str:
    source = f"{FILE_VAR}={str(path)!r}"
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SettingsError(
                f"{source}: others may read it (mode {stat.S_IMODE(mode):04o}): chmod 600 it, the cluster secret "
                "must be readable by the services' user only"
            )
        text = path.read_text().strip()
    except OSError as exc:
        raise SettingsError(f"{source}: cannot read it: {exc.strerror}") from None
    return _checked(text, source)


def make_file(path: Path) -> bool:
    """Write a new random secret to ``path`` (mode 0600) unless a file is there; whether it wrote one.

    Made with ``O_EXCL``: processes starting together agree on one secret, the first one's.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    return True


def load_secret(*, create: bool, environ: Mapping[str, str] | None = None) -> str:
    """The cluster secret (:class:`SettingsError`, one line, when there is none or it is unusable).

    With ``create`` (a service starting) a missing file is made first.
    """
    env = os.environ if environ is None else environ
    settings = load(ClusterSettings, env)
    if settings.secret:
        return _checked(settings.secret, SECRET_VAR)
    path = secret_file(env)
    if create:
        try:
            if make_file(path):
                log.warning("made a new cluster secret in %s (%s)", path, FILE_VAR)
        except OSError as exc:
            raise SettingsError(f"{FILE_VAR}={str(path)!r}: cannot make it: {exc.strerror}") from None
    elif not path.exists():
        raise SettingsError(
            f"no cluster secret: {SECRET_VAR} is not set and {FILE_VAR}={str(path)!r} does not exist "
            "(a service makes it when it starts; give this process the services' secret)"
        )
    return _read(path)


# ------------------------------------------------------------------------------ server side ----


def _presented(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == HEADER:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def _refusing(handler: grpc.RpcMethodHandler[Any, Any], message: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of ``handler``'s kind that refuses ``UNAUTHENTICATED`` without reading the request
    (no deserializer: a large request is not even decoded)."""

    async def refuse(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        del request
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await refuse(request, context)
        yield  # pragma: no cover - an async generator, as response streams must be

    kwargs: dict[str, Any] = {"response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)


class ClusterGuard(aio.ServerInterceptor):
    """Refuses a control RPC that does not carry the cluster secret; lets every other call through.

    Refusals are counted in ``violations`` (shared with auth's, so a service's process stats
    report them with its other refusals) and logged once per (reason, method).
    """

    def __init__(self, secret: str, violations: collections.Counter[str] | None = None) -> None:
        self.secret = secret.encode()
        self.violations = violations if violations is not None else collections.Counter()
        self._logged: set[tuple[str, str]] = set()

    def refusals(self) -> int:
        return self.violations[grpc.StatusCode.UNAUTHENTICATED.name]

    def _refusal(self, method: str, presented: str | None) -> str:
        self.violations[grpc.StatusCode.UNAUTHENTICATED.name] += 1
        why = "no cluster secret" if presented is None else "a wrong cluster secret"
        key = (why, method)  # the call details name no peer: logged once per method and reason
        if key not in self._logged and len(self._logged) < LOGGED_LIMIT:
            self._logged.add(key)
            log.warning(
                "cluster: UNAUTHENTICATED refused %s: %s (refusals so far: %d)",
                method,
                why,
                self.violations[grpc.StatusCode.UNAUTHENTICATED.name],
            )
        return (MISSING if presented is None else WRONG).format(
            method=method, header=HEADER, secret=SECRET_VAR, file=FILE_VAR
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not is_control(method):
            return handler
        presented = _presented(handler_call_details.invocation_metadata)
        if presented is not None and hmac.compare_digest(presented.encode(), self.secret):
            return handler
        return _refusing(handler, self._refusal(method, presented))


# ------------------------------------------------------------------------------ client side ----


def control_interceptors(secret: str) -> list[aio.ClientInterceptor]:
    """Interceptors that add the secret to the control calls of a channel (and to no other call)."""
    header = ((HEADER, secret),)
    return header_interceptors(lambda method: header if is_control(method) else ())


def control_metadata(secret: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata a control call carries, for a synchronous client or a call of one's own."""
    return ((HEADER, secret if secret is not None else load_secret(create=False)),)

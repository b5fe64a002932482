"""The gRPC server bootstrap every service uses.

``run_service`` is the whole ``main`` of a service: it reads the settings
(a malformed value is one line on stderr and exit status 2), sets up logging
and tracing, serves until SIGTERM or SIGINT, then stops gracefully:

1. health turns NOT_SERVING, so load balancers and the launcher stop routing;
   ``ServiceContext.stopping`` is set and the background tasks started with
   ``stop_first`` (streams to other services) are cancelled and awaited, so a peer
   that stops at the same time is not left waiting on them;
2. ``server.stop(grace)`` lets in-flight RPCs finish for up to the grace period
   (long-lived streams a service serves should end when ``stopping`` is set);
3. background tasks (owned by one task group) are cancelled and awaited;
4. resources registered on the exit stack (pools, files) are closed;
5. traces are flushed.

A service supplies one ``register`` coroutine that adds its servicers to the
server, starts its background tasks through the :class:`ServiceContext` and
returns the full names of the services it registered (for health and
reflection).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from sokutatsu.core.auth import Policy, server_policy
from sokutatsu.core.auth_interceptor import AuthInterceptor
from sokutatsu.core.cluster import ClusterGuard, load_secret
from sokutatsu.core.errors import StartupError
from sokutatsu.core.interceptors import DomainErrorInterceptor
from sokutatsu.core.process_stats import SERVICE_NAME as PROCESS_SERVICE
from sokutatsu.core.process_stats import ProcessServicer
from sokutatsu.core.request_budget import RequestBudget
from sokutatsu.core.runtime_settings import (
    DEFAULT_MAX_FRAME_BYTES,
    SMALL_REQUESTS,
    RuntimeSettings,
    ServiceSettings,
)
from sokutatsu.core.settings import SettingsError, load
from sokutatsu.core.shutdown import watch_stop
from sokutatsu.core.stop_noise import drop_cancelled_at_stop
from sokutatsu.core.telemetry import setup_telemetry
from sokutatsu.core.tls import ServerTls, check_plaintext, server_tls
from sokutatsu.core.v1 import process_pb2_grpc

log = logging.getLogger(__name__)

S = TypeVar("S", bound=ServiceSettings)

# A stop still running this long after its grace period logs what it waits for.
STOP_OVERRUN_SECONDS = 2.0
# How long a stop waits, after the server stopped, for cancelled calls' handlers to unwind.
UNWIND_SECONDS = 1.0

# The default largest frame (SOKUTATSU_MAX_FRAME_BYTES); batching keeps frames well under it.
MAX_MESSAGE_BYTES = DEFAULT_MAX_FRAME_BYTES


def server_options(
    max_frame_bytes: int = MAX_MESSAGE_BYTES, max_request_bytes: int | None = None
) -> list[tuple[str, Any]]:
    """The options of every service's gRPC server.

    A frame over ``max_frame_bytes`` (a request over ``max_request_bytes``, when lower) is refused by
    gRPC itself from its length prefix, before anything reads it: the call ends with
    ``RESOURCE_EXHAUSTED`` (docs/security.md, Limits per connection).

    A service whose requests are small (``max_request_bytes`` at most ``SMALL_REQUESTS``) also turns
    HTTP/2 BDP probing off: its receive windows stay at gRPC's initial 64 KiB per stream, so a client
    cannot make it buffer a large frame it will refuse. With probing on, gRPC had grown the windows
    and read 8 concurrent 15 MB frames into memory before refusing them (the sequencer went from
    49 to 175 MiB RSS; 51 MiB with probing off).
    """
    receive = max_frame_bytes if max_request_bytes is None else min(max_frame_bytes, max_request_bytes)
    options: list[tuple[str, Any]] = [
        # gRPC sets SO_REUSEPORT by default, which lets a second server bind a busy
        # port silently; a busy port must be an error.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", receive),
        ("grpc.max_send_message_length", max_frame_bytes),
    ]
    if max_request_bytes is not None and max_request_bytes <= SMALL_REQUESTS:
        options.append(("grpc.http2.bdp_probe", 0))
    return options


SERVER_OPTIONS: list[tuple[str, Any]] = server_options()

# Methods no span is made for, besides a service's ``untraced``: health and reflection are the
# suite's plumbing, polled (the monitor checks its brokers' health every stats interval) or held
# open for a channel's life (a client-side health checking channel keeps a health Watch open).
UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class HealthServicer(health_aio.HealthServicer):  # type: ignore[misc]
    """grpcio's asyncio health servicer, plus ``List`` (grpc.health.v1), which it leaves unimplemented.

    ``List`` answers every service given a status so far, as the standard says: a snapshot of
    each one's status, ``NOT_SERVING`` for all once the server is stopping.
    """

    def __init__(self) -> None:
        super().__init__()
        self._listed: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._stopping = False

    async def set(self, service: str, status: int) -> None:
        await super().set(service, status)
        if not self._stopping:  # as grpcio's: a status set after the shutdown began is ignored
            self._listed[service] = status

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._stopping = True
        self._listed = dict.fromkeys(self._listed, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def List(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:  # noqa: N802 - gRPC's name
        statuses = {name: health_pb2.HealthCheckResponse(status=status) for name, status in self._listed.items()}
        return health_pb2.HealthListResponse(statuses=statuses)


@dataclass
class ServiceContext:
    """What a service's ``register`` gets besides the server."""

    service: str
    runtime: RuntimeSettings
    stack: contextlib.AsyncExitStack
    health: HealthServicer
    _group: asyncio.TaskGroup
    # Full method names ("/pkg.Service/Method") the generic RPC tracing skips: long-lived
    # streams whose spans are made per batch by the service itself.
    untraced: set[str] = field(default_factory=set)
    # host:port the service answers on, set once it listens (empty before).
    address: str = ""
    # Calls refused by auth so far (always 0 with auth off), for the service's stats.
    auth_refusals: Callable[[], int] = lambda: 0
    # Set when the service begins to stop, before the server stops taking calls.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _first: set[asyncio.Task[None]] = field(default_factory=set)

    def start_background(
        self, coro: Coroutine[Any, Any, None], name: str, *, stop_first: bool = False
    ) -> asyncio.Task[None]:
        """Run ``coro`` until shutdown. If it fails, the service stops with its error.

        ``stop_first``: cancel it when the service begins to stop, before the server's grace
        period (a stream to a peer the peer would otherwise wait for while it stops too)."""
        task = self._group.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if stop_first:
            self._first.add(task)
            task.add_done_callback(self._first.discard)
        return task

    async def begin_stop(self) -> None:
        """Set ``stopping``; cancel the ``stop_first`` tasks and wait for them."""
        self.stopping.set()
        first = list(self._first)
        for task in first:
            task.cancel()
        if first:
            await asyncio.wait(first)

    def cancel_background(self) -> None:
        for task in list(self._tasks):
            task.cancel()


Register = Callable[[aio.Server, ServiceContext], Awaitable[Sequence[str]]]


def _bind_problem(address: str) -> str:
    """Why ``address`` cannot be bound, in words (best effort)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, int(port)))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "the port is already in use"
        if exc.errno == errno.EADDRNOTAVAIL:
            return "no such local address"
        if exc.errno == errno.EACCES:
            return "permission denied (ports below 1024 need privileges)"
        return exc.strerror or str(exc)
    except (socket.gaierror, ValueError) as exc:
        return f"cannot resolve the host ({exc})"
    return "gRPC could not bind it"


def announce(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` whole or not at all (a parent polls for the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(path)


async def serve(
    *,
    service: str,
    settings: ServiceSettings,
    runtime: RuntimeSettings,
    register: Register,
    listen_var: str,
    stop: asyncio.Event | None = None,
    tls: ServerTls | None = None,
    auth: Policy | None = None,
    reload_auth: Callable[[], Policy | None] | None = None,
    cluster_secret: str | None = None,
    traced: bool = True,
) -> None:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives, then stop gracefully.

    Control RPCs need ``cluster_secret`` (default: :func:`sokutatsu.core.cluster.load_secret`,
    which makes the secret file when there is none), whatever ``auth`` says.
    With ``tls`` the port serves TLS (mTLS when it requires client certificates), else plaintext.
    With ``auth`` every call but health and reflection is authenticated and authorised by it;
    with ``reload_auth`` too, SIGHUP replaces the policy by what it returns (a bad file keeps
    the policy in force). With ``traced`` (a process that installed a tracer provider; any
    caller in a process that may install one later) OpenTelemetry's gRPC instrumentation records
    each call.
    """
    stop = stop or asyncio.Event()
    guard = AuthInterceptor(auth) if auth is not None else None
    cluster = ClusterGuard(
        cluster_secret if cluster_secret is not None else load_secret(create=True),
        guard.violations if guard is not None else None,
    )
    _handle_signals(stop, guard, reload_auth)

    health = HealthServicer()
    untraced: set[str] = set()
    budget = RequestBudget(runtime.max_request_bytes_in_flight, runtime.max_request_bytes_per_connection)
    server = aio.server(
        interceptors=_interceptors(untraced, cluster, guard, budget, traced=traced),
        options=server_options(runtime.max_frame_bytes, settings.max_request_bytes),
    )
    async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as group:
        context = ServiceContext(
            service=service, runtime=runtime, stack=stack, health=health, _group=group, untraced=untraced
        )
        context.auth_refusals = lambda: sum(cluster.violations.values())
        # Handlers cancelled by this stop are logged by grpcio after serve returns: the filter stays.
        drop_cancelled_at_stop(context.stopping)
        names = list(await register(server, context))
        process = ProcessServicer(
            service, settings.instance, violations=cluster.violations, auth=guard is not None, tls=tls is not None
        )
        _add_common_services(server, names, health, process)
        try:
            if tls is None:
                port = server.add_insecure_port(settings.listen)
            else:
                port = server.add_secure_port(settings.listen, tls.credentials())
        except RuntimeError:
            raise StartupError(
                f"cannot listen on {settings.listen}: {_bind_problem(settings.listen)} "
                f"(set {listen_var} to another host:port)"
            ) from None
        await server.start()
        try:
            host = settings.listen.rpartition(":")[0]
            if host in ("0.0.0.0", "[::]", "::"):  # noqa: S104 - announcing, not binding
                host = "127.0.0.1"
            address = f"{host}:{port}"
            context.address = address
            for name in ["", *names]:
                await health.set(name, health_pb2.HealthCheckResponse.SERVING)
            if runtime.announce_file is not None:
                announce(
                    runtime.announce_file,
                    {"service": service, "instance": settings.instance, "address": address, "pid": os.getpid()},
                )
            if runtime.parent_pid:
                context.start_background(_watch_parent(runtime.parent_pid, stop), "parent-watch")
            security = "plaintext" if tls is None else "mTLS" if tls.require_client_auth else "TLS"
            if auth is not None:
                security += ", auth on"
            log.info("%s %s serving on %s (%s)", service, settings.instance, address, security)
            await stop.wait()
            log.info("%s %s stopping (grace %.1fs)", service, settings.instance, runtime.grace_seconds)
        finally:
            # Also when a background task failed: stop serving before the task group unwinds.
            watchdog = watch_stop(f"{service} {settings.instance}", runtime.grace_seconds + STOP_OVERRUN_SECONDS)
            await _stop(server, context, health, runtime.grace_seconds)
    watchdog.cancel()
    log.info("%s %s stopped", service, settings.instance)


async def _stop(server: aio.Server, context: ServiceContext, health: HealthServicer, grace: float) -> None:
    """The stop, in order: health says NOT_SERVING, the service's stop_first tasks end, the
    server stops (calls get ``grace`` seconds), cancelled calls unwind, background tasks end."""
    await health.enter_graceful_shutdown()
    await context.begin_stop()
    await server.stop(grace)
    await _calls_unwound(UNWIND_SECONDS)
    context.cancel_background()


def _is_call_task(task: asyncio.Task[Any]) -> bool:
    """grpcio's AsyncIO server names the tasks it runs a call in (server.pyx.pxi)."""
    name = task.get_name()
    return name == "rpc_task" or name.startswith("HandleExceptions[")


async def _calls_unwound(limit: float) -> None:
    """Wait (up to ``limit``) for the tasks of the calls the stop cancelled to end.

    grpcio's ``server.stop()`` returns once its C core has no live call, while a cancelled
    handler may still be running its ``finally`` (pair.receive_watermarks awaits its reader
    there). Left pending, such a task is cancelled by the closing event loop and grpcio prints
    that cancellation's traceback straight to stderr, past any log filter."""
    calls = [t for t in asyncio.all_tasks() if not t.done() and _is_call_task(t)]
    if not calls:
        return
    _, pending = await asyncio.wait(calls, timeout=limit)
    if pending:
        log.warning("%d cancelled call(s) still unwinding %.1fs after the server stopped", len(pending), limit)


def _handle_signals(
    stop: asyncio.Event, guard: AuthInterceptor | None, reload_auth: Callable[[], Policy | None] | None
) -> None:
    """SIGTERM and SIGINT stop the service; SIGHUP reloads the auth policy (when there is one)."""
    loop = asyncio.get_running_loop()
    handlers: list[tuple[signal.Signals, Callable[[], None]]] = [(signal.SIGTERM, stop.set), (signal.SIGINT, stop.set)]
    if guard is not None and reload_auth is not None:
        handlers.append((signal.SIGHUP, lambda: _reload_policy(guard, reload_auth)))
    for sig, handler in handlers:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handler)


def _reload_policy(guard: AuthInterceptor, reload_auth: Callable[[], Policy | None]) -> None:
    try:
        policy = reload_auth()
    except SettingsError as exc:
        log.error("auth policy not reloaded; the one in force stays: %s", exc)  # noqa: TRY400 - one line
        return
    if policy is None:
        log.error("auth policy not reloaded: SOKUTATSU_AUTH_FILE is not set; the one in force stays")
        return
    guard.policy = policy
    principals = {id(p) for p in (*policy.by_token.values(), *policy.by_cn.values())}
    log.warning("auth policy reloaded on SIGHUP: %d principals", len(principals))


def _add_common_services(
    server: aio.Server, names: list[str], health: HealthServicer, process: ProcessServicer
) -> None:
    """What every service serves besides its own: health, its process figures, reflection of all."""
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    process_pb2_grpc.add_ProcessServicer_to_server(process, server)
    reflection.enable_server_reflection(
        [*names, PROCESS_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )


def _interceptors(
    untraced: set[str], cluster: ClusterGuard, guard: AuthInterceptor | None, budget: RequestBudget, *, traced: bool
) -> list[aio.ServerInterceptor]:
    """OpenTelemetry outermost, so it records the status the cluster secret, auth or the domain mapping chose.

    It traces neither the ``untraced`` methods nor health and reflection (``UNTRACED_PREFIXES``).
    Without ``traced`` it is left out, and not even imported: a process that does not trace
    starts without it (about 0.1 s of CPU at each start on this project's 2-core machines).
    """
    interceptors: list[aio.ServerInterceptor] = []
    if traced:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor  # noqa: PLC0415 - see above

        def wanted(details: grpc.HandlerCallDetails) -> bool:
            method = details.method
            return method not in untraced and not method.startswith(UNTRACED_PREFIXES)

        interceptors.append(aio_server_interceptor(filter_=wanted))  # type: ignore[no-untyped-call]
    interceptors.append(cluster)
    if guard is not None:
        interceptors.append(guard)
    interceptors.append(DomainErrorInterceptor(budget))
    return interceptors


PARENT_CHECK_SECONDS = 1.0


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Stop when the launcher that started this process is gone (its children are re-parented)."""
    while os.getppid() == parent_pid:  # noqa: ASYNC110 - no event exists for "my parent died"
        await asyncio.sleep(PARENT_CHECK_SECONDS)
    log.warning("parent process %d is gone; stopping", parent_pid)
    stop.set()


def _fail(service: str, message: str, status: int) -> NoReturn:
    sys.stderr.write(f"sokutatsu-{service}: error: {message}\n")
    sys.exit(status)


def run_service(service: str, settings_cls: type[S], build: Callable[[S], Register]) -> NoReturn:
    """The ``main`` of a service process."""
    try:
        runtime = load(RuntimeSettings)
        settings = load(settings_cls)
        tls = server_tls()
        auth = server_policy()
        listen_var = settings_cls.env_prefix + "LISTEN"
        check_plaintext(settings.listen, listen_var, tls, runtime.allow_plaintext)
        register = build(settings)
    except SettingsError as exc:
        _fail(service, str(exc), 2)
    logging.basicConfig(
        level=runtime.log_level,
        format=f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s: %(message)s",
    )
    try:
        cluster_secret = load_secret(create=True)  # after the logging set-up: making one is logged
    except SettingsError as exc:
        _fail(service, str(exc), 2)
    try:
        telemetry = setup_telemetry(service, settings.instance, runtime.trace_dir)
    except OSError as exc:
        _fail(service, f"cannot write traces to {runtime.trace_dir}: {exc.strerror} (SOKUTATSU_TRACE_DIR)", 2)
    # What start-up made (modules, classes, protobuf descriptors: tens of thousands of objects) lives
    # as long as the process: out of the collector's sight, a full collection no longer walks it
    # (the broker's took 10-12 ms, a pause in every stream, before: docs/broker.md).
    gc.freeze()
    try:
        # Errors raised while the task group is open arrive wrapped in a group.
        asyncio.run(
            serve(
                service=service,
                settings=settings,
                runtime=runtime,
                register=register,
                listen_var=listen_var,
                tls=tls,
                auth=auth,
                reload_auth=server_policy,
                cluster_secret=cluster_secret,
                traced=telemetry.provider is not None,
            )
        )
    except* StartupError as group:
        telemetry.shutdown()
        _fail(service, "; ".join(str(e) for e in group.exceptions), 1)
    except* Exception as group:
        for error in group.exceptions:
            log.error("%s failed", service, exc_info=error)  # noqa: TRY400 - logs each error of the group
        telemetry.shutdown()
        first = group.exceptions[0]
        _fail(service, f"stopped after an internal error: {type(first).__name__}: {first} (traceback in the log)", 1)
    telemetry.shutdown()
    sys.exit(0)

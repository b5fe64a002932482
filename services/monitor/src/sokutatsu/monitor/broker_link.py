"""One broker of the pair as the monitor reaches it: statistics stream, health, control calls.

A :class:`BrokerLink` keeps one channel to its broker for the monitor's lifetime and two
watchers on it: the ``WatchStats`` stream (re-opened with jittered backoff when it breaks,
at once when health answers again) and a gRPC health check every stats interval. The
broker counts as reachable while statistics frames arrive (one within the stale window);
a broken stream or a health answer other than SERVING (a broker shutting down) mark it
unreachable at once, until the next frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.client._retry import Backoff  # the SDK's reconnect backoff (jittered exponential)
from sokutatsu.core.shutdown import stop_if_cancelled
from sokutatsu.core.tls import open_channel
from sokutatsu.monitor.assignments import BrokerView
from sokutatsu.monitor.settings import BrokerEndpoint

log = logging.getLogger(__name__)

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 16 * 2**20),
    ("grpc.max_send_message_length", 16 * 2**20),
    # A broker that comes back is found quickly.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# Control calls (the switchover steps, SetRole) give up after this long.
CONTROL_TIMEOUT_SECONDS = 2.0
BACKOFF_INITIAL_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 1.0


def _metadata() -> tuple[tuple[str, str], ...]:
    """W3C trace context of the current span, so the broker's server span joins the switchover's trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def rpc_error_text(exc: BaseException) -> str:
    if isinstance(exc, aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class BrokerLink:
    def __init__(
        self,
        endpoint: BrokerEndpoint,
        interval: float,
        stale_after: float,
        on_update: Callable[[], None],
        *,
        link: str = "",
    ) -> None:
        self.broker_id = endpoint.broker_id
        # For subscribers and the peer; the monitor's own calls go to ``link`` (default: the same).
        self.address = endpoint.address
        self.interval = interval
        self.stale_after = stale_after
        self._on_update = on_update
        self.channel = open_channel(link or endpoint.address, options=CHANNEL_OPTIONS, cluster=True)
        self.admin = broker_pb2_grpc.BrokerAdminStub(self.channel)
        self.control = broker_pb2_grpc.BrokerControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.stats: broker_pb2.BrokerStats | None = None
        self.streaming = False
        self.draining = False
        self.health_status = "UNKNOWN"
        self.health_error = ""
        self._wake = asyncio.Event()
        self.down = True
        self.error = "not contacted yet"
        self._told = False  # whether the first failure was logged
        # Monotonic times: last sign of life, since when it is reachable (0 = never).
        self.last_ok = 0.0
        self.up_since = 0.0
        self.stats_at = 0.0  # when the last statistics frame arrived
        self.last_seen_unix_nano = 0

    # ------------------------------------------------------------- liveness --
    def reachable(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return not self.down and self.last_ok > 0 and now - self.last_ok < self.stale_after

    def problem(self, now: float | None = None) -> str:
        """Why it is not reachable, in words (empty while it is)."""
        now = time.monotonic() if now is None else now
        if self.reachable(now):
            return ""
        why = self.error if self.down else f"no statistics for {now - self.last_ok:.1f}s"
        if self.health_error and not why.endswith(self.health_error):
            return f"{why}; health check: {self.health_error}"
        return why

    def view(self, now: float | None = None) -> BrokerView:
        return BrokerView(self.broker_id, self.address, self.stats, self.reachable(now))

    def _alive(self) -> None:
        now = time.monotonic()
        if not self.reachable(now):
            self.up_since = now
        self.down = False
        self.error = ""
        self.last_ok = now
        self.last_seen_unix_nano = time.time_ns()

    def _lost(self, why: str) -> None:
        if not self.down or not self._told:
            log.warning("broker %s (%s): %s", self.broker_id, self.address, why)
            self._told = True
        self.down = True
        self.error = why

    # -------------------------------------------------------------- watchers --
    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._watch_stats(), name=f"stats-{self.broker_id}")
            group.create_task(self._watch_health(), name=f"health-{self.broker_id}")

    async def _watch_stats(self) -> None:
        backoff = Backoff(initial=BACKOFF_INITIAL_SECONDS, maximum=BACKOFF_MAX_SECONDS)
        request = broker_pb2.WatchStatsRequest(interval_ms=max(10, round(self.interval * 1000)))
        while True:
            stop_if_cancelled()
            try:
                async for stats in self.admin.WatchStats(request):
                    self.streaming = True
                    backoff.reset()
                    self.receive(stats)
                why = "its statistics stream ended"
            except aio.AioRpcError as exc:
                why = f"statistics stream: {rpc_error_text(exc)}"
            self.streaming = False
            self._lost(why)
            self._on_update()
            self._wake.clear()
            # Health answering again cuts the wait short.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), backoff.next_delay())

    def receive(self, stats: broker_pb2.BrokerStats) -> None:
        """One statistics frame from the broker."""
        self.stats_at = time.monotonic()
        if stats.broker_id != self.broker_id:
            self.stats = None
            self._lost(
                f"it reports broker id {stats.broker_id!r}, but SOKUTATSU_MONITOR_BROKERS names "
                f"{self.address} {self.broker_id!r}; the monitor leaves it alone"
            )
        else:
            self.stats = stats
            if not self.draining:
                self._alive()
        self._on_update()

    async def _watch_health(self) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        timeout = max(self.interval, min(1.0, self.stale_after))
        while True:
            stop_if_cancelled()
            try:
                reply = await self.health.Check(request, timeout=timeout)
            except aio.AioRpcError as exc:
                # Silence shows in the statistics stream; this only says why.
                self.health_status = "UNREACHABLE"
                self.health_error = rpc_error_text(exc)
            else:
                self.health_error = ""
                self.health_status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    self.draining = False
                    if not self.streaming:
                        self._wake.set()
                else:
                    self.draining = True
                    self._lost(f"health reports {self.health_status} (shutting down)")
                    self._on_update()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await self.channel.close()

    # ------------------------------------------------------- control calls --
    async def subscription(self, subscriber_id: str, topic: str) -> broker_pb2.Subscription:
        reply = await self.admin.ListSubscriptions(
            broker_pb2.ListSubscriptionsRequest(topic=topic), timeout=CONTROL_TIMEOUT_SECONDS, metadata=_metadata()
        )
        for sub in reply.subscriptions:
            if sub.subscriber_id == subscriber_id and sub.topic == topic:
                return sub
        raise LookupError(f"{self.broker_id} does not list a subscription of {subscriber_id} on {topic}")

    async def switch_position(
        self, switchover_id: str, subscriber_id: str, topic: str
    ) -> broker_pb2.GetSwitchPositionResponse:
        request = broker_pb2.GetSwitchPositionRequest(
            switchover_id=switchover_id, subscriber_id=subscriber_id, topic=topic
        )
        return await self.control.GetSwitchPosition(request, timeout=CONTROL_TIMEOUT_SECONDS, metadata=_metadata())

    async def accept(
        self, switchover_id: str, subscription: broker_pb2.Subscription, position: broker_pb2.Position
    ) -> broker_pb2.AcceptSubscriberResponse:
        request = broker_pb2.AcceptSubscriberRequest(
            switchover_id=switchover_id, subscription=subscription, position=position
        )
        return await self.control.AcceptSubscriber(request, timeout=CONTROL_TIMEOUT_SECONDS, metadata=_metadata())

    async def redirect(
        self, switchover_id: str, subscriber_id: str, topic: str, *, target: str, target_broker_id: str, reason: str
    ) -> broker_pb2.RedirectSubscriberResponse:
        request = broker_pb2.RedirectSubscriberRequest(
            switchover_id=switchover_id,
            subscriber_id=subscriber_id,
            topic=topic,
            target=target,
            target_broker_id=target_broker_id,
            reason=reason,
        )
        return await self.control.RedirectSubscriber(request, timeout=CONTROL_TIMEOUT_SECONDS, metadata=_metadata())

    async def release(self, switchover_id: str, subscriber_id: str, topic: str) -> broker_pb2.ReleaseSubscriberResponse:
        request = broker_pb2.ReleaseSubscriberRequest(
            switchover_id=switchover_id, subscriber_id=subscriber_id, topic=topic
        )
        return await self.control.ReleaseSubscriber(request, timeout=CONTROL_TIMEOUT_SECONDS, metadata=_metadata())

    async def set_role(
        self, role: broker_pb2.BrokerRole.ValueType, epoch: int, peer: str, lease_ms: int = 0
    ) -> broker_pb2.RoleInfo:
        request = broker_pb2.SetRoleRequest(role=role, epoch=epoch, peer=peer, lease_ms=lease_ms)
        info = await self.control.SetRole(request, timeout=CONTROL_TIMEOUT_SECONDS, metadata=_metadata())
        if self.stats is not None:
            # Until the next statistics frame confirms it.
            self.stats.role = info.role
            self.stats.epoch = info.epoch
        return info

    async def renew_lease(self, grant: int, epoch: int, lease_ms: int) -> broker_pb2.RenewLeaseResponse:
        """The monitor's lease (lease.py): grant an earlier token at ``epoch``, take a new one."""
        request = broker_pb2.RenewLeaseRequest(grant=grant, epoch=epoch, lease_ms=lease_ms)
        return await self.control.RenewLease(request, timeout=self.interval * 5 + 0.5)


def is_unreachable(exc: BaseException) -> bool:
    """Whether a failed call means the broker did not answer (rather than refused)."""
    return isinstance(exc, aio.AioRpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    )

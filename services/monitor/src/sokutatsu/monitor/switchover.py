"""The four switchover steps (seed 000 §3.2.1), each timed and traced.

Moving subscriber S from the broker serving it (``source``) to the other (``target``):

1. POSITION: ``source.GetSwitchPosition``, what S has acknowledged.
2. ACCEPT: ``target.AcceptSubscriber`` with that position (asked again every 10 ms while the
   target answers UNAVAILABLE, up to the switch timeout: it has not yet had its peer's holdings);
   the answer's ``floor`` says from where the target holds S's messages. While the position does not cover the floor (a
   broker that was away from S starts holding at accept time), step 1 is asked again every
   few milliseconds, up to the switch timeout; then the switchover is aborted and undone
   (``target.ReleaseSubscriber``): S stays where it was.
3. REDIRECT: ``source.RedirectSubscriber``: S's SDK reconnects to the target with its own
   position, which is never below the switch position, so nothing is lost or doubled.
4. RELEASE: ``source.ReleaseSubscriber``: the source clears its queue for S (or keeps it as
   a shadow when it is the standby). A source refuses while the redirected stream is still
   attached (asked again every few ms) and while it cannot hear its peer, to keep the data;
   a release still refused after a second is left to the monitor (:class:`PendingRelease`).

Each step becomes a ``StepTiming`` in the record and a child span of the switchover's span.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc import aio
from opentelemetry import trace

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.monitor.broker_link import is_unreachable, rpc_error_text
from sokutatsu.monitor.positions import covers, describe_behind, vector
from sokutatsu.monitor.v1 import monitor_pb2

tracer = trace.get_tracer("sokutatsu.monitor")

# Step 1 is asked again this often while the position does not cover the floor (and step 4
# while it is refused, for up to RELEASE_RETRY_SECONDS).
POSITION_POLL_SECONDS = 0.002
RELEASE_RETRY_SECONDS = 1.0
# Step 2 is asked again this often while the taking broker answers UNAVAILABLE (not yet synced).
ACCEPT_RETRY_SECONDS = 0.01

REDIRECT_REASONS = {
    monitor_pb2.SWITCHOVER_REASON_SLOW: "slow subscriber moved to the standby",
    monitor_pb2.SWITCHOVER_REASON_RECOVERED: "recovered subscriber migrated back to the active",
    monitor_pb2.SWITCHOVER_REASON_MANUAL: "moved by an operator",
}


class PairEnd(Protocol):
    """What a switchover needs of a broker (``BrokerLink`` in the service)."""

    @property
    def broker_id(self) -> str: ...

    @property
    def address(self) -> str: ...

    async def subscription(self, subscriber_id: str, topic: str) -> broker_pb2.Subscription: ...

    async def switch_position(
        self, switchover_id: str, subscriber_id: str, topic: str
    ) -> broker_pb2.GetSwitchPositionResponse: ...

    async def accept(
        self, switchover_id: str, subscription: broker_pb2.Subscription, position: broker_pb2.Position
    ) -> broker_pb2.AcceptSubscriberResponse: ...

    async def redirect(
        self, switchover_id: str, subscriber_id: str, topic: str, *, target: str, target_broker_id: str, reason: str
    ) -> broker_pb2.RedirectSubscriberResponse: ...

    async def release(
        self, switchover_id: str, subscriber_id: str, topic: str
    ) -> broker_pb2.ReleaseSubscriberResponse: ...


@dataclass(frozen=True)
class PendingRelease:
    """Step 4 was refused (the source did not hear its peer): what finishing it needs.

    The monitor retries the release once the source hears the target again; if the target
    is gone instead, it gives the subscriber back to the source (``source.AcceptSubscriber``
    with the switch position: the source still holds everything after it).
    """

    switchover_id: str
    subscriber_id: str
    topic: str
    source_id: str
    target_id: str
    subscription: broker_pb2.Subscription
    position: broker_pb2.Position


@dataclass(frozen=True)
class Outcome:
    # Whether the subscriber is served by the target at the end (as far as the monitor knows).
    moved: bool
    pending: PendingRelease | None = None


class _Aborted(Exception):
    pass


def _step_name(step: monitor_pb2.SwitchoverStep.ValueType) -> str:
    return monitor_pb2.SwitchoverStep.Name(step).removeprefix("SWITCHOVER_STEP_").lower()


@contextlib.contextmanager
def timed_step(
    record: monitor_pb2.Switchover, step: monitor_pb2.SwitchoverStep.ValueType, on: trace.Tracer | None = None
) -> Iterator[None]:
    """Time one step into ``record`` and trace it as a child span (errors mark the span)."""
    started_ns = time.time_ns()
    t0 = time.perf_counter()
    try:
        with (on or tracer).start_as_current_span(f"switchover.{_step_name(step)}"):
            yield
    finally:
        micros = round((time.perf_counter() - t0) * 1e6)
        record.steps.append(monitor_pb2.StepTiming(step=step, started_unix_nano=started_ns, duration_micros=micros))


def _failed(step: str, broker: str, exc: BaseException) -> str:
    if isinstance(exc, _Aborted):
        return f"step {step} aborted: {exc}"
    if isinstance(exc, LookupError):
        return f"before step 1: {exc}"
    return f"step {step} on {broker} failed: {rpc_error_text(exc)}"


async def _undo(target: PairEnd, record: monitor_pb2.Switchover) -> str:
    try:
        await target.release(record.id, record.subscriber_id, record.topic)
    except Exception as exc:  # noqa: BLE001 - the undo is best effort and said so
        return f"undoing step 2 on {target.broker_id} failed too ({rpc_error_text(exc)}); "
    return f"step 2 undone on {target.broker_id}; "


async def run_switchover(
    record: monitor_pb2.Switchover,
    source: PairEnd,
    target: PairEnd,
    *,
    switch_timeout: float,
    poll: float = POSITION_POLL_SECONDS,
    target_up: Callable[[], bool] = lambda: True,
    on: trace.Tracer | None = None,
) -> Outcome:
    """Run the four steps for ``record`` (its id, subscriber, topic, brokers and reason set).

    ``target_up`` is asked before step 3: a target that stopped answering is not redirected to.
    Spans go to ``on`` (default: the global tracer provider's).
    """
    on = on or tracer
    attributes: dict[str, str | int] = {
        "sokutatsu.switchover.id": record.id,
        "sokutatsu.subscriber_id": record.subscriber_id,
        "sokutatsu.topic": record.topic,
        "sokutatsu.from_broker": source.broker_id,
        "sokutatsu.to_broker": target.broker_id,
        "sokutatsu.reason": monitor_pb2.SwitchoverReason.Name(record.reason).removeprefix("SWITCHOVER_REASON_"),
        "sokutatsu.depth": record.depth,
        "sokutatsu.threshold": record.threshold,
    }
    with on.start_as_current_span("switchover", attributes=attributes) as span:
        record.started_unix_nano = time.time_ns()
        t0 = time.perf_counter()
        try:
            outcome = await _Run(record, source, target, switch_timeout, poll, target_up, on).run()
        finally:
            record.total_micros = round((time.perf_counter() - t0) * 1e6)
            record.finished = True
        span.set_attribute("sokutatsu.switchover.moved", outcome.moved)
        span.set_attribute("sokutatsu.switchover.position_retries", record.position_retries)
        if record.error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, record.error))
        return outcome


@dataclass
class _Run:
    record: monitor_pb2.Switchover
    source: PairEnd
    target: PairEnd
    switch_timeout: float
    poll: float
    target_up: Callable[[], bool]
    tracer: trace.Tracer
    # Which step and broker a failure belongs to, for the record.
    step: str = "1 (position)"
    broker: str = ""
    accept_sent: bool = False

    async def run(self) -> Outcome:
        record, source, target = self.record, self.source, self.target
        self.broker = source.broker_id
        try:
            subscription, switch = await self._prepare()
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and undone
            undo = await _undo(target, record) if self.accept_sent else ""
            record.error = f"{_failed(self.step, self.broker, exc)}; {undo}the subscriber stays on {source.broker_id}"
            return Outcome(moved=False)
        try:
            with timed_step(record, monitor_pb2.SWITCHOVER_STEP_REDIRECT, self.tracer):
                redirected = await source.redirect(
                    record.id,
                    record.subscriber_id,
                    record.topic,
                    target=target.address,
                    target_broker_id=target.broker_id,
                    reason=REDIRECT_REASONS.get(record.reason, "switchover"),
                )
                record.redirected = redirected.redirected
        except Exception as exc:  # noqa: BLE001 - every failure is recorded
            failed = _failed("3 (redirect)", source.broker_id, exc)
            if is_unreachable(exc):
                # It may have redirected; the target holds everything the subscriber needs.
                record.error = (
                    f"{failed}; {target.broker_id} keeps the subscriber (it reconnects there, or a failover "
                    "moves everyone)"
                )
                return Outcome(moved=False)
            undo = await _undo(target, record)
            record.error = f"{failed}; {undo}the subscriber stays on {source.broker_id}"
            return Outcome(moved=False)
        return await self._release(subscription, switch.position)

    async def _prepare(self) -> tuple[broker_pb2.Subscription, broker_pb2.GetSwitchPositionResponse]:
        """Steps 1 and 2 (raises on any failure; the caller undoes step 2)."""
        record, source, target = self.record, self.source, self.target
        sid, sub, topic = record.id, record.subscriber_id, record.topic
        subscription = await source.subscription(sub, topic)
        with timed_step(record, monitor_pb2.SWITCHOVER_STEP_POSITION, self.tracer):
            switch = await source.switch_position(sid, sub, topic)
        self.step, self.broker = "2 (accept)", target.broker_id
        with timed_step(record, monitor_pb2.SWITCHOVER_STEP_ACCEPT, self.tracer):
            deadline = time.monotonic() + self.switch_timeout
            self.accept_sent = True  # before the call: one that failed may still have been applied
            floor = vector((await self._accept(subscription, switch.position, deadline)).floor)
            while not covers(vector(switch.position), floor):
                self._check_deadline(deadline, vector(switch.position), floor)
                await asyncio.sleep(self.poll)
                self.broker = source.broker_id
                switch = await source.switch_position(sid, sub, topic)
                self.broker = target.broker_id
                record.position_retries += 1
            if record.position_retries:
                # Let the target drop what the subscriber acknowledged meanwhile.
                await target.accept(sid, subscription, switch.position)
        if not self.target_up():
            raise _Aborted(f"{target.broker_id} stopped answering before the redirect")
        return subscription, switch

    async def _accept(
        self, subscription: broker_pb2.Subscription, position: broker_pb2.Position, deadline: float
    ) -> broker_pb2.AcceptSubscriberResponse:
        """``target.AcceptSubscriber``, asked again every few ms up to ``deadline`` while it answers
        UNAVAILABLE and the monitor still reaches it: a broker refuses so until it has its peer's
        holdings of the peer's current session (it came back, or the pair's link just opened), which
        takes a frame of the pair's stream. Before, a switchover asked for then failed at once."""
        record, target = self.record, self.target
        while True:
            try:
                return await target.accept(record.id, subscription, position)
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or not self.target_up() or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(max(self.poll, ACCEPT_RETRY_SECONDS))

    def _check_deadline(self, deadline: float, position: dict[str, int], floor: dict[str, int]) -> None:
        if time.monotonic() >= deadline:
            raise _Aborted(
                f"the subscriber's acknowledged position did not reach what {self.target.broker_id} holds "
                f"within {self.switch_timeout:g}s ({describe_behind(position, floor)})"
            )

    async def _release(self, subscription: broker_pb2.Subscription, position: broker_pb2.Position) -> Outcome:
        record, source, target = self.record, self.source, self.target
        try:
            with timed_step(record, monitor_pb2.SWITCHOVER_STEP_RELEASE, self.tracer):
                await self._release_soon()
        except Exception as exc:  # noqa: BLE001 - every failure is recorded
            pending = PendingRelease(
                record.id,
                record.subscriber_id,
                record.topic,
                source.broker_id,
                target.broker_id,
                subscription,
                position,
            )
            failed = _failed("4 (release)", source.broker_id, exc)
            if isinstance(exc, aio.AioRpcError) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                record.error = (
                    f"{failed}; {target.broker_id} serves the subscriber and {source.broker_id} keeps its copy "
                    f"until the monitor releases it (or gives the subscriber back to it if {target.broker_id} "
                    "is gone)"
                )
                return Outcome(moved=True, pending=pending)
            record.error = f"{failed}; {target.broker_id} serves the subscriber"
            return Outcome(moved=True, pending=None if is_unreachable(exc) else pending)
        return Outcome(moved=True)

    async def _release_soon(self) -> None:
        """Step 4, asked again every few ms while refused (FAILED_PRECONDITION), for a short while.

        The source refuses while the redirected stream is still attached (the SDK closes it
        a moment after the Redirect frame) and while it does not hear its peer; the first
        passes in milliseconds, the second is left to the monitor.
        """
        record = self.record
        deadline = time.monotonic() + min(self.switch_timeout, RELEASE_RETRY_SECONDS)
        while True:
            try:
                await self.source.release(record.id, record.subscriber_id, record.topic)
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() >= deadline:
                    raise
                record.release_retries += 1
                await asyncio.sleep(self.poll)
            else:
                return

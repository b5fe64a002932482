"""A model of one broker's control side for one subscriber, after broker.proto's BrokerControl.

Used where the monitor's sequencing is checked without broker processes: it answers
like the broker (step 1 only while serving or leaving; accept makes it serve and says its
floor; redirect leaves; release clears or shadows, and clears nothing twice; SetRole fenced
by epoch, over 2^62 refused), can be told to fail a call, and can hold step 1 until a gate
opens (to catch a switchover in the middle). Every scenario that uses it also runs against
a real pair (``real_pair.py``) unless only the model can produce its fault, so where the
model drifts from the broker a test fails.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio

from sokutatsu.broker.v1 import broker_pb2

# The highest epoch a broker takes (pair_state.py).
MAX_EPOCH = 2**62


def rpc_error(code: grpc.StatusCode, details: str) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details)


@dataclass
class ModelBroker:
    """One broker's control side for one subscriber, after broker.proto's BrokerControl."""

    broker_id: str
    role: str  # "active" or "standby"
    state: str  # SERVING, SHADOW, AWAY, LEAVING
    # The broker's epoch: SetRole is fenced by it, as pair_state.py fences it.
    epoch: int = 0
    # What GetSwitchPosition answers, call after call (the last one repeats).
    positions: list[dict[str, int]] = field(default_factory=lambda: [{"pub": 10}])
    floor: dict[str, int] = field(default_factory=dict)
    fail: dict[str, aio.AioRpcError] = field(default_factory=dict)
    # How many times a call in ``fail`` fails before it succeeds (absent: always).
    fail_times: dict[str, int] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    accepted_positions: list[dict[str, int]] = field(default_factory=list)
    subscriber_id: str = "desk-1"
    # When set, step 1 waits for it.
    gate: asyncio.Event | None = None
    # Calls whose answer is lost after the broker acted on them (the caller sees DEADLINE_EXCEEDED).
    lose_answer: set[str] = field(default_factory=set)
    # RenewLease: the last token made, and how many grants applied.
    token: int = 0
    grants: int = 0

    @property
    def address(self) -> str:
        return f"{self.broker_id}.test:1"

    def call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            left = self.fail_times.get(name)
            if left is None:
                raise self.fail[name]
            if left > 0:
                self.fail_times[name] = left - 1
                raise self.fail[name]

    async def subscription(self, subscriber_id: str, topic: str) -> broker_pb2.Subscription:
        self.call("subscription")
        return broker_pb2.Subscription(subscriber_id=subscriber_id, topic=topic, durable=True)

    async def switch_position(
        self, switchover_id: str, subscriber_id: str, topic: str
    ) -> broker_pb2.GetSwitchPositionResponse:
        self.call("position")
        if self.gate is not None:
            await self.gate.wait()
        if self.state not in ("SERVING", "LEAVING"):  # a redirected copy still answers, as broker.py's does
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, f"{self.broker_id} does not serve {subscriber_id}")
        last = self.positions.pop(0) if len(self.positions) > 1 else self.positions[0]
        return broker_pb2.GetSwitchPositionResponse(position=broker_pb2.Position(last_seq=last), connected=True)

    async def accept(
        self, switchover_id: str, subscription: broker_pb2.Subscription, position: broker_pb2.Position
    ) -> broker_pb2.AcceptSubscriberResponse:
        self.call("accept")
        self.accepted_positions.append(dict(position.last_seq))
        self.state = "SERVING"
        return broker_pb2.AcceptSubscriberResponse(floor=broker_pb2.Position(last_seq=self.floor))

    async def redirect(
        self, switchover_id: str, subscriber_id: str, topic: str, *, target: str, target_broker_id: str, reason: str
    ) -> broker_pb2.RedirectSubscriberResponse:
        self.call("redirect")
        self.state = "LEAVING"
        return broker_pb2.RedirectSubscriberResponse(redirected=True)

    async def release(self, switchover_id: str, subscriber_id: str, topic: str) -> broker_pb2.ReleaseSubscriberResponse:
        self.call("release")
        if self.state in ("AWAY", "SHADOW"):  # already released: nothing to clear (broker.py)
            return broker_pb2.ReleaseSubscriberResponse(cleared=0)
        self.state = "AWAY" if self.role == "active" else "SHADOW"
        return broker_pb2.ReleaseSubscriberResponse(cleared=1)


class StubAdapter:
    """The generated stubs' calls (``BrokerControlStub``, ``BrokerAdminStub``) answered by a model."""

    def __init__(self, model: ModelBroker) -> None:
        self.model = model
        self.roles: list[tuple[broker_pb2.BrokerRole.ValueType, int, str]] = []
        self.set_role_requests: list[broker_pb2.SetRoleRequest] = []

    async def ListSubscriptions(self, request: Any, **_: Any) -> broker_pb2.ListSubscriptionsResponse:  # noqa: N802 - the stub's names
        sub = await self.model.subscription(self.model.subscriber_id, request.topic)
        return broker_pb2.ListSubscriptionsResponse(subscriptions=[sub])

    async def GetSwitchPosition(self, request: Any, **_: Any) -> broker_pb2.GetSwitchPositionResponse:  # noqa: N802 - the stub's names
        return await self.model.switch_position(request.switchover_id, request.subscriber_id, request.topic)

    async def AcceptSubscriber(self, request: Any, **_: Any) -> broker_pb2.AcceptSubscriberResponse:  # noqa: N802 - the stub's names
        return await self.model.accept(request.switchover_id, request.subscription, request.position)

    async def RedirectSubscriber(self, request: Any, **_: Any) -> broker_pb2.RedirectSubscriberResponse:  # noqa: N802 - the stub's names
        return await self.model.redirect(
            request.switchover_id,
            request.subscriber_id,
            request.topic,
            target=request.target,
            target_broker_id=request.target_broker_id,
            reason=request.reason,
        )

    async def ReleaseSubscriber(self, request: Any, **_: Any) -> broker_pb2.ReleaseSubscriberResponse:  # noqa: N802 - the stub's names
        return await self.model.release(request.switchover_id, request.subscriber_id, request.topic)

    async def RenewLease(self, request: Any, **_: Any) -> broker_pb2.RenewLeaseResponse:  # noqa: N802 - the stub's names
        """A grant applies to the last token while active at the epoch named (pair_state.py ``grant``)."""
        model = self.model
        if "renew_lease" in model.fail:  # not among `calls`: it comes every round
            raise model.fail["renew_lease"]
        active = model.role == "active"
        granted = bool(request.grant) and request.grant == model.token and active and request.epoch == model.epoch
        model.grants += granted
        model.token += 1
        role = broker_pb2.BROKER_ROLE_ACTIVE if active else broker_pb2.BROKER_ROLE_STANDBY
        return broker_pb2.RenewLeaseResponse(
            token=model.token, granted=granted, role=role, epoch=model.epoch, monitored=True
        )

    async def SetRole(self, request: Any, **_: Any) -> broker_pb2.RoleInfo:  # noqa: N802 - the stub's names
        """Fenced by epoch as the broker fences it (pair_state.py ``set_by_monitor``)."""
        model = self.model
        model.call("set_role")
        self.set_role_requests.append(request)
        if request.role not in (broker_pb2.BROKER_ROLE_ACTIVE, broker_pb2.BROKER_ROLE_STANDBY):
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "SetRoleRequest.role is not a role a broker takes")
        if request.epoch > MAX_EPOCH:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"SetRole: epoch {request.epoch} is over {MAX_EPOCH}")
        role = "active" if request.role == broker_pb2.BROKER_ROLE_ACTIVE else "standby"
        if request.epoch < model.epoch or (request.epoch == model.epoch and role != model.role):
            raise rpc_error(
                grpc.StatusCode.FAILED_PRECONDITION, f"epoch {request.epoch} is not newer than {model.epoch}"
            )
        model.role, model.epoch = role, request.epoch
        self.roles.append((request.role, request.epoch, request.peer))  # the role changes that took
        if "set_role" in model.lose_answer:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return broker_pb2.RoleInfo(broker_id=model.broker_id, role=request.role, epoch=request.epoch)

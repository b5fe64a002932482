"""The real side of the monitor's model-pair scenarios: broker processes behind the same interface.

``model_pair.py`` models a broker's control side; the scenarios that use it also run
against a real pair (``tests/broker/fix_broker.py``'s ``pair_factory``) through
:class:`RealEnd`, which answers like a ``ModelBroker`` (``calls``, ``accepted_positions``)
but sends every call to a broker process through the monitor's own ``BrokerLink``. So
where the model and the broker disagree, the same assertion fails on one side.

Faults are real: ``before``/``after`` run a coroutine once around the named call (kill or
pause a broker, delete the subscription, acknowledge on the subscriber's stream) instead of
the model's canned errors. Positions are real: :class:`RawSubscriber` receives and
acknowledges on a raw ``Subscribe`` stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from grpc import aio

from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.core.tls import open_channel
from sokutatsu.monitor.broker_link import BrokerLink
from sokutatsu.monitor.settings import BrokerEndpoint
from tests.broker.fix_broker import BrokerProcess, Pair, stats
from tests.broker.raw import SubscribeCall, batch, message, open_publish, publish

# Only stops a hung test; nothing asserts on durations.
LIMIT_SECONDS = 30.0
Hook = Callable[[], Awaitable[None]]


def state_name(state: broker_pb2.QueueState.ValueType) -> str:
    return broker_pb2.QueueState.Name(state).removeprefix("QUEUE_STATE_")


async def until(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + LIMIT_SECONDS
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def subscription(subscriber_id: str, topic: str) -> broker_pb2.Subscription:
    """The scenarios' subscription: durable, migrate mode, 1 MB budget (as the harness's frames say)."""
    return broker_pb2.Subscription(
        subscriber_id=subscriber_id,
        topic=topic,
        durable=True,
        overflow_mode=broker_pb2.OVERFLOW_MODE_MIGRATE,
        memory_budget_bytes=1_000_000,
    )


@dataclass
class RealEnd:
    """A broker process as a switchover's ``PairEnd``, recording calls like ``ModelBroker``."""

    process: BrokerProcess
    link: BrokerLink
    calls: list[str] = field(default_factory=list)
    accepted_positions: list[dict[str, int]] = field(default_factory=list)
    # Run once, just before (after) the named call: a real fault at that moment.
    before: dict[str, Hook] = field(default_factory=dict)
    after: dict[str, Hook] = field(default_factory=dict)

    @property
    def broker_id(self) -> str:
        return self.link.broker_id

    @property
    def address(self) -> str:
        return self.link.address

    async def _before(self, name: str) -> None:
        self.calls.append(name)
        hook = self.before.pop(name, None)
        if hook is not None:
            await hook()

    async def _after(self, name: str) -> None:
        hook = self.after.pop(name, None)
        if hook is not None:
            await hook()

    async def subscription(self, subscriber_id: str, topic: str) -> broker_pb2.Subscription:
        await self._before("subscription")
        sub = await self.link.subscription(subscriber_id, topic)
        await self._after("subscription")
        return sub

    async def switch_position(
        self, switchover_id: str, subscriber_id: str, topic: str
    ) -> broker_pb2.GetSwitchPositionResponse:
        await self._before("position")
        reply = await self.link.switch_position(switchover_id, subscriber_id, topic)
        await self._after("position")
        return reply

    async def accept(
        self, switchover_id: str, subscription: broker_pb2.Subscription, position: broker_pb2.Position
    ) -> broker_pb2.AcceptSubscriberResponse:
        await self._before("accept")
        self.accepted_positions.append(dict(position.last_seq))
        reply = await self.link.accept(switchover_id, subscription, position)
        await self._after("accept")
        return reply

    async def redirect(
        self, switchover_id: str, subscriber_id: str, topic: str, *, target: str, target_broker_id: str, reason: str
    ) -> broker_pb2.RedirectSubscriberResponse:
        await self._before("redirect")
        reply = await self.link.redirect(
            switchover_id, subscriber_id, topic, target=target, target_broker_id=target_broker_id, reason=reason
        )
        await self._after("redirect")
        return reply

    async def release(self, switchover_id: str, subscriber_id: str, topic: str) -> broker_pb2.ReleaseSubscriberResponse:
        await self._before("release")
        reply = await self.link.release(switchover_id, subscriber_id, topic)
        await self._after("release")
        return reply

    async def set_role(self, role: broker_pb2.BrokerRole.ValueType, epoch: int, peer: str) -> broker_pb2.RoleInfo:
        """A role change by hand (setting up what a scenario's frames say), not recorded."""
        async with open_channel(self.address, cluster=True) as channel:
            info: broker_pb2.RoleInfo = await broker_pb2_grpc.BrokerControlStub(channel).SetRole(
                broker_pb2.SetRoleRequest(role=role, epoch=epoch, peer=peer), timeout=10
            )
            return info

    # ------------------------------------------------------------ inspection --
    async def stats(self) -> broker_pb2.BrokerStats:
        return await stats(self.address)

    async def state(self, subscriber_id: str, topic: str) -> str:
        for sub in (await self.stats()).subscribers:
            if (sub.subscriber_id, sub.topic) == (subscriber_id, topic):
                return state_name(sub.state)
        return "ABSENT"

    async def acked(self, subscriber_id: str, topic: str) -> dict[str, int]:
        """The switch position (what the subscriber acknowledged here), asked directly."""
        async with open_channel(self.address, cluster=True) as channel:
            reply = await broker_pb2_grpc.BrokerControlStub(channel).GetSwitchPosition(
                broker_pb2.GetSwitchPositionRequest(subscriber_id=subscriber_id, topic=topic), timeout=10
            )
            return dict(reply.position.last_seq)

    async def peer_up(self) -> bool:
        return (await self.stats()).peer_up


def _serialize(request: broker_pb2.SubscribeRequest) -> bytes:
    return request.SerializeToString()


@dataclass
class RawSubscriber:
    """A subscriber's raw stream on one broker: reads what arrives, acknowledges when told."""

    call: SubscribeCall
    channel: aio.Channel
    received: dict[str, int] = field(default_factory=dict)
    redirect: broker_pb2.Redirect | None = None
    reader: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, address: str, subscriber_id: str, topic: str, position: dict[str, int] | None = None
    ) -> RawSubscriber:
        channel = open_channel(address, cluster=True)
        call: SubscribeCall = channel.stream_stream(
            "/sokutatsu.broker.v1.Broker/Subscribe",
            request_serializer=_serialize,
            response_deserializer=broker_pb2.SubscribeResponse.FromString,
        )()
        opening = broker_pb2.SubscribeOpen(
            subscription=subscription(subscriber_id, topic),
            position=broker_pb2.Position(last_seq=position or {}),
            credits=1000,
        )
        await call.write(broker_pb2.SubscribeRequest(open=opening))
        first = await call.read()
        assert isinstance(first, broker_pb2.SubscribeResponse), first
        assert first.HasField("subscribed"), first
        sub = cls(call, channel)
        sub.reader = asyncio.create_task(sub._read())
        return sub

    async def _read(self) -> None:
        while True:
            response = await self.call.read()
            if response is aio.EOF:
                return
            assert isinstance(response, broker_pb2.SubscribeResponse)
            if response.HasField("batch"):
                for m in response.batch.messages:
                    self.received[m.publisher_id] = max(self.received.get(m.publisher_id, 0), m.publisher_seq)
            elif response.HasField("redirect"):
                self.redirect = response.redirect

    async def has(self, position: dict[str, int]) -> bool:
        if self.reader is not None and self.reader.done():
            self.reader.result()  # its error, if it failed
        return all(self.received.get(p, 0) >= seq for p, seq in position.items())

    async def ack(self, position: dict[str, int]) -> None:
        await self.call.write(
            broker_pb2.SubscribeRequest(
                credit=broker_pb2.SubscriberCredit(acked=broker_pb2.Position(last_seq=position))
            )
        )

    async def close(self) -> None:
        self.call.cancel()
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
        await self.channel.close()


@dataclass
class RealPair:
    """A started, caught-up pair (broker-a active, broker-b standby) and an end for each."""

    pair: Pair
    active: RealEnd
    standby: RealEnd
    subscribers: list[RawSubscriber] = field(default_factory=list)

    @classmethod
    def of(cls, pair: Pair) -> RealPair:
        def end(process: BrokerProcess, broker_id: str) -> RealEnd:
            link = BrokerLink(BrokerEndpoint(broker_id, process.address), 0.05, 0.5, lambda: None)
            return RealEnd(process, link)

        return cls(pair, end(pair.active, "broker-a"), end(pair.standby, "broker-b"))

    @property
    def brokers_setting(self) -> str:
        return f"broker-a={self.active.address},broker-b={self.standby.address}"

    def end(self, broker_id: str) -> RealEnd:
        return self.active if broker_id == "broker-a" else self.standby

    async def create(self, subscriber_id: str, topic: str) -> None:
        """A durable migrate-mode subscription, made on the active; waits until the standby has it too."""
        async with open_channel(self.active.address, cluster=True) as channel:
            await broker_pb2_grpc.BrokerAdminStub(channel).CreateSubscription(
                broker_pb2.CreateSubscriptionRequest(subscription=subscription(subscriber_id, topic)),
                timeout=10,
            )

        async def on_both() -> bool:
            return await self.standby.state(subscriber_id, topic) == "SHADOW"

        await until(on_both, f"the standby to hold {subscriber_id}'s subscription")

    async def delete(self, end: RealEnd, subscriber_id: str, topic: str) -> None:
        async with open_channel(end.address, cluster=True) as channel:
            await broker_pb2_grpc.BrokerAdminStub(channel).DeleteSubscription(
                broker_pb2.DeleteSubscriptionRequest(subscriber_id=subscriber_id, topic=topic), timeout=10
            )

    async def publish(self, topic: str, counts: dict[str, int]) -> None:
        """Publish ``counts[p]`` messages of each publisher ``p`` (numbered from 1) to both brokers, as the SDK does."""
        for end in (self.active, self.standby):
            async with open_channel(end.address, cluster=True) as channel:
                for publisher, count in counts.items():
                    call, _ = await open_publish(channel, publisher)
                    ack = await publish(call, batch(topic, [message(publisher, seq) for seq in range(1, count + 1)]))
                    assert (ack.acked_through_seq, ack.single_copy) == (count, False), ack
                    call.cancel()

    async def subscribe(
        self, end: RealEnd, subscriber_id: str, topic: str, position: dict[str, int] | None = None
    ) -> RawSubscriber:
        sub = await RawSubscriber.open(end.address, subscriber_id, topic, position)
        self.subscribers.append(sub)
        return sub

    async def acked_at(self, sub: RawSubscriber, end: RealEnd, position: dict[str, int], key: tuple[str, str]) -> None:
        """Receive up to ``position`` on ``sub``, acknowledge it, wait until ``end`` says so."""
        await until(lambda: sub.has(position), f"the subscriber to receive {position}")
        await sub.ack(position)

        async def acked() -> bool:
            return await end.acked(*key) == position

        await until(acked, f"{end.broker_id} to record the acknowledgement {position}")

    async def peer_is(self, end: RealEnd, up: bool) -> None:
        async def heard() -> bool:
            return await end.peer_up() == up

        await until(heard, f"{end.broker_id}'s peer_up to be {up}")

    async def close(self) -> None:
        for sub in self.subscribers:
            await sub.close()
        for end in (self.active, self.standby):
            await end.link.close()
            process = end.process.process
            if process is not None and process.poll() is None:
                end.process.thaw()
                end.process.kill9()  # quicker than a graceful stop; nothing is checked after the test

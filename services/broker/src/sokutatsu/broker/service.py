"""The broker's gRPC servicers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc import aio

from sokutatsu.broker.broker import Broker, PeerServes
from sokutatsu.broker.catalog import TopicSpec
from sokutatsu.broker.delivery_workers import Workers
from sokutatsu.broker.limits import Client, Limits
from sokutatsu.broker.pair import receive_watermarks
from sokutatsu.broker.settings import parse_peer
from sokutatsu.broker.subscribe_many import ManyStream
from sokutatsu.broker.subscription_queue import SubscriptionQueue
from sokutatsu.broker.v1 import broker_pb2, broker_pb2_grpc
from sokutatsu.core.errors import InvalidArgument, echo
from sokutatsu.core.settings import SettingsError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
# WatchStatsRequest.interval_ms at most (one hour): a snapshot stream that never sends is a held call.
MAX_WATCH_INTERVAL_MS = 3_600_000
SERVICE = "sokutatsu.broker.v1.Broker"
# RenewLeaseRequest.lease_ms bounds (the monitor's SOKUTATSU_MONITOR_LEASE_MS is within them).
MIN_LEASE_MS = 10
MAX_LEASE_MS = 60_000


class Undecodable:
    """A frame that could not be parsed; the handler refuses it with INVALID_ARGUMENT."""

    def __init__(self, kind: str, error: str) -> None:
        self.kind = kind
        self.error = error


def _lenient(cls: type[M]) -> Callable[[bytes], M | Undecodable]:
    def parse(raw: bytes) -> M | Undecodable:
        try:
            return cls.FromString(raw)
        except DecodeError as exc:
            return Undecodable(cls.__name__, str(exc))

    return parse


def _serialize(response: bytes | Message) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def _frame(request: Any, cls: type[M]) -> M:
    if isinstance(request, Undecodable):
        raise InvalidArgument(f"a frame could not be decoded as {request.kind}: {request.error}")
    if not isinstance(request, cls):  # pragma: no cover - the deserializer makes only these
        raise InvalidArgument(f"expected a {cls.__name__} frame")
    return request


class DataPlane:
    """``Broker``: the publish and subscribe streams, within the limits per client (limits.py)."""

    def __init__(self, broker: Broker, limits: Limits) -> None:
        self.broker = broker
        self.limits = limits
        # The delivery workers SubscribeMany streams are moved to (None: this process serves them).
        self.workers: Workers | None = None

    async def publish(
        self, requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[broker_pb2.PublishResponse]:
        raw = await anext(requests, None)
        if raw is None:
            return
        first = _frame(raw, broker_pb2.PublishRequest)
        if first.WhichOneof("frame") != "open":
            raise InvalidArgument("the first frame of a Publish stream must be PublishOpen")
        publisher_id = first.open.publisher_id
        state = self.broker.publisher(publisher_id)
        client = self.limits.client(context)
        self.limits.open_stream(client, "Publish")
        self.broker.resume_publisher(publisher_id, state, first.open.first_unacked_seq)
        self.broker.publish_stream_opened(publisher_id)
        # Frames are stored as they arrive (a reader task); acknowledgements follow in order,
        # each once what it covers is durable where it has to be, merged when several are ready.
        acks: asyncio.Queue[tuple[broker_pb2.PublishAck, list[asyncio.Future[None]]] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for raw in requests:
                    batch = self._batch(raw, client)
                    # Over the rate, the next frame is read only later: gRPC flow control holds
                    # the publisher back (and its acknowledgements come later).
                    await self.limits.throttle(client, len(batch.messages))
                    acks.put_nowait(await self.broker.publish(publisher_id, state, batch))
            finally:
                acks.put_nowait(None)

        reader = asyncio.create_task(read(), name=f"publish-{publisher_id}")

        def peer_changed() -> None:
            # Everything stored so far is already in this queue's earlier items; this ack
            # restates it with the new single_copy.
            acks.put_nowait((broker_pb2.PublishAck(acked_through_seq=state.last_seq), []))

        self.broker.peer_listeners.add(peer_changed)
        try:
            yield broker_pb2.PublishResponse(
                opened=broker_pb2.PublishOpened(
                    last_seq=state.last_seq,
                    broker_id=self.broker.settings.instance,
                    max_batch_messages=self.limits.max_batch_messages,
                )
            )
            ended = False
            while not ended:
                item = await acks.get()
                if item is None:
                    break
                merged, waits = item
                while not acks.empty():
                    more = acks.get_nowait()
                    if more is None:
                        ended = True
                        break
                    _merge(merged, more[0])
                    waits += more[1]
                for wait in waits:
                    await wait
                # Whether it may count alone is decided now, as it goes out (pair_state.py, invariant 6).
                await self.broker.mark_alone(merged)
                yield broker_pb2.PublishResponse(ack=merged)
            await reader
        finally:
            # Count first: awaiting below may be cut short by a second cancellation.
            self.broker.publish_stream_closed(publisher_id)
            self.limits.close_stream(client)
            self.broker.peer_listeners.discard(peer_changed)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    def _batch(self, raw: Any, client: Client | None) -> broker_pb2.PublishBatch:
        """A Publish frame after PublishOpen: a batch within the limit."""
        request = _frame(raw, broker_pb2.PublishRequest)
        if request.WhichOneof("frame") != "batch":
            raise InvalidArgument("after PublishOpen, every frame of a Publish stream must be a PublishBatch")
        self.limits.check_batch(client, request.batch)
        return request.batch

    async def subscribe(
        self, requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes | broker_pb2.SubscribeResponse]:
        # An async generator (not context.write): the OpenTelemetry interceptor iterates stream handlers.
        first = await anext(requests, None)
        if first is None:
            return
        request = _frame(first, broker_pb2.SubscribeRequest)
        if request.WhichOneof("frame") != "open":
            raise InvalidArgument("the first frame of a Subscribe stream must be SubscribeOpen")
        release = self.hold(self.limits.client(context), request.open.subscription, "Subscribe")
        try:
            # Closed here, not whenever it is collected: its own clean-up detaches the queue.
            async with contextlib.aclosing(self._subscribe(requests, request)) as responses:
                async for response in responses:
                    yield response
        finally:
            release()

    def hold(self, client: Client | None, subscription: broker_pb2.Subscription, method: str) -> Callable[[], None]:
        """Count a subscription's stream for ``client``'s limits (and a live non-durable subscription,
        while its stream lasts); return the release, to call once when the stream ends (synchronous)."""
        live = (subscription.topic, subscription.subscriber_id) if not subscription.durable else None
        self.limits.open_stream(client, method)
        counted = False
        try:
            if live is not None:
                counted = self.limits.hold_subscription(client, live, self._exists, durable=False)
        except BaseException:
            self.limits.close_stream(client)
            raise

        def release() -> None:
            if live is not None and counted:
                self.limits.release_subscription(live)
            self.limits.close_stream(client)

        return release

    async def subscribe_many(
        self, requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """Many subscriptions on one stream (subscribe_many.py). The stream counts as one for the
        limits per client, and each subscription open on it as one more (and as a Subscribe stream would).

        With delivery workers ready, the stream is answered with one frame naming the worker to open
        it at (``moved_to``, the one with the fewest streams) and ended: the worker relays it back to
        this process (delivery_workers.py), which runs its ManyStream as below."""
        moved = self.workers.pick() if self.workers is not None else None
        if moved is not None:
            yield broker_pb2.SubscribeManyResponse(moved_to=moved).SerializeToString()
            return
        async with contextlib.aclosing(self.many(self.limits.client(context), _many_frames(requests))) as responses:
            async for response in responses:
                yield response

    async def many(
        self, client: Client | None, frames: AsyncIterator[broker_pb2.SubscribeManyRequest]
    ) -> AsyncGenerator[bytes, None]:
        """One SubscribeMany stream of ``client``, its gRPC side here or at a delivery worker: counted
        as one stream for the client's limits while it runs, each subscription on it as ``hold`` says."""
        self.limits.open_stream(client, "SubscribeMany")
        try:
            stream = ManyStream(
                self.broker,
                lambda subscription: self.hold(client, subscription, "SubscribeMany subscription"),
                self.broker.settings.batch_bytes,
            )
            async with contextlib.aclosing(stream.run(frames)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.limits.close_stream(client)

    def _exists(self, subscription: tuple[str, str]) -> bool:
        return _exists(self.broker, subscription)

    async def _subscribe(
        self, requests: AsyncIterator[Any], request: broker_pb2.SubscribeRequest
    ) -> AsyncGenerator[bytes | broker_pb2.SubscribeResponse, None]:
        """The Subscribe stream after its first frame (the caller counts it for the limits)."""
        try:
            queue, generation = await self.broker.attach(request.open)
        except PeerServes as serves:
            yield broker_pb2.SubscribeResponse(redirect=serves.redirect)
            return
        failure: list[BaseException] = []
        reader = asyncio.create_task(self._read_credits(requests, queue, generation, failure), name="subscribe-credits")
        try:
            yield broker_pb2.SubscribeResponse(
                subscribed=broker_pb2.Subscribed(
                    broker_id=self.broker.settings.instance,
                    role=self.broker.role,
                    position=request.open.position,
                )
            )
            while True:
                frame = await queue.next_batch()
                if frame is None:
                    break
                yield frame
            if queue.redirect is not None:
                yield broker_pb2.SubscribeResponse(redirect=queue.redirect)
        finally:
            # Detach first and without awaiting: a second cancellation of this handler must
            # not leave the queue attached to a stream that no longer exists.
            self.broker.detach(queue)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if failure:
            raise failure[0]

    async def _read_credits(
        self, requests: AsyncIterator[Any], queue: SubscriptionQueue, generation: int, failure: list[BaseException]
    ) -> None:
        try:
            async for raw in requests:
                self.broker.credit(queue, _credit_frame(raw))
        except (InvalidArgument, aio.AioRpcError, asyncio.InvalidStateError) as exc:
            failure.append(exc)
        finally:
            queue.stop_stream(generation)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Publish": grpc.stream_stream_rpc_method_handler(
                    self.publish, _lenient(broker_pb2.PublishRequest), _serialize
                ),
                "Subscribe": grpc.stream_stream_rpc_method_handler(
                    self.subscribe, _lenient(broker_pb2.SubscribeRequest), _serialize
                ),
                "SubscribeMany": grpc.stream_stream_rpc_method_handler(
                    self.subscribe_many, _lenient(broker_pb2.SubscribeManyRequest), _serialize
                ),
            },
        )


class Admin(broker_pb2_grpc.BrokerAdminServicer):
    def __init__(
        self, broker: Broker, limits: Limits, stats_interval: float = 1.0, workers: Workers | None = None
    ) -> None:
        self.broker = broker
        self.limits = limits
        self.stats_interval = stats_interval
        self.workers = workers

    def _stats(self) -> broker_pb2.BrokerStats:
        stats = self.broker.stats()
        stats.client_limits.CopyFrom(self.limits.stats())
        if self.workers is not None:
            stats.delivery_workers.extend(self.workers.stats())
        return stats

    def _exists(self, subscription: tuple[str, str]) -> bool:
        return _exists(self.broker, subscription)

    async def CreateTopic(
        self, request: broker_pb2.CreateTopicRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.CreateTopicResponse:
        t = request.topic
        spec = await self.broker.create_topic(TopicSpec(t.name, t.max_count, t.max_bytes, t.total_order))
        return broker_pb2.CreateTopicResponse(topic=_topic_proto(spec))

    async def DeleteTopic(
        self, request: broker_pb2.DeleteTopicRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.DeleteTopicResponse:
        await self.broker.delete_topic(request.name)
        return broker_pb2.DeleteTopicResponse()

    async def ListTopics(
        self, request: broker_pb2.ListTopicsRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.ListTopicsResponse:
        return broker_pb2.ListTopicsResponse(topics=[_topic_proto(t.spec) for t in self.broker.topics.values()])

    async def CreateSubscription(
        self, request: broker_pb2.CreateSubscriptionRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.CreateSubscriptionResponse:
        spec = self.broker.subscription_spec(request.subscription)
        key = (spec.topic, spec.subscriber_id)
        # A durable subscription counts for the client that created it while it exists.
        new = spec.durable and not self._exists(key)
        counted = new and self.limits.hold_subscription(self.limits.client(context), key, self._exists, durable=True)
        try:
            created = await self.broker.create_subscription(spec)
        except BaseException:
            if counted:
                self.limits.release_subscription(key)
            raise
        return broker_pb2.CreateSubscriptionResponse(subscription=created.to_proto())

    async def DeleteSubscription(
        self, request: broker_pb2.DeleteSubscriptionRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.DeleteSubscriptionResponse:
        await self.broker.delete_subscription(request.topic, request.subscriber_id)
        self.limits.release_subscription((request.topic, request.subscriber_id), everyone=True)
        return broker_pb2.DeleteSubscriptionResponse()

    async def ListSubscriptions(
        self, request: broker_pb2.ListSubscriptionsRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.ListSubscriptionsResponse:
        topics = [self.broker.topics[request.topic]] if request.topic in self.broker.topics else []
        if not request.topic:
            topics = list(self.broker.topics.values())
        return broker_pb2.ListSubscriptionsResponse(
            subscriptions=[q.spec.to_proto() for t in topics for q in t.queue_list]
        )

    async def GetStats(
        self, request: broker_pb2.GetStatsRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.BrokerStats:
        await self.broker.confirm_role()
        return self._stats()

    async def WatchStats(
        self, request: broker_pb2.WatchStatsRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[broker_pb2.BrokerStats]:
        interval = request.interval_ms / 1000 if request.interval_ms else self.stats_interval
        if not 0.01 <= interval <= MAX_WATCH_INTERVAL_MS / 1000:
            raise InvalidArgument(
                f"WatchStatsRequest.interval_ms {echo(request.interval_ms)} is outside 10 to {MAX_WATCH_INTERVAL_MS} "
                "(one hour), or 0 for the broker's default"
            )
        while True:
            await self.broker.confirm_role()
            yield self._stats()
            await asyncio.sleep(interval)


def _exists(broker: Broker, subscription: tuple[str, str]) -> bool:
    """Whether the broker holds a subscription of (topic, subscriber id)."""
    topic = broker.topics.get(subscription[0])
    return topic is not None and subscription[1] in topic.queues


def _credit_frame(raw: Any) -> broker_pb2.SubscriberCredit:
    request = _frame(raw, broker_pb2.SubscribeRequest)
    if request.WhichOneof("frame") != "credit":
        raise InvalidArgument("after SubscribeOpen, every frame must be a SubscriberCredit")
    return request.credit


async def _many_frames(requests: AsyncIterator[Any]) -> AsyncIterator[broker_pb2.SubscribeManyRequest]:
    async for raw in requests:
        yield _frame(raw, broker_pb2.SubscribeManyRequest)


def _merge(into: broker_pb2.PublishAck, later: broker_pb2.PublishAck) -> None:
    """Fold a later acknowledgement into an earlier one (acks are cumulative).

    A refusal the later ack has overtaken (the publisher already resent and stored those
    messages) is dropped: it would send the publisher back below what is acknowledged.
    """
    into.acked_through_seq = later.acked_through_seq
    into.duplicates += later.duplicates
    into.dropped += later.dropped
    still = [r for r in [*into.rejected, *later.rejected] if r.first_seq > later.acked_through_seq]
    del into.rejected[:]
    into.rejected.extend(still[:1])


def _topic_proto(spec: TopicSpec) -> broker_pb2.Topic:
    return broker_pb2.Topic(
        name=spec.name, max_count=spec.max_count, max_bytes=spec.max_bytes, total_order=spec.total_order
    )


class Control(broker_pb2_grpc.BrokerControlServicer):
    """``BrokerControl``: roles, the four switchover steps, and the peer's watermark stream."""

    def __init__(self, broker: Broker, stopping: asyncio.Event | None = None) -> None:
        self.broker = broker
        # Set when this broker begins to stop: the peer's watermark stream then ends at once.
        self.stopping = stopping or asyncio.Event()

    async def _role(self) -> broker_pb2.RoleInfo:
        b = self.broker
        await b.confirm_role()
        return broker_pb2.RoleInfo(
            broker_id=b.settings.instance, role=b.role, epoch=b.epoch, peer=b.peer, peer_up=b.peer_up
        )

    async def GetRole(
        self, request: broker_pb2.GetRoleRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.RoleInfo:
        return await self._role()

    async def SetRole(
        self, request: broker_pb2.SetRoleRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.RoleInfo:
        if request.peer:
            parse_peer_or_invalid(request.peer)
        if request.lease_ms and not MIN_LEASE_MS <= request.lease_ms <= MAX_LEASE_MS:
            raise InvalidArgument(
                f"SetRoleRequest.lease_ms {echo(request.lease_ms)} is outside {MIN_LEASE_MS} to {MAX_LEASE_MS} "
                "(0: the broker's peer timeout)"
            )
        self.broker.set_role(request.role, request.epoch, request.peer, request.lease_ms / 1000)
        return await self._role()

    async def GetSwitchPosition(
        self, request: broker_pb2.GetSwitchPositionRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.GetSwitchPositionResponse:
        queue = self.broker.switch_position(request.topic, request.subscriber_id)
        return broker_pb2.GetSwitchPositionResponse(
            position=broker_pb2.Position(last_seq=queue.acked),
            delivered=broker_pb2.Position(last_seq=queue.delivered),
            connected=queue.attached,
        )

    async def AcceptSubscriber(
        self, request: broker_pb2.AcceptSubscriberRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.AcceptSubscriberResponse:
        queue, dropped = await self.broker.accept(request.subscription, dict(request.position.last_seq))
        return broker_pb2.AcceptSubscriberResponse(
            depth=queue.depth, dropped=dropped, floor=broker_pb2.Position(last_seq=queue.floor)
        )

    async def RedirectSubscriber(
        self, request: broker_pb2.RedirectSubscriberRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.RedirectSubscriberResponse:
        if not request.target:
            raise InvalidArgument("RedirectSubscriberRequest.target (host:port of the taking broker) is required")
        parse_peer_or_invalid(request.target)
        redirect = broker_pb2.Redirect(
            target=request.target,
            target_broker_id=request.target_broker_id,
            reason=request.reason,
            switchover_id=request.switchover_id,
        )
        connected = self.broker.redirect_subscriber(request.topic, request.subscriber_id, redirect)
        return broker_pb2.RedirectSubscriberResponse(redirected=connected)

    async def ReleaseSubscriber(
        self, request: broker_pb2.ReleaseSubscriberRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.ReleaseSubscriberResponse:
        return broker_pb2.ReleaseSubscriberResponse(
            cleared=await self.broker.release(request.topic, request.subscriber_id)
        )

    async def RenewLease(
        self, request: broker_pb2.RenewLeaseRequest, context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.RenewLeaseResponse:
        """The monitor's lease (pair_state.py, invariant 6): grant an earlier token, take a new one."""
        if request.grant and not MIN_LEASE_MS <= request.lease_ms <= MAX_LEASE_MS:
            raise InvalidArgument(
                f"RenewLeaseRequest.lease_ms {echo(request.lease_ms)} is outside {MIN_LEASE_MS} to {MAX_LEASE_MS}"
            )
        b = self.broker
        await b.confirm_role()
        pair = b.pair
        granted = bool(request.grant) and pair.grant(request.grant, request.epoch, request.lease_ms / 1000)
        token, peer_up = pair.take_token()
        return broker_pb2.RenewLeaseResponse(
            token=token,
            granted=granted,
            role=b.role,
            epoch=b.epoch,
            peer_up=peer_up,
            remaining_ms=min(round(pair.lease_left * 1000), MAX_LEASE_MS),
            monitored=pair.monitored,
        )

    async def ReplicateWatermarks(
        self, request_iterator: AsyncIterator[broker_pb2.DeliveredWatermarks], context: aio.ServicerContext[Any, Any]
    ) -> broker_pb2.ReplicateWatermarksResponse:
        await receive_watermarks(self.broker, request_iterator, self.stopping)
        return broker_pb2.ReplicateWatermarksResponse()


def parse_peer_or_invalid(address: str) -> str:
    try:
        return parse_peer(address)
    except SettingsError as exc:
        raise InvalidArgument(f"{echo(address)}: {exc}") from None

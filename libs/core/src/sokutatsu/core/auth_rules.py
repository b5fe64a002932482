"""What each RPC needs: full method name -> permission, and where its topic, queue and subscriber are.

Every RPC of every service has a rule here (tests/security/test_auth.py checks that against
the services' descriptors); a method without one is refused when auth is on. For streams whose
topic travels in the frames (``Broker/Publish``: every ``PublishBatch``; ``Broker/Subscribe``:
the ``SubscribeOpen``; ``Broker/SubscribeMany``: each ``SubscribeOpen`` of a frame),
:attr:`Rule.frame` checks each request frame as the servicer reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sokutatsu.core.auth import ADMIN, DEQUEUE, ENQUEUE, PUBLISH, SERVICE, SUBSCRIBE

# The part of a request a rule checks: (permission, topic or queue or None, subscriber id or None).
Check = tuple[str, str | None, str | None]

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class Rule:
    """``permission`` on ``resource(request)``, and ownership of ``subscriber(request)``.

    ``admin_too``: an admin principal passes as well (subscription management). ``frame``: for
    request streams, the checks each frame needs (none for a frame that needs none).
    """

    permission: str
    resource: Callable[[Any], str] | None = None
    subscriber: Callable[[Any], str] | None = None
    admin_too: bool = False
    frame: Callable[[Any], Sequence[Check]] | None = None


def _publish_frame(frame: Any) -> Sequence[Check]:
    which = getattr(frame, "WhichOneof", None)
    if which is None or which("frame") != "batch":
        return ()  # PublishOpen, or a frame the servicer refuses as undecodable
    return ((PUBLISH, frame.batch.topic, None),)


def _subscribe_frame(frame: Any) -> Sequence[Check]:
    which = getattr(frame, "WhichOneof", None)
    if which is None or which("frame") != "open":
        return ()  # credits of the stream's own subscriber
    subscription = frame.open.subscription
    return ((SUBSCRIBE, subscription.topic, subscription.subscriber_id),)


def _subscribe_many_frame(frame: Any) -> Sequence[Check]:
    """Each subscription a SubscribeMany frame opens (credits and closes are for those)."""
    return [check for one in getattr(frame, "frames", ()) for check in _subscribe_frame(one)]


def _service(names: str, *methods: str) -> dict[str, Rule]:
    return {f"/{names}/{m}": Rule(SERVICE) for m in methods}


def _admin(names: str, *methods: str) -> dict[str, Rule]:
    return {f"/{names}/{m}": Rule(ADMIN) for m in methods}


_BROKER = "sokutatsu.broker.v1.Broker"
_BROKER_ADMIN = "sokutatsu.broker.v1.BrokerAdmin"
_MONITOR = "sokutatsu.monitor.v1.Monitor"
_SEQUENCER = "sokutatsu.sequencer.v1.Sequencer"
_QUEUES = "sokutatsu.queuedb.v1.QueueService"

RULES: Mapping[str, Rule] = {
    # Broker: the topic is in the frames.
    f"/{_BROKER}/Publish": Rule(PUBLISH, frame=_publish_frame),
    f"/{_BROKER}/Subscribe": Rule(SUBSCRIBE, frame=_subscribe_frame),
    f"/{_BROKER}/SubscribeMany": Rule(SUBSCRIBE, frame=_subscribe_many_frame),
    **_admin(_BROKER_ADMIN, "CreateTopic", "DeleteTopic", "ListTopics", "ListSubscriptions", "GetStats", "WatchStats"),
    # The SDK's Subscriber creates its own durable subscription.
    f"/{_BROKER_ADMIN}/CreateSubscription": Rule(
        SUBSCRIBE,
        resource=lambda r: r.subscription.topic,
        subscriber=lambda r: r.subscription.subscriber_id,
        admin_too=True,
    ),
    f"/{_BROKER_ADMIN}/DeleteSubscription": Rule(
        SUBSCRIBE, resource=lambda r: r.topic, subscriber=lambda r: r.subscriber_id, admin_too=True
    ),
    **_service(
        "sokutatsu.broker.v1.BrokerControl",
        "GetRole",
        "SetRole",
        "GetSwitchPosition",
        "AcceptSubscriber",
        "RedirectSubscriber",
        "ReleaseSubscriber",
        "ReplicateWatermarks",
        "RenewLease",
    ),
    # Monitor: a subscriber looks up and watches its own assignment; moving one is admin's.
    f"/{_MONITOR}/GetStatus": Rule(ADMIN),
    f"/{_MONITOR}/GetAssignment": Rule(
        SUBSCRIBE, resource=lambda r: r.topic, subscriber=lambda r: r.subscriber_id, admin_too=True
    ),
    f"/{_MONITOR}/WatchAssignments": Rule(SUBSCRIBE, subscriber=lambda r: r.subscriber_id, admin_too=True),
    f"/{_MONITOR}/RequestSwitchover": Rule(ADMIN),
    # Sequencer: publishers stamp; the rest is between sequencers, or status.
    f"/{_SEQUENCER}/Stamp": Rule(PUBLISH),
    **_service(_SEQUENCER, "WatchDistributions", "InstallDistribution", "GetSendRate"),
    f"/{_SEQUENCER}/GetStatus": Rule(ADMIN),
    # Queue-db.
    **_admin(_QUEUES, "CreateQueue", "ListQueues"),
    f"/{_QUEUES}/GetQueue": Rule(DEQUEUE, resource=lambda r: r.name, admin_too=True),
    f"/{_QUEUES}/GetQueueStats": Rule(DEQUEUE, resource=lambda r: r.queue, admin_too=True),
    f"/{_QUEUES}/Enqueue": Rule(ENQUEUE, resource=lambda r: r.queue),
    f"/{_QUEUES}/Dequeue": Rule(DEQUEUE, resource=lambda r: r.queue),
    f"/{_QUEUES}/Ack": Rule(DEQUEUE, resource=lambda r: r.queue),
    f"/{_QUEUES}/Nack": Rule(DEQUEUE, resource=lambda r: r.queue),
    **_service(
        "sokutatsu.queuedb.v1.Transfer",
        "Deliver",
        "DeliverStream",
        "GetRecoveryState",
        "PrepareBatch",
        "FinishPrepared",
        "ListPrepared",
    ),
    # Every service: its process figures (sokutatsu.core.process_stats).
    "/sokutatsu.core.v1.Process/GetProcessStats": Rule(ADMIN),
}


def is_control(method: str) -> bool:
    """A control RPC: between the suite's services only (rule ``service``), so it needs the cluster
    secret whether auth is on or off (:mod:`sokutatsu.core.cluster`)."""
    rule = RULES.get(method)
    return rule is not None and rule.permission == SERVICE


def is_open(method: str) -> bool:
    """Health and reflection answer anyone."""
    return method.startswith(OPEN_PREFIXES)

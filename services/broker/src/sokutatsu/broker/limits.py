"""Limits per client: batch size, open streams, subscriptions, publish rate (docs/security.md).

A *client* is the authenticated principal when auth is on (``SOKUTATSU_AUTH_FILE``): all of its
connections share its limits, and a principal with ``service = true`` (the suite's own links:
monitor, peer broker, sequencer, transfer daemon) is not limited. With auth off a client is one
gRPC connection, named by the peer's ``host:port`` (``context.peer()``); such limits bound what
one connection holds, not what a client opening more connections can hold (the broker-wide
``MAX_COUNT``/``MAX_BYTES`` and auth do that).

* more messages in one ``PublishBatch`` than ``MAX_BATCH_MESSAGES``: ``INVALID_ARGUMENT``
  (bad input: the stream ends, and the SDK never sends one, as the broker tells it its limit);
* one more Publish or Subscribe stream than ``MAX_STREAMS_PER_CLIENT``: ``RESOURCE_EXHAUSTED``;
* one more subscription (``CreateSubscription`` of a new durable one, or a non-durable
  ``Subscribe``) than ``MAX_SUBSCRIPTIONS_PER_CLIENT``: ``RESOURCE_EXHAUSTED``;
* over ``MAX_PUBLISH_RATE`` messages per second: throttled, not refused. The broker reads the
  client's next batch only once a token bucket (one second's worth) allows it, so gRPC flow
  control holds the publisher back and its acknowledgements come later.

Each refusal is counted (``BrokerStats.client_limits``) and logged once per (client, limit),
as auth refusals are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpc import aio

from sokutatsu.broker.settings import BrokerSettings
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.auth import Policy, Principal
from sokutatsu.core.errors import InvalidArgument, ResourceExhausted, echo

log = logging.getLogger(__name__)

# How many distinct (client, limit) refusals are remembered for logging once each.
LOGGED_LIMIT = 10_000

_Context = aio.ServicerContext[Any, Any]
SubscriptionKey = tuple[str, str]  # (topic, subscriber id)


@dataclass(frozen=True)
class Client:
    """Who the limits count for: ``key`` is "principal NAME" or "peer ipv4:HOST:PORT" (one connection).

    ``who`` names it in the log, which says each refusal once per principal or peer host.
    """

    key: str
    who: str
    per_connection: bool


class Bucket:
    """A token bucket of ``rate`` messages per second holding at most one second's worth.

    A batch takes its messages at once and may leave the bucket in debt; whoever takes next
    waits until the debt is paid, so any batch size works and the average rate holds.
    """

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.at = time.monotonic()

    def take(self, count: int) -> float:
        """Take ``count`` messages; return how long to wait before handling them (0 = at once)."""
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= count
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


def _principal(policy: Policy, context: _Context) -> Principal | None:
    """The principal auth admitted for this call (the auth interceptor ran first)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return policy.by_token_value(token.strip())
            return None
    for name in context.auth_context().get("x509_common_name", []):
        principal = policy.by_cn.get(name.decode() if isinstance(name, bytes) else str(name))
        if principal is not None:
            return principal
    return None


def client_of(policy: Policy | None, context: _Context) -> Client | None:
    """Who ``context``'s call counts for under ``policy``; ``None`` for a service principal (not
    limited). A delivery worker finds it this way and hands it to the broker with the stream."""
    if policy is not None:
        principal = _principal(policy, context)
        if principal is not None:
            name = f"principal {principal.name}"
            return None if principal.service else Client(name, name, per_connection=False)
    peer = context.peer()
    return Client(f"peer {peer}", f"peer {peer.rpartition(':')[0] or peer}", per_connection=True)


class Limits:
    """The limits per client of one broker, and their counters."""

    def __init__(self, settings: BrokerSettings, max_frame_bytes: int, policy: Policy | None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.max_batch_messages = settings.max_batch_messages
        self.max_streams = settings.max_streams_per_client
        self.max_subscriptions = settings.max_subscriptions_per_client
        self.max_publish_rate = settings.max_publish_rate
        self.policy = policy
        self.batch_refusals = 0
        self.stream_refusals = 0
        self.subscription_refusals = 0
        self.throttled_batches = 0
        self._streams: dict[str, int] = {}
        # Per client, the durable subscriptions it created (and that still exist when counted)
        # and its live non-durable ones; who holds each.
        self._subscriptions: dict[str, set[SubscriptionKey]] = {}
        self._holder: dict[SubscriptionKey, str] = {}
        self._refs: dict[SubscriptionKey, int] = {}
        self._durable: set[SubscriptionKey] = set()
        self._buckets: dict[str, Bucket] = {}
        self._logged: set[tuple[str, str]] = set()

    # -------------------------------------------------------------- clients --
    def client(self, context: _Context) -> Client | None:
        """Who ``context``'s call counts for; ``None`` for a service principal (not limited)."""
        return client_of(self.policy, context)

    def _refused(self, client: Client | None, limit: str, message: str) -> None:
        key = (client.who if client is not None else "a service principal", limit)
        if key not in self._logged and len(self._logged) < LOGGED_LIMIT:
            self._logged.add(key)
            log.warning("limit: %s refused to %s: %s (%s)", limit, key[0], message, self._totals())

    def _totals(self) -> str:
        return (
            f"refusals so far: batch {self.batch_refusals}, streams {self.stream_refusals}, "
            f"subscriptions {self.subscription_refusals}"
        )

    # -------------------------------------------------------------- batches --
    def check_batch(self, client: Client | None, batch: broker_pb2.PublishBatch) -> None:
        """``INVALID_ARGUMENT`` for a batch holding more than ``MAX_BATCH_MESSAGES``."""
        count = len(batch.messages)
        limit = self.max_batch_messages
        if limit and count > limit:
            self.batch_refusals += 1
            message = (
                f"a PublishBatch of {count} messages is over the broker's maximum of {limit} per batch "
                "(SOKUTATSU_BROKER_MAX_BATCH_MESSAGES); send smaller batches (PublishOpened.max_batch_messages)"
            )
            self._refused(client, "max batch messages", message)
            raise InvalidArgument(message)

    # -------------------------------------------------------------- streams --
    def open_stream(self, client: Client | None, method: str) -> None:
        """Count a new Publish or Subscribe stream; ``RESOURCE_EXHAUSTED`` when the client holds the maximum."""
        if client is None:
            return
        held = self._streams.get(client.key, 0)
        if self.max_streams and held >= self.max_streams:
            self.stream_refusals += 1
            message = (
                f"{client.key} already holds {held} Publish and Subscribe streams, the broker's maximum per client "
                f"(SOKUTATSU_BROKER_MAX_STREAMS_PER_CLIENT); close one before opening another {method} stream"
            )
            self._refused(client, "max streams per client", message)
            raise ResourceExhausted(message)
        self._streams[client.key] = held + 1

    def close_stream(self, client: Client | None) -> None:
        """A stream counted by :meth:`open_stream` ended (synchronous: runs while being cancelled too)."""
        if client is None:
            return
        held = self._streams.get(client.key, 0) - 1
        if held > 0:
            self._streams[client.key] = held
            return
        self._streams.pop(client.key, None)
        if client.per_connection:
            # The connection holds no stream: forget its bucket (a principal's stays).
            self._buckets.pop(client.key, None)

    # -------------------------------------------------------- subscriptions --
    def hold_subscription(
        self,
        client: Client | None,
        subscription: SubscriptionKey,
        exists: Callable[[SubscriptionKey], bool],
        *,
        durable: bool,
    ) -> bool:
        """Count a subscription for ``client``; ``RESOURCE_EXHAUSTED`` when it holds the maximum.

        Returns whether it was counted, so the caller releases it (:meth:`release_subscription`)
        only then. One already counted (the same subscriber reconnecting and taking over its
        stream, or a duplicate the broker then refuses) is no new subscription: it is counted
        once, with a reference per holder. ``exists`` says whether a durable subscription counted
        earlier still exists (it may have been deleted on the peer): those gone are not counted.
        """
        if client is None:
            return False
        if subscription in self._holder:
            self._refs[subscription] += 1
            return True
        held = self._subscriptions.setdefault(client.key, set())
        if self.max_subscriptions and len(held) >= self.max_subscriptions:
            for gone in [s for s in held if s in self._durable and not exists(s)]:
                self.release_subscription(gone, everyone=True)
            held = self._subscriptions.setdefault(client.key, set())
        if self.max_subscriptions and len(held) >= self.max_subscriptions:
            self.subscription_refusals += 1
            message = (
                f"{client.key} already holds {len(held)} subscriptions (durable ones it created and live "
                "non-durable ones), the broker's maximum per client (SOKUTATSU_BROKER_MAX_SUBSCRIPTIONS_PER_CLIENT); "
                f"delete or close one before subscribing {echo(subscription[1])} to {echo(subscription[0])}"
            )
            self._refused(client, "max subscriptions per client", message)
            raise ResourceExhausted(message)
        held.add(subscription)
        self._holder[subscription] = client.key
        self._refs[subscription] = 1
        if durable:
            self._durable.add(subscription)
        return True

    def release_subscription(self, subscription: SubscriptionKey, *, everyone: bool = False) -> None:
        """One holder of a counted subscription let it go (a non-durable stream ended, a create
        failed); with ``everyone``, the subscription is gone (a durable one deleted)."""
        refs = self._refs.get(subscription, 0) - 1
        if refs > 0 and not everyone:
            self._refs[subscription] = refs
            return
        self._refs.pop(subscription, None)
        self._durable.discard(subscription)
        key = self._holder.pop(subscription, None)
        if key is None:
            return
        held = self._subscriptions.get(key)
        if held is not None:
            held.discard(subscription)
            if not held:
                del self._subscriptions[key]

    # ----------------------------------------------------------------- rate --
    async def throttle(self, client: Client | None, count: int) -> None:
        """Wait until ``client`` may publish ``count`` more messages (``MAX_PUBLISH_RATE``)."""
        if client is None or not self.max_publish_rate:
            return
        bucket = self._buckets.get(client.key)
        if bucket is None:
            bucket = self._buckets[client.key] = Bucket(self.max_publish_rate)
        wait = bucket.take(count)
        if wait > 0:
            self.throttled_batches += 1
            key = (client.who, "max publish rate")
            if key not in self._logged and len(self._logged) < LOGGED_LIMIT:
                self._logged.add(key)
                log.warning(
                    "limit: %s publishes over %g messages per second (SOKUTATSU_BROKER_MAX_PUBLISH_RATE); "
                    "its batches are read more slowly",
                    client.who,
                    self.max_publish_rate,
                )
            await asyncio.sleep(wait)

    # ---------------------------------------------------------------- stats --
    def stats(self) -> broker_pb2.ClientLimits:
        return broker_pb2.ClientLimits(
            max_frame_bytes=self.max_frame_bytes,
            max_batch_messages=self.max_batch_messages,
            batch_refusals=self.batch_refusals,
            max_streams_per_client=self.max_streams,
            stream_refusals=self.stream_refusals,
            max_subscriptions_per_client=self.max_subscriptions,
            subscription_refusals=self.subscription_refusals,
            max_publish_rate=self.max_publish_rate,
            throttled_batches=self.throttled_batches,
        )

"""A subscription's definition: who, which topic, which keys, and what to do when it falls behind."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sokutatsu.broker.messages import check_name
from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.core.errors import InvalidArgument, echo

FLOW_TO_DISK = "flow-to-disk"
MIGRATE = "migrate"
_MODES = {
    broker_pb2.OVERFLOW_MODE_FLOW_TO_DISK: FLOW_TO_DISK,
    broker_pb2.OVERFLOW_MODE_MIGRATE: MIGRATE,
}
_MODE_ENUMS = {v: k for k, v in _MODES.items()}
DROP_OLDEST = "drop_oldest"
REFUSE_PUBLISH = "refuse_publish"
_POLICIES = {
    broker_pb2.RETENTION_POLICY_DROP_OLDEST: DROP_OLDEST,
    broker_pb2.RETENTION_POLICY_REFUSE_PUBLISH: REFUSE_PUBLISH,
}
_POLICY_ENUMS = {v: k for k, v in _POLICIES.items()}


@dataclass(frozen=True)
class Retention:
    """Retention limits of a queue (0 = none): bytes of segment files on disk, age in milliseconds,
    and what a queue at its maximum bytes does. The broker's are each queue's default and maximum."""

    max_bytes: int = 0
    max_age_ms: int = 0
    policy: str = DROP_OLDEST

    def to_proto(self) -> broker_pb2.Retention:
        return broker_pb2.Retention(
            max_bytes=self.max_bytes, max_age_ms=self.max_age_ms, policy=_POLICY_ENUMS[self.policy]
        )

    @functools.cached_property
    def proto_fields(self) -> Mapping[str, int]:
        """The fields of :meth:`to_proto`, made once: ``Broker.stats`` passes them for a message field.

        One dict shared by every caller, so nobody may write to it (a ``MappingProxyType`` would say
        so, but a proto's keyword arguments take only a real dict for a message field)."""
        return {"max_bytes": self.max_bytes, "max_age_ms": self.max_age_ms, "policy": _POLICY_ENUMS[self.policy]}

    @property
    def refuses(self) -> bool:
        """Whether a queue under these limits refuses publishes at its maximum bytes."""
        return bool(self.max_bytes) and self.policy == REFUSE_PUBLISH

    def within(self, requested: Retention) -> Retention:
        """The limits in force for a subscription that asked for ``requested`` (0 / "" = these)."""
        return Retention(
            max_bytes=requested.max_bytes or self.max_bytes,
            max_age_ms=requested.max_age_ms or self.max_age_ms,
            policy=requested.policy or self.policy,
        )

    def check(self, requested: broker_pb2.Retention) -> None:
        """INVALID_ARGUMENT when ``requested`` asks for more than these maximums."""
        for asked, maximum, what, setting in (
            (requested.max_bytes, self.max_bytes, "max_bytes", "SOKUTATSU_BROKER_RETENTION_MAX_BYTES"),
            (requested.max_age_ms, self.max_age_ms, "max_age_ms", "SOKUTATSU_BROKER_RETENTION_MAX_AGE"),
        ):
            if maximum and asked > maximum:
                raise InvalidArgument(
                    f"Subscription.retention.{what} {asked} is over the broker's maximum of {maximum} ({setting}); "
                    "ask for less, or 0 for the maximum"
                )


@dataclass(frozen=True)
class SubscriptionSpec:
    subscriber_id: str
    topic: str
    exact_keys: frozenset[str]
    prefixes: tuple[str, ...]
    durable: bool
    mode: str
    budget: int
    # Retention asked for (0 / "" = the broker's; docs/broker.md, Retention and expiry).
    retention: Retention = Retention(policy="")

    @property
    def filtered(self) -> bool:
        return bool(self.exact_keys or self.prefixes)

    @property
    def overflow_mode(self) -> broker_pb2.OverflowMode.ValueType:
        return _MODE_ENUMS[self.mode]

    def matches(self, key: str) -> bool:
        if not self.exact_keys and not self.prefixes:
            return True
        return key in self.exact_keys or (bool(self.prefixes) and key.startswith(self.prefixes))

    @classmethod
    def from_proto(
        cls,
        sub: broker_pb2.Subscription,
        default_mode: str,
        default_budget: int,
        max_budget: int,
        retention_maximums: Retention | None = None,
    ) -> SubscriptionSpec:
        check_name("subscriber id", sub.subscriber_id)
        if retention_maximums is not None:
            retention_maximums.check(sub.retention)
        check_name("topic name", sub.topic)
        for key in [*sub.filter.exact_keys, *sub.filter.prefixes]:
            if not key or len(key) > 256:
                raise InvalidArgument(f"filter entry {echo(key)}: keys and prefixes are 1-256 characters")
        if sub.overflow_mode not in broker_pb2.OverflowMode.values():
            allowed = ", ".join(f"{name} = {number}" for name, number in broker_pb2.OverflowMode.items())
            raise InvalidArgument(
                f"Subscription.overflow_mode {sub.overflow_mode} is not an OverflowMode: use one of {allowed} "
                "(UNSPECIFIED: the broker's SOKUTATSU_BROKER_DEFAULT_MODE)"
            )
        if sub.memory_budget_bytes > max_budget:
            raise InvalidArgument(
                f"Subscription.memory_budget_bytes {echo(sub.memory_budget_bytes)} is over the broker's maximum of "
                f"{max_budget} bytes (SOKUTATSU_BROKER_MAX_QUEUE_BUDGET); ask for at most that, or 0 for the "
                f"broker's default ({default_budget} bytes)"
            )
        return cls(
            subscriber_id=sub.subscriber_id,
            topic=sub.topic,
            exact_keys=frozenset(sub.filter.exact_keys),
            prefixes=tuple(sorted(set(sub.filter.prefixes))),
            durable=sub.durable,
            mode=_MODES.get(sub.overflow_mode, default_mode),
            budget=sub.memory_budget_bytes or default_budget,
            retention=Retention(
                max_bytes=sub.retention.max_bytes,
                max_age_ms=sub.retention.max_age_ms,
                policy=_POLICIES.get(sub.retention.policy, ""),
            ),
        )

    def to_proto(self) -> broker_pb2.Subscription:
        return broker_pb2.Subscription(
            subscriber_id=self.subscriber_id,
            topic=self.topic,
            filter=broker_pb2.KeyFilter(exact_keys=sorted(self.exact_keys), prefixes=list(self.prefixes)),
            durable=self.durable,
            overflow_mode=self.overflow_mode,
            memory_budget_bytes=self.budget,
            retention=broker_pb2.Retention(
                max_bytes=self.retention.max_bytes,
                max_age_ms=self.retention.max_age_ms,
                policy=_POLICY_ENUMS.get(self.retention.policy, broker_pb2.RETENTION_POLICY_UNSPECIFIED),
            ),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "subscriber_id": self.subscriber_id,
            "topic": self.topic,
            "exact_keys": sorted(self.exact_keys),
            "prefixes": list(self.prefixes),
            "durable": self.durable,
            "mode": self.mode,
            "budget": self.budget,
            "retention": {
                "max_bytes": self.retention.max_bytes,
                "max_age_ms": self.retention.max_age_ms,
                "policy": self.retention.policy,
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SubscriptionSpec:
        return cls(
            subscriber_id=data["subscriber_id"],
            topic=data["topic"],
            exact_keys=frozenset(data["exact_keys"]),
            prefixes=tuple(data["prefixes"]),
            durable=data["durable"],
            mode=data["mode"],
            budget=data["budget"],
            retention=Retention(**data.get("retention", {"policy": ""})),
        )

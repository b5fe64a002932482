"""Assignments derived from BrokerStats alone (what a restarted monitor rebuilds)."""

from __future__ import annotations

from sokutatsu.broker.v1 import broker_pb2
from sokutatsu.monitor.assignments import BrokerView, active_broker, derive_assignments

ACTIVE = broker_pb2.BROKER_ROLE_ACTIVE
STANDBY = broker_pb2.BROKER_ROLE_STANDBY
SERVING = broker_pb2.QUEUE_STATE_SERVING
SHADOW = broker_pb2.QUEUE_STATE_SHADOW
AWAY = broker_pb2.QUEUE_STATE_AWAY
LEAVING = broker_pb2.QUEUE_STATE_LEAVING


def _sub(
    subscriber_id: str, state: broker_pb2.QueueState.ValueType, depth: int = 0, connected: bool = True
) -> broker_pb2.SubscriberStats:
    return broker_pb2.SubscriberStats(
        subscriber_id=subscriber_id, topic="prices", state=state, depth=depth, connected=connected
    )


def _view(
    broker_id: str,
    role: broker_pb2.BrokerRole.ValueType,
    subs: list[broker_pb2.SubscriberStats],
    *,
    reachable: bool = True,
    epoch: int = 1,
) -> BrokerView:
    stats = broker_pb2.BrokerStats(broker_id=broker_id, role=role, epoch=epoch, subscribers=subs)
    return BrokerView(broker_id, f"{broker_id}:1", stats, reachable)


def test_normal_and_migrated_subscribers() -> None:
    a = _view("broker-a", ACTIVE, [_sub("fast", SERVING, 3), _sub("slow", AWAY)])
    b = _view("broker-b", STANDBY, [_sub("fast", SHADOW, 3), _sub("slow", SERVING, 90_000)])
    view = derive_assignments([a, b])
    fast, slow = view["fast", "prices"], view["slow", "prices"]
    assert (fast.broker_id, fast.address, fast.migrated, fast.stats.depth) == ("broker-a", "broker-a:1", False, 3)
    assert (slow.broker_id, slow.migrated, slow.stats.depth) == ("broker-b", True, 90_000)


def test_leaving_counts_as_serving_until_the_other_serves() -> None:
    a = _view("broker-a", ACTIVE, [_sub("s", LEAVING)])
    b = _view("broker-b", STANDBY, [_sub("s", SHADOW)])
    assert derive_assignments([a, b])["s", "prices"].broker_id == "broker-a"
    b = _view("broker-b", STANDBY, [_sub("s", SERVING, connected=False)])
    assert derive_assignments([a, b])["s", "prices"].broker_id == "broker-b"


def test_both_serving_between_steps_2_and_3_prefers_the_connected_one() -> None:
    a = _view("broker-a", ACTIVE, [_sub("s", SERVING, connected=True)])
    b = _view("broker-b", STANDBY, [_sub("s", SERVING, connected=False)])
    assert derive_assignments([a, b])["s", "prices"].broker_id == "broker-a"
    assert derive_assignments([b, a])["s", "prices"].broker_id == "broker-a"


def test_a_broker_that_answers_wins_over_the_last_words_of_a_dead_one() -> None:
    """After a failover the old active's last statistics still say SERVING."""
    a = _view("broker-a", ACTIVE, [_sub("s", SERVING)], reachable=False)
    b = _view("broker-b", ACTIVE, [_sub("s", SERVING, connected=False)], epoch=2)
    served = derive_assignments([a, b])["s", "prices"]
    assert served.broker_id == "broker-b"
    assert not served.migrated


def test_until_failover_the_dead_active_still_holds_its_subscribers() -> None:
    a = _view("broker-a", ACTIVE, [_sub("s", SERVING)], reachable=False)
    b = _view("broker-b", STANDBY, [_sub("s", SHADOW)])
    assert derive_assignments([a, b])["s", "prices"].broker_id == "broker-a"


def test_nobody_serving_is_an_empty_assignment() -> None:
    a = _view("broker-a", ACTIVE, [_sub("s", AWAY)])
    b = _view("broker-b", STANDBY, [_sub("s", SHADOW, depth=7)])
    served = derive_assignments([a, b])["s", "prices"]
    assert served.broker_id == ""
    assert not served.migrated
    assert served.stats.depth == 7


def test_a_broker_without_statistics_adds_nothing() -> None:
    a = BrokerView("broker-a", "a:1", None, False)
    b = _view("broker-b", STANDBY, [_sub("s", SERVING)])
    view = derive_assignments([a, b])
    assert list(view) == [("s", "prices")]
    assert view["s", "prices"].migrated


def test_same_subscriber_on_two_topics_is_two_assignments() -> None:
    subs = [_sub("s", SERVING), broker_pb2.SubscriberStats(subscriber_id="s", topic="news", state=SERVING)]
    view = derive_assignments([_view("broker-a", ACTIVE, subs)])
    assert set(view) == {("s", "prices"), ("s", "news")}


def test_the_same_statistics_give_the_same_view() -> None:
    """What a restarted monitor relies on: nothing but the statistics decide."""
    a = _view("broker-a", ACTIVE, [_sub("x", SERVING), _sub("y", AWAY), _sub("z", LEAVING)])
    b = _view("broker-b", STANDBY, [_sub("x", SHADOW), _sub("y", SERVING), _sub("z", SERVING, connected=False)])
    first = {k: v.placement() for k, v in derive_assignments([a, b]).items()}
    again = {k: v.placement() for k, v in derive_assignments([b, a]).items()}
    assert (
        first
        == again
        == {
            ("x", "prices"): ("broker-a", False),
            ("y", "prices"): ("broker-b", True),
            ("z", "prices"): ("broker-b", True),
        }
    )


def test_active_broker_is_the_reachable_one_with_the_highest_epoch() -> None:
    a = _view("broker-a", ACTIVE, [], epoch=1)
    b = _view("broker-b", ACTIVE, [], epoch=3)
    assert active_broker([a, b]) is b
    down = _view("broker-b", ACTIVE, [], epoch=3, reachable=False)
    assert active_broker([a, down]) is a
    assert active_broker([_view("broker-a", STANDBY, [])]) is None

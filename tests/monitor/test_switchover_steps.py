"""The four switchover steps, their timings, spans, aborts and undo, against a model of the pair.

The broker pair is modelled (``tests/monitor/model_pair.py``) after the documented BrokerControl
contract, in memory: this checks the monitor's sequencing (what is called, in which order,
what is undone, what the record says) deterministically, including faults that are hard
to time with real processes (a position that never covers the floor, a taking broker lost
just before the redirect). The same steps against real broker processes are the e2e tests.
"""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from sokutatsu.monitor.switchover import run_switchover
from sokutatsu.monitor.v1 import monitor_pb2
from tests.monitor.model_pair import ModelBroker, rpc_error

KEY = ("desk-1", "prices")


def _record(
    reason: monitor_pb2.SwitchoverReason.ValueType = monitor_pb2.SWITCHOVER_REASON_SLOW,
) -> monitor_pb2.Switchover:
    return monitor_pb2.Switchover(
        id="sw-test",
        subscriber_id=KEY[0],
        topic=KEY[1],
        from_broker_id="broker-a",
        to_broker_id="broker-b",
        reason=reason,
    )


def _steps(record: monitor_pb2.Switchover) -> list[str]:
    return [monitor_pb2.SwitchoverStep.Name(s.step).removeprefix("SWITCHOVER_STEP_") for s in record.steps]


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _pair() -> tuple[ModelBroker, ModelBroker]:
    return ModelBroker("broker-a", "active", "SERVING"), ModelBroker("broker-b", "standby", "SHADOW")


async def test_four_steps_in_order_timed_and_traced(spans: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = spans
    active, standby = _pair()
    record = _record()
    outcome = await run_switchover(record, active, standby, switch_timeout=5, on=provider.get_tracer("t"))
    assert outcome.moved
    assert outcome.pending is None
    assert record.error == ""
    assert record.finished
    assert record.redirected
    assert _steps(record) == ["POSITION", "ACCEPT", "REDIRECT", "RELEASE"]
    assert all(s.started_unix_nano for s in record.steps)
    assert record.total_micros >= sum(s.duration_micros for s in record.steps)
    assert active.calls == ["subscription", "position", "redirect", "release"]
    assert standby.calls == ["accept"]
    assert standby.accepted_positions == [{"pub": 10}]
    assert (active.state, standby.state) == ("AWAY", "SERVING")

    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert set(finished) == {
        "switchover",
        "switchover.position",
        "switchover.accept",
        "switchover.redirect",
        "switchover.release",
    }
    root = finished["switchover"]
    expected = {
        "sokutatsu.subscriber_id": "desk-1",
        "sokutatsu.topic": "prices",
        "sokutatsu.from_broker": "broker-a",
        "sokutatsu.to_broker": "broker-b",
        "sokutatsu.reason": "SLOW",
        "sokutatsu.switchover.id": "sw-test",
    }
    attributes = dict(root.attributes or {})
    assert {k: attributes.get(k) for k in expected} == expected
    for name in ("position", "accept", "redirect", "release"):
        child = finished[f"switchover.{name}"]
        assert child.parent is not None
        assert child.parent.span_id == root.context.span_id


async def test_position_is_asked_again_until_it_covers_the_floor() -> None:
    """Migrate back: the active starts holding at accept time, above what the subscriber acked."""
    standby = ModelBroker("broker-b", "standby", "SERVING", positions=[{"p": 5}, {"p": 7}, {"p": 9}, {"p": 12}])
    active = ModelBroker("broker-a", "active", "AWAY", floor={"p": 9})
    record = _record(monitor_pb2.SWITCHOVER_REASON_RECOVERED)
    outcome = await run_switchover(record, standby, active, switch_timeout=5, poll=0)
    assert outcome.moved
    assert record.error == ""
    assert record.position_retries == 2  # 5 and 7 are below 9; 9 covers it
    assert active.accepted_positions == [{"p": 5}, {"p": 9}]  # accepted again with the covering position
    assert _steps(record) == ["POSITION", "ACCEPT", "REDIRECT", "RELEASE"]
    assert (standby.state, active.state) == ("SHADOW", "SERVING")


async def test_position_that_never_covers_the_floor_aborts_and_undoes(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    standby = ModelBroker("broker-b", "standby", "SERVING", positions=[{"p": 5}])
    active = ModelBroker("broker-a", "active", "AWAY", floor={"p": 9, "q": 1})
    record = _record(monitor_pb2.SWITCHOVER_REASON_RECOVERED)
    outcome = await run_switchover(
        record, standby, active, switch_timeout=0.05, poll=0.001, on=provider.get_tracer("t")
    )
    assert not outcome.moved
    assert "step 2 (accept) aborted" in record.error
    assert "p at 5 < 9, q at 0 < 1" in record.error
    assert "step 2 undone on broker-a" in record.error
    assert record.error.endswith("the subscriber stays on broker-b")
    assert "redirect" not in standby.calls
    assert active.calls == ["accept", "release"]  # the undo
    assert record.position_retries > 0
    assert _steps(record) == ["POSITION", "ACCEPT"]
    root = next(s for s in exporter.get_finished_spans() if s.name == "switchover")
    assert root.status.status_code is StatusCode.ERROR


async def test_unknown_subscription_at_step_1_changes_nothing() -> None:
    active, standby = _pair()
    active.fail["position"] = rpc_error(grpc.StatusCode.NOT_FOUND, "no subscription desk-1 on prices")
    record = _record()
    outcome = await run_switchover(record, active, standby, switch_timeout=5)
    assert not outcome.moved
    assert record.error.startswith("step 1 (position) on broker-a failed: NOT_FOUND: no subscription")
    assert standby.calls == []  # nothing to undo
    assert _steps(record) == ["POSITION"]


async def test_taking_broker_down_at_step_2_keeps_the_subscriber_where_it_is() -> None:
    active, standby = _pair()
    standby.fail["accept"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
    standby.fail["release"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
    record = _record()
    outcome = await run_switchover(record, active, standby, switch_timeout=5)
    assert not outcome.moved
    assert "step 2 (accept) on broker-b failed: UNAVAILABLE" in record.error
    assert "undoing step 2 on broker-b failed too" in record.error
    assert active.state == "SERVING"
    assert "redirect" not in active.calls


async def test_taking_broker_lost_before_the_redirect_aborts() -> None:
    active, standby = _pair()
    record = _record()
    outcome = await run_switchover(record, active, standby, switch_timeout=5, target_up=lambda: False)
    assert not outcome.moved
    assert "broker-b stopped answering before the redirect" in record.error
    assert "redirect" not in active.calls
    assert standby.calls == ["accept", "release"]


async def test_release_refused_while_the_stream_is_still_attached_is_asked_again() -> None:
    active, standby = _pair()
    active.fail["release"] = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "'desk-1' is connected here")
    active.fail_times["release"] = 2
    record = _record()
    outcome = await run_switchover(record, active, standby, switch_timeout=5, poll=0)
    assert outcome.moved
    assert outcome.pending is None
    assert record.error == ""
    assert record.release_retries == 2
    assert active.calls == ["subscription", "position", "redirect", "release", "release", "release"]


async def test_release_refused_while_the_peer_is_unheard_is_left_pending() -> None:
    active, standby = _pair()
    active.fail["release"] = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "peer broker-b is down; keeping the queue")
    record = _record()
    outcome = await run_switchover(record, active, standby, switch_timeout=0.05)
    assert outcome.moved
    assert outcome.pending is not None
    assert (outcome.pending.source_id, outcome.pending.target_id) == ("broker-a", "broker-b")
    assert dict(outcome.pending.position.last_seq) == {"pub": 10}
    assert "step 4 (release) on broker-a failed: FAILED_PRECONDITION" in record.error
    assert _steps(record) == ["POSITION", "ACCEPT", "REDIRECT", "RELEASE"]


async def test_serving_broker_lost_at_the_redirect_leaves_the_subscriber_to_the_taker() -> None:
    active, standby = _pair()
    active.fail["redirect"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset")
    record = _record()
    outcome = await run_switchover(record, active, standby, switch_timeout=5)
    assert not outcome.moved
    assert "broker-b keeps the subscriber" in record.error
    assert standby.calls == ["accept"]  # not undone: the subscriber will reconnect there


async def test_redirect_refused_is_undone() -> None:
    active, standby = _pair()
    active.fail["redirect"] = rpc_error(grpc.StatusCode.NOT_FOUND, "no subscription")
    record = _record()
    outcome = await run_switchover(record, active, standby, switch_timeout=5)
    assert not outcome.moved
    assert standby.calls == ["accept", "release"]
    assert record.error.endswith("the subscriber stays on broker-a")

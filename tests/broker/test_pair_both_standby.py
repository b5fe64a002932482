"""Invariant 2's third way back to active (pair_state.py ``lead_both_standby``: of two standbys of a pair
without a monitor that hear each other, the caught-up one leads), against the schedules a review of its
first version found: two in-process brokers exchanging their real frames (``_Link``), and the state alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sokutatsu.broker.pair_state import ACTIVE, STANDBY, PairState
from sokutatsu.broker.v1 import broker_pb2
from tests.broker.test_subscription_lists import _Link, _pair, _publish, _restarted

DESK = broker_pb2.Subscription(subscriber_id="desk", topic="orders", durable=True)


async def test_a_restarted_broker_does_not_lead_before_it_has_the_peers_new_subscription(tmp_path: Path) -> None:
    """A review's schedule: A active, B standby. A is killed; while it is down a client creates "desk" on B
    and B alone acknowledges a publisher's 1-3 on it. A restarts as standby. B's first frame on its new
    stream carries its holdings and its list, and says caught_up=False (it has no holdings of A's session
    yet). The first version judged A caught up before adopting "desk" and made it active: it served desk
    empty, and its watermark trimmed B's copy: 1-3 lost, untold. Decided after the whole frame, A is
    behind (its new copy lacks what B holds), and B, caught up once it has A's holdings, leads."""
    async with _pair(tmp_path, peer_timeout_ms="300") as (active, standby, *_):
        await asyncio.sleep(0.5)  # A is gone: B no longer hears it
        assert not standby.peer_up
        await standby.create_subscription(standby.subscription_spec(DESK))
        await _publish(standby, 1, 3, "orders")  # acknowledged by B alone
        assert standby.queue("orders", "desk").depth == 3
        again = await _restarted(active, tmp_path)
        assert again.role == STANDBY
        from_again, to_again = _Link(again, standby), _Link(standby, again)
        try:
            await from_again.step()  # B hears A (A's session 0 frame)
            await to_again.step()  # B's first frame on its new stream: holdings + list
            desk = again.queue("orders", "desk")
            assert desk.behind
            for _ in range(3):
                await from_again.step()
                await to_again.step()
            assert (again.role, standby.role) == (STANDBY, ACTIVE)
            assert standby.queue("orders", "desk").depth == 3
        finally:
            await from_again.close()
            await to_again.close()
            await again.close()


async def test_a_standby_that_its_peer_does_not_hear_does_not_lead(tmp_path: Path) -> None:
    """A review's schedule: both standby and both behind (A restarted; B lacks some of q), hearing each
    other. The A->B direction is cut: B's frames say not_hearing_you. The first version made A (the lower
    id) lead on those frames after BOTH_BEHIND_SECONDS, and a subscriber that came to B (which hears no one)
    promoted B: A kept its role (same epoch, lower id), two actives for as long as the cut lasted. A peer
    that does not hear this broker is never led over: B alone is active."""
    idle = broker_pb2.Subscription(subscriber_id="idle", topic="prices", durable=True)
    async with _pair(tmp_path, peer_timeout_ms="300") as (active, standby, to_standby, to_active):
        for broker in (active, standby):
            await _publish(broker, 1, 3)
        for _ in range(3):
            await to_standby.step()
            await to_active.step()
        standby.queue("prices", "idle").may_lack("q", 5)  # B lacks some of q (e.g. its own earlier crash)
        await asyncio.sleep(0.5)  # A killed
        again = await _restarted(active, tmp_path)
        from_again, to_again = _Link(again, standby), _Link(standby, again)
        try:
            for _ in range(4):
                await from_again.step()
                await to_again.step()
            assert (again.role, standby.role) == (STANDBY, STANDBY)
            await asyncio.sleep(0.5)  # A->B cut: B stops hearing A; A still hears B
            assert not standby.peer_up
            again.pair.both_standby_since -= 11  # BOTH_BEHIND_SECONDS have passed
            await to_again.step()
            assert (again.role, not again.pair.peer_hears_me) == (STANDBY, True)
            attached, _ = await standby.attach(broker_pb2.SubscribeOpen(subscription=idle, credits=10))
            for _ in range(3):
                await to_again.step()
            assert (again.role, standby.role) == (STANDBY, ACTIVE)
            standby.detach(attached)
        finally:
            await from_again.close()
            await to_again.close()
            await again.close()


def test_a_silence_starts_the_wait_of_two_standbys_behind_again(tmp_path: Path) -> None:
    """A review's schedule: two standbys both behind wait BOTH_BEHIND_SECONDS before the lower id leads.
    The first version kept counting across a minute without frames and led on the first frame after it,
    before the new session's holdings; the wait now starts again with each session, and leading needs the
    peer's holdings of its current session."""
    now = [100.0]
    state = PairState.load(
        instance="broker-a",
        role="standby",
        peer="x:1",
        peer_link="",
        peer_timeout=0.3,
        state_dir=tmp_path,
        clock=lambda: now[0],
    )
    state.heard(1, True)
    assert not state.lead_both_standby("broker-b", STANDBY, 0, False, lambda: False)  # both behind: wait
    now[0] += 60  # no frame for a minute (the link down both ways)
    assert not state.peer_up
    state.heard(2, False)  # the first frame after the silence: a new session, no holdings yet
    assert not state.lead_both_standby("broker-b", STANDBY, 0, False, lambda: False)
    state.heard(2, True)  # the holdings
    assert not state.lead_both_standby("broker-b", STANDBY, 0, False, lambda: False)  # the wait starts again
    waited = 0.0
    while not state.lead_both_standby("broker-b", STANDBY, 0, False, lambda: False):
        now[0] += 0.1  # a frame every 0.1 s
        waited += 0.1
        state.heard(2, False)
        assert waited < 11
    assert waited >= 10
    assert (state.role, state.epoch) == (ACTIVE, 1)

"""A sequencer that is not the leader killed with -9 and restarted (issue #21, item 1).

While it is down, receivers stop at its domain's next slot (total order cannot be decided
without it). Once it serves again they continue when it shows a number stamped with the
distribution the others moved on to. That used to wait for the leader's next install to get
through, which the leader's channel to the dead peer held back for seconds (its reconnect
back-off grew while the peer was down). The assertion is about behaviour, not wall time: the
restarted sequencer holds the distribution in force at the leader before the leader has
announced two more.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

import pytest

from sokutatsu.client import OrderedPublisher
from tests.broker.fix_broker import Pair, until
from tests.sequencer.fix_sequencer import GroupFactory, SequencerProcess
from tests.sequencer.test_ordered import TOPIC, _check_same_order, _wait_all, ordered_group

pytestmark = pytest.mark.timeout(240)


async def _keep_sending(
    process: SequencerProcess, pair: Pair, name: str, stop: asyncio.Event, numbers: list[int]
) -> None:
    rng = random.Random(name)  # noqa: S311 - reproducible test data
    async with OrderedPublisher(process.address, pair.addresses, TOPIC, domain=process.domain, client_id=name) as pub:
        while not stop.is_set():
            futures = [
                pub.publish_nowait("k", f"{name}:{len(numbers) + i}".encode()) for i in range(rng.randrange(1, 20))
            ]
            stamps = await asyncio.wait_for(asyncio.gather(*futures), 60)
            numbers.extend(s.seq for s in stamps)
            await asyncio.sleep(0.02)


async def _answers(process: SequencerProcess) -> bool:
    with contextlib.suppress(Exception):
        await process.status()
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("outages", [(1.5, 3.0, 4.5)])
async def test_a_restarted_non_leader_holds_the_leaders_distribution_before_the_leader_moves_on_twice(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory, outages: tuple[float, ...]
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a", "b", "c"], pair.addresses, TOPIC)
    leader, victim = group["a"], group["b"]
    stop = asyncio.Event()
    sent: dict[str, list[int]] = {d: [] for d in group}
    lag: list[tuple[int, int, int]] = []  # (leader's id when b answered, b's first id >= it, leader's id then)
    async with ordered_group(pair, group) as readers:
        feeds = [asyncio.create_task(_keep_sending(p, pair, f"{d}0", stop, sent[d])) for d, p in group.items()]
        await until(lambda: _installed_at_least(victim, 2), "a second distribution on b")
        for outage in outages:
            victim.kill9()
            # Down long enough for the leader to try (and fail) several installs on it.
            await asyncio.sleep(outage)
            victim.start()
            await until(lambda: _answers(victim), "the restarted sequencer to answer", limit=60)
            in_force = (await leader.status()).distribution.id
            seen = in_force
            for _ in range(3000):  # 60 s only stops a hung test
                seen = max(seen, (await leader.status()).distribution.id)
                held = (await victim.status()).distribution.id
                if held >= in_force:
                    break
                await asyncio.sleep(0.02)
            lag.append((in_force, held, seen))
        stop.set()
        await asyncio.gather(*feeds)
        await _wait_all(readers, sum(len(v) for v in sent.values()), group)
    _check_same_order(readers, {d: sorted(v) for d, v in sent.items()})
    # Each time, b held the leader's distribution before the leader announced two more.
    assert all(held >= in_force and seen <= in_force + 1 for in_force, held, seen in lag), (lag, leader.log()[-4000:])


async def _installed_at_least(process: SequencerProcess, distribution_id: int) -> bool:
    return (await process.status()).distribution.id >= distribution_id

"""A durable ordered subscription created before the group's first distribution and attached
for the first time after messages were published (docs/sequencer.md, "When to subscribe"):
it receives the backlog and delivers the same order as a subscriber that was there all along."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest

from sokutatsu.client import OrderedSubscriber
from sokutatsu.sequencer.server import create_total_order_topic
from tests.broker.fix_broker import Pair
from tests.sequencer.fix_sequencer import GroupFactory
from tests.sequencer.test_ordered import TOPIC, _check_same_order, _feed, _wait_all, ordered_group

pytestmark = pytest.mark.timeout(180)


async def test_a_durable_subscription_created_early_and_attached_later_delivers_the_same_order(
    pair_factory: Callable[..., Awaitable[Pair]], sequencer_group: GroupFactory
) -> None:
    pair = await pair_factory()
    group = sequencer_group(["a", "b", "c"], pair.addresses, TOPIC)
    await create_total_order_topic(pair.addresses, TOPIC)
    early = OrderedSubscriber(pair.addresses, "attached-later", TOPIC)
    await early.start()  # creates the durable subscription on both brokers
    await early.close()
    async with ordered_group(pair, group, readers=1) as readers:
        feeds = [_feed(group, pair, d, f"{d}0", 300, random.Random(d)) for d in ("a", "b", "c")]  # noqa: S311
        a, b, c = await asyncio.gather(*feeds)
        total = len(a) + len(b) + len(c)
        await _wait_all(readers, total, group)
        got: list[tuple[str, int]] = []
        async with OrderedSubscriber(pair.addresses, "attached-later", TOPIC) as late:

            async def read() -> None:
                async for message in late:
                    got.append((message.stamp.domain, message.stamp.seq))
                    if len(got) == total:
                        return

            await asyncio.wait_for(read(), 60)  # only stops a hung test
    _check_same_order(readers, {"a": sorted(a), "b": sorted(b), "c": sorted(c)})
    assert got == readers[0].got

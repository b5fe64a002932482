"""The sequencer benchmark's machinery on a tiny real run: every service its own process, the
stamp counts add up, and both ordered readers got every message in one order. The figures
themselves come from `make bench`."""

from __future__ import annotations

import pytest

from sokutatsu.bench.sequencer import DOMAINS, SequencerBenchConfig, run

pytestmark = pytest.mark.timeout(240)
TINY = SequencerBenchConfig(stamp_seconds=0.3, ranges=(1, 50), window=4, messages=400, readers=2)


async def test_a_tiny_run_stamps_and_delivers_everything_in_one_order() -> None:
    result = await run(TINY)
    rows = result["stamps"]["rows"]
    assert [(r["range"], r["fsync"]) for r in rows] == [(1, False), (50, False), (50, True)]
    for row in rows:
        assert row["requests"] > 0
        assert row["numbers"] == row["requests"] * row["range"]
    ordered = result["ordered"]
    assert ordered["messages"] == TINY.messages * len(DOMAINS)
    assert ordered["same_order"]
    assert ordered["complete"]
    assert len(ordered["per_reader_msgs_per_s"]) == TINY.readers
    assert result["machine"]["cpus"]

"""The gRPC cost benchmark's machinery on a tiny real run: a bare server per variant, alternating; the
figures themselves come from `sokutatsu bench grpc-cost`."""

from __future__ import annotations

import asyncio

import pytest

from sokutatsu.bench.grpc_cost import VARIANTS, Config, markdown, run

pytestmark = pytest.mark.timeout(120)


def test_each_variant_s_server_answers_and_its_cpu_is_counted() -> None:
    result = asyncio.run(run(Config(rate=200, seconds=1.0, rounds=1)))
    assert set(result["turns"]) == set(VARIANTS)
    for name, (turn,) in result["turns"].items():
        assert turn["experiments"] == VARIANTS[name]
        # About 200 a second for a second; the server answered each (none is lost on one stream).
        assert 100 <= turn["pairs"] <= 300
        assert turn["cpu_s"] > 0
    text = markdown(result)
    assert "| services: `-event_engine_listener,-event_engine_client` |" in text
    assert "| grpc-defaults: `(empty: gRPC's defaults)` |" in text

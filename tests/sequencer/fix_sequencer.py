"""Real sequencer processes for tests (``sokutatsu.harness.sequencer``, with the tests' quicker
settings): one per domain on free ports chosen before the start (peers name each other by
address, so a restarted sequencer comes back on its port), kill -9 and restart on the same journal."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from sokutatsu.harness import sequencer, settings

# Quicker than the defaults so tests wait less; the logic is the same.
TEST_SETTINGS = settings(sequencer.PREFIX, distribution_interval_ms="300", share_check_ms="50", fill_after_ms="500")


class SequencerProcess(sequencer.SequencerProcess):
    """The harness's sequencer with the tests' quicker settings (``env`` overrides them)."""

    def __init__(self, domain: str, folder: Path, address: str, env: Mapping[str, str] | None = None) -> None:
        super().__init__(domain, folder, address, {**TEST_SETTINGS, **(env or {})})


GroupFactory = Callable[..., dict[str, SequencerProcess]]


@pytest.fixture
def sequencer_group(tmp_path: Path) -> Iterator[GroupFactory]:
    """``sequencer_group(["a", "b", "c"], brokers, topic, **settings)``: one sequencer per domain,
    the first one the leader, each knowing the others; not started (start the others before
    the leader, or together). Settings are ``SOKUTATSU_SEQUENCER_*`` without the prefix."""
    made: list[dict[str, SequencerProcess]] = []

    def make(domains: list[str], brokers: list[str], topic: str, **values: str) -> dict[str, SequencerProcess]:
        made.append(sequencer.sequencer_group(tmp_path, domains, brokers, topic, kind=SequencerProcess, **values))
        return made[-1]

    yield make
    for group in made:
        sequencer.stop_group(group)

"""Real sequencer processes for tests: one per domain on fixed free ports (peers name each
other by address, so a restarted sequencer must come back on its port), kill -9 and restart
on the same journal."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from grpc import aio

from sokutatsu.core.embedded_pg import free_port
from sokutatsu.harness import ServiceProcess
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc

# Quicker than the defaults so tests wait less; the logic is the same.
TEST_SETTINGS = {
    "SOKUTATSU_SEQUENCER_DISTRIBUTION_INTERVAL_MS": "300",
    "SOKUTATSU_SEQUENCER_SHARE_CHECK_MS": "50",
    "SOKUTATSU_SEQUENCER_FILL_AFTER_MS": "500",
    "SOKUTATSU_GRACE_SECONDS": "1",
}


class SequencerProcess(ServiceProcess):
    """One domain's sequencer on a fixed address (its peers name it by address), killed and
    started again on the same journal."""

    def __init__(self, domain: str, folder: Path, address: str, env: dict[str, str]) -> None:
        super().__init__(
            "sokutatsu.sequencer",
            folder,
            {
                **TEST_SETTINGS,
                "SOKUTATSU_SEQUENCER_LISTEN": address,
                "SOKUTATSU_SEQUENCER_INSTANCE": f"seq-{domain}",
                "SOKUTATSU_SEQUENCER_DOMAIN": domain,
                "SOKUTATSU_SEQUENCER_STATE_DIR": str(folder / "state"),
                # A test session killed by its timeout takes its sequencers with it.
                "SOKUTATSU_PARENT_PID": str(os.getpid()),
                **env,
            },
        )
        self.domain = domain
        self.address = address

    def log(self) -> str:
        return self.output()

    async def status(self) -> sequencer_pb2.SequencerStatus:
        async with aio.insecure_channel(self.address) as channel:
            result: sequencer_pb2.SequencerStatus = await sequencer_pb2_grpc.SequencerStub(channel).GetStatus(
                sequencer_pb2.GetStatusRequest(), timeout=10
            )
            return result


GroupFactory = Callable[..., dict[str, SequencerProcess]]


@pytest.fixture
def sequencer_group(tmp_path: Path) -> Iterator[GroupFactory]:
    """``sequencer_group(["a", "b", "c"], brokers, topic, **settings)``: one sequencer per domain,
    the first one the leader, each knowing the others; not started (start the others before
    the leader, or together). Settings are ``SOKUTATSU_SEQUENCER_*`` without the prefix."""
    made: list[SequencerProcess] = []

    def make(domains: list[str], brokers: list[str], topic: str, **settings: str) -> dict[str, SequencerProcess]:
        ports = {d: f"127.0.0.1:{free_port()}" for d in domains}
        group = {}
        for i, domain in enumerate(domains):
            folder = tmp_path / f"seq-{domain}"
            folder.mkdir()
            peers = ",".join(f"{d}={a}" for d, a in ports.items() if d != domain)
            env = {
                "SOKUTATSU_SEQUENCER_PEERS": peers,
                "SOKUTATSU_SEQUENCER_BROKERS": ",".join(brokers),
                "SOKUTATSU_SEQUENCER_TOPIC": topic,
                "SOKUTATSU_SEQUENCER_LEADER": "true" if i == 0 else "false",
                **{f"SOKUTATSU_SEQUENCER_{k.upper()}": v for k, v in settings.items()},
            }
            process = SequencerProcess(domain, folder, ports[domain], env)
            made.append(process)
            group[domain] = process
        return group

    yield make
    for process in made:
        process.stop()

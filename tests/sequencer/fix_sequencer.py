"""Real sequencer processes for tests: one per domain on fixed free ports (peers name each
other by address, so a restarted sequencer must come back on its port), kill -9 and restart
on the same journal."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from grpc import aio

from sokutatsu.core.embedded_pg import free_port
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc
from tests.helpers import ensure_stopped, start_service

# Quicker than the defaults so tests wait less; the logic is the same.
TEST_SETTINGS = {
    "SOKUTATSU_SEQUENCER_DISTRIBUTION_INTERVAL_MS": "300",
    "SOKUTATSU_SEQUENCER_SHARE_CHECK_MS": "50",
    "SOKUTATSU_SEQUENCER_FILL_AFTER_MS": "500",
    "SOKUTATSU_GRACE_SECONDS": "1",
}


@dataclass
class SequencerProcess:
    domain: str
    folder: Path
    address: str
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[str] | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        run = self.folder / f"run{self.starts}"  # one log per start, kept for the failure message
        run.mkdir()
        env = {
            **TEST_SETTINGS,
            "SOKUTATSU_SEQUENCER_LISTEN": self.address,
            "SOKUTATSU_SEQUENCER_INSTANCE": f"seq-{self.domain}",
            "SOKUTATSU_SEQUENCER_DOMAIN": self.domain,
            "SOKUTATSU_SEQUENCER_STATE_DIR": str(self.folder / "state"),
            # A test session killed by its timeout takes its sequencers with it.
            "SOKUTATSU_PARENT_PID": str(os.getpid()),
            **self.env,
        }
        self.process = start_service("sokutatsu.sequencer", env, run).process

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.folder.glob("run*/*.log")))

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            ensure_stopped(self.process)

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

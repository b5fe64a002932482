"""Real sequencer processes for tests: one per domain on fixed free ports (peers name each
other by address, so a restarted sequencer must come back on its port), kill -9 and restart
on the same journal."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from grpc import aio

from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc

START_LIMIT_SECONDS = 30.0

# Quicker than the defaults so tests wait less; the logic is the same.
TEST_SETTINGS = {
    "SOKUTATSU_SEQUENCER_DISTRIBUTION_INTERVAL_MS": "300",
    "SOKUTATSU_SEQUENCER_SHARE_CHECK_MS": "50",
    "SOKUTATSU_SEQUENCER_FILL_AFTER_MS": "500",
    "SOKUTATSU_GRACE_SECONDS": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class SequencerProcess:
    domain: str
    folder: Path
    address: str
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        announce = self.folder / "announce.json"
        announce.unlink(missing_ok=True)
        self.starts += 1
        log = (self.folder / f"sequencer-{self.starts}.log").open("wb")
        env = {
            **os.environ,
            **TEST_SETTINGS,
            "SOKUTATSU_SEQUENCER_LISTEN": self.address,
            "SOKUTATSU_SEQUENCER_INSTANCE": f"seq-{self.domain}",
            "SOKUTATSU_SEQUENCER_DOMAIN": self.domain,
            "SOKUTATSU_SEQUENCER_STATE_DIR": str(self.folder / "state"),
            "SOKUTATSU_ANNOUNCE_FILE": str(announce),
            # A test session killed by its timeout takes its sequencers with it.
            "SOKUTATSU_PARENT_PID": str(os.getpid()),
            **self.env,
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sokutatsu.sequencer"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        deadline = time.monotonic() + START_LIMIT_SECONDS
        while not announce.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"sequencer {self.domain} did not start: {self.log()}")
            time.sleep(0.02)

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.folder.glob("sequencer-*.log")))

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

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

"""Sequencer processes and a total-order group of them.

The members of a group name each other by address, so each gets a free port chosen before any
starts, and a member killed comes back on its port and its journal. The followers start before
the leader (it installs the first distribution on them); :func:`start_group` does that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from sokutatsu.core.embedded_pg import free_port
from sokutatsu.core.tls import open_channel
from sokutatsu.harness.process import START_LIMIT_SECONDS, ServiceProcess, settings, until
from sokutatsu.sequencer.v1 import sequencer_pb2, sequencer_pb2_grpc

PREFIX = "SOKUTATSU_SEQUENCER_"
S = TypeVar("S", bound="SequencerProcess")


class SequencerProcess(ServiceProcess):
    """One domain's sequencer on ``address`` (its peers name it by address; ``127.0.0.1:0`` for one
    nobody names), with its journal under ``folder/state``; killed and started again on the same
    journal. ``env`` adds to (or overrides) those settings."""

    def __init__(self, domain: str, folder: Path, address: str, env: Mapping[str, str] | None = None) -> None:
        defaults = settings(
            PREFIX, listen=address, instance=f"seq-{domain}", domain=domain, state_dir=str(folder / "state")
        )
        super().__init__("sokutatsu.sequencer", folder, {**defaults, "SOKUTATSU_GRACE_SECONDS": "1", **(env or {})})
        self.domain = domain
        self.address = address

    @property
    def leader(self) -> bool:
        return self.env.get(f"{PREFIX}LEADER") == "true"

    def log(self) -> str:
        return self.output()

    async def status(self) -> sequencer_pb2.SequencerStatus:
        async with open_channel(self.address) as channel:
            result: sequencer_pb2.SequencerStatus = await sequencer_pb2_grpc.SequencerStub(channel).GetStatus(
                sequencer_pb2.GetStatusRequest(), timeout=10
            )
            return result

    async def installed(self) -> bool:
        """Whether it has a distribution (it stamps only then)."""
        return bool((await self.status()).distribution.id)

    async def wait_installed(self, limit: float = START_LIMIT_SECONDS) -> None:
        await until(self.installed, f"seq-{self.domain} to install a distribution", limit=limit)


def sequencer_group(
    folder: Path,
    domains: Sequence[str],
    brokers: Sequence[str],
    topic: str,
    *,
    kind: type[S] = SequencerProcess,  # type: ignore[assignment]
    **values: str,
) -> dict[str, S]:
    """One sequencer per domain (under ``folder/seq-<domain>``, not started), the first one the
    leader, each knowing the others and publishing on ``brokers``; ``values`` are more
    ``SOKUTATSU_SEQUENCER_*`` settings (without the prefix). ``kind``: a subclass to make them as."""
    ports: set[int] = set()
    while len(ports) < len(domains):
        ports.add(free_port())
    addresses = {d: f"127.0.0.1:{p}" for d, p in zip(domains, sorted(ports), strict=True)}
    group = {}
    for i, domain in enumerate(domains):
        env = settings(
            PREFIX,
            peers=",".join(f"{d}={a}" for d, a in addresses.items() if d != domain),
            brokers=",".join(brokers),
            topic=topic,
            leader="true" if i == 0 else "false",
        )
        env.update(settings(PREFIX, **values))
        group[domain] = kind(domain, folder / f"seq-{domain}", addresses[domain], env)
    return group


def start_order(group: Mapping[str, S]) -> list[S]:
    """The followers, then the leader (it installs the first distribution on them)."""
    return sorted(group.values(), key=lambda m: m.leader)


def start_group(group: Mapping[str, SequencerProcess]) -> None:
    for member in start_order(group):
        member.start()


def stop_group(group: Mapping[str, SequencerProcess]) -> None:
    for member in group.values():
        member.stop()

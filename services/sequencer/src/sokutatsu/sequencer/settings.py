"""Sequencer settings (environment variables ``SOKUTATSU_SEQUENCER_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sokutatsu.core.runtime_settings import ServiceSettings
from sokutatsu.core.settings import parse_address, parse_name, setting


@dataclass(frozen=True)
class SequencerSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_SEQUENCER_"

    listen: str = setting(
        "LISTEN", "127.0.0.1:7101", "host:port to serve gRPC on (port 0 = any free port).", parse_address
    )
    instance: str = setting("INSTANCE", "seq-a", "Name of this sequencer in logs and traces.", parse_name)

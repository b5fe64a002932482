"""Broker settings (environment variables ``SOKUTATSU_BROKER_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sokutatsu.core.runtime_settings import ServiceSettings
from sokutatsu.core.settings import parse_address, parse_name, setting


@dataclass(frozen=True)
class BrokerSettings(ServiceSettings):
    env_prefix: ClassVar[str] = "SOKUTATSU_BROKER_"

    listen: str = setting(
        "LISTEN", "127.0.0.1:7201", "host:port to serve gRPC on (port 0 = any free port).", parse_address
    )
    instance: str = setting("INSTANCE", "broker-a", "Broker id, unique within the pair.", parse_name)

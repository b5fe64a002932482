"""What the monitor's keepers (``roles.RoleKeeper``, ``releases.ReleaseKeeper``) may use of the
monitor that owns them: a narrow interface, so they never import ``monitor.py``, which builds them.

The monitor (``monitor.Monitor``) is the one implementation; a keeper reads its broker links,
settings, running and recent switchovers, starts tasks through it (so their errors are logged
and they end with it), and tells its watchers when something changed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from sokutatsu.monitor.assignments import SubKey
from sokutatsu.monitor.broker_link import BrokerLink
from sokutatsu.monitor.pair import Member
from sokutatsu.monitor.settings import MonitorSettings
from sokutatsu.monitor.v1 import monitor_pb2

T = TypeVar("T")


class KeeperHost(Protocol):
    @property
    def settings(self) -> MonitorSettings: ...

    @property
    def links(self) -> Mapping[str, BrokerLink]:
        """The broker links, by broker id."""

    @property
    def running(self) -> Mapping[SubKey, monitor_pb2.Switchover]:
        """The switchovers under way, by subscription."""

    @property
    def recent(self) -> deque[monitor_pb2.Switchover]:
        """The latest switchovers and failovers, newest first (a keeper records its own here)."""

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run ``coro`` as a task the monitor logs the failure of and cancels when it stops."""

    def members(self, now: float) -> list[Member]:
        """The pair as the role rules (``pair.decide_roles``) see it at ``now``."""

    def tell_watchers(self) -> None:
        """Something the monitor's watchers see changed."""

"""``sokutatsu.core.v1.Process``: every service's own figures (pid, uptime, RSS, auth refusals).

The shared bootstrap (:mod:`sokutatsu.core.server`) serves it on every service's port, so
an operator asks any process the same question; ``sokutatsu status`` shows it.
"""

from __future__ import annotations

import collections
import os
import resource
import time
from typing import Any

from grpc import aio

from sokutatsu.core.v1 import process_pb2, process_pb2_grpc

SERVICE_NAME = process_pb2.DESCRIPTOR.services_by_name["Process"].full_name


def rss_bytes() -> int:
    """This process's resident memory now, in bytes (0 where ``/proc`` does not say)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


class ProcessServicer(process_pb2_grpc.ProcessServicer):
    def __init__(
        self,
        service: str,
        instance: str,
        *,
        violations: collections.Counter[str] | None = None,
        auth: bool = False,
        tls: bool = False,
    ) -> None:
        self._service = service
        self._instance = instance
        self._started = time.monotonic()
        # Refusals by status code name: auth's and the cluster secret's (core.cluster).
        self._violations = violations
        self._auth = auth
        self._tls = tls

    def stats(self) -> process_pb2.ProcessStats:
        violations = self._violations if self._violations is not None else collections.Counter()
        return process_pb2.ProcessStats(
            service=self._service,
            instance=self._instance,
            pid=os.getpid(),
            uptime_seconds=time.monotonic() - self._started,
            rss_bytes=rss_bytes(),
            auth_refusals=sum(violations.values()),
            unauthenticated=violations["UNAUTHENTICATED"],
            permission_denied=violations["PERMISSION_DENIED"],
            auth=self._auth,
            tls=self._tls,
        )

    async def GetProcessStats(
        self, request: process_pb2.GetProcessStatsRequest, context: aio.ServicerContext[Any, Any]
    ) -> process_pb2.ProcessStats:
        return self.stats()

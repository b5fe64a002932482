"""Crash injection at named steps of the transfer protocol (tests kill real processes with it).

``CRASH_AT=step@n`` makes the process SIGKILL itself the n-th time it reaches ``step``: no
cleanup, no flush, exactly what a power cut or ``kill -9`` leaves behind.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter

log = logging.getLogger(__name__)


class CrashPoints:
    def __init__(self, spec: str) -> None:
        step, _, n = spec.partition("@")
        self.step = step
        self.at = int(n) if n else 0
        self.seen: Counter[str] = Counter()

    def reach(self, step: str) -> None:
        if step != self.step:
            return
        self.seen[step] += 1
        if self.seen[step] == self.at:
            log.warning("fault injection: killing this process at %s (time %d)", step, self.at)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

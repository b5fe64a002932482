"""The monitor's domain errors (besides the shared ones in ``sokutatsu.core.errors``)."""

from __future__ import annotations

import grpc

from sokutatsu.core.errors import SokutatsuError


class SwitchoverRunning(SokutatsuError):
    """A switchover of the same subscriber is already running: this one is not started."""

    code = grpc.StatusCode.ABORTED

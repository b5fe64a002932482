"""Running Sokutatsu's own services as real processes, for the tests, the benchmarks, the
demo, the launcher and the fault-schedule harness (issue #22: one way to do it, not five).

:class:`~sokutatsu.harness.process.ServiceProcess` starts ``python -m <module>``, waits for
the address it announces, and kills (``SIGKILL``), pauses (``SIGSTOP``), resumes, stops
(``SIGTERM``, then ``SIGKILL`` after a bound) and starts it again on the same folder. The
services' own pieces build on it: :mod:`~sokutatsu.harness.broker` (a broker, the pair, waited
for until paired), :mod:`~sokutatsu.harness.monitor`, :mod:`~sokutatsu.harness.sequencer` (a
sequencer, a total-order group) and :mod:`~sokutatsu.harness.queuedb` (a node's service and its
transfer daemon). Nothing here imports pytest; every bound only stops a hung wait.
"""

from sokutatsu.harness.process import (
    HarnessError,
    ServiceProcess,
    children,
    freeze,
    kill9,
    read_announce,
    settings,
    spawn,
    stop_process,
    stop_process_async,
    thaw,
    until,
    wait_announced,
)

__all__ = [
    "HarnessError",
    "ServiceProcess",
    "children",
    "freeze",
    "kill9",
    "read_announce",
    "settings",
    "spawn",
    "stop_process",
    "stop_process_async",
    "thaw",
    "until",
    "wait_announced",
]

"""Running Sokutatsu's own services as real processes, for the tests, the benchmarks, the
demo, the launcher and the fault-schedule harness (issue #22: one way to do it, not five).

:class:`~sokutatsu.harness.process.ServiceProcess` starts ``python -m <module>``, waits for
the address it announces, and kills (``SIGKILL``), pauses (``SIGSTOP``), resumes, stops
(``SIGTERM``, then ``SIGKILL`` after a bound) and starts it again on the same folder.
"""

from sokutatsu.harness.process import HarnessError, ServiceProcess, read_announce, spawn, stop_process, wait_announced

__all__ = ["HarnessError", "ServiceProcess", "read_announce", "spawn", "stop_process", "wait_announced"]

"""Test session: real PostgreSQL, real gRPC servers, real processes.

PostgreSQL comes from, in order: ``SOKUTATSU_PG_DSN``; a testcontainers
PostgreSQL container when a Docker engine answers; otherwise an embedded
cluster started by this session (system initdb/pg_ctl, as the postgres user
when root). See ``tests/fix_pg.py``.
"""

import os
import tempfile
from pathlib import Path

import pytest

from sokutatsu.core.cluster import FILE_VAR, SECRET_VAR, make_file
from tests.helpers import FIGURES

pytest_plugins = [
    "tests.fix_pg",
    "tests.fix_schedule",
    "tests.broker.fix_broker",
    "tests.monitor.fix_monitor",
    "tests.sequencer.fix_sequencer",
    "tests.queuedb.fix_queuedb",
    "tests.security.fix_tls",
    "tests.security.fix_auth",
]


# The JVMs the tests start (the analytics session, `sokutatsu analyze` and `sokutatsu demo`
# subprocesses) are short-lived and run small jobs: there the C2 compiler's threads and G1's
# parallel collectors cost more CPU than they win (one `sokutatsu analyze` of the quick demo's
# 1,054 spans on this 2-core machine: 91 s of CPU with the defaults, 51 s with these; a bare
# session's start 27 s against 13-15 s). Neither flag changes what Spark computes. spark-submit
# adds SPARK_SUBMIT_OPTS to the driver JVM's options; the product's own options are untouched.
SPARK_TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def pytest_configure(config: object) -> None:
    """The JVM options above, for every JVM of the session (added to any SPARK_SUBMIT_OPTS set).

    The session's cluster secret (docs/security.md): a file of its own, which every service the
    tests start and every control channel they open (``open_channel(..., cluster=True)``) uses."""
    if SPARK_TEST_JVM_OPTIONS not in os.environ.get("SPARK_SUBMIT_OPTS", ""):
        os.environ["SPARK_SUBMIT_OPTS"] = f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} {SPARK_TEST_JVM_OPTIONS}".strip()
    if os.environ.get(SECRET_VAR) or os.environ.get(FILE_VAR):
        return
    path = Path(tempfile.mkdtemp(prefix="sokutatsu-cluster-")) / "cluster-secret"
    make_file(path)
    os.environ[FILE_VAR] = str(path)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist, a worker hands its figures to the controller, which prints them."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["figures"] = list(FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    FIGURES.extend(getattr(node, "workeroutput", {}).get("figures", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures tests measured (``tests.helpers.report_figure``)."""
    if FIGURES:
        terminalreporter.section("figures measured by the tests")
        for line in FIGURES:
            terminalreporter.write_line(line)

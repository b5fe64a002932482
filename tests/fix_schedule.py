"""The order tests run in, and which run together under pytest-xdist (a pytest plugin, see conftest.py).

``make test`` runs the suite on several workers (``pytest -n TEST_WORKERS --dist loadgroup``;
the groups apply with ``--dist loadgroup`` only):

* **Longest first.** Modules holding a test marked ``slow`` run before the others, so the
  long end-to-end, crash and benchmark tests start at once and the short ones fill the gaps
  (the longest-processing-time rule): the run ends soon after its longest test, not a long
  test started last. Modules stay contiguous in that order (in one process a module-scoped
  fixture is set up once); across workers only a group below stays on one worker, so a new
  module-scoped fixture that is costly belongs in ``SHARED_FIXTURE_GROUPS``.
* **Shared costly fixtures on one worker.** Tests that share a fixture that is costly to make
  (a JVM for Spark, a whole demo run, a virtualenv, a set of fuzz targets) are one unit of
  work for the scheduler: the fixture is made once, by one worker, instead of once per worker.

Nothing here changes what a test checks; ``pytest`` without ``-n`` runs the same tests in
the same order, in one process.
"""

from __future__ import annotations

from typing import Any

import pytest

# Path prefix of the tests (relative to the repository) -> the group they run in together.
SHARED_FIXTURE_GROUPS = {
    # One SparkSession per worker (tests/analytics/conftest.py). Split in two (test_transforms on a
    # JVM of its own), fresh-clone runs on four workers were no faster: parallel parts of 6 min 29 s
    # and 7 min 08 s, against 6 min 11 s and 7 min 13 s in one group, the same day.
    "tests/analytics/": "spark",
    "tests/demo/test_demo.py": "demo",  # one quick demo run for the module's checks
    "tests/deploy/test_runtime_environment.py": "runtime-venv",  # one runtime virtualenv
    "tests/security/test_fuzz.py": "fuzz-targets",  # one set of started services to probe
    "tests/services/test_lifecycle.py": "lifecycle-db",  # one database
}


def _group(nodeid: str) -> str | None:
    for prefix, group in SHARED_FIXTURE_GROUPS.items():
        if nodeid.startswith(prefix):
            return group
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Longest first, modules kept whole: a module's rank is whether it holds a slow test.
    slow_modules = {item.nodeid.partition("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.partition("::")[0] not in slow_modules)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the groups above. (pytest-xdist 3.8's own loadgroup marks a
    group by rewriting ``item._nodeid``, which pytest 9 no longer reads, so its groups are
    silently lost: each test of a group could run on another worker.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]  # noqa: PLC0415 - only under xdist

    class SharedFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """A group's tests are one unit of work (one worker); every other test is a unit alone."""

        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid) or nodeid

    return SharedFixtureScheduling(config, log)

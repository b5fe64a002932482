"""One local SparkSession for the whole analytics test session (starting one takes seconds).

These modules import pyspark (and what the job brings: pyarrow, matplotlib) inside the fixtures
and tests that use it, not at the top: every pytest process collects every test module, and
only the worker that runs the Spark group needs them (about 2-3 s of CPU per process to import).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    from sokutatsu.analytics.job import spark_session  # noqa: PLC0415 - see the docstring

    session = spark_session("local[2]", short_job=True)  # small inputs: the quick JIT (job.py)
    yield session
    session.stop()


# A Spark test without a timeout of its own gets this one, not pytest's 120 s: the first test on a
# worker starts the JVM (tens of seconds on a busy 2-core machine), and a test interrupted by its
# timeout mid-job leaves the shared session broken for every later test.
SPARK_TIMEOUT_SECONDS = 300


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("spark") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SPARK_TIMEOUT_SECONDS))

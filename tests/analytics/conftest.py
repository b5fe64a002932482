"""One local SparkSession for the whole analytics test session (starting one takes seconds)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from sokutatsu.analytics.job import spark_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = spark_session("local[2]")
    yield session
    session.stop()

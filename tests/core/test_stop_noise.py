"""grpcio's ERROR for a handler cancelled by the server's own stop is dropped, and nothing else
(tests/broker/test_pair_stop.py shows the whole pair stopping without an ERROR line)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from sokutatsu.core.stop_noise import GRPC_LOGGER, drop_cancelled_at_stop


def _record(exc: BaseException | None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(
        GRPC_LOGGER, logging.ERROR, "server.pyx.pxi", 812,
        "Exception not handled by _handle_exceptions in servicer method [%s]", ("/x.v1.X/Stream",), exc_info,
    )  # fmt: skip


def test_a_handler_cancelled_once_the_service_stops_is_not_an_error_but_anything_else_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stopping = asyncio.Event()
    noise = drop_cancelled_at_stop(stopping)
    logger = logging.getLogger(GRPC_LOGGER)
    try:
        with caplog.at_level(logging.ERROR, logger=GRPC_LOGGER):
            logger.handle(_record(asyncio.CancelledError()))  # while serving: kept
            stopping.set()
            logger.handle(_record(asyncio.CancelledError()))  # after the stop began: dropped
            logger.handle(_record(ValueError("a real fault")))  # kept
            logger.handle(_record(None))  # kept
        kept = [r.exc_info[1] if r.exc_info else None for r in caplog.records]
        assert [type(e).__name__ for e in kept] == ["CancelledError", "ValueError", "NoneType"]
    finally:
        logger.removeFilter(noise)


def test_a_later_service_replaces_the_filters_of_services_that_stopped() -> None:
    logger = logging.getLogger(GRPC_LOGGER)
    stopped, running = asyncio.Event(), asyncio.Event()
    stopped.set()
    first = drop_cancelled_at_stop(stopped)
    second = drop_cancelled_at_stop(running)
    third = drop_cancelled_at_stop(asyncio.Event())
    try:
        assert first not in logger.filters
        assert second in logger.filters
        assert third in logger.filters
    finally:
        for f in (first, second, third):
            logger.removeFilter(f)

"""The processor's log levels: --log-level debug turns on the processor's own decision lines,
not the per-call debug lines of the libraries under it (grpc.aio logs two per RPC)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from extproc.serve.logs import QUIET_LIBRARIES, setup_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    libraries = {name: logging.getLogger(name).level for name in QUIET_LIBRARIES}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, was in libraries.items():
            logging.getLogger(name).setLevel(was)


@pytest.mark.usefixtures("restored_logging")
def test_debug_is_the_processors_own_not_its_libraries() -> None:
    setup_logging("debug")
    assert logging.getLogger("extproc.server").isEnabledFor(logging.DEBUG)
    assert logging.getLogger("extproc.ledger").isEnabledFor(logging.DEBUG)
    for name in ("grpc._cython.cygrpc", "redis.asyncio.connection", "asyncio"):
        library = logging.getLogger(name)
        assert not library.isEnabledFor(logging.DEBUG), name
        assert library.isEnabledFor(logging.INFO), name  # their warnings and errors still show


@pytest.mark.usefixtures("restored_logging")
def test_a_quieter_level_applies_to_the_libraries_too() -> None:
    setup_logging("warning")
    assert not logging.getLogger("extproc.server").isEnabledFor(logging.INFO)
    assert not logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.INFO)
    assert logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.WARNING)

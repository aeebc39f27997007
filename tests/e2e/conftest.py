"""Fixtures for the e2e tier: real Envoy, real processor processes, simulated clusters."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from extproc.harness.launch import Client, FleetStack


@pytest.fixture(scope="module")
def fleet4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(tmp_path_factory.mktemp("fleet4"), clusters=4)
    with stack:
        yield stack


def dump_logs(stack: FleetStack) -> str:
    """Tail of every process log, for assertion messages."""
    parts = []
    for path in sorted(Path(stack.workdir).glob("*.log")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
    return "\n".join(parts)


MakeClient = Callable[[int], Client]


@pytest.fixture
def make_client() -> Iterator[Callable[[int], Client]]:
    """Keep-alive clients that are closed when the test ends."""
    made: list[Client] = []

    def make(port: int) -> Client:
        client = Client(port)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()

"""Fixtures for the e2e tier: real Envoy, real processor processes, simulated clusters."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from extproc.core.placement import Placement
from extproc.harness.launch import Client, FleetStack


@pytest.fixture(scope="module")
def fleet4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(tmp_path_factory.mktemp("fleet4"), clusters=4)
    with stack:
        yield stack


def chat_body(text: str, max_tokens: int = 2) -> bytes:
    """A one-message OpenAI chat body, the request most e2e tests send."""
    doc = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return orjson.dumps(doc)


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


def kill_primary_then_restart(
    stack: FleetStack,
    client: Client,
    path: str,
    body: bytes,
    headers: dict[str, str],
    placement: Placement,
    return_within_s: float = 10,
) -> None:
    """SIGKILL the session's primary: 40 sequential requests through the outage must all
    succeed on the pre-assigned secondary; after a restart the session returns to its primary.

    SIGKILL, and wait until the process is gone: a request written to the dying engine would
    fail rather than be retried (issue 12: it could run twice)."""
    stack.sims[placement.primary].kill()
    served: list[str] = []
    for _ in range(40):  # through the outage, before and after the picker notices
        status, hdrs, data = client.post_json(path, body, headers)
        assert status == 200, (data[:200], dump_logs(stack))
        served.append(hdrs["x-served-by"])
        time.sleep(0.05)
    assert set(served) == {placement.secondary}, collections.Counter(served)

    stack.restart_sim(placement.primary)
    deadline = time.monotonic() + return_within_s
    while True:
        status, hdrs, _ = client.post_json(path, body, headers)
        assert status == 200
        if hdrs["x-served-by"] == placement.primary:
            break
        assert time.monotonic() < deadline, "session never returned to its primary"
        time.sleep(0.2)

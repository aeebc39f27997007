"""An engine's 429/503 is backpressure, not failure, through a real Envoy.

- it ejects nothing (outlier detection counts only failures Envoy saw itself);
- it moves the request once, to the session's secondary (the engine refused it at admission:
  nothing ran), and a second refusal reaches the client;
- a reset after the engine took the request is not retried (the generation may be running);
- no generation runs twice: the simulated clusters count generations per x-request-id.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import Client, FleetStack
from tests.e2e.conftest import MakeClient, chat_body, dump_logs
from tests.e2e.predict import PURE_HASH, placement_for

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("backpressure"),
        clusters=3,
        # Pure hashing predicts first turns (no balance spills): tests engine backpressure.
        fleet_overrides={"affinity": PURE_HASH},
    )
    with stack:
        yield stack


def _admin(
    stack: FleetStack, name: str, method: str, path: str, body: bytes | None = None
) -> bytes:
    client = Client(stack.sim_specs[name].port)
    try:
        status, _headers, data = client.request(
            method, path, body, {"content-type": "application/json"} if body else None
        )
        assert status == 200, data
        return data
    finally:
        client.close()


def _fault(stack: FleetStack, name: str, **fault: object) -> None:
    _admin(stack, name, "POST", "/admin/fault", orjson.dumps(fault))


def _executions(stack: FleetStack) -> dict[str, collections.Counter[str]]:
    """Per cluster: generations started per x-request-id."""
    out: dict[str, collections.Counter[str]] = {}
    for name in stack.sim_specs:
        doc = orjson.loads(_admin(stack, name, "GET", "/admin/executions"))
        out[name] = collections.Counter(doc["executions"])
    return out


def _runs_per_request(stack: FleetStack) -> collections.Counter[str]:
    total: collections.Counter[str] = collections.Counter()
    for counts in _executions(stack).values():
        total.update(counts)
    return total


def _ejections(stack: FleetStack, cluster: str) -> int:
    return stack.envoy_stat(f"cluster.{cluster}.outlier_detection.ejections_enforced_total")


def test_engine_429_and_503_move_the_request_once_and_eject_nothing(
    fleet: FleetStack, make_client: MakeClient
) -> None:
    runtime = load_runtime(fleet.fleet_path)
    headers = {"x-session-id": "backpressure-session"}
    body = chat_body("are you busy?")
    placement = placement_for(runtime, CHAT, body, headers)
    primary, secondary = placement.primary, placement.secondary
    assert secondary is not None
    client = make_client(fleet.listener_port)
    for status in (503, 429):
        before_runs = _executions(fleet)
        _fault(fleet, primary, mode="error", status=status)
        try:
            for _ in range(12):
                code, hdrs, data = client.post_json(CHAT, body, headers)
                assert code == 200, (status, code, data[:200], dump_logs(fleet))
                # Moved once, to the session's secondary (previous_priorities).
                assert hdrs["x-served-by"] == secondary
        finally:
            _fault(fleet, primary, mode="none")
        after_runs = _executions(fleet)
        # The primary refused before generating: no run there; one run each on the secondary.
        assert after_runs[primary] == before_runs[primary]
        assert sum((after_runs[secondary] - before_runs[secondary]).values()) == 12
        # Twelve consecutive refusals ejected nothing, and the primary serves again at once.
        assert _ejections(fleet, primary) == 0
        assert fleet.host_health()
        assert all(ok for (c, _a), ok in fleet.host_health().items() if c == primary)
        code, hdrs, _ = client.post_json(CHAT, body, headers)
        assert (code, hdrs["x-served-by"]) == (200, primary)
    assert max(_runs_per_request(fleet).values()) == 1


def test_a_second_refusal_reaches_the_client(fleet: FleetStack, make_client: MakeClient) -> None:
    runtime = load_runtime(fleet.fleet_path)
    headers = {"x-session-id": "everyone-is-busy"}
    body = chat_body("anyone free?")
    placement = placement_for(runtime, CHAT, body, headers)
    assert placement.secondary is not None
    busy = (placement.primary, placement.secondary)
    aggregate = placement.route

    def counts() -> dict[str, int]:
        stats = {c: fleet.envoy_stat(f"cluster.{c}.upstream_rq_total") for c in busy}
        for name in ("upstream_rq_retry", "upstream_rq_retry_limit_exceeded"):
            stats[name] = fleet.envoy_stat(f"cluster.{aggregate}.{name}")
        return stats

    before = counts()
    for name in busy:
        _fault(fleet, name, mode="error", status=503)
    try:
        code, _hdrs, data = make_client(fleet.listener_port).post_json(CHAT, body, headers)
    finally:
        for name in busy:
            _fault(fleet, name, mode="none")
    # The engine's own 503 (its JSON error), after exactly two attempts: one on each cluster,
    # one retry, then the retry limit. No retry storm.
    assert code == 503, data[:200]
    assert orjson.loads(data)["error"]["message"] == "injected fault: 503"
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {
        busy[0]: 1,
        busy[1]: 1,
        "upstream_rq_retry": 1,
        "upstream_rq_retry_limit_exceeded": 1,
    }
    assert all(_ejections(fleet, c) == 0 for c in busy)


def test_a_reset_after_the_engine_took_the_request_is_not_retried(
    fleet: FleetStack, make_client: MakeClient
) -> None:
    runtime = load_runtime(fleet.fleet_path)
    headers = {"x-session-id": "crash-mid-prefill"}
    body = chat_body("a long prefill")
    placement = placement_for(runtime, CHAT, body, headers)
    primary, secondary = placement.primary, placement.secondary
    assert secondary is not None
    client = make_client(fleet.listener_port)
    before = _executions(fleet)
    _fault(fleet, primary, mode="reset")
    try:
        # The engine starts each generation, then drops the connection before a response byte:
        # Envoy must not run it again elsewhere. The client gets Envoy's 503 (flag UC). Two
        # resets within one outlier interval eject the primary (tests/e2e/
        # test_resetting_engine.py): a later request may be served by the secondary, as a new
        # request, never as a retry of a reset one.
        resets = 0
        for attempt in range(3):
            code, hdrs, data = client.post_json(CHAT, body, headers)
            if code == 200 and attempt > 0:
                assert hdrs["x-served-by"] == secondary
                continue
            assert code == 503, (code, data[:200])
            assert b"reset before headers" in data
            resets += 1
    finally:
        _fault(fleet, primary, mode="none")
    after = _executions(fleet)
    started_on_primary = after[primary] - before[primary]
    assert sorted(started_on_primary.values()) == [1] * resets
    # None of the three reset requests ran anywhere else.
    assert not set(started_on_primary) & set(after[secondary])
    assert max(_runs_per_request(fleet).values()) == 1

"""Failover through a real Envoy, seen without any engine header (issue 17), and the budget
charge following the cluster that serves (issue 13).

The simulated clusters still send ``x-served-by``, but these stacks configure
``affinity.served_by_header: null``: everything the processor learns about the serving
cluster comes from Envoy's ext_proc response attributes (extproc/protocol/attributes.py), as
with real engines, which send no such header.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import Client, FleetStack, http_get, wait_until
from tests.e2e.conftest import MakeClient, chat_body, dump_logs
from tests.e2e.predict import PURE_HASH, placement_for
from tests.support.flow import NO_PLACEMENT, refused_at_once

CHAT = "/v1/chat/completions"
BUDGET = 2
CLASSES: list[dict[str, Any]] = [{"name": "chat", "budget": {"max_concurrent": BUDGET}}]


def _metric(stack: FleetStack, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return stack.processor_metrics().get(key, 0.0)


def _inflight(stack: FleetStack) -> float:
    """Budget reservations the processor holds, over every compartment."""
    return sum(
        value
        for (name, _labels), value in stack.processor_metrics().items()
        if name == "fleet_budget_inflight_requests"
    )


def _sessions(stack: FleetStack, primary: str, secondary: str | None, n: int) -> list[str]:
    """``n`` session ids whose hash placement is (primary, secondary) (any secondary: None)."""
    runtime = load_runtime(stack.fleet_path)
    found: list[str] = []
    for i in range(20_000):
        sid = f"{primary}-{i}"
        placement = placement_for(
            runtime, CHAT, chat_body(sid, max_tokens=8), {"x-session-id": sid}
        )
        if placement.primary == primary and secondary in (None, placement.secondary):
            found.append(sid)
            if len(found) == n:
                return found
    raise AssertionError(f"fewer than {n} sessions hash to {primary}, {secondary}")


@pytest.fixture
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("observed"),
        clusters=3,
        fleet_overrides={
            "classes": refused_at_once(CLASSES),
            "flow": NO_PLACEMENT,
            "affinity": {"enabled": True, "served_by_header": None},
            # Probing off: this stack shows the move at the response headers (the backstop
            # when the processor's probes have not seen a death yet), which a probed-down
            # primary would bypass.
            "processor": {"inspect_usage": True, "probe_clusters": False},
        },
    )
    with stack:
        yield stack


def test_failover_is_seen_from_envoy_without_a_served_by_header(
    observed: FleetStack, make_client: MakeClient
) -> None:
    (sid,) = _sessions(observed, "c1", None, 1)
    runtime = load_runtime(observed.fleet_path)
    placement = placement_for(runtime, CHAT, chat_body(sid, max_tokens=8), {"x-session-id": sid})
    secondary = placement.secondary
    assert secondary is not None
    client = make_client(observed.listener_port)
    headers = {"x-session-id": sid}
    for _ in range(3):
        status, hdrs, _ = client.post_json(CHAT, chat_body(sid, max_tokens=8), headers)
        assert status == 200 and hdrs["x-served-by"] == "c1"
    assert _metric(observed, "fleet_failovers_observed_total", cluster="c1") == 0
    before = _metric(observed, "fleet_upstream_output_tokens_total", cluster=secondary)
    # SIGKILL the primary (the process gone before the next request, see test_failover.py).
    observed.sims["c1"].kill()
    served: collections.Counter[str] = collections.Counter()
    for _ in range(10):
        status, hdrs, data = client.post_json(CHAT, chat_body(sid, max_tokens=8), headers)
        assert status == 200, (data[:200], dump_logs(observed))
        served[hdrs["x-served-by"]] += 1
    assert served == {secondary: 10}
    # Envoy's response attributes named the secondary's host: the failover is seen ...
    assert _metric(observed, "fleet_failovers_observed_total", cluster="c1") >= 1
    # ... the usage is credited to the secondary (output tokens of all 10 answers) ...
    after = _metric(observed, "fleet_upstream_output_tokens_total", cluster=secondary)
    assert after - before >= 10
    # ... and every budget charge taken on c1 before the failover was seen moved with it.
    moved = _metric(
        observed, "fleet_budget_charges_moved_total", request_class="chat", result="moved"
    )
    assert moved >= 1
    wait_until(lambda: _inflight(observed) == 0, 10, "budget released")


# Slow enough that a request holds its budget while the others arrive (~0.5 s each).
SLOW_SIMS = ("--time-scale", "0.2", "--prefill-tps", "20000", "--decode-tps", "50")


@pytest.fixture
def defaults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    """The default processor settings: with a class budget, processor.probe_clusters is on."""
    stack = FleetStack(
        tmp_path_factory.mktemp("defaults"),
        clusters=3,
        sim_args=SLOW_SIMS,
        # The default probing (processor.probe_clusters unset); flow control off, so the
        # burst's refusals are counted as 429s at once.
        fleet_overrides={
            "classes": refused_at_once(CLASSES),
            "flow": NO_PLACEMENT,
            # Pure hashing predicts first turns (no balance spills): tests failover charges.
            "affinity": {"served_by_header": None, **PURE_HASH},
        },
    )
    with stack:
        yield stack


def _concurrency(stack: FleetStack, name: str, reset: bool = False) -> dict[str, Any]:
    if reset:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", stack.sim_specs[name].port, timeout=5)
        conn.request("DELETE", "/admin/concurrency")
        conn.getresponse().read()
        conn.close()
    status, body = http_get(stack.sim_specs[name].port, "/admin/concurrency")
    assert status == 200
    doc: dict[str, Any] = orjson.loads(body)
    return doc


def _post(stack: FleetStack, sid: str) -> int:
    client = Client(stack.listener_port)
    try:
        status, _, _ = client.post_json(CHAT, chat_body(sid, max_tokens=8), {"x-session-id": sid})
        return status
    finally:
        client.close()


def _burst(stack: FleetStack, sids: list[str]) -> collections.Counter[int]:
    with ThreadPoolExecutor(len(sids)) as pool:
        futures = [pool.submit(_post, stack, sid) for sid in sids]
        return collections.Counter(f.result() for f in futures)


def test_secondary_budget_holds_while_the_primary_is_down(defaults: FleetStack) -> None:
    """With the default settings, c1 dead: c1's sessions (secondary c2) and c2's own sessions
    all run on c2. During the detection window (c1 killed, the processor's probes have not
    seen it yet) c2 may exceed its class budget by at most c1's class budget (the stated
    bound, RELIABILITY.md): requests admitted against c1 that Envoy fails over. Once the probes
    found c1 down, c2's class budget (2 at a time) holds for both together, counted at c2."""
    displaced = _sessions(defaults, "c1", "c2", 8)
    native = _sessions(defaults, "c2", None, 8)
    # Right at the kill: the burst starts before the next probe round can see it.
    _concurrency(defaults, "c2", reset=True)
    defaults.sims["c1"].kill()
    window = _burst(defaults, displaced + native)
    window_peak = _concurrency(defaults, "c2")["peak"].get("chat", 0)
    assert window_peak <= BUDGET + BUDGET, (window_peak, window, dump_logs(defaults))
    assert set(window) <= {200, 429}, window
    wait_until(lambda: _inflight(defaults) == 0, 10, "the window's requests to end")
    defaults.wait_healthy(["c1"], healthy=False)

    def probed_down() -> bool:
        _post(defaults, displaced[0])
        return _metric(defaults, "fleet_placed_around_unready_total", cluster="c1") > 0

    wait_until(probed_down, 20, "the processor's probes to find c1 down", interval=0.2)
    wait_until(lambda: _inflight(defaults) == 0, 10, "the probe requests to end")
    _concurrency(defaults, "c2", reset=True)
    statuses = _burst(defaults, displaced + native)
    peak = _concurrency(defaults, "c2")["peak"].get("chat", 0)
    print(f"failover charge: window peak {window_peak} {dict(window)}; after {peak} {statuses}")
    # The budget holds at the upstream that served, and was reached (not merely unused).
    assert peak == BUDGET, (peak, statuses, dump_logs(defaults))
    assert set(statuses) == {200, 429}, statuses
    assert statuses[429] >= 4, statuses
    wait_until(lambda: _inflight(defaults) == 0, 10, "every reservation released")
    # Nothing was charged to the dead cluster's compartment.
    assert (
        _metric(defaults, "fleet_budget_inflight_requests", cluster="c1", request_class="chat") == 0
    )

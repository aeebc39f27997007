"""Failover and fail-open through a real Envoy, with simulated clusters killed and restarted."""

from __future__ import annotations

import collections
import signal
import time
from collections.abc import Iterator

import pytest

from extproc.config import load_runtime
from extproc.harness.launch import FleetStack
from tests.e2e.conftest import MakeClient, chat_body, dump_logs
from tests.e2e.predict import PURE_HASH, placement_for

CHAT = "/v1/chat/completions"


@pytest.fixture
def fleet3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("fleet3"),
        clusters=3,
        # Pure hashing predicts first turns (no balance spills): tests failover.
        fleet_overrides={"affinity": PURE_HASH},
    )
    with stack:
        yield stack


def test_primary_killed_moves_session_to_secondary_and_back(
    fleet3: FleetStack, make_client: MakeClient
) -> None:
    runtime = load_runtime(fleet3.fleet_path)
    headers = {"x-session-id": "failover-session"}
    body = chat_body("keep talking")
    placement = placement_for(runtime, CHAT, body, headers)
    primary, secondary = placement.primary, placement.secondary
    assert secondary is not None
    client = make_client(fleet3.listener_port)
    served: list[str] = []

    def send(n: int, pause: float = 0.02) -> None:
        for _ in range(n):
            status, hdrs, data = client.post_json(CHAT, body, headers)
            assert status == 200, (status, data[:200], dump_logs(fleet3))
            served.append(hdrs["x-served-by"])
            time.sleep(pause)

    send(10)
    assert set(served) == {primary}
    # SIGKILL, and wait until the process is gone: a request Envoy wrote to the dying process
    # fails instead of being retried (issue 12: once an engine has a request, a retry could run
    # the generation twice). Every request sent after the crash must succeed.
    fleet3.sims[primary].kill()
    served.clear()
    # Sequential traffic right through the outage: every request must succeed.
    send(60)
    assert set(served) == {secondary}, collections.Counter(served)
    fleet3.restart_sim(primary)
    fleet3.wait_healthy([primary])
    # Envoy's aggregate cluster picks the recovered priority up within about a second of the
    # health check passing; keep sending (all must still succeed) until it does.
    served.clear()
    deadline = time.monotonic() + 10
    while not served or served[-1] != primary:
        assert time.monotonic() < deadline, collections.Counter(served)
        send(1, pause=0.1)
    served.clear()
    send(10)
    assert set(served) == {primary}


def test_processor_down_fails_open_and_ignores_spoofed_route(
    fleet3: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(fleet3.listener_port)
    fleet3.procs[0].signal(signal.SIGKILL)
    fleet3.procs[0].stop()
    counts: collections.Counter[str] = collections.Counter()
    spoofed = {"x-fleet-route": "c3", "x-fleet-primary": "c3"}
    before = {
        c: fleet3.envoy_stat(f"cluster.{c}.upstream_rq_total") for c in ("c3", "all_clusters")
    }
    for i in range(30):
        status, hdrs, data = client.post_json(CHAT, chat_body(f"fail open {i}"), spoofed)
        assert status == 200, data[:200]
        counts[hdrs["x-served-by"]] += 1
    # Every request took the fallback route, none the spoofed cluster.
    assert (
        fleet3.envoy_stat("cluster.all_clusters.upstream_rq_total") - before["all_clusters"] == 30
    )
    assert fleet3.envoy_stat("cluster.c3.upstream_rq_total") == before["c3"]
    assert len(counts) >= 2, counts
    # Back up: routing by the processor resumes.
    fleet3.start_processor(0)
    runtime = load_runtime(fleet3.fleet_path)
    body = chat_body("after restart")
    expected = placement_for(runtime, CHAT, body, {"x-session-id": "s"}).primary
    for _ in range(5):
        status, hdrs, _ = client.post_json(CHAT, body, {"x-session-id": "s"})
        assert status == 200
        assert hdrs["x-served-by"] == expected

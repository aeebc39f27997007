"""An engine that accepts connections and resets every request is ejected, through a real Envoy.

Its health check keeps passing (the simulated engine's ``reset`` fault answers ``/health`` and
resets only inference requests), so only outlier detection can take it out: the local-origin
failure percentage (render/envoy.py ``_outlier_detection``). Until then each request gets
Envoy's 503 and runs nowhere else (a reset after the engine took the request is never retried);
after it the session's requests go to its secondary. An engine's own 503 is not counted
(tests/e2e/test_backpressure.py).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import LOOPBACK, Client, FleetStack, http_get, wait_until
from tests.e2e.conftest import MakeClient, chat_body, dump_logs
from tests.e2e.predict import PURE_HASH, placement_for

CHAT = "/v1/chat/completions"
# The detector runs once per 1 s outlier interval and ejects after an interval with two
# resets, so how many requests are sent first depends on how fast the machine answers them
# (hundreds on a loaded machine, thousands on an idle one): the loop runs until the ejection,
# bounded in count (and by pytest's timeout) against a detector that never ejects.
MAX_REQUESTS = 50_000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("resetting"),
        clusters=3,
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


def _runs(stack: FleetStack) -> dict[str, collections.Counter[str]]:
    out: dict[str, collections.Counter[str]] = {}
    for name in stack.sim_specs:
        doc = orjson.loads(_admin(stack, name, "GET", "/admin/executions"))
        out[name] = collections.Counter(doc["executions"])
    return out


def test_an_engine_that_resets_every_request_is_ejected(
    fleet: FleetStack, make_client: MakeClient
) -> None:
    runtime = load_runtime(fleet.fleet_path)
    headers = {"x-session-id": "resetting-engine"}
    body = chat_body("are you there?")
    placement = placement_for(runtime, CHAT, body, headers)
    primary, secondary = placement.primary, placement.secondary
    assert secondary is not None
    address = f"{LOOPBACK}:{fleet.sim_specs[primary].port}"
    stat = f"cluster.{primary}.outlier_detection.ejections_enforced_local_origin_failure_percentage"
    client = make_client(fleet.listener_port)
    code, hdrs, _ = client.post_json(CHAT, body, headers)
    assert (code, hdrs["x-served-by"]) == (200, primary)
    before = _runs(fleet)
    _admin(fleet, primary, "POST", "/admin/fault", orjson.dumps({"mode": "reset"}))
    outcomes: list[str] = []
    started = time.monotonic()
    try:
        for _ in range(MAX_REQUESTS):
            code, hdrs, data = client.post_json(CHAT, body, headers)
            if code == 200:
                assert hdrs["x-served-by"] == secondary, dump_logs(fleet)
                outcomes.append("secondary")
                break
            assert code == 503 and b"reset before headers" in data, (code, data[:200])
            outcomes.append("reset")
        ejected_after_s = time.monotonic() - started
        # Read before the fault is lifted: the one ejection is the failure percentage's.
        ejections = fleet.envoy_stat(stat)
    finally:
        _admin(fleet, primary, "POST", "/admin/fault", orjson.dumps({"mode": "none"}))
    print(
        f"\nresetting engine: out of rotation after {ejected_after_s:.2f} s, "
        f"{outcomes.count('reset')} requests reset first"
    )
    assert outcomes[-1] == "secondary", (outcomes[-5:], len(outcomes), dump_logs(fleet))
    assert outcomes.count("reset") >= 2  # the detector's volume: two requests
    assert ejections == 1
    # Outlier detection took it out, not the health check: /health kept passing, so the host's
    # only flag is the outlier check's.
    flags = _health_flags(fleet, primary, address)
    assert "failed_outlier_check" in flags and "failed_active_hc" not in flags, flags
    # Each reset request started once on the primary and ran nowhere else.
    after = _runs(fleet)
    reset_ids = after[primary] - before[primary]
    assert sorted(reset_ids.values()) == [1] * outcomes.count("reset")
    assert not set(reset_ids) & set(after[secondary])
    assert max(max(c.values(), default=0) for c in after.values()) == 1

    # Out of rotation, not gone: the ejection lapses and the session returns to its primary.
    def back() -> bool:
        code, hdrs, _ = client.post_json(CHAT, body, headers)
        return code == 200 and hdrs["x-served-by"] == primary

    wait_until(back, 60, "the ejected primary to serve again", 0.5)


def _health_flags(stack: FleetStack, cluster: str, address: str) -> str:
    _status, text = http_get(stack.admin_port, "/clusters")
    for line in text.decode().splitlines():
        parts = line.split("::")
        if len(parts) >= 4 and parts[:3] == [cluster, address, "health_flags"]:
            return parts[3]
    raise AssertionError(f"{cluster} {address} not in Envoy's /clusters")

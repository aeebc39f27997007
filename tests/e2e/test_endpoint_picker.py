"""Endpoint-picker (Inference Extension) mode through a real Envoy.

Envoy is configured the way Inference Extension gateways pick hosts: one pool cluster holding
every endpoint, with the override_host load-balancing policy reading the picker's list from
the envoy.lb dynamic metadata (primary endpoint first, the secondary's on retry).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import FleetStack
from tests.e2e.conftest import MakeClient, chat_body, dump_logs, kill_primary_then_restart
from tests.e2e.predict import PURE_HASH, placement_for

CHAT = "/v1/chat/completions"


@pytest.fixture
def picker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("epp"),
        clusters=3,
        # Pure hashing predicts first turns (no balance spills): tests endpoint picking.
        fleet_overrides={"processor": {"mode": "endpoint_picker"}, "affinity": PURE_HASH},
    )
    with stack:
        yield stack


def test_picker_sends_sessions_to_primary_endpoint_and_falls_back(
    picker: FleetStack, make_client: MakeClient
) -> None:
    runtime = load_runtime(picker.fleet_path)
    client = make_client(picker.listener_port)
    for i in range(20):
        headers = {"x-session-id": f"epp-{i}"}
        body = chat_body("hello")
        status, hdrs, data = client.post_json(CHAT, body, headers)
        assert status == 200, (data[:200], dump_logs(picker))
        assert hdrs["x-served-by"] == placement_for(runtime, CHAT, body, headers).primary

    headers = {"x-session-id": "epp-failover"}
    body = chat_body("keep going")
    placement = placement_for(runtime, CHAT, body, headers)
    kill_primary_then_restart(picker, client, CHAT, body, headers, placement)


def test_no_ready_endpoint_gets_503_json(picker: FleetStack, make_client: MakeClient) -> None:
    for sim in picker.sims.values():
        sim.signal(signal.SIGKILL)
    client = make_client(picker.listener_port)
    deadline = time.monotonic() + 10
    while True:
        status, hdrs, data = client.post_json(CHAT, chat_body("anyone?"))
        # Until the picker's probes see every endpoint gone, Envoy tries the picked one and
        # answers its own 503 (also JSON since Envoy's local replies are rendered as JSON).
        if status == 503 and hdrs.get("content-type") == "application/json":
            code = orjson.loads(data).get("error", {}).get("code")
            if code == "no_ready_endpoint":
                break
        assert time.monotonic() < deadline, (status, data[:200])
        time.sleep(0.2)
    err = orjson.loads(data)["error"]
    assert err["code"] == "no_ready_endpoint"

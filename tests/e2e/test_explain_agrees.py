"""`extproc explain` shows exactly what the live processor decides, through a real Envoy.

Load-aware affinity on with its defaults (bounded-load placement of new sessions included), in
route mode and in endpoint-picker mode. Before each request the
running processor is asked, through `extproc explain --admin` (its admin endpoint: the live
state, changed by nothing), what it would decide; then the request goes through Envoy and the
decision Envoy acted on is read from its access log (the aggregate cluster named by
x-fleet-route, or the endpoint the picker chose, and x-fleet-primary). Every pair must match,
including after a cluster fails and affinity moves sessions off it (migrations and spills that
pure hashing would not make), for new sessions that start off a cluster holding more than its
share of recent requests, and for a hot prefix key spread over its top candidates.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from extproc.config import Runtime, load_runtime
from extproc.explain import explain_remote
from extproc.harness.launch import Client, FleetStack, wait_until
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.predict import facts_for

CHAT = "/v1/chat/completions"
AFFINITY = {
    "enabled": True,
    "signal_max_age_s": 60,
    "new_session_ttl_s": 60,
    "override_ttl_s": 120,
    "hot_key_share": 0.5,
    "hot_key_spread": 3,
    "hot_key_min_requests": 5,
    "hot_key_half_life_s": 600,
}
VIRAL = orjson.dumps(
    {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are the assistant of a viral app. " * 120},
            {"role": "user", "content": "What is trending today?"},
        ],
        "max_tokens": 2,
    }
)


def body(session: str, turn: int) -> bytes:
    messages = [{"role": "user", "content": f"{session} turn {t}"} for t in range(turn + 1)]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 2})


def hash_order(runtime: Runtime, sid: str) -> list[str]:
    point = facts_for(runtime, CHAT, body(sid, 0), {"x-session-id": sid}).session.point
    return runtime.policy.placers["short"].ranked(point)


def sessions_on(runtime: Runtime, primary: str, count: int, tag: str) -> list[str]:
    found = [f"{tag}-{i}" for i in range(2000) if hash_order(runtime, f"{tag}-{i}")[0] == primary]
    assert len(found) >= count
    return found[:count]


class Agreement:
    """Explain, then send; at the end, compare each explanation with Envoy's access log line
    for its request (one request at a time, so the log is in request order)."""

    def __init__(self, stack: FleetStack, client: Client, picker: bool) -> None:
        self.stack = stack
        self.client = client
        self.picker = picker
        self.admin = f"http://127.0.0.1:{stack.metrics_ports[0]}"
        self.log = Path(stack.workdir) / "access.log"
        self.kinds: collections.Counter[str] = collections.Counter()
        self.explained: list[dict[str, Any]] = []
        self.first_line = len(self._lines())

    def _lines(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        data = self.log.read_bytes()
        # Envoy may be writing a line right now: only lines that have ended are complete.
        complete = data[: data.rfind(b"\n") + 1]
        return [orjson.loads(x) for x in complete.splitlines() if x.strip()]

    def _idle(self) -> bool:
        samples = self.stack.processor_metrics()
        return samples.get(("fleet_extproc_streams_active", ()), 0.0) == 0.0

    def check(self, payload: bytes, headers: dict[str, str]) -> dict[str, Any]:
        # The previous exchange's ext_proc stream may still be closing after its client got the
        # response; until it has, its cluster still counts it in flight. Explain and decide must
        # see the same counts, so both wait for it.
        wait_until(self._idle, 10, "the previous exchange's stream to end")
        explained = explain_remote(self.admin, CHAT, headers, payload)
        assert explained["outcome"] == "route", explained
        status, _hdrs, data = self.client.post_json(CHAT, payload, headers)
        assert status == 200, (data[:300], dump_logs(self.stack))
        self.kinds[str(explained["kind"])] += 1
        self.explained.append(explained)
        return explained

    def compare(self) -> None:
        want = self.first_line + len(self.explained)
        # Envoy flushes its access log about once a second.
        wait_until(lambda: len(self._lines()) >= want, 20, "an access log line per request")
        lines = self._lines()[self.first_line : want]
        for i, (line, explained) in enumerate(zip(lines, self.explained, strict=True)):
            brief = {k: explained.get(k) for k in ("kind", "primary", "secondary", "endpoints")}
            assert line["primary"] == explained["primary"], (i, line, brief)
            if self.picker:
                endpoints = explained["endpoints"]
                assert isinstance(endpoints, list) and endpoints, explained
                assert line["upstream"] == endpoints[0], (line, explained)
            else:
                assert line["route_cluster"] == explained["x-fleet-route"], (line, explained)


def _stack(tmp: Path, **processor: Any) -> FleetStack:
    overrides: dict[str, Any] = {"affinity": AFFINITY}
    if processor:
        overrides["processor"] = processor
    return FleetStack(tmp, clusters=3, fleet_overrides=overrides)


@pytest.fixture
def route_mode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with _stack(tmp_path_factory.mktemp("explain-route")) as stack:
        yield stack


@pytest.fixture
def picker_mode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with _stack(tmp_path_factory.mktemp("explain-epp"), mode="endpoint_picker") as stack:
        yield stack


def _offline_cli(stack: FleetStack, sid: str, tmp: Path) -> dict[str, Any]:
    """`extproc explain --config` for a request, as a freshly started processor decides it."""
    path = tmp / f"{sid}.json"
    path.write_bytes(body(sid, 0))
    cmd = [sys.executable, "-m", "extproc", "explain", "--config", str(stack.fleet_path)]
    cmd += ["--body", str(path), "--header", f"x-session-id={sid}"]
    out = subprocess.run(
        cmd,
        capture_output=True,
        check=True,
        timeout=60,
        env={**os.environ},
    )
    result: dict[str, Any] = orjson.loads(out.stdout)
    return result


def _scenario(
    stack: FleetStack, client: Client, picker: bool, tmp: Path, failing: str
) -> Agreement:
    runtime = load_runtime(stack.fleet_path)
    agree = Agreement(stack, client, picker)
    victims = sessions_on(runtime, failing, 3, "victim")
    others = [f"bystander-{i}" for i in range(4)]
    # A fresh processor decides as `extproc explain --config` does (the CLI, offline).
    first = agree.check(body(victims[0], 0), {"x-session-id": victims[0]})
    offline = _offline_cli(stack, victims[0], tmp)
    for key in ("primary", "secondary", "x-fleet-route", "kind", "class"):
        assert offline[key] == first[key], (key, offline, first)
    if picker:
        assert offline["endpoints"] == first["endpoints"], (offline, first)
    for sid in victims[1:] + others:
        agree.check(body(sid, 0), {"x-session-id": sid})
    # A hot prefix key: after hot_key_min_requests it is spread over its top candidates.
    for _ in range(9):
        agree.check(VIRAL, {})
    fault = Client(stack.sim_specs[failing].port)
    try:
        fault.post_json("/admin/fault", b'{"mode": "refuse"}')
        if picker:
            # The picker probes endpoints; wait until it has seen the failure, so that the
            # explain and the request below are decided on the same readiness.
            def noticed() -> bool:
                view = explain_remote(
                    agree.admin, CHAT, {"x-session-id": victims[1]}, body(victims[1], 1)
                )
                return view["primary"] != failing

            wait_until(noticed, 20, "the picker to see the failed endpoint")
        else:
            # "refuse" drops connections after accepting the request, which Envoy no longer
            # retries (issue 12: the engine may have started generating): let the active health
            # check take the cluster out first, as it would a dead engine.
            stack.wait_healthy([failing], healthy=False)
        for turn in (1, 2):
            for sid in victims + others:
                agree.check(body(sid, turn), {"x-session-id": sid})
        # New sessions whose hash primary is the failed cluster.
        for sid in sessions_on(runtime, failing, 2, "newcomer"):
            agree.check(body(sid, 0), {"x-session-id": sid})
    finally:
        fault.post_json("/admin/fault", b'{"mode": "none"}')
        fault.close()
    agree.compare()
    return agree


def test_explain_matches_the_live_processor_in_route_mode(
    route_mode: FleetStack, make_client: MakeClient, tmp_path: Path
) -> None:
    agree = _scenario(route_mode, make_client(route_mode.listener_port), False, tmp_path, "c2")
    # Affinity made decisions pure hashing would not, and explain predicted each of them.
    assert agree.kinds["migrated"] >= 1, agree.kinds
    # The third victim is the third new session in a row hashing to c2: 3 of 3 recent requests
    # would put c2 over 1.1 x the mean, so it starts on its next candidate (the default bound).
    assert agree.kinds["spilled"] >= 1, agree.kinds
    assert agree.kinds["override"] >= 1, agree.kinds
    assert agree.kinds["hot_spread"] >= 1, agree.kinds
    assert len(agree.explained) >= 30


def test_explain_matches_the_live_processor_in_endpoint_picker_mode(
    picker_mode: FleetStack, make_client: MakeClient, tmp_path: Path
) -> None:
    stack = picker_mode
    agree = _scenario(stack, make_client(stack.listener_port), True, tmp_path, "c1")
    assert agree.kinds["migrated"] + agree.kinds["spilled"] >= 1, agree.kinds
    assert agree.kinds["hot_spread"] >= 1, agree.kinds
    assert len(agree.explained) >= 30

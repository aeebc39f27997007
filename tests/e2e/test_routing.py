"""Routing through a real Envoy + processor to simulated clusters."""

from __future__ import annotations

import collections

import orjson

from extproc.config import load_runtime
from extproc.harness.launch import FleetStack
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.predict import explain_live, live_primary

CHAT = "/v1/chat/completions"


def chat_body(messages: list[dict[str, str]], **extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 4, **extra})


def conversation(session: int, turns: int) -> list[list[dict[str, str]]]:
    """Growing message lists: turn k+1 repeats turn k and appends."""
    msgs = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
    out = []
    for t in range(turns):
        msgs = [
            *msgs,
            {"role": "user", "content": f"session {session} question {t}: " + "why? " * 30},
        ]
        out.append(list(msgs))
        msgs = [*msgs, {"role": "assistant", "content": f"answer {t}"}]
    return out


def test_each_session_stays_on_its_primary_across_turns(
    fleet4: FleetStack, make_client: MakeClient
) -> None:
    """The product default: a new session starts where the live processor's explain says (its
    hash primary, or a later candidate when bounded-load placement spills it), and every later
    turn follows that first turn's cluster."""
    client = make_client(fleet4.listener_port)
    served: dict[int, set[str]] = collections.defaultdict(set)
    kinds: collections.Counter[str] = collections.Counter()
    for session in range(24):
        # Half the sessions name themselves in the trusted header, half rely on the prefix key.
        headers = {"x-session-id": f"sess-{session}"} if session % 2 else {}
        first: str | None = None
        for messages in conversation(session, 5):
            body = chat_body(messages)
            if first is None:
                explained = explain_live(fleet4, CHAT, body, headers)
                kinds[str(explained["kind"])] += 1
                expected = str(explained["primary"])
            else:
                expected = first
            status, hdrs, data = client.post_json(CHAT, body, headers)
            assert status == 200, (data, dump_logs(fleet4))
            assert hdrs["x-served-by"] == expected, (session, explained)
            first = first or hdrs["x-served-by"]
            served[session].add(hdrs["x-served-by"])
    assert all(len(clusters) == 1 for clusters in served.values()), served
    # The sessions are not all on one cluster (they share a system prompt).
    assert len({next(iter(c)) for c in served.values()}) >= 3
    # Spills happened and were shown as such: 24 sessions of 5 turns over 4 clusters leave the
    # hash uneven enough (asserted through the metric the processor counts them with).
    samples = fleet4.processor_metrics()
    assert kinds["spilled"] >= 1, kinds
    assert samples[("fleet_route_decisions_total", (("kind", "spilled"),))] == kinds["spilled"]


def test_thousand_sessions_spread_evenly(fleet4: FleetStack, make_client: MakeClient) -> None:
    client = make_client(fleet4.listener_port)
    counts: collections.Counter[str] = collections.Counter()
    body = chat_body([{"role": "user", "content": "hi"}])
    for session in range(1000):
        status, hdrs, _ = client.post_json(CHAT, body, {"x-session-id": f"spread-{session}"})
        assert status == 200
        counts[hdrs["x-served-by"]] += 1
    assert len(counts) == 4
    mean = 1000 / 4
    assert max(counts.values()) / mean <= 1.3, counts


def test_client_sent_route_header_is_ignored(fleet4: FleetStack, make_client: MakeClient) -> None:
    runtime = load_runtime(fleet4.fleet_path)
    client = make_client(fleet4.listener_port)
    for session in range(12):
        headers = {"x-session-id": f"spoof-{session}"}
        body = chat_body([{"role": "user", "content": "route me"}])
        primary = live_primary(fleet4, CHAT, body, headers)
        other = next(n for n in runtime.cluster_names if n != primary)
        spoofed = {
            **headers,
            "x-fleet-route": other,
            "x-fleet-primary": other,
            "x-fleet-class": "long",
        }
        status, hdrs, _ = client.post_json(CHAT, body, spoofed)
        assert status == 200
        assert hdrs["x-served-by"] == primary


def test_four_mib_body_routes_to_its_primary(fleet4: FleetStack, make_client: MakeClient) -> None:
    client = make_client(fleet4.listener_port)
    document = "lorem ipsum dolor sit amet " * (4 * 1024 * 1024 // 27)
    body = chat_body([{"role": "user", "content": document}])
    assert len(body) >= 4 * 1024 * 1024
    expected = live_primary(fleet4, CHAT, body)  # a new session: the bound may spill it
    status, hdrs, data = client.post_json(CHAT, body)
    assert status == 200, data[:300]
    assert hdrs["x-served-by"] == expected


def test_sixteen_mib_body_routes(fleet4: FleetStack, make_client: MakeClient) -> None:
    client = make_client(fleet4.listener_port)
    body = chat_body([{"role": "user", "content": "x" * (16 * 1024 * 1024)}])
    expected = live_primary(fleet4, CHAT, body, {"x-session-id": "big"})
    status, hdrs, data = client.post_json(CHAT, body, {"x-session-id": "big"})
    assert status == 200, data[:300]
    assert hdrs["x-served-by"] == expected


def test_body_over_the_limit_gets_a_json_413(fleet4: FleetStack, make_client: MakeClient) -> None:
    runtime = load_runtime(fleet4.fleet_path)
    client = make_client(fleet4.listener_port)
    size = runtime.config.processor.max_body_bytes + 1000
    body = chat_body([{"role": "user", "content": "y" * size}])
    status, hdrs, data = client.post_json(CHAT, body)
    assert status == 413
    assert hdrs["content-type"] == "application/json"
    assert orjson.loads(data)["error"]["code"] == "request_too_large"


def test_malformed_json_gets_the_api_error_format(
    fleet4: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(fleet4.listener_port)
    status, hdrs, data = client.post_json(CHAT, b'{"model": "m", "messages": [')
    assert status == 400
    assert hdrs["content-type"] == "application/json"
    err = orjson.loads(data)["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]

    status, _, data = client.post_json("/v1/messages", b"not json")
    assert status == 400
    doc = orjson.loads(data)
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"

    status, _, data = client.request(
        "POST", CHAT, chat_body([{"role": "user", "content": "hi"}]), {"content-type": "text/plain"}
    )
    assert status == 400
    assert "Content-Type" in orjson.loads(data)["error"]["message"]


def test_non_inference_paths_pass_through(fleet4: FleetStack, make_client: MakeClient) -> None:
    client = make_client(fleet4.listener_port)
    status, _, data = client.request("GET", "/v1/models")
    assert status == 200
    assert orjson.loads(data)["object"] == "list"

"""The header path through a real Envoy (processor.read_body: when_needed, the default).

A request with the trusted session header and a content-length costs Envoy one ext_proc message
(the headers) instead of two, its body goes straight upstream, and it lands on the cluster the
body path would have chosen. Counted with Envoy's own ext_proc statistics.
"""

from __future__ import annotations

import http.client
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import LOOPBACK, Client, FleetStack, wait_until
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.predict import live_primary
from tests.support.flow import NO_PLACEMENT, refused_at_once

CHAT = "/v1/chat/completions"
# Messages Envoy's ext_proc filter sent to the processor (the listener's stat prefix is fixed
# by render/envoy.py, the filter adds "ext_proc.").
SENT = "http.ingress.ext_proc.stream_msgs_sent"


def chat_body(text: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def test_one_exchange_per_request_and_the_body_paths_cluster(
    fleet4: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(fleet4.listener_port)
    sizes = (100, 70_000, 4 * 1024 * 1024)
    before = fleet4.envoy_stat(SENT)
    for n, size in enumerate(sizes):
        headers = {"x-session-id": f"agent-{n}"}
        body = chat_body("w" * size)
        # The cluster the body path would choose: the live processor's decision from the whole
        # body (explain), bounded placement of this new session included.
        expected = live_primary(fleet4, CHAT, body, headers)
        status, hdrs, data = client.post_json(CHAT, body, headers)
        assert status == 200, (data[:300], dump_logs(fleet4))
        assert hdrs["x-served-by"] == expected
    assert fleet4.envoy_stat(SENT) - before == len(sizes)  # the headers message only
    # Without a session header the body is needed: two messages (headers, then the body).
    body = chat_body("keyed by the prefix")
    expected = live_primary(fleet4, CHAT, body)
    before = fleet4.envoy_stat(SENT)
    status, hdrs, _ = client.post_json(CHAT, body)
    assert status == 200
    assert hdrs["x-served-by"] == expected
    assert fleet4.envoy_stat(SENT) - before == 2
    samples = fleet4.processor_metrics()
    assert samples[("fleet_header_decisions_total", ())] == len(sizes)


def test_chunked_upload_waits_for_its_body(fleet4: FleetStack) -> None:
    """No content-length: the size is known only from the body, so Envoy sends it (two
    messages) and the request is placed as the body path places it."""
    headers = {"x-session-id": "agent-chunked", "content-type": "application/json"}
    body = chat_body("chunk " * 5000)
    expected = live_primary(fleet4, CHAT, body, headers)
    before = fleet4.envoy_stat(SENT)
    conn = http.client.HTTPConnection(LOOPBACK, fleet4.listener_port, timeout=60)
    try:
        pieces = [body[i : i + 4096] for i in range(0, len(body), 4096)]
        conn.request("POST", CHAT, body=iter(pieces), headers=headers, encode_chunked=True)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, data[:300]
    assert resp.getheader("x-served-by") == expected
    assert fleet4.envoy_stat(SENT) - before == 2


def test_bad_json_on_the_header_path_is_answered_by_the_upstream(
    fleet4: FleetStack, make_client: MakeClient
) -> None:
    """Documented: the processor never reads this body, so the engine answers its own 400 (in
    the API's format); the request was still placed (and budgeted) like any other."""
    client = make_client(fleet4.listener_port)
    status, hdrs, data = client.post_json(
        CHAT, b'{"model": "m", "messages": [', {"x-session-id": "agent-bad"}
    )
    assert status == 400, data[:300]
    assert hdrs["x-served-by"] in load_runtime(fleet4.fleet_path).cluster_names
    assert "JSON" in orjson.loads(data)["error"]["message"]


@pytest.mark.parametrize("session_header", [True, False], ids=["header-path", "body-path"])
def test_a_request_decided_at_headers_holds_its_budget_until_it_ends(
    tmp_path_factory: pytest.TempPathFactory, session_header: bool
) -> None:
    """Envoy ends an ext_proc stream once it expects no further message, and the stream's end
    is when the budget is given back: the header path's override keeps a phase pending
    (response trailers), so a class that admits one request at a time refuses a second one
    while the first generates (JSON and SSE), and admits again once it has ended. The same
    holds on the body path (no session header), whose request-headers answer turns the
    response phases on (responses.continue_inference_headers)."""
    classes = [{"name": "only", "budget": {"max_concurrent": 1}}]
    stack = FleetStack(
        tmp_path_factory.mktemp("header-hold"),
        clusters=2,
        # About 1.5 s of generation (64 tokens at 40 tokens/s, real time).
        sim_args=("--time-scale", "1", "--decode-tps", "40"),
        fleet_overrides={"classes": refused_at_once(classes), "flow": NO_PLACEMENT},
    )
    headers = {"content-type": "application/json"}
    if session_header:
        headers["x-session-id"] = "agent-hold"

    def held() -> float:
        samples = stack.processor_metrics()
        return sum(v for (n, _l), v in samples.items() if n == "fleet_budget_inflight_requests")

    with stack, ThreadPoolExecutor(1) as pool:
        first_client, second_client = Client(stack.listener_port), Client(stack.listener_port)
        try:
            for stream in (False, True):
                body = orjson.dumps(
                    {
                        "model": "m",
                        "messages": [{"role": "user", "content": "go"}],
                        "max_tokens": 64,
                        "stream": stream,
                    }
                )
                first = pool.submit(first_client.request, "POST", CHAT, body, headers)
                wait_until(lambda: held() == 1, 10, "the first request to hold the budget")
                status, _, data = second_client.request("POST", CHAT, body, headers)
                assert status == 429, (stream, data[:300], dump_logs(stack))
                assert not first.done(), "the first request ended before the second was refused"
                assert first.result(timeout=30)[0] == 200
                wait_until(lambda: held() == 0, 10, "the budget to be given back")
                status, _, _ = second_client.request("POST", CHAT, body, headers)
                assert status == 200
                wait_until(lambda: held() == 0, 10, "the budget to be given back")
            decided = stack.processor_metrics().get(("fleet_header_decisions_total", ()), 0.0)
            assert decided == (6 if session_header else 0)
        finally:
            first_client.close()
            second_client.close()

"""Requests with trailers through a real Envoy: decided on the whole body, never a false 413.

What Envoy 1.40 sends in BUFFERED mode (seen with these clients): an HTTP/2 request whose body is
followed by trailers reaches ext_proc as the whole body with end_of_stream=false, then (with
request_trailer_mode SEND) a trailers message; headers followed directly by trailers reach it as
headers, then trailers, with no body message at all. HTTP/1.1 chunked trailers are dropped by
Envoy's HTTP/1 codec by default (enable_trailers is off), so that body ends the stream.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from extproc.harness.launch import Client, FleetStack, http_get, wait_until
from tests.e2e.h2_client import h2_post
from tests.support.flow import NO_PLACEMENT, refused_at_once

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
TRAILERS = [("x-checksum", "sha256=abc"), ("x-client-trace", "t1")]
CLASSES: list[dict[str, Any]] = [
    {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 1}},
    {"name": "long"},
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    # One cluster, so every request of a class lands on the same budget; a 48-token stream at
    # 16 tokens/s holds the short class's single slot for ~3 s.
    stack = FleetStack(
        tmp_path_factory.mktemp("trailers"),
        clusters=1,
        sim_args=("--time-scale", "1", "--decode-tps", "16", "--prefill-tps", "2000000"),
        fleet_overrides={"classes": refused_at_once(CLASSES), "flow": NO_PLACEMENT},
    )
    with stack:
        yield stack


def _chat(content: str, **extra: Any) -> bytes:
    msg = {"role": "user", "content": content}
    return orjson.dumps({"model": "m", "messages": [msg], "max_tokens": 4, **extra})


def _upstream(stack: FleetStack) -> dict[str, Any]:
    status, body = http_get(stack.sim_specs["c1"].port, "/admin/concurrency")
    assert status == 200
    doc: dict[str, Any] = orjson.loads(body)
    return doc


def _total(stack: FleetStack, klass: str) -> int:
    return int(_upstream(stack)["total"].get(klass, 0))


def test_http2_body_with_trailers_is_routed_and_admitted(fleet: FleetStack) -> None:
    before = _total(fleet, "short")
    resp = h2_post(fleet.listener_port, CHAT, _chat("hello with trailers"), trailers=TRAILERS)
    assert resp.status == 200, resp
    assert resp.headers["x-served-by"] == "c1"
    assert orjson.loads(resp.body)["object"] == "chat.completion"
    # It reached the upstream with the processor's class: placed and admitted like any other.
    assert _total(fleet, "short") == before + 1


def test_large_http2_body_with_trailers_arrives_whole(fleet: FleetStack) -> None:
    # ~2 MB of JSON in ~130 DATA frames, then trailers: still one body message, decided whole.
    before = _total(fleet, "long")
    body = _chat("long context " + "tool output line. " * 120_000)
    assert len(body) > 2_000_000
    resp = h2_post(fleet.listener_port, CHAT, body, trailers=TRAILERS)
    assert resp.status == 200, resp.body[:300]
    assert _total(fleet, "long") == before + 1


def test_trailers_do_not_bypass_a_full_class(fleet: FleetStack) -> None:
    held: list[int] = []

    def hold() -> None:
        client = Client(fleet.listener_port, timeout=30)
        try:
            body = _chat("hold the only short slot", max_tokens=48, stream=True)
            held.append(client.post_json(CHAT, body)[0])
        finally:
            client.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        wait_until(lambda: _upstream(fleet)["inflight"].get("short") == 1, 10, "slot held")
        resp = h2_post(fleet.listener_port, CHAT, _chat("full class, trailers"), trailers=TRAILERS)
        plain = h2_post(fleet.listener_port, CHAT, _chat("full class, no trailers"))
    finally:
        holder.join(30)
    assert held == [200]
    # The same answer as the request without trailers: the class's 429 with retry hints.
    assert (resp.status, plain.status) == (429, 429), (resp, plain)
    assert "retry-after" in resp.headers
    assert orjson.loads(resp.body)["error"]["type"] == orjson.loads(plain.body)["error"]["type"]


@pytest.mark.parametrize(
    ("path", "style_key"), [(CHAT, "error"), ("/v1/messages", "type")], ids=["openai", "anthropic"]
)
def test_headers_then_trailers_without_body_get_a_json_400(
    fleet: FleetStack, path: str, style_key: str
) -> None:
    before = _upstream(fleet)["total"]
    resp = h2_post(fleet.listener_port, path, b"", trailers=TRAILERS)
    assert resp.status == 400, resp
    doc = orjson.loads(resp.body)
    assert style_key in doc
    if path == "/v1/messages":
        assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    else:
        assert doc["error"]["type"] == "invalid_request_error"
    # Answered by the processor: nothing reached the upstream, classified or not.
    assert _upstream(fleet)["total"] == before


def test_http1_chunked_trailers_are_dropped_by_envoy_and_the_body_decided(
    fleet: FleetStack,
) -> None:
    before = _total(fleet, "short")
    body = _chat("chunked with trailers")
    raw = (
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\nte: trailers\r\nconnection: close\r\n\r\n"
    ).encode()
    raw += b"%x\r\n" % len(body) + body + b"\r\n0\r\nx-checksum: sha256=abc\r\n\r\n"
    with socket.create_connection(("127.0.0.1", fleet.listener_port), timeout=30) as sock:
        sock.sendall(raw)
        answer = bytearray()
        while chunk := sock.recv(1 << 16):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), bytes(answer[:300])
    assert _total(fleet, "short") == before + 1

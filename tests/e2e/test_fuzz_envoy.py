"""Hostile requests through a real Envoy + processor + simulated clusters.

A bounded CI run of `extproc fuzz --target envoy`, and regression tests for what the full run
found: Envoy's own error answers (a malformed or oversized header block, a malformed trailer
block after a well-formed request, an unreachable upstream) were text/plain, which neither SDK
family can parse; they are now JSON errors (extproc/render/local_reply.py).
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from extproc.harness.launch import LOOPBACK, Client, FleetStack, wait_until
from extproc.reliability.fuzz_cases import error_format_problem
from extproc.reliability.fuzz_cmd import failed
from extproc.reliability.fuzz_envoy import exchange, fuzz_overrides, run_envoy_fuzz
from tests.support.flow import NO_PLACEMENT, refused_at_once


def test_five_hundred_hostile_requests_through_envoy() -> None:
    """Every kind of defect fails this, RELIABILITY.md's defect 6 included: its three kinds
    (trailer cases closed without an answer, Envoy's text/plain 413, the simulated engine's
    text/plain answer to a compressed body) have regression tests below."""
    tally, leftovers = run_envoy_fuzz(500, seed=14, batch=8, pool_size=150)
    assert tally.cases == 500
    assert failed(tally, leftovers) == [], dict(tally.defect_kinds)
    assert tally.outcomes["routed"] > 20
    assert leftovers["bypassed_requests"] == 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with FleetStack(tmp_path_factory.mktemp("localreply"), clusters=1) as s:
        yield s


@pytest.fixture(scope="module")
def observing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    """A processor that reads responses (affinity and usage inspection on)."""
    overrides = {"affinity": {"enabled": True}, "processor": {"inspect_usage": True}}
    with FleetStack(
        tmp_path_factory.mktemp("observing"), clusters=1, fleet_overrides=overrides
    ) as s:
        yield s


def _raw(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    result = exchange(port, (head, body))
    assert not isinstance(result, str), result
    return result


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        (b"x-tenant-tier: \x08\r\n", 400),  # a control character in a header value
        (b"".join(b"x-f%d: v\r\n" % i for i in range(200)), 431),  # a header flood
        (b"x-big: " + b"o" * (64 << 10) + b"\r\n", 431),  # one oversized header
    ],
)
def test_envoy_header_errors_are_json_errors(stack: FleetStack, extra: bytes, status: int) -> None:
    for path in (b"/v1/chat/completions", b"/v1/messages"):
        head = b"POST " + path + b" HTTP/1.1\r\nhost: g\r\n" + extra + b"content-length: 2\r\n\r\n"
        code, headers, body = _raw(stack.listener_port, head)
        assert code == status
        assert error_format_problem(path.decode(), body, headers.get("content-type")) is None, body


@pytest.mark.parametrize(
    "extra",
    [b"x-tenant-tier: \x08\r\n", b"".join(b"x-f%d: v\r\n" % i for i in range(200))],
    ids=["control-character", "header-flood"],
)
def test_header_errors_are_answered_when_the_processor_reads_responses(
    observing: FleetStack, extra: bytes
) -> None:
    """Defect 2 of RELIABILITY.md: with the response phases rendered on, Envoy's own answer to a
    malformed header block waited on the processor and never came (Envoy closed the connection
    a second later). The phases are now asked for per inference request, so the answer comes."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\n" + extra + b"content-length: 2\r\n\r\n"
    )
    code, headers, body = _raw(observing.listener_port, head)
    assert code in (400, 431)
    assert error_format_problem("/v1/chat/completions", body, headers.get("content-type")) is None


def test_responses_are_still_read_when_asked_for_per_request(observing: FleetStack) -> None:
    """The per-request override does turn the response phases on: the response's load report
    (headers) and its usage (body) are read."""
    names = ("fleet_load_reports_total", "fleet_upstream_output_tokens_total")

    def totals() -> dict[str, float]:
        samples = observing.processor_metrics()
        return {n: sum(v for (name, _), v in samples.items() if name == n) for n in names}

    before = totals()
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    code, _headers, _raw_body = _raw(observing.listener_port, head + body)
    assert code == 200
    after = totals()
    assert all(after[n] > before[n] for n in names), (before, after)


@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/v1/messages"])
def test_malformed_trailer_after_a_good_request_is_a_json_error(
    stack: FleetStack, path: bytes
) -> None:
    """A control character in a trailer is a codec error after the request exists: it has a
    ``:path``, and Envoy sets its DPE flag only when it closes the connection, after the reply
    was mapped, so neither of the older mapper filters matched (RELIABILITY.md, defect 5)."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    head = (
        b"POST " + path + b" HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
        b"anthropic-version: 2023-06-01\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    framed = b"%x\r\n" % len(body) + body + b"\r\n0\r\nx-checksum: a\x08b\r\n\r\n"
    result = exchange(stack.listener_port, (head, framed))
    assert not isinstance(result, str), result
    code, headers, raw = result
    assert code == 400
    assert error_format_problem(path.decode(), raw, headers.get("content-type")) is None, raw
    assert orjson.loads(raw)["error"]["code"] == "http1.invalid_characters"


def test_unreachable_upstream_is_a_json_error(tmp_path: Path) -> None:
    with FleetStack(tmp_path, clusters=1) as s:
        s.sims["c1"].kill()
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        head = (
            b"POST /v1/messages HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
            b"anthropic-version: 2023-06-01\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            % len(body)
        )
        code, headers, raw = _raw(s.listener_port, head + body)
        assert code == 503
        assert error_format_problem("/v1/messages", raw, headers.get("content-type")) is None
        assert orjson.loads(raw)["type"] == "error"


def test_processor_errors_keep_their_own_body(stack: FleetStack) -> None:
    """The mapper leaves the processor's immediate answers alone (they carry no flag)."""
    body = b'{"model": "m", "messages": "not an array"}'
    head = (
        b"POST /v1/messages HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    code, _headers, raw = _raw(stack.listener_port, head + body)
    assert code == 400
    doc = orjson.loads(raw)
    assert doc["error"]["type"] == "invalid_request_error"
    assert "messages" in doc["error"]["message"]


def test_raw_client_sees_socket_errors_as_outcomes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert isinstance(exchange(port, (b"GET / HTTP/1.1\r\n\r\n", b"")), str)


# ----- defect 6 (RELIABILITY.md) --------------------------------------------------------------

CHAT_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
GENERATE_64 = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 64}


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with FleetStack(
        tmp_path_factory.mktemp("budgeted"), clusters=1, fleet_overrides=fuzz_overrides()
    ) as s:
        yield s


@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/v1/messages"])
@pytest.mark.parametrize("trailer", [b"x-checksum: a\x08b", b"x-checksum: \x17\x01"])
def test_malformed_trailer_of_a_budgeted_chunked_upload_is_answered(
    budgeted: FleetStack, path: bytes, trailer: bytes
) -> None:
    """Defect 6: Envoy's answer to a codec error after the request headers ran through the
    response phases the processor had turned on for the request, and the connection manager
    closed the connection while the answer waited on the processor (no answer at all). A body
    without a content-length now reads no response phase Envoy's answer would wait on."""
    head = (
        b"POST " + path + b" HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
        b"anthropic-version: 2023-06-01\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    framed = b"%x\r\n" % len(CHAT_BODY) + CHAT_BODY + b"\r\n0\r\n" + trailer + b"\r\n\r\n"
    result = exchange(budgeted.listener_port, (head, framed))
    assert not isinstance(result, str), result
    code, headers, raw = result
    assert code == 400, raw
    assert error_format_problem(path.decode(), raw, headers.get("content-type")) is None, raw


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_body_over_envoys_buffer_limit_is_a_json_error(budgeted: FleetStack, path: str) -> None:
    """Defect 6: a body past Envoy's buffer limit (rendered from the processor's max_body_bytes,
    4 MiB in the fuzz config) got Envoy's own 413 in text/plain; the mapper now rewrites every
    answer Envoy writes itself."""
    text = "a" * (9 << 20)
    body = orjson.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    )
    head = (
        f"POST {path} HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    code, headers, raw = _raw(budgeted.listener_port, head, body)
    assert code == 413
    assert error_format_problem(path, raw, headers.get("content-type")) is None, raw
    assert orjson.loads(raw)["error"]["code"] == "request_payload_too_large"


def test_a_compressed_body_on_the_header_path_gets_the_engines_json_error(
    budgeted: FleetStack,
) -> None:
    """Defect 6: on the header path the body goes straight to the engine. A br body was
    decoded, and refused in text/plain, by the simulated engine's HTTP server (aiohttp) before
    its handler could name the cluster; real engines (uvicorn) do not decode a request's
    content-encoding and answer their own JSON 400."""
    body = b"\x8b\x02\x80" + CHAT_BODY[::-1]
    head = (
        b"POST /v1/messages HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
        b"anthropic-version: 2023-06-01\r\nx-session-id: agent-br\r\ncontent-encoding: br\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    code, headers, raw = _raw(budgeted.listener_port, head, body)
    assert code == 400
    assert headers.get("x-served-by") == "c1"  # the engine's own answer
    assert error_format_problem("/v1/messages", raw, headers.get("content-type")) is None, raw


def test_a_chunked_upload_holds_its_budget_until_it_ends(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The chunked upload's override reads no response phase but keeps one pending (response
    trailers), so the ext_proc stream, and the budget it holds, lasts until the exchange ends:
    a class that admits one request at a time refuses a second one while a chunked first one
    generates (JSON and SSE), and admits again once it has ended."""
    classes = [{"name": "only", "budget": {"max_concurrent": 1}}]
    stack = FleetStack(
        tmp_path_factory.mktemp("chunked-hold"),
        clusters=1,
        # About 1.5 s of generation (64 tokens at 40 tokens/s, real time).
        sim_args=("--time-scale", "1", "--decode-tps", "40"),
        fleet_overrides={"classes": refused_at_once(classes), "flow": NO_PLACEMENT},
    )

    def held() -> float:
        samples = stack.processor_metrics()
        return sum(v for (n, _l), v in samples.items() if n == "fleet_budget_inflight_requests")

    def chunked(body: bytes) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(LOOPBACK, stack.listener_port, timeout=60)
        try:
            pieces = [body[i : i + 16] for i in range(0, len(body), 16)]
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=iter(pieces),
                headers={"content-type": "application/json"},
                encode_chunked=True,
            )
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    with stack, ThreadPoolExecutor(1) as pool:
        second = Client(stack.listener_port)
        try:
            for stream in (False, True):
                body = orjson.dumps({**GENERATE_64, "stream": stream})
                first = pool.submit(chunked, body)
                wait_until(lambda: held() == 1, 10, "the chunked request to hold the budget")
                status, _, data = second.request(
                    "POST", "/v1/chat/completions", body, {"content-type": "application/json"}
                )
                assert status == 429, (stream, data[:300])
                assert not first.done(), "the chunked request ended before the second was refused"
                assert first.result(timeout=30)[0] == 200
                wait_until(lambda: held() == 0, 10, "the budget to be given back")
        finally:
            second.close()

"""Requests with trailers, as Envoy 1.40 sends them in BUFFERED mode, over a real gRPC stream.

Observed with a logging ext_proc server behind Envoy (tests/e2e/test_trailers.py runs the same
requests through Envoy): the first message carries protocol_config (request_body_mode
BUFFERED); an HTTP/2 body followed by trailers arrives as ONE body message holding the whole
body with end_of_stream=false, then a request_trailers message; headers followed directly by
trailers bring no body message at all, only the trailers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from tests.stream.test_servicer import (
    CHAT,
    MESSAGES,
    Processor,
    assert_continues,
    body_msg,
    chat,
    exchange,
    headers_msg,
    immediate,
    routed,
    start,
)

__all__ = ["start"]  # the fixture, shared with test_servicer

Start = Callable[..., Awaitable[Processor]]
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def first_headers(path: str = CHAT, mode: int | None = BUFFERED) -> ep.ProcessingRequest:
    msg = headers_msg(path)
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
    return msg


def trailers_msg() -> ep.ProcessingRequest:
    trailers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key="x-checksum", raw_value=b"sha256=abc")]
    )
    return ep.ProcessingRequest(request_trailers=ep.HttpTrailers(trailers=trailers))


def continues_trailers(answer: ep.ProcessingResponse) -> bool:
    return answer.WhichOneof(
        "response"
    ) == "request_trailers" and not answer.request_trailers.HasField("header_mutation")


async def test_a_buffered_body_before_trailers_is_decided_whole(start: Start) -> None:
    proc = await start()
    body = chat("a request with trailers", max_tokens=8)
    head, decided, after = await exchange(
        proc, [first_headers(), body_msg(body, end_of_stream=False), trailers_msg()]
    )
    assert_continues(head)
    headers = routed(decided)
    # The same decision as for the same body without trailers.
    expected = proc.expected_route(CHAT, {"content-type": "application/json"}, body)
    assert headers["x-fleet-primary"] == expected.placement.primary
    assert headers["x-fleet-class"] == expected.request_class.name
    assert continues_trailers(after)
    labels = {"api": "openai.chat", "request_class": expected.request_class.name}
    assert proc.sample("fleet_requests_total", {**labels, "outcome": "routed"}) == 1


async def test_without_protocol_config_a_body_before_trailers_is_taken_as_buffered(
    start: Start,
) -> None:
    # Envoys older than protocol_config: BUFFERED, what the rendered filter asks for.
    proc = await start()
    _head, decided, _after = await exchange(
        proc,
        [
            first_headers(mode=None),
            body_msg(chat("old envoy"), end_of_stream=False),
            trailers_msg(),
        ],
    )
    routed(decided)


async def test_headers_then_trailers_get_the_empty_body_400(start: Start) -> None:
    proc = await start()
    for path, style in ((CHAT, "openai"), (MESSAGES, "anthropic")):
        head, answer = await exchange(proc, [first_headers(path), trailers_msg()])
        assert_continues(head)
        status, doc, _ = immediate(answer)
        assert status == 400
        if style == "openai":
            assert doc["error"]["type"] == "invalid_request_error"
        else:
            assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"


async def test_trailers_of_a_request_that_is_not_inference_pass(start: Start) -> None:
    proc = await start()
    head, answer = await exchange(proc, [first_headers("/v1/models"), trailers_msg()])
    assert head.WhichOneof("response") == "request_headers"
    assert continues_trailers(answer)

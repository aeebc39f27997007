"""The ext_proc servicer over a real grpc.aio server and channel, driven by scripted streams.

Each test starts FleetProcessor on 127.0.0.1 port 0, wired like extproc/serve/service.py,
and plays Envoy: request_headers (pseudo-headers as raw_value bytes), then request_body with
end_of_stream=True, one answer per message.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.core.decide import Route
from extproc.core.facts import RequestFacts, parse_request
from extproc.names import (
    BUFFER_HEADROOM,
    CLASS_HEADER,
    FLEET_HEADERS,
    PRIMARY_HEADER,
    ROUTE_HEADER,
    SECONDARY_HEADER,
    SESSION_HEADER,
)
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.protocol.server import FleetProcessor
from extproc.serve.service import grpc_options

ROOT = Path(__file__).resolve().parents[2]
CANONICAL = ROOT / "compose" / "fleet.yaml"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
STEP_TIMEOUT = 20.0  # per gRPC step; generous for a 16 MiB body on a loaded CI machine


def chat(content: str, **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra})


@dataclass
class Processor:
    runtime: Runtime
    metrics: Metrics
    registry: CollectorRegistry
    stub: Any
    max_body_bytes: int

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    def expected_route(self, path: str, headers: dict[str, str], body: bytes) -> Route:
        """The core's own decision for this request: what the stream must carry to Envoy."""
        facts = parse_request(
            path,
            {k.lower(): v for k, v in headers.items()},
            body,
            self.runtime.key_rules,
            self.runtime.parse_limits,
        )
        assert isinstance(facts, RequestFacts), facts
        return self.runtime.policy.route(facts)


def load_canonical(**processor: Any) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(CANONICAL.read_text())
    data = copy.deepcopy(data)
    data["processor"].update(processor)
    # Routes are predicted by pure hashing (Processor.expected_route): these tests are about
    # the protocol, not balance (bounded placement of new sessions would spill some).
    data.setdefault("affinity", {})["balance_factor"] = 0
    return data


@pytest.fixture
async def start() -> AsyncIterator[Callable[..., Awaitable[Processor]]]:
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []

    async def _start(
        reset_linger_s: float = 0.0, doc: dict[str, Any] | None = None, **processor: Any
    ) -> Processor:
        """The canonical fleet with these processor settings, or the fleet ``doc``."""
        cfg = parse_config(doc or load_canonical(**processor), "compose/fleet.yaml")
        runtime = compile_runtime(cfg)
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        options = grpc_options(cfg.processor.max_body_bytes)
        server = grpc.aio.server(options=options)
        ep_grpc.add_ExternalProcessorServicer_to_server(
            FleetProcessor(
                Pipeline(RuntimeHolder(runtime), metrics), reset_linger_s=reset_linger_s
            ),
            server,
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        # The client plays Envoy, whose gRPC client sets no message size cap of its own: only
        # the processor's receive limit decides what gets through.
        unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=unlimited)
        channels.append(channel)
        return Processor(
            runtime,
            metrics,
            registry,
            ep_grpc.ExternalProcessorStub(channel),
            cfg.processor.max_body_bytes,
        )

    yield _start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)


def headers_msg(
    path: str,
    method: str = "POST",
    extra: dict[str, str] | None = None,
    end_of_stream: bool = False,
    content_type: str | None = "application/json",
) -> ep.ProcessingRequest:
    pairs = [(":method", method), (":path", path), (":authority", "gateway"), (":scheme", "http")]
    if content_type is not None:
        pairs.append(("content-type", content_type))
    pairs.extend((extra or {}).items())
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=header_map, end_of_stream=end_of_stream)
    )


def body_msg(body: bytes, end_of_stream: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))


async def exchange(
    proc: Processor, messages: Iterable[ep.ProcessingRequest]
) -> list[ep.ProcessingResponse]:
    """One ext_proc stream: send each message, read its answer, then end the stream cleanly."""
    call = proc.stub.Process()
    answers: list[ep.ProcessingResponse] = []
    for message in messages:
        await asyncio.wait_for(call.write(message), STEP_TIMEOUT)
        answer = await asyncio.wait_for(call.read(), STEP_TIMEOUT)
        assert answer is not grpc.aio.EOF, "the processor closed the stream instead of answering"
        answers.append(answer)
    await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT)
    # The server ends the stream when Envoy does; no extra answers, and the status is OK.
    assert await asyncio.wait_for(call.read(), STEP_TIMEOUT) is grpc.aio.EOF
    assert await asyncio.wait_for(call.code(), STEP_TIMEOUT) == grpc.StatusCode.OK
    return answers


async def request(
    proc: Processor,
    body: bytes,
    path: str = CHAT,
    extra: dict[str, str] | None = None,
) -> ep.ProcessingResponse:
    first, second = await exchange(proc, [headers_msg(path, extra=extra), body_msg(body)])
    assert_continues(first)
    return second


def assert_continues(answer: ep.ProcessingResponse) -> None:
    """Header phase: continue with nothing changed (routing waits for the body)."""
    assert answer.WhichOneof("response") == "request_headers"
    assert not answer.request_headers.HasField("response")


def set_headers(answer: ep.ProcessingResponse) -> dict[str, str]:
    assert answer.WhichOneof("response") == "request_body", answer
    common = answer.request_body.response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def routed(answer: ep.ProcessingResponse) -> dict[str, str]:
    headers = set_headers(answer)
    # Without clear_route_cache Envoy keeps the route it picked before the body arrived.
    assert answer.request_body.response.clear_route_cache
    assert set(headers) == set(FLEET_HEADERS)
    return headers


def immediate(answer: ep.ProcessingResponse) -> tuple[int, dict[str, Any], dict[str, str]]:
    assert answer.WhichOneof("response") == "immediate_response", answer
    resp = answer.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in resp.headers.set_headers}
    assert headers.get("content-type") == "application/json"
    return resp.status.code, orjson.loads(resp.body), headers


def assert_openai_error(doc: dict[str, Any], code: str) -> None:
    assert set(doc) == {"error"}
    assert doc["error"]["type"] == "invalid_request_error"
    assert doc["error"]["code"] == code
    assert isinstance(doc["error"]["message"], str)
    assert doc["error"]["message"]


def assert_anthropic_error(doc: dict[str, Any], kind: str) -> None:
    assert doc["type"] == "error"
    assert set(doc["error"]) == {"type", "message"}
    assert doc["error"]["type"] == kind
    assert doc["error"]["message"]


# --- routing ------------------------------------------------------------------------------


async def test_a_routed_request_gets_fleet_headers_and_clears_the_route_cache(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    body = chat("hello there", max_tokens=64)
    headers = routed(await request(proc, body, extra={"x-session-id": "sess-42"}))
    expected = proc.expected_route(
        CHAT, {"x-session-id": "sess-42", "content-type": "application/json"}, body
    )
    primary, secondary = expected.placement.primary, expected.placement.secondary
    assert headers[PRIMARY_HEADER] == primary
    assert headers[SECONDARY_HEADER] == secondary
    assert headers[ROUTE_HEADER] == f"{primary}__{secondary}"
    assert primary in proc.runtime.cluster_names
    assert secondary in proc.runtime.cluster_names
    assert primary != secondary
    assert headers[CLASS_HEADER] == "short"
    assert len(headers[SESSION_HEADER]) == 16
    assert "sess-42" not in headers[SESSION_HEADER]


async def test_the_same_session_gets_the_same_route_on_every_stream(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    by_header = [
        routed(await request(proc, chat(f"turn {i}"), extra={"x-session-id": "sticky"}))
        for i in range(4)
    ]
    assert all(h == by_header[0] for h in by_header)
    # Prefix-keyed: later turns of one conversation extend the first and keep its route.
    convo: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    by_prefix = []
    for i in range(4):
        convo.append({"role": "user", "content": f"question {i}"})
        by_prefix.append(routed(await request(proc, orjson.dumps({"messages": convo}))))
        convo.append({"role": "assistant", "content": f"answer {i}"})
    assert all(h == by_prefix[0] for h in by_prefix)


async def test_sessions_spread_over_the_fleet(start: Callable[..., Awaitable[Processor]]) -> None:
    proc = await start()
    primaries = {
        routed(await request(proc, chat("x"), extra={"x-session-id": f"s{i}"}))[PRIMARY_HEADER]
        for i in range(40)
    }
    assert primaries == set(proc.runtime.cluster_names)


async def test_a_client_sent_fleet_header_does_not_influence_the_decision(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    body = chat("pick me a cluster")
    honest = routed(await request(proc, body))
    other = next(n for n in proc.runtime.cluster_names if n != honest[PRIMARY_HEADER])
    spoof = {
        ROUTE_HEADER: other,
        PRIMARY_HEADER: other,
        SECONDARY_HEADER: other,
        CLASS_HEADER: "long",
        SESSION_HEADER: "0000000000000000",
    }
    assert routed(await request(proc, body, extra=spoof)) == honest


async def test_a_16_mib_body_routes(start: Callable[..., Awaitable[Processor]]) -> None:
    proc = await start()
    body = chat("d" * (16 << 20))
    assert len(body) > 16 << 20
    assert len(body) < proc.max_body_bytes
    headers = routed(await request(proc, body))
    assert headers[CLASS_HEADER] == "long"  # ~4M estimated tokens
    expected = proc.expected_route(CHAT, {"content-type": "application/json"}, body)
    assert headers[ROUTE_HEADER] == expected.placement.route


async def test_trailing_slash_and_query_string_still_route(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    plain = routed(await request(proc, chat("q")))
    assert routed(await request(proc, chat("q"), path=CHAT + "/?stream=false")) == plain


# --- pass-through -------------------------------------------------------------------------


async def test_get_models_passes_through_without_a_decision(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    (answer,) = await exchange(
        proc, [headers_msg("/v1/models", method="GET", end_of_stream=True, content_type=None)]
    )
    assert_continues(answer)
    assert proc.sample("fleet_passthrough_requests_total") == 1
    assert proc.sample("fleet_route_decisions_total", {"kind": "primary"}) == 0


async def test_a_post_to_a_non_inference_path_passes_through_body_and_all(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    head, body = await exchange(
        proc, [headers_msg("/v1/embeddings"), body_msg(b"this is not even JSON")]
    )
    assert_continues(head)
    assert body.WhichOneof("response") == "request_body"
    assert not body.request_body.HasField("response")
    assert proc.sample("fleet_passthrough_requests_total") == 1


# --- bad input ----------------------------------------------------------------------------


async def test_malformed_json_is_an_immediate_openai_400(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    status, doc, _ = immediate(await request(proc, b'{"messages": [ {"role": "user"'))
    assert status == 400
    assert_openai_error(doc, "invalid_request_error")
    assert "JSON" in doc["error"]["message"]


async def test_anthropic_path_gets_anthropic_errors(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    status, doc, _ = immediate(await request(proc, b"{not json", path=MESSAGES))
    assert status == 400
    assert_anthropic_error(doc, "invalid_request_error")


async def test_wrong_messages_type_is_400_even_with_a_session_header(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    answer = await request(proc, orjson.dumps({"messages": "hi"}), extra={"x-session-id": "s"})
    status, doc, _ = immediate(answer)
    assert status == 400
    assert doc["error"]["param"] == "messages"


async def test_post_without_a_body_is_400_at_the_header_phase(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    (answer,) = await exchange(proc, [headers_msg(CHAT, end_of_stream=True)])
    status, doc, _ = immediate(answer)
    assert status == 400
    assert_openai_error(doc, "invalid_request_error")
    assert "empty" in doc["error"]["message"]


async def test_a_body_over_max_body_bytes_is_a_json_413(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start(max_body_bytes=1 << 20)
    body = chat("x" * (1 << 20))
    assert proc.max_body_bytes < len(body) < proc.max_body_bytes + (1 << 20)
    status, doc, _ = immediate(await request(proc, body))
    assert status == 413
    assert_openai_error(doc, "request_too_large")
    status, doc, _ = immediate(await request(proc, body, path=MESSAGES))
    assert status == 413
    assert_anthropic_error(doc, "request_too_large")
    assert (
        proc.sample(
            "fleet_requests_total",
            {"api": "openai.chat", "request_class": "", "outcome": "too_large"},
        )
        == 1
    )


async def test_a_body_as_large_as_envoy_buffers_gets_a_json_413(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start(max_body_bytes=1 << 20)
    envoy_limit = proc.max_body_bytes + BUFFER_HEADROOM  # per_connection_buffer_limit_bytes
    status, doc, _ = immediate(await request(proc, b" " * envoy_limit))
    assert status == 413
    assert_openai_error(doc, "request_too_large")


async def test_a_partial_body_is_a_413_not_a_crash(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    # A filter configured to stream bodies says so in the stream's first message; only then is
    # a body message without end_of_stream a piece (in BUFFERED mode it is the whole body,
    # followed by trailers: tests/stream/test_servicer_trailers.py).
    streamed = headers_msg(CHAT)
    streamed.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.STREAMED
    head, first, rest = await exchange(
        proc,
        [
            streamed,
            body_msg(b'{"messages": [{"role": "user", ', end_of_stream=False),
            body_msg(b'"content": "hi"}]}', end_of_stream=True),
        ],
    )
    assert_continues(head)
    status, doc, _ = immediate(first)
    assert status == 413
    assert_openai_error(doc, "request_too_large")
    # Decided already: a chunk that still arrives is let through, never decided twice.
    assert rest.WhichOneof("response") == "request_body"
    assert not rest.request_body.HasField("response")
    assert proc.sample("fleet_extproc_stream_errors_total", {"reason": "handler_exception"}) == 0


# --- streams --------------------------------------------------------------------------------


async def test_concurrent_interleaved_streams_keep_their_own_state(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """Open many streams, send every header first, then every body: no state crosses over."""
    proc = await start()
    n = 24
    calls = [proc.stub.Process() for _ in range(n)]
    paths = [MESSAGES if i % 3 == 0 else CHAT for i in range(n)]
    sessions = [f"user-{i}" for i in range(n)]
    for call, path, session in zip(calls, paths, sessions, strict=True):
        await asyncio.wait_for(
            call.write(headers_msg(path, extra={"x-session-id": session})), STEP_TIMEOUT
        )
    heads = await asyncio.gather(*(asyncio.wait_for(c.read(), STEP_TIMEOUT) for c in calls))
    for head in heads:
        assert_continues(head)
    bodies = [chat(f"question {i}") if i % 5 else b"{broken" for i in range(n)]

    async def finish(call: Any, body: bytes) -> ep.ProcessingResponse:
        await asyncio.wait_for(call.write(body_msg(body)), STEP_TIMEOUT)
        answer = await asyncio.wait_for(call.read(), STEP_TIMEOUT)
        await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT)
        assert await asyncio.wait_for(call.read(), STEP_TIMEOUT) is grpc.aio.EOF
        return answer

    answers = await asyncio.gather(
        *(finish(c, b) for c, b in zip(reversed(calls), reversed(bodies), strict=True))
    )
    answers.reverse()
    for i, answer in enumerate(answers):
        if i % 5 == 0:
            status, doc, _ = immediate(answer)
            assert status == 400
            if paths[i] == MESSAGES:
                assert_anthropic_error(doc, "invalid_request_error")
            else:
                assert_openai_error(doc, "invalid_request_error")
            continue
        expected = proc.expected_route(
            paths[i], {"x-session-id": sessions[i], "content-type": "application/json"}, bodies[i]
        )
        assert routed(answer)[ROUTE_HEADER] == expected.placement.route
    await wait_for_gauge(proc, "fleet_extproc_streams_active", 0)


async def test_a_stream_the_client_cancels_is_cleaned_up(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """Envoy cancels the ext_proc stream when the client aborts: the processor must not leak it."""
    proc = await start()
    call = proc.stub.Process()
    await asyncio.wait_for(call.write(headers_msg(CHAT)), STEP_TIMEOUT)
    assert_continues(await asyncio.wait_for(call.read(), STEP_TIMEOUT))
    await wait_for_gauge(proc, "fleet_extproc_streams_active", 1)
    call.cancel()
    await wait_for_gauge(proc, "fleet_extproc_streams_active", 0)
    # The server still serves new streams.
    routed(await request(proc, chat("after the cancel")))


async def wait_for_gauge(proc: Processor, name: str, value: float) -> None:
    """The server's ``finally`` runs after the client sees the stream end: poll, bounded."""
    deadline = asyncio.get_running_loop().time() + STEP_TIMEOUT
    while proc.sample(name) != value:
        assert asyncio.get_running_loop().time() < deadline, f"{name} = {proc.sample(name)}"
        await asyncio.sleep(0.01)


# --- metrics --------------------------------------------------------------------------------


async def test_metrics_count_outcomes_by_api_and_class(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start()
    routed_chat = {"api": "openai.chat", "request_class": "short", "outcome": "routed"}
    routed_long = {"api": "anthropic.messages", "request_class": "medium", "outcome": "routed"}
    bad_chat = {"api": "openai.chat", "request_class": "", "outcome": "bad_request"}
    assert proc.sample("fleet_requests_total", routed_chat) == 0
    for i in range(3):
        routed(await request(proc, chat(f"q{i}")))
    medium = orjson.dumps(
        {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "m" * 20_000}]}
    )
    routed(await request(proc, medium, path=MESSAGES))
    immediate(await request(proc, b"[]"))
    assert proc.sample("fleet_requests_total", routed_chat) == 3
    assert proc.sample("fleet_requests_total", routed_long) == 1
    assert proc.sample("fleet_requests_total", bad_chat) == 1
    assert proc.sample("fleet_route_decisions_total", {"kind": "primary"}) == 4
    assert proc.sample("fleet_decision_seconds_count") == 4
    assert proc.sample("fleet_request_body_bytes_count") == 5
    assert proc.sample("fleet_request_body_bytes_sum") == sum(
        len(b) for b in (chat("q0"), chat("q1"), chat("q2"), medium, b"[]")
    )
    await wait_for_gauge(proc, "fleet_extproc_streams_active", 0)


async def _streams_active(proc: Processor, want: float, within_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + within_s
    while asyncio.get_running_loop().time() < deadline:
        if proc.sample("fleet_extproc_streams_active") == want:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_envoy_half_close_then_reset_ends_the_stream_without_waiting_out_the_linger(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """Envoy's close is a half-close followed at once by a reset. With serve's linger the handler
    waits for that reset instead of sending a status (which grpc.aio leaks on a cancelled
    call): the reset, not the linger, ends the stream."""
    proc = await start(reset_linger_s=60.0, envoy_graceful_close=False)
    call = proc.stub.Process()
    await asyncio.wait_for(call.write(headers_msg(CHAT)), STEP_TIMEOUT)
    await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    await asyncio.wait_for(call.write(body_msg(chat("hello"))), STEP_TIMEOUT)
    answer = await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    routed(answer)
    await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT)
    # Half-closed: the processor lingers (60 s here) instead of answering with a status.
    assert await _streams_active(proc, 1.0, 5.0)
    call.cancel()
    assert await _streams_active(proc, 0.0, 10.0), "the reset did not end the lingering stream"


async def test_a_graceful_envoys_half_close_gets_ok_at_once_without_the_linger(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """processor.envoy_graceful_close (the default): Envoy half-closes and waits for the status
    (ext_proc_graceful_grpc_close). The handler answers the half-close at once with OK, serve's
    linger configured or not: no reset is awaited, so no cancellation happens."""
    proc = await start(reset_linger_s=60.0)
    call = proc.stub.Process()
    await asyncio.wait_for(call.write(headers_msg(CHAT)), STEP_TIMEOUT)
    await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    await asyncio.wait_for(call.write(body_msg(chat("hello"))), STEP_TIMEOUT)
    routed(await asyncio.wait_for(call.read(), STEP_TIMEOUT))
    await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT)
    # Well inside the 60 s linger: the status is the handler's return, not the linger's end.
    assert await asyncio.wait_for(call.read(), 20.0) is grpc.aio.EOF
    assert await asyncio.wait_for(call.code(), 20.0) == grpc.StatusCode.OK
    assert await _streams_active(proc, 0.0, 10.0)


async def test_a_peer_that_waits_for_the_status_gets_ok_after_the_linger(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start(reset_linger_s=0.2, envoy_graceful_close=False)
    loop = asyncio.get_running_loop()
    began = loop.time()
    answers = await exchange(proc, [headers_msg(CHAT), body_msg(chat("hello"))])
    routed(answers[1])
    assert loop.time() - began >= 0.2
    assert await _streams_active(proc, 0.0, 10.0)

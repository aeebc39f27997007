"""The header path (processor.read_body: when_needed): a request that carries the trusted session
header and a content-length is decided at its headers, and Envoy is told not to send the body.

- a property: over random sequences of requests, the header path's placement, class and
  admission (routed / 429 / 413) equal the body path's for the same requests, with the budgets
  filled and released in the same order;
- the servicer over real gRPC: one exchange and a mode override, the same routing headers as
  the body path, the defined behaviour without content-length (chunked uploads: the body path),
  bad JSON passed on (validated with read_body: always), oversized requests refused at headers,
  and a body that arrives anyway (a filter without allow_mode_override) passing untouched.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.core.api import BadRequest
from extproc.ledger.gate import build_gate
from extproc.names import FLEET_HEADERS
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Outcome, Rejected, Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.protocol import responses
from tests.stream import test_servicer
from tests.stream.test_servicer import (
    CHAT,
    Processor,
    body_msg,
    chat,
    exchange,
    headers_msg,
    immediate,
    routed,
)
from tests.support.flow import NO_PLACEMENT, refused_at_once

# The servicer tests' fixture (a FleetProcessor on a real grpc.aio server), registered here
# under the same name.
start = test_servicer.start

PM = processing_mode_pb2.ProcessingMode
MESSAGES = "/v1/messages"


def fleet(read_body: str, affinity: bool) -> dict[str, Any]:
    return {
        "version": 1,
        "processor": {"read_body": read_body},
        "clusters": [
            {"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"], "weight": 1 + i % 2}
            for i in range(1, 6)
        ],
        "session": {"header": "x-session-id", "tier_header": "x-tenant-tier"},
        "classes": refused_at_once(
            [
                {
                    "name": "gold",
                    "tiers": ["gold"],
                    "eligible": ["c1", "c2"],
                    "budget": {"max_concurrent": 2},
                },
                {"name": "short", "max_input_tokens": 300, "budget": {"max_concurrent": 3}},
                {
                    "name": "medium",
                    "max_input_tokens": 3000,
                    "budget": {"max_inflight_tokens": 5000},
                },
                {
                    "name": "long",
                    "eligible": ["c4", "c5"],
                    "budget": {"max_inflight_tokens": 20000},
                },
            ]
        ),
        "affinity": {"enabled": affinity},
        "flow": NO_PLACEMENT,
    }


def request_body(api_path: str, size: int, salt: int) -> bytes:
    text = f"{salt} " + "x" * size
    if api_path == MESSAGES:
        return orjson.dumps(
            {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
        )
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def request_headers(api_path: str, sid: str, tier: str | None, length: int) -> dict[str, str]:
    out = {
        ":method": "POST",
        ":path": api_path,
        "content-type": "application/json",
        "content-length": str(length),
        "x-session-id": sid,
    }
    if tier is not None:
        out["x-tenant-tier"] = tier
    return out


def summary(outcome: Outcome) -> tuple[object, ...]:
    """What must agree: placement, class and the admission verdict."""
    if isinstance(outcome, Routed):
        p = outcome.route.placement
        return ("routed", outcome.route.request_class.name, p.primary, p.secondary, outcome.kind)
    if isinstance(outcome, Rejected):
        r = outcome.reject
        p = outcome.route.placement
        return ("rejected", outcome.route.request_class.name, p.primary, r.status, r.reason)
    return (type(outcome).__name__,)


def pipeline_of(read_body: str, affinity: bool) -> tuple[Pipeline, Any]:
    runtime = compile_runtime(parse_config(fleet(read_body, affinity)))
    registry = CollectorRegistry()
    # A frozen clock: the two pipelines must see the same instants (token refills, TTLs).
    gate = build_gate(runtime, registry, lambda: 100.0, random.Random(1))
    return Pipeline(RuntimeHolder(runtime), Metrics(registry), gate), gate


# One step: a request (path, session, tier, size) or the release of the i-th one still held.
step = st.one_of(
    st.tuples(
        st.just("request"),
        st.sampled_from([CHAT, MESSAGES]),
        st.sampled_from(["s1", "s2", "s3", "s4", "agent-7", "ü-session"]),
        st.sampled_from([None, None, "gold"]),
        st.sampled_from([10, 900, 1150, 1250, 5000, 11000, 11900, 40000, 90000]),
    ),
    st.tuples(st.just("release"), st.integers(0, 20)),
)


async def compare(steps: list[tuple[Any, ...]], affinity: bool) -> list[tuple[object, ...]]:
    """Play ``steps`` through a header-path and a body-path pipeline side by side; every
    request's outcome must agree. Returns the outcomes' summaries."""
    by_headers, gate_h = pipeline_of("when_needed", affinity)
    by_body, gate_b = pipeline_of("always", affinity)
    held: list[tuple[Routed, Routed]] = []
    seen: list[tuple[object, ...]] = []
    try:
        for n, s in enumerate(steps):
            now = 100.0 + n
            if s[0] == "release":
                if held:
                    h, b = held.pop(s[1] % len(held))
                    await by_headers.release(h.hold)
                    await by_body.release(b.hold)
                continue
            _, path, sid, tier, size = s
            body = request_body(path, size, n)
            headers = request_headers(path, sid, tier, len(body))
            assert await by_body.decide_headers(headers, now) is None  # read_body: always
            at_headers = await by_headers.decide_headers(headers, now)
            assert at_headers is not None
            with_body = await by_body.decide(headers, body, now)
            assert summary(at_headers) == summary(with_body), s
            seen.append(summary(at_headers))
            if isinstance(at_headers, Routed):
                assert isinstance(with_body, Routed)
                assert at_headers.facts.session == with_body.facts.session
                assert at_headers.facts.input_tokens == with_body.facts.input_tokens
                assert not at_headers.facts.body_read and with_body.facts.body_read
                held.append((at_headers, with_body))
        assert gate_h.held == gate_b.held
    finally:
        for h, b in held:
            await by_headers.release(h.hold)
            await by_body.release(b.hold)
        assert gate_h.held == 0 and gate_b.held == 0
        for p, g in ((by_headers, gate_h), (by_body, gate_b)):
            await p.aclose()
            await g.close()
    return seen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=30), affinity=st.booleans())
def test_header_path_places_classifies_and_admits_like_the_body_path(
    steps: list[tuple[Any, ...]], affinity: bool
) -> None:
    asyncio.run(compare(steps, affinity))


async def test_the_comparison_covers_every_class_and_both_refusals() -> None:
    """A fixed sequence through the same comparison: the gold tier, each size class, a 429
    (gold admits two at a time per cluster, one session stays on one) and a 413 (no long
    budget could ever admit 22,500 tokens)."""
    gold = [("request", CHAT, "g", "gold", 100 + i) for i in range(3)]
    sizes = [("request", MESSAGES, "s1", None, n) for n in (10, 5000, 40000, 90000)]
    seen = await compare([*gold, ("release", 0), *gold[:1], *sizes], affinity=True)
    kinds = {(x[0], x[1]) for x in seen}
    assert {("routed", c) for c in ("gold", "short", "medium", "long")} <= kinds
    statuses = {x[3] for x in seen if x[0] == "rejected"}
    assert statuses == {429, 413}


async def test_the_header_path_needs_the_header_and_a_declared_size() -> None:
    pipeline, gate = pipeline_of("when_needed", affinity=False)
    try:
        body = request_body(CHAT, 100, 0)
        full = request_headers(CHAT, "s1", None, len(body))
        assert isinstance(await pipeline.decide_headers(full, 0.0), Routed)
        no_session = {k: v for k, v in full.items() if k != "x-session-id"}
        chunked = {k: v for k, v in full.items() if k != "content-length"}
        for headers in (
            no_session,
            chunked,
            {**full, "x-session-id": ""},
            {**full, "content-length": "0"},
            {**full, "content-length": "12a"},
            {**full, "content-length": "١٢"},  # digits, but not ASCII ones
            {**full, ":path": "/v1/models"},
            {**full, ":method": "GET"},
        ):
            assert await pipeline.decide_headers(headers, 0.0) is None, headers
        # Refused at headers, as the body path would refuse them once the body arrived.
        huge = await pipeline.decide_headers({**full, "content-length": str(64 << 20)}, 0.0)
        assert isinstance(huge, BadRequest) and huge.status == 413
        text = await pipeline.decide_headers({**full, "content-type": "text/plain"}, 0.0)
        assert isinstance(text, BadRequest) and text.status == 400
        registry = pipeline.metrics.header_decisions
        assert registry._value.get() == 3  # the routed one and the two refusals
    finally:
        await pipeline.aclose()
        await gate.close()


# --- the servicer over real gRPC -----------------------------------------------------------


def header_answer(answer: ep.ProcessingResponse, runtime: Runtime) -> dict[str, str]:
    """The header path's routing answer: headers set, route re-picked, the body skipped."""
    assert answer.WhichOneof("response") == "request_headers", answer
    common = answer.request_headers.response
    assert common.clear_route_cache
    assert answer.HasField("mode_override")
    mode = answer.mode_override
    assert mode.request_body_mode == PM.NONE
    # The response phases the processor reads are asked for (the canonical config reads
    # response headers: its budgets' charge follows a failover), and response trailers stay
    # asked for: the stream then lasts as long as the exchange.
    assert runtime.response_phases and not runtime.inspect_usage
    assert mode.response_header_mode == PM.SEND and mode.response_body_mode == PM.NONE
    assert mode.response_trailer_mode == PM.SEND
    headers = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }
    assert set(headers) == set(FLEET_HEADERS)
    return headers


def with_length(body: bytes, **extra: str) -> dict[str, str]:
    return {"content-length": str(len(body)), **extra}


async def test_one_exchange_and_the_body_paths_routing(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    fast = await start()
    slow = await start(read_body="always")
    for n, size in enumerate((10, 9000, 500_000)):
        body = chat("y" * size)
        extra = with_length(body, **{"x-session-id": f"agent-{n}"})
        (answer,) = await exchange(fast, [headers_msg(CHAT, extra=extra)])
        first, second = await exchange(slow, [headers_msg(CHAT, extra=extra), body_msg(body)])
        assert not first.request_headers.HasField("response")
        assert first.mode_override.request_body_mode == PM.BUFFERED  # the body is asked for
        assert header_answer(answer, fast.runtime) == routed(second)
    assert fast.sample("fleet_header_decisions_total") == 3
    assert fast.sample("fleet_request_body_bytes_count") == 0  # no body reached the processor
    assert slow.sample("fleet_header_decisions_total") == 0


async def test_chunked_upload_takes_the_body_path(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """No content-length (HTTP/1.1 chunked, or HTTP/2 without one): the size is known only once
    the body has arrived, so the request waits for it, as with read_body: always."""
    proc = await start()
    body = chat("z" * 20000)
    extra = {"x-session-id": "agent-chunked", "transfer-encoding": "chunked"}
    first, second = await exchange(proc, [headers_msg(CHAT, extra=extra), body_msg(body)])
    assert first.mode_override.request_body_mode == PM.BUFFERED  # the body is asked for
    assert not first.request_headers.HasField("response")
    by_body = routed(second)
    (declared,) = await exchange(
        proc, [headers_msg(CHAT, extra=with_length(body, **{"x-session-id": "agent-chunked"}))]
    )
    assert header_answer(declared, proc.runtime) == by_body  # the same session label too
    assert proc.sample("fleet_header_decisions_total") == 1
    # The chunked upload ran without the response phases the canonical config reads (defect
    # 6: response trailers only), and is counted; the declared one read them.
    assert proc.runtime.response_phases
    assert first.mode_override.response_header_mode == PM.SKIP
    assert first.mode_override.response_trailer_mode == PM.SEND
    skipped = "fleet_response_phases_skipped_total"
    assert proc.sample(skipped, {"reason": "chunked_upload"}) == 1


async def test_bad_json_goes_upstream_unless_read_body_always(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    body = b'{"model": "m", "messages": [ not json'
    extra = with_length(body, **{"x-session-id": "agent-bad"})
    fast = await start()
    (answer,) = await exchange(fast, [headers_msg(CHAT, extra=extra)])
    header_answer(answer, fast.runtime)  # routed: the upstream answers bad JSON with a 400
    strict = await start(read_body="always")
    _, refused = await exchange(strict, [headers_msg(CHAT, extra=extra), body_msg(body)])
    status, doc, _ = immediate(refused)
    assert status == 400 and "not valid JSON" in doc["error"]["message"]


async def test_refusals_decided_at_headers_answer_the_body(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """A 413 (declared size over the limit) or 400 (Content-Type) is decided at the headers but
    answers the body message: answered while a large body still uploads, Envoy would close the
    connection under the client's writes. No override: Envoy sends the body as usual."""
    proc = await start()
    too_big = {"x-session-id": "a", "content-length": str(proc.max_body_bytes + 1)}
    first, second = await exchange(proc, [headers_msg(MESSAGES, extra=too_big), body_msg(b"{}")])
    assert not first.HasField("mode_override")  # the rendered modes: the body is sent
    assert not first.request_headers.HasField("response")
    status, doc, _ = immediate(second)
    assert status == 413 and doc["type"] == "error"  # Anthropic's own format
    text = {"x-session-id": "a", "content-length": "20"}
    body = b'{"model": "m", "x": 1}'
    _, answer = await exchange(
        proc, [headers_msg(CHAT, extra=text, content_type="text/plain"), body_msg(body)]
    )
    status, _, _ = immediate(answer)
    assert status == 400
    # Decided once, at the headers: the body message only carried the answer.
    assert proc.sample("fleet_header_decisions_total") == 2
    assert proc.sample("fleet_request_body_bytes_count") == 0


async def test_a_body_sent_anyway_passes_without_a_second_decision(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """A filter rendered without allow_mode_override ignores the override: the body arrives
    after the header decision and passes untouched, the request decided and counted once."""
    proc = await start()
    body = chat("hello")
    extra = with_length(body, **{"x-session-id": "agent-old-filter"})
    first, second = await exchange(proc, [headers_msg(CHAT, extra=extra), body_msg(body)])
    header_answer(first, proc.runtime)
    assert second == responses.CONTINUE_BODY
    routed_total = proc.sample(
        "fleet_requests_total",
        {"api": "openai.chat", "request_class": "short", "outcome": "routed"},
    )
    assert routed_total == 1

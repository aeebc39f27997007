"""OpenTelemetry traces through a real Envoy: Envoy's span, the processor's decision span and its
steps, and the engine's parent, exported over OTLP gRPC to a collector served by this test (the
protocol's own TraceService, from opentelemetry-proto).

The rendered Envoy traces (tracing.endpoint in fleet.yaml), so Envoy's ext_proc call carries
its span context to the processor and its router writes Envoy's context into the upstream
traceparent; the rendered upstream filter puts the processor's back. The simulated engine echoes
the traceparent it received (x-sim-traceparent).

Classes by size: ``chat`` (short prompts, no budget), ``strict`` (one request per cluster, no
wait: a 429) and ``queued`` (one per cluster, waits up to 20 s). Decode runs at 20 tokens/s,
so a 40-token answer holds its budget about 2 s.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from extproc.config import load_runtime
from extproc.harness.launch import Client, FleetStack, wait_until
from extproc.harness.otlp import Collector
from extproc.harness.sim_cluster import SIM_TRACEPARENT_HEADER
from tests.e2e.conftest import dump_logs
from tests.support.flow import NO_PLACEMENT

CHAT = "/v1/chat/completions"
SIM_ARGS = ("--time-scale", "1", "--prefill-tps", "1000000", "--decode-tps", "20")
HOLD_TOKENS = 40
CLASSES: list[dict[str, Any]] = [
    {"name": "chat", "max_input_tokens": 64},
    {
        "name": "strict",
        "max_input_tokens": 2000,
        "budget": {"max_concurrent": 1},
        "wait": {"max_wait_s": 0},
    },
    {"name": "queued", "budget": {"max_concurrent": 1}, "wait": {"max_wait_s": 20, "max_queue": 4}},
]
# Every prompt carries this and every session id starts with it: no exported span may.
MARK = "secretprompt" + secrets.token_hex(4)
SPAN_WAIT_S = 60.0  # Envoy flushes its spans every 5 s; a loaded machine is slower


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    receiver = Collector().start()
    try:
        yield receiver, receiver.port
    finally:
        receiver.stop()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, collector: tuple[Collector, int]
) -> Iterator[FleetStack]:
    running = FleetStack(
        tmp_path_factory.mktemp("tracing"),
        clusters=3,
        sim_args=SIM_ARGS,
        processor_env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
        fleet_overrides={
            "classes": CLASSES,
            "flow": NO_PLACEMENT,
            # Failover is Envoy's here: the processor does not place around a dead primary.
            "processor": {"inspect_usage": True, "probe_clusters": False},
            "tracing": {"enabled": True, "endpoint": f"http://127.0.0.1:{collector[1]}"},
        },
    )
    with running:
        yield running


def traceparent() -> tuple[str, bytes]:
    trace_id = secrets.token_bytes(16)
    return f"00-{trace_id.hex()}-{secrets.token_hex(8)}-01", trace_id


def body(words: int, max_tokens: int = 2) -> bytes:
    text = f"{MARK} " + "word " * words
    doc = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return orjson.dumps(doc)


def send(
    stack: FleetStack, payload: bytes, session: str, parent: str
) -> tuple[int, dict[str, str], bytes]:
    client = Client(stack.listener_port)
    try:
        return client.post_json(CHAT, payload, {"x-session-id": session, "traceparent": parent})
    finally:
        client.close()


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


def decision_of(collector: Collector, trace_id: bytes, stack: FleetStack) -> trace_pb2.Span:
    def found() -> bool:
        return any(s.name == "fleet.decision" for _, s in collector.of_trace(trace_id))

    wait_until(found, SPAN_WAIT_S, "the processor's decision span")
    (span,) = [s for _, s in collector.of_trace(trace_id) if s.name == "fleet.decision"]
    return span


def children(collector: Collector, trace_id: bytes, parent: trace_pb2.Span) -> dict[str, Any]:
    return {
        s.name: s for _, s in collector.of_trace(trace_id) if s.parent_span_id == parent.span_id
    }


def session(tag: str) -> str:
    return f"{MARK}-{tag}-{secrets.token_hex(4)}"


def test_one_request_is_one_trace_from_envoy_through_the_processor_to_the_engine(
    stack: FleetStack, collector: tuple[Collector, int]
) -> None:
    receiver = collector[0]
    parent, trace_id = traceparent()
    key = session("one")
    status, headers, data = send(stack, body(5), key, parent)
    assert status == 200, (data[:200], dump_logs(stack))
    decision = decision_of(receiver, trace_id, stack)
    # The engine's parent is the processor's decision span (not Envoy's, which the router
    # wrote into traceparent first).
    _version, engine_trace, engine_parent, _flags = headers[SIM_TRACEPARENT_HEADER].split("-")
    assert engine_trace == trace_id.hex()
    assert engine_parent == decision.span_id.hex()
    # Envoy's spans are in the same trace; the decision's parent is Envoy's ext_proc call.
    wait_until(
        lambda: any(s == "envoy" for s, _ in receiver.of_trace(trace_id)),
        SPAN_WAIT_S,
        "Envoy's spans",
    )
    envoy_spans = {s.span_id: s for svc, s in receiver.of_trace(trace_id) if svc == "envoy"}
    assert decision.parent_span_id in envoy_spans, [s.name for s in envoy_spans.values()]
    steps = children(receiver, trace_id, decision)
    # Decided at the headers (session header and content-length): no body to parse.
    assert set(steps) == {"fleet.session_lookup", "fleet.budget_reservation", "fleet.engine_pick"}
    for step in steps.values():
        assert decision.start_time_unix_nano <= step.start_time_unix_nano
        assert step.end_time_unix_nano <= decision.end_time_unix_nano
    attrs = attributes(decision)
    runtime = load_runtime(stack.fleet_path)
    # Decided at the headers, the body and the model it names are not read.
    assert "gen_ai.request.model" not in attrs
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["fleet.class"] == "chat"
    assert attrs["fleet.decision"] == "kept"
    assert attrs["fleet.primary"] == headers["x-served-by"] == attrs["fleet.served_by"]
    assert attrs["fleet.secondary"] in {c.name for c in runtime.clusters}
    assert attrs["gen_ai.usage.output_tokens"] == 2
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert "gen_ai.usage.cache_read.input_tokens" in attrs
    # The session as its keyed label only.
    assert attrs["fleet.session_source"] == "header"
    assert attrs["fleet.session"] and key not in str(attrs["fleet.session"])


def test_a_request_decided_on_its_body_shows_the_parse(
    stack: FleetStack, collector: tuple[Collector, int]
) -> None:
    parent, trace_id = traceparent()
    client = Client(stack.listener_port)
    try:  # no session header: the key is read from the prompt
        status, _headers, data = client.post_json(CHAT, body(5), {"traceparent": parent})
    finally:
        client.close()
    assert status == 200, (data[:200], dump_logs(stack))
    decision = decision_of(collector[0], trace_id, stack)
    assert "fleet.body_parse" in children(collector[0], trace_id, decision)
    attrs = attributes(decision)
    assert attrs["fleet.session_source"] != "header"
    assert attrs["gen_ai.request.model"] == "m"


def _hold_budget(
    stack: FleetStack, words: int, tag: str, request_class: str
) -> tuple[threading.Thread, str, list[int]]:
    """A request of ``request_class`` that holds its cluster's one slot for ~2 s, in a thread;
    returns once the processor counts it in flight."""
    key = session(tag)
    statuses: list[int] = []

    def run() -> None:
        statuses.append(send(stack, body(words, HOLD_TOKENS), key, traceparent()[0])[0])

    thread = threading.Thread(target=run)
    thread.start()

    def holding() -> bool:
        return any(
            name == "fleet_budget_inflight_requests"
            and ("request_class", request_class) in labels
            and value >= 1
            for (name, labels), value in stack.processor_metrics().items()
        )

    wait_until(holding, 30, f"a {request_class} request in flight")
    return thread, key, statuses


def test_a_queued_request_shows_its_wait(
    stack: FleetStack, collector: tuple[Collector, int]
) -> None:
    thread, key, statuses = _hold_budget(stack, 2500, "queue", "queued")
    parent, trace_id = traceparent()
    status, _headers, data = send(stack, body(2500), key, parent)
    thread.join(timeout=60)
    assert status == 200 and statuses == [200], (data[:200], dump_logs(stack))
    decision = decision_of(collector[0], trace_id, stack)
    attrs = attributes(decision)
    assert attrs["fleet.class"] == "queued"
    assert attrs["fleet.wait_ms"] > 0
    wait = children(collector[0], trace_id, decision)["fleet.flow_wait"]
    waited_ms = (wait.end_time_unix_nano - wait.start_time_unix_nano) / 1e6
    assert waited_ms == pytest.approx(attrs["fleet.wait_ms"], abs=1.0)


def test_a_429_is_a_span_with_its_reason(
    stack: FleetStack, collector: tuple[Collector, int]
) -> None:
    thread, key, statuses = _hold_budget(stack, 400, "strict", "strict")
    parent, trace_id = traceparent()
    status, _headers, data = send(stack, body(400), key, parent)
    thread.join(timeout=60)
    assert status == 429 and statuses == [200], (data[:200], dump_logs(stack))
    decision = decision_of(collector[0], trace_id, stack)
    attrs = attributes(decision)
    assert attrs["fleet.decision"] == "rejected"
    assert attrs["http.response.status_code"] == 429
    assert attrs["fleet.reject.reason"]
    assert decision.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert decision.status.message == attrs["fleet.reject.reason"]


def test_a_failover_shows_the_serving_cluster(
    stack: FleetStack, collector: tuple[Collector, int]
) -> None:
    key = session("failover")
    payload = body(5)
    parent, trace_id = traceparent()
    assert send(stack, payload, key, parent)[0] == 200
    first = attributes(decision_of(collector[0], trace_id, stack))
    primary, secondary = first["fleet.primary"], first["fleet.secondary"]
    stack.sims[primary].kill()
    try:
        parent, trace_id = traceparent()
        status, headers, data = send(stack, payload, key, parent)
        assert status == 200, (data[:200], dump_logs(stack))
        assert headers["x-served-by"] == secondary
        attrs = attributes(decision_of(collector[0], trace_id, stack))
        assert attrs["fleet.primary"] == primary
        assert attrs["fleet.served_by"] == secondary
        assert attrs["fleet.decision"] == "failed_over"
    finally:
        stack.restart_sim(primary)
        stack.wait_healthy([primary])


def test_no_exported_span_carries_prompt_text_or_a_session_id(
    stack: FleetStack, collector: tuple[Collector, int]
) -> None:
    receiver = collector[0]
    # Every test of this module sent MARK in its prompts and session ids; wait for Envoy's
    # last flush so that every span they caused is here.
    parent, trace_id = traceparent()
    assert send(stack, body(5), session("last"), parent)[0] == 200
    wait_until(
        lambda: any(s == "envoy" for s, _ in receiver.of_trace(trace_id)),
        SPAN_WAIT_S,
        "Envoy's last spans",
    )
    with receiver.lock:
        spans = list(receiver.spans)
    assert len({svc for svc, _ in spans}) == 2 and len(spans) > 10
    for service, span in spans:
        text = span.SerializeToString()
        assert MARK.encode() not in text, (service, span.name, attributes(span))

"""Tracing: off it imports nothing of OpenTelemetry; on, the decision record becomes a span under
the request's trace (the ext_proc call's context first), the rendered Envoy traces to the same
collector and hands the processor's context to the engine, and Envoy Gateway gets the same.
The whole path through a real Envoy is tests/e2e/test_tracing.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extproc.config import compile_runtime, parse_config
from extproc.config.schema import TracingConfig
from extproc.names import TRACEPARENT_HEADER
from extproc.render.envoy import render_bootstrap
from extproc.render.envoy_parts import render_part
from extproc.render.envoy_tracing import COLLECTOR_CLUSTER
from extproc.tracing import DecisionTrace, annotate, begin, end, phase
from extproc.tracing.otel import DecisionTracer
from tests.unit.test_gateway import Fleet, one, render, validate_custom
from tests.unit.test_render_envoy import validate

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ENVOY_CALL = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"


def test_tracing_off_imports_no_tracer() -> None:
    # Neither the decision tracer nor the SDK's tracing or exporters. (redis-py imports parts of
    # the SDK's metrics by itself when the SDK is installed; without the tracing extra, as in
    # the production image, nothing of OpenTelemetry is there.)
    traced = ("extproc.tracing.otel", "opentelemetry.sdk.trace", "opentelemetry.exporter")
    code = (
        "import sys\n"
        "import extproc.serve.service as s, extproc.protocol.server, extproc.pipeline.pipeline\n"
        "from extproc.config.schema import TracingConfig\n"
        "assert s.build_tracer(TracingConfig()) is None\n"
        f"print(sorted(m for m in sys.modules if m.startswith({traced!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_with_no_current_decision_the_hooks_do_nothing() -> None:
    with phase("body_parse"):
        annotate(fleet__class="x")  # no trace: nothing to record, nothing raised


def tracer(ratio: float = 1.0) -> tuple[DecisionTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    cfg = TracingConfig(enabled=True, sampling_ratio=ratio, service_name="fleet-test")
    return DecisionTracer(cfg, exporter), exporter


def decided(
    t: DecisionTracer, headers: dict[str, str], metadata: dict[str, str]
) -> tuple[DecisionTrace, dict[str, str]]:
    trace = DecisionTrace()
    token = begin(trace)
    try:
        with phase("session_lookup"):
            annotate(fleet__class="chat")
        carry = t.open(trace, headers, metadata)
        trace.decided()
        annotate(fleet__served_by="c2")  # a response phase, after the answer
    finally:
        end(token)
    t.close(trace)
    return trace, carry


def test_the_decision_span_is_the_child_of_envoys_call_and_the_parent_of_the_engine() -> None:
    t, exporter = tracer()
    _trace, carry = decided(t, {"traceparent": PARENT}, {"traceparent": ENVOY_CALL})
    t.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    decision, step = spans["fleet.decision"], spans["fleet.session_lookup"]
    ctx = decision.get_span_context()
    assert f"{ctx.trace_id:032x}" == PARENT.split("-")[1]
    # Envoy's ext_proc call (gRPC metadata) is the parent, not the client's span.
    assert decision.parent is not None and f"{decision.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert carry["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    assert sampled(carry["traceparent"])
    assert step.parent is not None and step.parent.span_id == ctx.span_id
    assert decision.attributes == {"fleet.class": "chat", "fleet.served_by": "c2"}
    assert decision.resource.attributes["service.name"] == "fleet-test"
    assert decision.end_time is not None and step.end_time is not None
    assert decision.start_time is not None and step.start_time is not None
    assert decision.start_time <= step.start_time <= step.end_time <= decision.end_time


def test_without_envoys_context_the_request_headers_are_the_parent() -> None:
    t, exporter = tracer()
    decided(t, {"traceparent": PARENT}, {})
    t.shutdown()
    (decision,) = [s for s in exporter.get_finished_spans() if s.name == "fleet.decision"]
    assert decision.parent is not None and f"{decision.parent.span_id:016x}" == "b7ad6b7169203331"


def sampled(traceparent: str) -> bool:
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)


def test_sampling_follows_the_parent_and_the_ratio_for_new_traces() -> None:
    t, exporter = tracer(ratio=0.0)
    # A new trace at ratio 0: nothing exported, yet the context still travels (not sampled).
    _trace, carry = decided(t, {}, {})
    assert not sampled(carry["traceparent"])
    # A sampled parent is followed whatever the ratio.
    _trace, carry = decided(t, {"traceparent": PARENT}, {})
    t.shutdown()
    assert sampled(carry["traceparent"])
    assert [s.name for s in exporter.get_finished_spans()].count("fleet.decision") == 1


def fleet(tracing: dict[str, Any] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "version": 1,
        "clusters": [
            {"name": "a", "endpoints": ["10.0.0.1:8000"]},
            {"name": "b", "endpoints": ["10.0.0.2:8000"]},
        ],
    }
    if tracing is not None:
        cfg["tracing"] = tracing
    return cfg


def hcm_of(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    typed: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return typed


def router_of(hcm: dict[str, Any]) -> dict[str, Any]:
    (router,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"]
    typed: dict[str, Any] = router["typed_config"]
    return typed


@pytest.mark.parametrize(
    ("protocol", "h2"), [("grpc", True), ("http/protobuf", False)], ids=["grpc", "http"]
)
def test_the_rendered_envoy_traces_to_the_collector(
    protocol: str, h2: bool, tmp_path: Path
) -> None:
    tracing = {"enabled": True, "endpoint": "http://collector:4317", "protocol": protocol}
    tracing["sampling_ratio"] = 0.25  # type: ignore[assignment]
    runtime = compile_runtime(parse_config(fleet(tracing), "t.yaml"))
    bootstrap = render_bootstrap(runtime)
    hcm = hcm_of(bootstrap)
    provider = hcm["tracing"]["provider"]["typed_config"]
    assert hcm["tracing"]["random_sampling"] == {"value": 25.0}
    if h2:
        assert provider["grpc_service"]["envoy_grpc"]["cluster_name"] == COLLECTOR_CLUSTER
    else:
        assert provider["http_service"]["http_uri"]["uri"] == "http://collector:4317/v1/traces"
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    collector = clusters[COLLECTOR_CLUSTER]
    assert ("typed_extension_protocol_options" in collector) == h2
    upstream = router_of(hcm)["upstream_http_filters"]
    assert upstream[-1]["name"] == "envoy.filters.http.upstream_codec"
    assert TRACEPARENT_HEADER in hcm["route_config"]["internal_only_headers"]
    # The drop-in parts carry the same: the collector's cluster, the tracer, the router's filters.
    assert COLLECTOR_CLUSTER in {c["name"] for c in render_part(runtime, "clusters")}
    part = render_part(runtime, "tracing")
    assert part["http_connection_manager"]["tracing"] == hcm["tracing"]
    assert part["router"]["upstream_http_filters"] == upstream
    validate(bootstrap, tmp_path)


def test_no_trace_settings_without_tracing_and_no_envoy_tracer_without_an_endpoint() -> None:
    plain = render_bootstrap(compile_runtime(parse_config(fleet(None), "t.yaml")))
    hcm = hcm_of(plain)
    assert "tracing" not in hcm and "upstream_http_filters" not in router_of(hcm)
    assert TRACEPARENT_HEADER not in hcm["route_config"]["internal_only_headers"]
    # Tracing from the OTEL_* variables only: the processor traces, Envoy (no collector known)
    # does not, but still hands the processor's context on to the engine.
    runtime = compile_runtime(parse_config(fleet({"enabled": True}), "t.yaml"))
    hcm = hcm_of(render_bootstrap(runtime))
    assert "tracing" not in hcm and router_of(hcm)["upstream_http_filters"]
    assert render_part(runtime, "tracing") == {
        "router": {"upstream_http_filters": router_of(hcm)["upstream_http_filters"]}
    }


def test_envoy_gateway_traces_to_the_same_collector() -> None:
    tracing = {"enabled": True, "endpoint": "http://otel.observability:4317", "sampling_ratio": 0.1}
    cfg = fleet(tracing)
    runtime = compile_runtime(parse_config(cfg, "t.yaml"))
    objs = render(Fleet(runtime, yaml.safe_dump(cfg)))
    proxy = one(objs, "EnvoyProxy")
    traced = proxy["spec"]["telemetry"]["tracing"]
    assert traced["samplingFraction"] == {"numerator": 1000, "denominator": 10000}
    (ref,) = traced["provider"]["backendRefs"]
    backend = [o for o in objs if o["kind"] == "Backend" and o["metadata"]["name"] == ref["name"]]
    assert backend[0]["spec"]["endpoints"] == [
        {"fqdn": {"hostname": "otel.observability", "port": 4317}}
    ]
    for obj in (proxy, backend[0]):
        validate_custom(obj)

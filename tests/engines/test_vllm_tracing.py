"""A real vLLM (the CPU build, a tiny random-weight model) exporting its own OpenTelemetry spans
behind Envoy and the processor, all three to an OTLP gRPC receiver served by the test: vLLM's
request span is a child of the processor's decision span, in the client's trace."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from extproc.harness.launch import Client, wait_until
from extproc.harness.otlp import Collector
from extproc.harness.real_engines import vllm
from extproc.harness.real_engines.base import ENGINES_DIR
from extproc.harness.real_engines.fleet import RealFleet

SPAN_WAIT_S = 120.0
OURS = ("envoy", "fleet-extproc")


class TracedVllm(vllm.VllmEngine):
    """vLLM with its OTLP trace export on (--otlp-traces-endpoint)."""

    def __init__(self, name: str, workdir: Path, spec: vllm.VllmSpec, endpoint: str) -> None:
        super().__init__(name, workdir, spec)
        self.endpoint = endpoint

    def argv(self, port: int) -> list[str]:
        return [*super().argv(port), f"--otlp-traces-endpoint={self.endpoint}"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RealFleet, Collector]]:
    collector = Collector().start()
    workdir = tmp_path_factory.mktemp("vllm-tracing")
    model = vllm.tiny_model(ENGINES_DIR / "cache")
    engine = TracedVllm("c1-e1", workdir / "engines", vllm.VllmSpec(model), collector.endpoint)
    fleet = RealFleet(
        workdir,
        {"c1": [engine]},
        vllm.START_TIMEOUT_S,
        cluster_fields={"engine": "vllm"},
        processor_env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
        fleet_overrides={"tracing": {"enabled": True, "endpoint": collector.endpoint}},
    )
    try:
        with fleet:
            yield fleet, collector
    finally:
        collector.stop()


def test_vllms_request_span_is_the_child_of_the_decision_span(
    traced: tuple[RealFleet, Collector],
) -> None:
    fleet, collector = traced
    assert fleet.stack is not None
    trace_id = secrets.token_bytes(16)
    parent = f"00-{trace_id.hex()}-{secrets.token_hex(8)}-01"
    body = orjson.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    client = Client(fleet.stack.listener_port)
    try:
        status, _headers, data = client.post_json(
            "/v1/chat/completions", body, {"x-session-id": "traced", "traceparent": parent}
        )
    finally:
        client.close()
    assert status == 200, data[:300]

    def engine_span_and_envoys() -> bool:
        services = {s for s, _ in collector.of_trace(trace_id)}
        return "envoy" in services and bool(services - set(OURS))

    wait_until(engine_span_and_envoys, SPAN_WAIT_S, "vLLM's and Envoy's spans")
    spans = collector.of_trace(trace_id)
    (decision,) = [s for svc, s in spans if svc == "fleet-extproc" and s.name == "fleet.decision"]
    engine_spans = [s for svc, s in spans if svc not in OURS]
    assert engine_spans and all(s.parent_span_id == decision.span_id for s in engine_spans), [
        (s.name, s.parent_span_id.hex()) for s in engine_spans
    ]
    envoy_ids = {s.span_id for svc, s in spans if svc == "envoy"}
    assert decision.parent_span_id in envoy_ids

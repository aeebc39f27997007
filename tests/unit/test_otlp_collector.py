"""`extproc otlp-collector`'s parts: spans exported by the OpenTelemetry SDK over real OTLP/gRPC
reach the Collector, and its HTTP view serves them as JSON and as a tree."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from extproc.harness.launch import LOOPBACK
from extproc.harness.otlp import Collector
from extproc.harness.otlp_view import TraceView


@pytest.fixture
def served() -> Iterator[tuple[Collector, TraceView]]:
    collector = Collector(limit=100).start()
    view = TraceView(collector, LOOPBACK, 0).start()
    try:
        yield collector, view
    finally:
        view.stop()
        collector.stop()


def get(view: TraceView, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{view.port}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def export_one_trace(collector: Collector) -> str:
    provider = TracerProvider(resource=Resource.create({"service.name": "unit"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=collector.endpoint, insecure=True))
    )
    tracer = provider.get_tracer("test")
    with (
        tracer.start_as_current_span("root") as root,
        tracer.start_as_current_span("child") as child,
    ):
        child.set_attribute("fleet.class", "short")
        child.set_status(Status(StatusCode.ERROR, "budget"))
    provider.shutdown()
    return f"{root.get_span_context().trace_id:032x}"


def test_exported_spans_are_served_as_json_parents_first(
    served: tuple[Collector, TraceView],
) -> None:
    collector, view = served
    trace_id = export_one_trace(collector)
    status, body = get(view, f"/traces/{trace_id}")
    assert status == 200
    spans = json.loads(body)["spans"]
    assert [(s["name"], s["depth"]) for s in spans] == [("root", 0), ("child", 1)]
    root, child = spans
    assert child["parent_span_id"] == root["span_id"] and root["parent_span_id"] == ""
    assert child["attributes"] == {"fleet.class": "short"}
    assert child["status"] == "STATUS_CODE_ERROR" and root["service"] == "unit"

    status, body = get(view, "/traces")
    assert status == 200
    (listed,) = json.loads(body)["traces"]
    assert (listed["trace_id"], listed["spans"], listed["services"]) == (trace_id, 2, ["unit"])

    status, body = get(view, f"/traces/{trace_id}?view=tree")
    lines = body.decode().splitlines()
    assert status == 200 and len(lines) == 2
    assert lines[0].startswith("unit: root ") and lines[1].startswith("  unit: child ")
    assert lines[1].endswith("STATUS_CODE_ERROR")


def test_bad_paths_and_ids_are_json_errors(served: tuple[Collector, TraceView]) -> None:
    _collector, view = served
    status, body = get(view, "/traces/not-hex")
    assert status == 400 and "error" in json.loads(body)
    status, body = get(view, "/nothing")
    assert status == 404 and "error" in json.loads(body)
    status, body = get(view, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "spans": 0}


def test_a_span_sent_twice_is_kept_once(served: tuple[Collector, TraceView]) -> None:
    collector, _view = served
    provider = TracerProvider()
    span = provider.get_tracer("test").start_span("retried")
    span.end()
    request = encode_spans([span])  # type: ignore[list-item]
    collector.Export(request, None)
    collector.Export(request, None)
    assert collector.count == 2
    assert [s.name for _, s in collector.snapshot()] == ["retried"]


def test_a_limited_collector_keeps_the_newest_spans() -> None:
    collector = Collector(limit=1).start()
    try:
        export_one_trace(collector)
        assert collector.count == 2
        assert [span.name for _, span in collector.snapshot()] == ["root"]
    finally:
        collector.stop()

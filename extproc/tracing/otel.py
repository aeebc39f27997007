"""Decision records as OpenTelemetry spans, exported over OTLP (imported only with tracing on).

One span per decision, ``fleet.decision``, child of the request's trace: the trace context
Envoy's ext_proc call carries (its gRPC metadata, when the rendered Envoy traces), else the
W3C ``traceparent`` / ``tracestate`` of the request headers, else a new trace. Its children are
the timed steps (``DecisionTrace.phases``). The span starts at the request's headers and ends
with the answer; attributes learnt from the response (served by, usage) are added before it is
exported, at the end of the exchange. The span's own context is what the processor sets as
the upstream request's ``traceparent``: the engine's span is its child.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from extproc.config.schema import TracingConfig
from extproc.tracing import DecisionTrace

DECISION_SPAN = "fleet.decision"
_PROPAGATOR = TraceContextTextMapPropagator()
_ENV_PROTOCOL = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def protocol_of(cfg: TracingConfig, environ: Mapping[str, str] = os.environ) -> str:
    if cfg.protocol is not None:
        return cfg.protocol
    for name in _ENV_PROTOCOL:
        if environ.get(name):
            return environ[name]
    return "grpc"


def build_exporter(cfg: TracingConfig, environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """The SDK's OTLP exporter; without an endpoint in fleet.yaml it reads the standard
    OTEL_EXPORTER_OTLP_* variables itself."""
    protocol = protocol_of(cfg, environ)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        if cfg.endpoint is None:
            return GrpcExporter()
        return GrpcExporter(endpoint=cfg.endpoint, insecure=cfg.endpoint.startswith("http://"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        if cfg.endpoint is None:
            return HttpExporter()
        endpoint = cfg.endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"OTLP protocol {protocol!r}: grpc or http/protobuf")


class DecisionTracer:
    """Turns decision records into spans of one TracerProvider (its own, not the global one)."""

    def __init__(self, cfg: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sampling_ratio)),
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter or build_exporter(cfg)))
        self._tracer = self._provider.get_tracer("fleet-extproc")

    def open(
        self, trace: DecisionTrace, headers: Mapping[str, str], metadata: Mapping[str, str]
    ) -> dict[str, str]:
        """Start the decision span under the request's trace; returns the headers that carry
        its context upstream (traceparent, and tracestate when the parent had one)."""
        carrier = metadata if "traceparent" in metadata else headers
        parent = _PROPAGATOR.extract(carrier)
        span = self._tracer.start_span(
            DECISION_SPAN, context=parent, kind=SpanKind.SERVER, start_time=trace.start_ns
        )
        trace.span = span
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=otel_trace.set_span_in_context(span))
        return out

    def close(self, trace: DecisionTrace) -> None:
        """The exchange ended: the steps as children, the attributes, and the span's end (at
        the answer)."""
        span = trace.span
        if not isinstance(span, Span):
            return
        end_ns = trace.decided_ns or trace.end_ns()
        if span.is_recording():
            context = otel_trace.set_span_in_context(span)
            for name, start, stop in trace.phases:
                child = self._tracer.start_span(f"fleet.{name}", context=context, start_time=start)
                child.end(end_time=stop)
            span.set_attributes(trace.attributes)
            if trace.status is not None:
                span.set_status(Status(StatusCode.ERROR, trace.status))
        span.end(end_time=end_ns)
        trace.span = None

    def shutdown(self) -> None:
        """Export what is left (at the process's end)."""
        self._provider.shutdown()

"""An OTLP trace receiver (the OpenTelemetry protocol's gRPC TraceService) for tests, benchmarks
and the compose harness (``extproc otlp-collector``): keeps the spans it is sent, with their
resource's service.name."""

from __future__ import annotations

import threading
from collections import deque
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from extproc.harness.launch import LOOPBACK


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Spans as (service.name, span); ``keep=False`` only counts them (a benchmark's sink);
    ``limit`` keeps only the newest spans (a long-running collector). A span sent again (an
    exporter retries a batch whose answer it did not see in time) is kept once; ``count`` is
    every span received."""

    def __init__(self, keep: bool = True, limit: int | None = None) -> None:
        self.lock = threading.Lock()
        self.keep = keep
        self.limit = limit
        self.count = 0
        self.spans: deque[tuple[str, trace_pb2.Span]] = deque()
        self._kept: set[tuple[bytes, bytes]] = set()
        self._server: grpc.Server | None = None
        self.port = 0

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope in resource_spans.scope_spans:
                    self.count += len(scope.spans)
                    if self.keep:
                        for span in scope.spans:
                            self._keep(service, span)
        return trace_service_pb2.ExportTraceServiceResponse()

    def _keep(self, service: str, span: trace_pb2.Span) -> None:
        key = (span.trace_id, span.span_id)
        if key in self._kept:
            return
        self._kept.add(key)
        self.spans.append((service, span))
        if self.limit is not None and len(self.spans) > self.limit:
            _, oldest = self.spans.popleft()
            self._kept.discard((oldest.trace_id, oldest.span_id))

    def of_trace(self, trace_id: bytes) -> list[tuple[str, trace_pb2.Span]]:
        with self.lock:
            return [(s, span) for s, span in self.spans if span.trace_id == trace_id]

    def snapshot(self) -> list[tuple[str, trace_pb2.Span]]:
        with self.lock:
            return list(self.spans)

    def start(self, host: str = LOOPBACK, port: int = 0) -> Collector:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)  # type: ignore[no-untyped-call]
        self.port = server.add_insecure_port(f"{host}:{port}")
        server.start()
        self._server = server
        return self

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

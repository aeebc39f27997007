"""The spans an OTLP :class:`~extproc.harness.otlp.Collector` keeps, served as JSON over HTTP
(``extproc otlp-collector``): the compose harness's trace viewer.

- ``GET /traces``: the newest traces, each with its span count and services;
- ``GET /traces/<trace id hex>``: that trace's spans, parents before children;
- ``GET /traces/<trace id hex>?view=tree``: the same as an indented text tree;
- ``GET /health``: 200 once serving.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from extproc.harness.otlp import Collector

Json = dict[str, Any]
TRACES_LISTED = 50


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind) if kind else None


def span_json(service: str, span: trace_pb2.Span) -> Json:
    return {
        "service": service,
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "kind": trace_pb2.Span.SpanKind.Name(span.kind),
        "start_unix_nano": span.start_time_unix_nano,
        "duration_ms": round((span.end_time_unix_nano - span.start_time_unix_nano) / 1e6, 3),
        "status": trace_pb2.Status.StatusCode.Name(span.status.code),
        "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
    }


def ordered(spans: Iterable[Json]) -> list[Json]:
    """Depth-first from the roots (spans whose parent is not in the trace), by start time; each
    span gains its ``depth``."""
    by_start = sorted(spans, key=lambda s: s["start_unix_nano"])
    ids = {s["span_id"] for s in by_start}
    children: dict[str, list[Json]] = {}
    for span in by_start:
        parent = span["parent_span_id"] if span["parent_span_id"] in ids else ""
        children.setdefault(parent, []).append(span)
    out: list[Json] = []
    stack = [(span, 0) for span in reversed(children.get("", []))]
    while stack:
        span, depth = stack.pop()
        out.append({**span, "depth": depth})
        stack.extend((child, depth + 1) for child in reversed(children.get(span["span_id"], [])))
    return out


def tree_text(spans: list[Json]) -> str:
    lines = []
    for span in ordered(spans):
        status = "" if span["status"] == "STATUS_CODE_UNSET" else f" {span['status']}"
        lines.append(
            f"{'  ' * span['depth']}{span['service']}: {span['name']} {span['duration_ms']} ms"
            f" span {span['span_id']} parent {span['parent_span_id'] or '-'}{status}"
        )
    return "\n".join(lines) + "\n"


def trace_list(collector: Collector) -> list[Json]:
    traces: dict[str, Json] = {}
    for service, span in collector.snapshot():
        entry = traces.setdefault(
            span.trace_id.hex(),
            {"trace_id": span.trace_id.hex(), "spans": 0, "services": [], "start_unix_nano": 0},
        )
        entry["spans"] += 1
        if service not in entry["services"]:
            entry["services"].append(service)
        if not entry["start_unix_nano"] or span.start_time_unix_nano < entry["start_unix_nano"]:
            entry["start_unix_nano"] = span.start_time_unix_nano
    newest = sorted(traces.values(), key=lambda t: t["start_unix_nano"], reverse=True)
    return newest[:TRACES_LISTED]


def _handler(collector: Collector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = [p for p in url.path.split("/") if p]
            if parts == ["health"]:
                self._send(200, {"status": "ok", "spans": collector.count})
            elif parts == ["traces"]:
                self._send(200, {"traces": trace_list(collector)})
            elif len(parts) == 2 and parts[0] == "traces":
                self._trace(parts[1], parse_qs(url.query).get("view", ["json"])[0])
            else:
                self._send(404, {"error": f"no such path: {url.path}"})

        def _trace(self, trace_hex: str, view: str) -> None:
            try:
                trace_id = bytes.fromhex(trace_hex)
            except ValueError:
                self._send(400, {"error": "a trace id is 32 hex digits"})
                return
            spans = [span_json(s, span) for s, span in collector.of_trace(trace_id)]
            if view == "tree":
                self._reply(200, "text/plain; charset=utf-8", tree_text(spans).encode())
            else:
                self._send(200, {"trace_id": trace_hex, "spans": ordered(spans)})

        def _send(self, status: int, doc: Json) -> None:
            self._reply(status, "application/json", json.dumps(doc, indent=1).encode())

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                # The client gave up waiting (a health probe's timeout on a loaded machine):
                # nobody is left to answer.
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            return  # one line per GET would drown the collector's own log

    return Handler


class TraceView:
    """The HTTP server, in a daemon thread."""

    def __init__(self, collector: Collector, host: str, port: int) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler(collector))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> TraceView:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

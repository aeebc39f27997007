"""Prometheus metric definitions over an injected registry (no process globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
_BODY_BUCKETS = tuple(float(1 << k) for k in range(8, 27, 2))  # 256 B … 64 MiB


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "fleet_requests",
            "Inference requests seen by the processor, by API, class and outcome.",
            ["api", "request_class", "outcome"],
            registry=registry,
        )
        self.routes = Counter(
            "fleet_route_decisions",
            "Routing decisions by kind (primary, spilled, fallback).",
            ["kind"],
            registry=registry,
        )
        self.passthrough = Counter(
            "fleet_passthrough_requests",
            "Requests on non-inference paths, left to Envoy's fallback route.",
            registry=registry,
        )
        self.decision_seconds = Histogram(
            "fleet_decision_seconds",
            "Time from the complete body to the processor's answer (parse + decide + admit).",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.body_bytes = Histogram(
            "fleet_request_body_bytes",
            "Size of inference request bodies.",
            buckets=_BODY_BUCKETS,
            registry=registry,
        )
        self.stream_errors = Counter(
            "fleet_extproc_stream_errors",
            "ext_proc streams that ended with an error, by reason.",
            ["reason"],
            registry=registry,
        )
        self.streams_active = Gauge(
            "fleet_extproc_streams_active",
            "ext_proc streams currently open (one per HTTP exchange in flight).",
            registry=registry,
        )
        self.config_info = Gauge(
            "fleet_config_info",
            "The fleet config version being served (value is always 1).",
            ["version"],
            registry=registry,
        )
        self.config_reloads = Counter(
            "fleet_config_reloads",
            "Config reload attempts by result.",
            ["result"],
            registry=registry,
        )

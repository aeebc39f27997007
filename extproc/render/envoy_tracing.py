"""Envoy's own OpenTelemetry tracer, to the collector the processor exports to.

With ``tracing.enabled`` and ``tracing.endpoint`` in fleet.yaml, the rendered connection
manager traces every request (``envoy.tracers.opentelemetry``, OTLP over the collector cluster
``fleet_otel_collector``), sampled at ``tracing.sampling_ratio`` and parent-based as the
processor's spans are. Envoy's ext_proc call is then a child span of the request's, and carries
its context in the call's gRPC metadata: the processor's decision span is its child.

Envoy's router writes the active span's context into the upstream request's ``traceparent``,
over the one the processor set. So the processor also sets it as ``x-fleet-traceparent``, and
an upstream filter of the router (a ``header_mutation`` run after that write) moves it back
into ``traceparent``: the engine's span is the processor's child. The header is internal-only:
a client cannot choose a parent for the engine's span.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from extproc.config.runtime import Runtime
from extproc.names import TRACEPARENT_HEADER

Json = dict[str, Any]

COLLECTOR_CLUSTER = "fleet_otel_collector"
ENVOY_SERVICE = "envoy"


def _type(name: str) -> str:
    return f"type.googleapis.com/envoy.{name}"


def traces(runtime: Runtime) -> bool:
    """The processor traces (and the rendered Envoy hands its context on to the engine)."""
    return runtime.config.tracing.enabled


def envoy_traces(runtime: Runtime) -> bool:
    """Envoy's own tracer is rendered: tracing on and a collector named in fleet.yaml."""
    cfg = runtime.config.tracing
    return cfg.enabled and cfg.endpoint is not None


def collector_address(runtime: Runtime) -> tuple[str, int, bool]:
    """host, port, and whether the collector speaks gRPC."""
    cfg = runtime.config.tracing
    assert cfg.endpoint is not None
    url = urlsplit(cfg.endpoint)
    grpc = (cfg.protocol or "grpc") == "grpc"
    default = (4317 if grpc else 4318) if url.scheme == "http" else 443
    return url.hostname or "localhost", url.port or default, grpc


def hcm_tracing(runtime: Runtime) -> Json:
    """The connection manager's ``tracing`` block."""
    cfg = runtime.config.tracing
    _host, _port, grpc = collector_address(runtime)
    provider: Json = {"@type": _type("config.trace.v3.OpenTelemetryConfig")}
    if grpc:
        provider["grpc_service"] = {
            "envoy_grpc": {"cluster_name": COLLECTOR_CLUSTER},
            "timeout": "1s",
        }
    else:
        assert cfg.endpoint is not None
        path = urlsplit(cfg.endpoint).path.rstrip("/")
        uri = cfg.endpoint.rstrip("/") + ("" if path.endswith("/v1/traces") else "/v1/traces")
        provider["http_service"] = {
            "http_uri": {"uri": uri, "cluster": COLLECTOR_CLUSTER, "timeout": "1s"},
        }
    provider["service_name"] = ENVOY_SERVICE
    return {
        "provider": {"name": "envoy.tracers.opentelemetry", "typed_config": provider},
        # Requests without a trace context; one that has it follows its parent's flag.
        "random_sampling": {"value": cfg.sampling_ratio * 100.0},
    }


def collector_cluster(runtime: Runtime) -> Json:
    host, port, grpc = collector_address(runtime)
    cluster: Json = {
        "name": COLLECTOR_CLUSTER,
        "type": "STRICT_DNS",
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": COLLECTOR_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": host, "port_value": port}}
                            }
                        }
                    ]
                }
            ],
        },
    }
    if grpc:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _type("extensions.upstreams.http.v3.HttpProtocolOptions"),
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    if urlsplit(runtime.config.tracing.endpoint or "").scheme == "https":
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _type("extensions.transport_sockets.tls.v3.UpstreamTlsContext"),
                "sni": host,
            },
        }
    return cluster


def upstream_filters() -> list[Json]:
    """The router's upstream filters: the processor's trace context back into ``traceparent``
    after the router wrote Envoy's own there (nothing happens without the header)."""
    return [
        {
            "name": "fleet.trace_context",
            "typed_config": {
                "@type": _type("extensions.filters.http.header_mutation.v3.HeaderMutation"),
                "mutations": {
                    "request_mutations": [
                        {
                            "append": {
                                "header": {
                                    "key": "traceparent",
                                    "value": f"%REQ({TRACEPARENT_HEADER})%",
                                },
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            }
                        },
                        {"remove": TRACEPARENT_HEADER},
                    ]
                },
            },
        },
        {
            "name": "envoy.filters.http.upstream_codec",
            "typed_config": {
                "@type": _type("extensions.filters.http.upstream_codec.v3.UpstreamCodec")
            },
        },
    ]

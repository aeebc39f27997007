"""Render a complete Envoy bootstrap from the fleet config.

Every setting here was verified against Envoy 1.40 (ARCHITECTURE.md, "Decisions"); the
comments say why each one is needed. Three modes share listeners, clusters and health checks so
that benchmarks compare like with like:

- ``extproc``: the processor decides. Two data paths (``processor.mode``; auto picks by fleet
  size, see ``config.runtime.picks_endpoints``):
  - pairs: route by ``x-fleet-route`` to a (primary, secondary) aggregate cluster, N·(N-1) of
    them; fallback route over all clusters when the processor is down;
  - pool (endpoint picker): one pool cluster holding every endpoint, each fleet cluster a
    locality of it; the processor names the primary's endpoint then the secondary's and
    Envoy's override_host policy tries them in order. Linear in clusters and endpoints.
- ``round_robin``: Envoy alone, round robin over every endpoint of every cluster;
- ``ring_hash``: Envoy alone, consistent hashing on the session header (Envoy-native stickiness,
  no body inspection, no budgets).
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal

from extproc.config.runtime import Runtime
from extproc.core.fleet import Cluster
from extproc.core.models import MODEL_POOL_PREFIX
from extproc.names import (
    BUFFER_HEADROOM,
    ENGINE_KEY_HEADER,
    EVERY_ENDPOINT_CLUSTER,
    FLEET_HEADERS,
    PD_HEADERS,
    ROUTE_HEADER,
    TRACEPARENT_HEADER,
    WAIT_TIMER_HEADROOM_S,
)
from extproc.render.disagg import prefill_mirror_policies, prefill_mirror_targets
from extproc.render.envoy_served import response_attributes, tag_endpoint
from extproc.render.envoy_tracing import (
    collector_cluster,
    envoy_traces,
    hcm_tracing,
    traces,
    upstream_filters,
)
from extproc.render.local_reply import local_reply_config

Mode = Literal["extproc", "round_robin", "ring_hash"]
MODES: tuple[Mode, ...] = ("extproc", "round_robin", "ring_hash")

FALLBACK_CLUSTER = EVERY_ENDPOINT_CLUSTER
EXTPROC_CLUSTER = "extproc"
# Retry conditions under which no generation can have started (see _retry_conditions).
RETRY_ON = ("connect-failure", "refused-stream", "reset-before-request", "retriable-status-codes")
# An engine's backpressure answers: it refused the request at admission.
RETRIABLE_STATUSES = (429, 503)
# Consecutive local-origin failures (connect failures, timeouts) that eject a host.
LOCAL_ORIGIN_EJECT_AFTER = 3
# A host that accepts connections and resets requests fails half of its local-origin events
# (a success when the connection is handed over, a failure at the reset): 50 % ejects it, on
# at least 4 events (two requests) in one outlier interval.
RESET_EJECT_PERCENT = 50
RESET_EJECT_VOLUME = 4
OUTLIER_INTERVAL_S = 1
# Overprovisioning factor (percent) that keeps a cluster's whole priority share while any of
# up to 1000 engines is healthy (see _engine_lb).
WHOLE_CLUSTER = 100_000
# Active health-check interval of the pool (see _pool): Envoy runs every check on its main
# thread, which also applies config updates.
POOL_HEALTH_CHECK_INTERVAL_S = 4.0
# HTTP/2 flow-control window of a client connection, at least (see h2_windows).
H2_CONNECTION_WINDOW = 16 << 20

Json = dict[str, Any]


def ext_type(name: str) -> str:
    """The @type URL of an Envoy extension config message."""
    return "type.googleapis.com/envoy.extensions." + name


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    mode: Mode = "extproc"
    access_log_path: str | None = "/dev/stdout"
    # Host:port overrides for tests and local runs: map compose service names to loopback.
    host_map: tuple[tuple[str, str], ...] = ()
    # Processor replicas as host:port when they are not one name (default: processor.address
    # and processor.port from fleet.yaml).
    extproc_endpoints: tuple[str, ...] = ()


def _map(hostport: str, opts: EnvoyOptions) -> tuple[str, int]:
    mapped = dict(opts.host_map).get(hostport, hostport)
    host, _, port = mapped.rpartition(":")
    return host.strip("[]"), int(port)


def _endpoint(hostport: str, opts: EnvoyOptions) -> Json:
    host, port = _map(hostport, opts)
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _inference_cluster(
    name: str,
    endpoints: list[str],
    health_path: str,
    opts: EnvoyOptions,
    owners: list[str] | None = None,
) -> Json:
    # ``owners``: each endpoint's cluster (the fallback cluster holds every cluster's).
    tags = owners or [name] * len(endpoints)
    return {
        "name": name,
        "type": "STRICT_DNS",
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": "0.25s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        tag_endpoint(_endpoint(e, opts), c)
                        for e, c in zip(endpoints, tags, strict=True)
                    ]
                }
            ],
        },
        # Active checks find a dead cluster within ~2 s even when it gets no traffic. Two failures,
        # not one: with sessions sticking to engines a falsely failed check moves every session
        # of the engine (one re-prefill each); single 0.5 s timeouts on a loaded machine did
        # (observed, tests/e2e/test_engine_affinity.py). Requests to a dead engine meanwhile
        # fail to connect and are retried on the secondary (_retry_policy).
        "health_checks": [
            {
                "timeout": "0.5s",
                "interval": "1s",
                "no_traffic_interval": "1s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "http_health_check": {"path": health_path},
            }
        ],
        "outlier_detection": _outlier_detection(),
    }


def _outlier_detection() -> Json:
    """Eject a host on failures Envoy saw itself, never on an answer the engine chose.

    Without the split, Envoy counts an upstream's own 502/503/504 as gateway failures: one 503
    (an overloaded engine's backpressure) ejected the host. With split_external_local_origin_
    errors, connect failures, timeouts and resets are local-origin events with their own
    counters, and HTTP statuses from the engine are external. Every detector on external
    statuses is off (5xx, gateway failure, success rate): an engine's 429/503 is backpressure
    and its 500 a bad request, neither is a broken host.

    Two local-origin detectors. Consecutive failures (LOCAL_ORIGIN_EJECT_AFTER) take out a host
    that refuses or times out connections. They never see a host that accepts and then resets:
    Envoy records a local-origin success for every request that gets a connection (the pool is
    ready) and a failure for the reset, so the count never passes 1. The local-origin failure
    percentage sees it: such a host fails exactly half of its local-origin events, a healthy
    one none. It is judged at the end of every interval on that interval's events, with at
    least RESET_EJECT_VOLUME of them (two requests), on every host (minimum_hosts 1). Such a
    host's health check passes: it must not end the ejection.
    """
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": LOCAL_ORIGIN_EJECT_AFTER,
        "enforcing_consecutive_local_origin_failure": 100,
        "failure_percentage_threshold": RESET_EJECT_PERCENT,
        "failure_percentage_minimum_hosts": 1,
        "failure_percentage_request_volume": RESET_EJECT_VOLUME,
        "enforcing_failure_percentage_local_origin": 100,
        "enforcing_failure_percentage": 0,
        "consecutive_5xx": 5,
        "enforcing_consecutive_5xx": 0,
        "consecutive_gateway_failure": 5,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "interval": f"{OUTLIER_INTERVAL_S}s",
        "base_ejection_time": "10s",
        "max_ejection_percent": 100,
        # A host that resets inference requests still answers its health check: a passing
        # check must not end the ejection (Envoy's default does).
        "successful_active_health_check_uneject_host": False,
    }


def _aggregate(primary: str, secondary: str) -> Json:
    # Priority order = failover order: the secondary is used only when the primary is unhealthy
    # or when a retry moves on (previous_priorities).
    return {
        "name": f"{primary}__{secondary}",
        "connect_timeout": "0.25s",
        "lb_policy": "CLUSTER_PROVIDED",
        "cluster_type": {
            "name": "envoy.clusters.aggregate",
            "typed_config": {
                "@type": ext_type("clusters.aggregate.v3.ClusterConfig"),
                "clusters": [primary, secondary],
            },
        },
    }


def _retry_policy(runtime: Runtime) -> Json:
    # previous_priorities moves the retry to the aggregate's next priority (the secondary);
    # previous_hosts keeps it off the host that just failed.
    return {
        **_retry_conditions(runtime),
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                "@type": ext_type("retry.priority.previous_priorities.v3.PreviousPrioritiesConfig"),
                "update_frequency": 1,
            },
        },
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": ext_type("retry.host.previous_hosts.v3.PreviousHostsPredicate")
                },
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }


def _retry_conditions(runtime: Runtime) -> Json:
    """Retry only what cannot have generated: a generation must never run twice.

    - connect-failure, refused-stream: the engine never saw the request;
    - reset-before-request: the connection was reset before the request was sent upstream
      (``reset`` would also retry a reset after the engine had the request, i.e. mid-prefill);
    - retriable-status-codes 429/503: the engine refused the request at admission, before any
      generation. The one retry moves it to the session's secondary (previous_priorities).
    Never gateway-error/5xx: a 504 or a reset after the request was sent can be a generation in
    progress. One retry: a refused request spills once instead of bouncing across the fleet.
    """
    policy: Json = {
        "retry_on": ",".join(RETRY_ON),
        "retriable_status_codes": list(RETRIABLE_STATUSES),
        "num_retries": 1,
    }
    per_try = runtime.config.listener.per_try_timeout_s
    if per_try > 0:
        # Bounds each attempt until its response begins. Its expiry answers 504 and is not
        # retried (no gateway-error in retry_on): the engine may be generating.
        policy["per_try_timeout"] = _seconds(per_try)
    return policy


def _fallback_retry_policy(runtime: Runtime) -> Json:
    return {
        **_retry_conditions(runtime),
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": ext_type("retry.host.previous_hosts.v3.PreviousHostsPredicate")
                },
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }


def _routes(runtime: Runtime, opts: EnvoyOptions) -> list[Json]:
    # Always explicit: an unset route timeout is Envoy's 15 s, which cuts most generations.
    timers = {"timeout": _seconds(runtime.config.listener.route_timeout_s)}
    fallback: Json = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": FALLBACK_CLUSTER,
            **timers,
            "retry_policy": _fallback_retry_policy(runtime),
            **prefill_mirror_policies(runtime),
        },
    }
    if opts.mode == "ring_hash":
        header = runtime.config.session.header or "x-session-id"
        fallback["route"]["hash_policy"] = [{"header": {"header_name": header}}]
    if opts.mode != "extproc":
        return [fallback]
    # The pool data path of a model-aware fleet may name a model's own pool (_model_pools).
    # The listener is not reloaded: a fleet made model-aware by a reload gets this route (and
    # its pools' route) only when Envoy's bootstrap is rendered again; until then a pool name
    # the processor sets is ignored (endpoint_picker: one route) or routes by_header (auto).
    pools = (
        [_model_pool_route(runtime, timers)]
        if _may_pick_endpoints(runtime) and runtime.model_pools
        else []
    )
    if runtime.config.processor.mode == "endpoint_picker":
        # Endpoint-picker mode routes everything to the pool; the picker chooses the host.
        # (auto keeps the header route too, so a reload that crosses the crossover changes
        # only the CDS clusters, never the listener.)
        return [*pools, fallback]
    adapters = [_named_engines_route(runtime, timers)] if _names_adapter_engines(runtime) else []
    by_header = {
        "match": {"prefix": "/", "headers": [{"name": ROUTE_HEADER, "present_match": True}]},
        "route": {
            "cluster_header": ROUTE_HEADER,
            **timers,
            "retry_policy": _retry_policy(runtime),
            **_engine_hash_policy(runtime),
            **prefill_mirror_policies(runtime),
        },
    }
    return [*pools, *adapters, by_header, fallback]


def _names_adapter_engines(runtime: Runtime) -> bool:
    """Route mode (or auto, which may be) with sticky engines: the processor may name a LoRA
    adapter's engines (its loaded ones), sending the request to the cluster of every endpoint,
    where override_host tries them in order (protocol/responses.py RouteAnswers.route says why
    not the pair aggregate)."""
    sticky = runtime.config.engines.affinity == "sticky"
    return sticky and runtime.config.processor.mode != "endpoint_picker"


def _named_engines_route(runtime: Runtime, timers: Json) -> Json:
    """x-fleet-route naming the cluster of every endpoint (an adapter's request with its engines
    named): the fallback route's retry policy, the next named host (the pairs' would leave a
    one-priority cluster no host on the retry, as for _model_pool_route)."""
    return {
        "match": {
            "prefix": "/",
            "headers": [{"name": ROUTE_HEADER, "string_match": {"exact": FALLBACK_CLUSTER}}],
        },
        "route": {
            "cluster": FALLBACK_CLUSTER,
            **timers,
            "retry_policy": _fallback_retry_policy(runtime),
            **prefill_mirror_policies(runtime),
        },
    }


def _model_pool_route(runtime: Runtime, timers: Json) -> Json:
    """A model's own pool (x-fleet-route set to its name by the processor, which only ever
    names a rendered pool): the pool's retry policy (the next picked host), not the pairs'
    (previous_priorities would leave a one-priority pool no host on the retry)."""
    return {
        "match": {
            "prefix": "/",
            "headers": [
                {"name": ROUTE_HEADER, "string_match": {"prefix": MODEL_POOL_PREFIX}},
            ],
        },
        "route": {
            "cluster_header": ROUTE_HEADER,
            **timers,
            "retry_policy": _fallback_retry_policy(runtime),
        },
    }


def _model_pools(runtime: Runtime, pool: Json) -> list[Json]:
    """The pool data path in a model-aware fleet: one more pool per base model, the same
    cluster as the pool of every endpoint (override_host, outlier detection, per-endpoint
    stats) with only the localities of the clusters serving the model. The processor routes a
    request to its model's pool, so a host choice that falls back (no picked host usable)
    stays among engines that serve the model, and Envoy's stats count each model apart. The
    pool of every endpoint stays for fail-open.

    No active health checks here: Envoy runs a cluster's checks for that cluster alone, so an
    endpoint serving k models was checked k + 1 times per interval, on the main thread that
    also applies updates (POOL_HEALTH_CHECK_INTERVAL_S). They would decide nothing: a request
    reaches a model's pool only with its hosts named, override_host takes a named host whatever
    its health (a dead one is retried on the next name), and the processor names only
    endpoints its own prober finds ready. The pool of every endpoint keeps its checks (fail-open
    balances over its healthy hosts). Outlier detection stays: passive, it costs no probe."""
    out: list[Json] = []
    seen: set[str] = set()
    for model_pool in runtime.model_pools.values():
        if model_pool.name in seen:
            continue  # an adapter shares its base's pool
        seen.add(model_pool.name)
        cluster = copy.deepcopy(pool)
        cluster["name"] = model_pool.name
        del cluster["health_checks"]
        assignment = cluster["load_assignment"]
        assignment["cluster_name"] = model_pool.name
        assignment["endpoints"] = [
            e for e in assignment["endpoints"] if e["locality"]["sub_zone"] in model_pool.clusters
        ]
        out.append(cluster)
    return out


def _sticky_engines(runtime: Runtime, opts: EnvoyOptions) -> bool:
    """Route mode with engines.affinity sticky: each cluster ring-hashes its engines."""
    sticky = runtime.config.engines.affinity == "sticky"
    return opts.mode == "extproc" and sticky and not _picks_endpoints(runtime)


def _engine_hash_policy(runtime: Runtime) -> Json:
    """The routed request's hash key: the processor's x-fleet-engine-key (internal_only, so a
    client cannot pick its engine; core/endpoints.engine_key says why not x-fleet-session).
    Ignored by a ROUND_ROBIN cluster, so it is harmless when engines are not sticky."""
    if runtime.config.engines.affinity != "sticky":
        return {}
    return {"hash_policy": [{"header": {"header_name": ENGINE_KEY_HEADER}}]}


def _engine_lb(runtime: Runtime) -> Json:
    """An inference cluster's engine choice when sessions stick to engines.

    A consistent hash on the route's hash key. On Envoy 1.40 through the pair aggregates (the
    aggregate hands the request's hash to the member cluster it picks), 300 sessions over 4
    engines, one engine killed, restarted, then a fifth added:
    - MAGLEV (default): the dead engine's sessions moved, each to one other engine, and no
      other session moved; the fifth engine took 57 of 300 (≈1/5) and nothing moved among the
      old four (in the e2e test, with 3 engines growing to 4: 2 of 225 moved among the old);
    - RING_HASH: also 30 of the other 234 sessions moved on the removal, and 29 of 300 moved
      among the old engines on the addition: Envoy re-divides a fixed-size ring among the
      healthy hosts, so every host's share of ring points changes with their number.
    Bounded load (hash_balance_factor, percent): an engine with more than that multiple of the
    cluster's mean active requests passes the request to the next engine for that key.
    """
    # Hosts hashed by address (the default): a STRICT_DNS name resolving to several engines
    # gives each its own ring points, where a per-endpoint hash_key would merge them.
    lb: Json
    if runtime.config.engines.envoy_policy == "maglev":
        lb = {"lb_policy": "MAGLEV", "maglev_lb_config": {"table_size": 65537}}
    else:
        lb = {
            "lb_policy": "RING_HASH",
            "ring_hash_lb_config": {"minimum_ring_size": 1024, "hash_function": "XX_HASH"},
        }
    # Leave the cluster only when none of its engines is healthy. Envoy weighs a priority by
    # healthy share x overprovisioning factor (default 1.4): with one of 3 engines down the
    # primary kept 93 % and 7 % of requests, chosen per request, went to the secondary
    # (observed on 1.40), scattering sessions. Any healthy engine now keeps the whole share,
    # and the hash keeps each session on one of them. Panic routing stays (Envoy's 50 %): with
    # panic off, health checks that timed out on a loaded machine left no host and answered
    # 503 where panic routing would have reached a live engine (observed in test_failover).
    common: Json = {}
    factor = runtime.config.engines.balance_factor
    if factor is not None:
        common["consistent_hashing_lb_config"] = {"hash_balance_factor": round(factor * 100)}
    lb["common_lb_config"] = common
    return lb


def _picks_endpoints(runtime: Runtime) -> bool:
    """The pool data path: the processor names endpoints (auto resolved by fleet size)."""
    return runtime.endpoint_picker


def _may_pick_endpoints(runtime: Runtime) -> bool:
    """The processor may name endpoints under this config, now or after a reload (auto):
    the bootstrap keeps what the pool needs, so only the CDS clusters differ between designs."""
    return runtime.config.processor.mode != "route"


def _pool(runtime: Runtime, opts: EnvoyOptions) -> Json:
    """The pool data path's one cluster: every endpoint, one locality per fleet cluster.

    The locality (sub_zone = the fleet cluster's name) is what keeps per-cluster visibility in
    one Envoy cluster: /clusters lists each host with it, health flags and counters, and with
    per-endpoint stats each host is a labelled series. Health checks and outlier detection are
    per host, as in the per-cluster clusters. Localities carry no weights, so with no picked
    host (processor down, fail-open) the fallback policy balances over every host.
    """
    # Prefill-only clusters (P/D) take no request from Envoy (see _clusters).
    prefill_only = {c.name for c in runtime.config.clusters if c.role == "prefill"}
    clusters = [c for c in runtime.clusters if c.name not in prefill_only]
    pool = _inference_cluster(FALLBACK_CLUSTER, [], clusters[0].health_path, opts)
    pool["load_assignment"]["endpoints"] = [
        {
            "locality": {"sub_zone": c.name},
            "lb_endpoints": [tag_endpoint(_endpoint(e, opts), c.name) for e in c.endpoints],
        }
        for c in clusters
    ]
    # One check per host per interval: at 1 s, 512 x 8 hosts are ~4,100 checks a second on
    # Envoy's main thread, which then applied a one-cluster update in 5.3 s instead of 1.3 s
    # (measured, BENCHMARKS.md "Scale"). A dead host still leaves at once: a refused
    # connection is retried on the next picked endpoint (the secondary's), outlier detection
    # ejects it after LOCAL_ORIGIN_EJECT_AFTER of them, and the processor's own prober stops
    # naming it; the slower checks only delay Envoy's own verdict (2 failures: ~8 s).
    for check in pool["health_checks"]:
        check["interval"] = check["no_traffic_interval"] = _seconds(POOL_HEALTH_CHECK_INTERVAL_S)
    del pool["lb_policy"]
    pool["load_balancing_policy"] = _override_host_policy()
    pool["track_cluster_stats"] = {"per_endpoint_stats": True}
    if all(_is_ip(_map(e, opts)[0]) for c in clusters for e in c.endpoints):
        # STRICT_DNS sends every endpoint, IP literals included, through the resolver at start
        # and every refresh (5 s): thousands of lookups on the main thread at 512 x 8.
        pool["type"] = "STATIC"
        del pool["dns_lookup_family"]
    return pool


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _override_host_policy() -> Json:
    """Inference Extension host selection: try the picker's endpoints in order (the next one on
    each retry), else round robin. ONE source (metadata): configuring the header too would
    duplicate the list and make retries cycle over the same hosts."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": ext_type("load_balancing_policies.override_host.v3.OverrideHost"),
                        "override_host_sources": [
                            {
                                "metadata": {
                                    "key": "envoy.lb",
                                    "path": [{"key": "x-gateway-destination-endpoint"}],
                                }
                            }
                        ],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.round_robin",
                                        "typed_config": {
                                            "@type": ext_type(
                                                "load_balancing_policies.round_robin.v3.RoundRobin"
                                            )
                                        },
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }


def _wait_timer(runtime: Runtime) -> Json:
    """``max_message_timeout`` when some class waits for budget (extproc/core/flow.py): the
    processor re-arms the message timer with ``override_message_timeout`` for the wait, which
    Envoy honours only up to this bound (0, the default, ignores every override)."""
    longest = max((c.wait.max_wait_s for c in runtime.policy.classes if c.wait.enabled), default=0)
    if not longest:
        return {}
    bound = max(longest + WAIT_TIMER_HEADROOM_S, runtime.config.processor.message_timeout_ms / 1000)
    return {"max_message_timeout": f"{math.ceil(bound)}s"}


def _ext_proc_filter(runtime: Runtime) -> Json:
    proc = runtime.config.processor
    extra: Json = {}
    if runtime.response_phases or runtime.decide_at_headers:
        # The processor's request-headers answer turns response phases on per inference
        # request, and the header path turns the request body off (request_body_mode NONE).
        extra["allow_mode_override"] = True
    if _may_pick_endpoints(runtime) or _names_adapter_engines(runtime):
        # Without this Envoy silently drops the envoy.lb metadata the picker returns (route
        # mode: the engines named for a LoRA adapter's request).
        extra["metadata_options"] = {"receiving_namespaces": {"untyped": ["envoy.lb"]}}
    extra.update(_wait_timer(runtime))
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": ext_type("filters.http.ext_proc.v3.ExternalProcessor"),
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}, "timeout": "5s"},
            # open: with the processor down the request continues without our headers and takes
            # the fallback route; closed: Envoy answers status_on_error.
            "failure_mode_allow": proc.failure_mode == "open",
            "status_on_error": {"code": "ServiceUnavailable"},
            # The default 200 ms is too short to ship a multi-MB body to the processor.
            "message_timeout": f"{proc.message_timeout_ms / 1000:g}s",
            "processing_mode": {
                # SEND: routing from the body needs the header phase; with SKIP the route is
                # already final and clear_route_cache does nothing.
                "request_header_mode": "SEND",
                # BUFFERED: the whole body in one message (BUFFERED_PARTIAL truncates JSON).
                "request_body_mode": "BUFFERED",
                # Each extra phase costs a gRPC exchange (70-90 µs): ask only for what we use.
                # Response phases are off here even when the processor reads responses (load
                # reports for affinity, usage, a budget charge that follows a failover, P/D's
                # sidecar status: Runtime.response_phases): it turns them on per inference
                # request with a mode override in its request-headers answer
                # (protocol/responses.py, observe_responses). Rendered SEND, they would also
                # hold Envoy's own reply to a malformed header block, which has no request
                # for the processor to have seen: that reply then never came (Envoy closed the
                # connection a second later; RELIABILITY.md).
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                # SEND: Envoy sends a trailers message only for requests that have trailers
                # (no cost otherwise). A request of headers then trailers carries no body message
                # at all: without this the processor would never see it and it would pass
                # unplaced and unbudgeted. (A body followed by trailers arrives whole, with
                # end_of_stream=false, before the trailers message.)
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SKIP",
            },
            **response_attributes(runtime),
            **extra,
        },
    }


def _access_log(path: str) -> list[Json]:
    fmt = {
        "time": "%START_TIME%",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ(:PATH)%",
        "status": "%RESPONSE_CODE%",
        "flags": "%RESPONSE_FLAGS%",
        # Which timer or error ended the request (upstream_per_try_timeout,
        # upstream_response_timeout, ...): the flags alone do not tell them apart.
        "details": "%RESPONSE_CODE_DETAILS%",
        "route_cluster": "%UPSTREAM_CLUSTER%",
        "upstream": "%UPSTREAM_HOST%",
        "primary": "%REQ(X-FLEET-PRIMARY)%",
        "class": "%REQ(X-FLEET-CLASS)%",
        "session": "%REQ(X-FLEET-SESSION)%",
        "duration_ms": "%DURATION%",
        "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
        "request_id": "%REQ(X-REQUEST-ID)%",
    }
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": ext_type("access_loggers.file.v3.FileAccessLog"),
                "path": path,
                "log_format": {"json_format": fmt},
            },
        }
    ]


def internal_only_headers(runtime: Runtime) -> list[str]:
    """Headers only a trusted hop may set: the processor's own (with the P/D prefiller header,
    which makes the decode-side sidecar dial a host), the tenant tier and the tenant (a
    client naming another tenant would take its share and its limits), and with tracing the
    processor's trace context for the engine."""
    cfg = runtime.config
    trusted = [h for h in (cfg.session.tier_header, cfg.flow.tenant_header) if h]
    trace = [TRACEPARENT_HEADER] if traces(runtime) else []
    return [*FLEET_HEADERS, *PD_HEADERS, *dict.fromkeys(trusted), *trace]


def _path_normalisation() -> Json:
    """Hand the processor and the engines the same, canonical path.

    The engines (uvicorn + Starlette) percent-decode the path, %2F included, so
    ``/v1/chat/%63ompletions`` is chat completions to them; without normalisation the
    processor saw an unknown path and Envoy served it on the fallback route, unbudgeted.
    normalize_path (RFC 3986: decodes unreserved %XX, resolves dot segments) and merge_slashes
    run before any filter; %2F/%5C are unescaped and forwarded. The processor also matches
    paths canonically (core/api.py), for a trailing slash and letter case.
    """
    return {
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
    }


def h2_windows(runtime: Runtime) -> tuple[int, int]:
    """(stream, connection) flow-control windows for HTTP/2 clients (Envoy's defaults: 256 MiB).

    Envoy 1.40 also takes the stream window as the HTTP/2 stream's buffer limit: with a 1 MiB
    window, a 1.2 MB body got Envoy's own plain-text 413 before ext_proc saw it (observed, with
    and without trailers). So the stream window is the buffer the largest allowed body needs,
    the same as the listener's per-connection buffer."""
    stream = runtime.config.processor.max_body_bytes + BUFFER_HEADROOM
    return stream, max(H2_CONNECTION_WINDOW, stream)


def _http2_limits(runtime: Runtime) -> Json:
    """HTTP/2 clients: a bounded number of streams per connection (Envoy's default: 2^31 - 1),
    and windows no larger than the largest allowed body needs."""
    stream, connection = h2_windows(runtime)
    return {
        "max_concurrent_streams": runtime.config.listener.max_streams_per_connection,
        "initial_stream_window_size": stream,
        "initial_connection_window_size": connection,
    }


def _edge_trust() -> Json:
    """Envoy is the edge: every client is external.

    use_remote_address (Envoy's edge best practice): the client is the TCP peer, not whatever
    X-Forwarded-For claims, and the request is an edge request, whose x-envoy-* control headers
    Envoy does not honour (e2e: a client's x-envoy-upstream-rq-timeout-ms / x-envoy-retry-on
    change nothing). internal_address_config stays unset: on Envoy 1.40 that makes no address
    internal, so internal_only_headers are stripped from every request, loopback and private
    peers included, before any filter runs. (An explicit but empty cidr_ranges list brings back
    the legacy default that treats private and loopback peers as internal and keeps their
    headers: verified, a spoofed tier header then reached the processor.)
    """
    return {
        "use_remote_address": True,
        # Envoy replaces a client's x-request-id at the edge (a client must not steer trace
        # sampling or collide with other requests' ids) and returns its own in the response,
        # so the client can quote the id the logs carry.
        "always_set_request_id_in_response": True,
    }


def _http_connection_manager(runtime: Runtime, opts: EnvoyOptions) -> Json:
    filters: list[Json] = []
    if opts.mode == "extproc":
        filters.append(_ext_proc_filter(runtime))
    router: Json = {"@type": ext_type("filters.http.router.v3.Router")}
    if opts.mode == "extproc" and traces(runtime):
        router["upstream_http_filters"] = upstream_filters()
    filters.append({"name": "envoy.filters.http.router", "typed_config": router})
    listener = runtime.config.listener
    hcm: Json = {
        "@type": ext_type("filters.network.http_connection_manager.v3.HttpConnectionManager"),
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        **_path_normalisation(),
        **_edge_trust(),
        # Only receiving the request is bounded by default; see ListenerConfig for each timer.
        "request_timeout": _seconds(listener.request_receive_timeout_s),
        "request_headers_timeout": _seconds(listener.request_headers_timeout_s),
        # 0s disables Envoy's 5 min default: a long prefill sends no byte for minutes.
        "stream_idle_timeout": _seconds(listener.stream_idle_timeout_s),
        "http2_protocol_options": _http2_limits(runtime),
        "route_config": {
            "name": "fleet",
            # Stripped from external requests before any filter runs: a client cannot pick its
            # own cluster, class or tier, even when the processor is down (fail-open).
            "internal_only_headers": internal_only_headers(runtime),
            "virtual_hosts": [
                {"name": "fleet", "domains": ["*"], "routes": _routes(runtime, opts)}
            ],
        },
        "http_filters": filters,
        "local_reply_config": local_reply_config(
            runtime.config.model_routing.unavailable_retry_after_s
        ),
    }
    if opts.access_log_path:
        hcm["access_log"] = _access_log(opts.access_log_path)
    if envoy_traces(runtime):
        hcm["tracing"] = hcm_tracing(runtime)
    return hcm


def _prefill_mirrors(runtime: Runtime, opts: EnvoyOptions) -> list[Json]:
    """SGLang's P/D protocol: one cluster per prefill endpoint, the request mirror's targets."""
    return [
        _inference_cluster(name, [address], health, opts)
        for name, address, health in prefill_mirror_targets(runtime)
    ]


def _clusters(runtime: Runtime, opts: EnvoyOptions) -> list[Json]:
    if opts.mode == "extproc" and _picks_endpoints(runtime):
        # The pool data path: no per-cluster clusters and no pairs; nothing routes to them.
        pool = _pool(runtime, opts)
        return [
            pool,
            *_model_pools(runtime, pool),
            *_prefill_mirrors(runtime, opts),
            _extproc_cluster(runtime, opts),
            *([collector_cluster(runtime)] if envoy_traces(runtime) else []),
        ]
    clusters: list[Cluster] = list(runtime.clusters)
    out = [_inference_cluster(c.name, list(c.endpoints), c.health_path, opts) for c in clusters]
    if _sticky_engines(runtime, opts):
        for cluster in out:
            cluster.update(_engine_lb(runtime))
            cluster["load_assignment"]["policy"] = {"overprovisioning_factor": WHOLE_CLUSTER}
    # Prefill-only clusters (P/D) take no request from Envoy: the decode pods' sidecar dials
    # them. Leave them out of the fail-open fallback and of the (primary, secondary) pairs.
    prefill_only = {c.name for c in runtime.config.clusters if c.role == "prefill"}
    clusters = [c for c in clusters if c.name not in prefill_only]
    every_endpoint = [e for c in clusters for e in c.endpoints]
    owners = [c.name for c in clusters for _ in c.endpoints]
    fallback = _inference_cluster(
        FALLBACK_CLUSTER, every_endpoint, clusters[0].health_path, opts, owners
    )
    if opts.mode == "ring_hash":
        fallback["lb_policy"] = "RING_HASH"
        # Hash on names, not addresses: the same ring in every run and on every machine.
        keys = [f"{c.name}/{i}" for c in clusters for i, _ in enumerate(c.endpoints)]
        lb_endpoints = fallback["load_assignment"]["endpoints"][0]["lb_endpoints"]
        for lb_endpoint, key in zip(lb_endpoints, keys, strict=True):
            lb_endpoint["metadata"]["filter_metadata"]["envoy.lb"] = {"hash_key": key}
    if opts.mode == "extproc" and (_may_pick_endpoints(runtime) or _names_adapter_engines(runtime)):
        # auto below the crossover: the fallback is the pool a reload may start using. Route
        # mode: where an adapter's named engines are tried (round robin without names, as
        # before, for fail-open).
        del fallback["lb_policy"]
        fallback["load_balancing_policy"] = _override_host_policy()
    out.append(fallback)
    if opts.mode == "extproc":
        out.extend(_aggregate(p.name, s.name) for p, s in itertools.permutations(clusters, 2))
        out.extend(_prefill_mirrors(runtime, opts))
        out.append(_extproc_cluster(runtime, opts))
    if envoy_traces(runtime):
        out.append(collector_cluster(runtime))
    return out


def _extproc_cluster(runtime: Runtime, opts: EnvoyOptions) -> Json:
    proc = runtime.config.processor
    replicas = opts.extproc_endpoints or (f"{proc.address}:{proc.port}",)
    return {
        "name": EXTPROC_CLUSTER,
        "type": "STRICT_DNS",
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": "0.25s",
        "load_assignment": {
            "cluster_name": EXTPROC_CLUSTER,
            "endpoints": [{"lb_endpoints": [_endpoint(e, opts) for e in replicas]}],
        },
        # Several processor replicas may sit behind this name (compose aliases, a
        # headless Service): drop a dead one fast via the gRPC health service, and
        # eject one that resets streams, instead of failing requests open. A draining
        # replica answers NOT_SERVING: within 2 x interval + timeout = 3 s (< its
        # processor.drain_delay_s) new streams go to the others while its open streams
        # continue (Envoy closes no connection on a failed health check). Two failures,
        # not one, and a 1 s timeout: a replica that answers one check slowly (a busy
        # machine) is not marked down; when every replica looked down at once, Envoy's
        # panic routing sent a stream to a replica that was really gone (observed).
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "1s",
                "no_traffic_interval": "1s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {},
            }
        ],
        "outlier_detection": {
            "consecutive_gateway_failure": 1,
            "enforcing_consecutive_gateway_failure": 100,
            "consecutive_5xx": 5,
            "enforcing_consecutive_5xx": 0,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 50,
        },
        # ext_proc is gRPC: the cluster must speak HTTP/2.
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": ext_type("upstreams.http.v3.HttpProtocolOptions"),
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }


def _overload_manager(runtime: Runtime) -> Json:
    # Without a global limit every connection (each may buffer a maximum-size body) is
    # accepted until memory or file descriptors run out; Envoy warns about it at start.
    return {
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": ext_type(
                        "resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
                    ),
                    "max_active_downstream_connections": runtime.config.listener.max_connections,
                },
            }
        ]
    }


# Envoy 1.34+ (off by default through 1.40): at the end of an exchange the ext_proc filter
# half-closes the side stream and waits for the processor's status (up to its remote-close
# timeout, 1 s by default, then resets) instead of closing and resetting at once. The processor
# then ends every stream with OK at the half-close (processor.envoy_graceful_close,
# protocol/server.py): no cancellation, hence neither grpc.aio's cancellation cost nor its
# leak of a status sent on a reset call (grpc/grpc#43360). Read once, when the filter's config
# is built: a static layer is where it belongs.
GRACEFUL_CLOSE_FLAG = "envoy.reloadable_features.ext_proc_graceful_grpc_close"
RUNTIME_LAYER = "fleet_extproc"


def runtime_flags(runtime: Runtime) -> Json:
    """The runtime keys the processor relies on (empty when it expects none)."""
    return {GRACEFUL_CLOSE_FLAG: True} if runtime.envoy_graceful_close else {}


def runtime_layer(flags: Json) -> Json:
    return {"name": RUNTIME_LAYER, "static_layer": dict(flags)}


def with_runtime_flags(bootstrap: Json, flags: Json) -> Json:
    """``bootstrap`` with ``flags`` in its static layer named RUNTIME_LAYER, every layer already
    present kept in its order. A bootstrap without layered_runtime gets ours followed by an
    admin layer, which is what Envoy runs without one (so /runtime_modify keeps working)."""
    if not flags:
        return bootstrap
    # Copies of what changes only: a large fleet's bootstrap is not copied whole.
    layers = [dict(la) for la in bootstrap.get("layered_runtime", {}).get("layers", [])]
    ours = [la for la in layers if la.get("name") == RUNTIME_LAYER and "static_layer" in la]
    if ours:
        ours[0]["static_layer"] = {**ours[0]["static_layer"], **flags}
    elif not layers:
        layers = [runtime_layer(flags), {"name": "admin", "admin_layer": {}}]
    else:
        # Later layers override earlier ones: ours goes before an admin layer, after the others.
        at = next((i for i, la in enumerate(layers) if "admin_layer" in la), len(layers))
        layers.insert(at, runtime_layer(flags))
    return {
        **bootstrap,
        "layered_runtime": {**bootstrap.get("layered_runtime", {}), "layers": layers},
    }


def render_bootstrap(runtime: Runtime, opts: EnvoyOptions | None = None) -> Json:
    return with_runtime_flags(_bootstrap(runtime, opts), runtime_flags(runtime))


def _bootstrap(runtime: Runtime, opts: EnvoyOptions | None = None) -> Json:
    opts = opts or EnvoyOptions()
    cfg = runtime.config
    return {
        "admin": {
            # Admin can drain and reconfigure Envoy: never expose it beyond loopback.
            "address": {
                "socket_address": {"address": "127.0.0.1", "port_value": cfg.listener.admin_port}
            },
            # The operator can still reach /stats and /clusters with the listener full.
            "ignore_global_conn_limit": True,
        },
        "overload_manager": _overload_manager(runtime),
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {
                        "socket_address": {
                            "address": _map(f"{cfg.listener.address}:{cfg.listener.port}", opts)[0],
                            "port_value": _map(f"{cfg.listener.address}:{cfg.listener.port}", opts)[
                                1
                            ],
                        }
                    },
                    # Long-context bodies are MBs of JSON; the default 1 MiB buffer gives 413.
                    "per_connection_buffer_limit_bytes": cfg.processor.max_body_bytes
                    + BUFFER_HEADROOM,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": _http_connection_manager(runtime, opts),
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": _clusters(runtime, opts),
        },
    }

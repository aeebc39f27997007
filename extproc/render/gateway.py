"""Render Kubernetes manifests (Gateway API + Envoy Gateway, or an InferencePool) from fleet.yaml.

Two ways to put the processor in front of a fleet on Kubernetes:

- ``envoy-gateway``: Envoy Gateway runs the processor as an ext_proc filter
  (``EnvoyExtensionPolicy``). Every ordered (primary, secondary) pair the processor can emit in
  ``x-fleet-route`` gets one HTTPRoute rule whose backendRefs are the primary's ``Backend`` and
  the secondary's *fallback* ``Backend``. Envoy Gateway turns the two backendRefs of one rule
  into one Envoy cluster with the fallback Backend's endpoints at priority 1: the same failover
  the aggregate cluster gives in the plain-Envoy bootstrap (``render/envoy.py``).
- ``inference-pool``: the Gateway API Inference Extension. The processor is the pool's Endpoint
  Picker (``InferencePool.spec.endpointPickerRef``) and one HTTPRoute sends to the pool; in a
  model-aware fleet, one pool per model and one rule per pool (``render_model_pools``).

``all`` renders both, sharing the processor Deployment.

The fallback flag lives on the ``Backend`` object (``spec.fallback``), not on the backendRef:
Gateway API's HTTPBackendRef has no such field and Envoy Gateway's BackendTrafficPolicy has no
per-backend fallback either. A cluster is primary in some pairs and secondary in others, so each
cluster gets two Backends with the same endpoints: ``fleet-<name>`` and
``fleet-<name>-fallback``. (Envoy Gateway must run with ``extensionApis.enableBackend: true``.)
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

from extproc.config.drain import longest_wait_s, termination_grace_s
from extproc.config.runtime import Runtime
from extproc.core.decide import Placer
from extproc.core.fleet import Cluster
from extproc.names import BUFFER_HEADROOM, ROUTE_HEADER, WAIT_TIMER_HEADROOM_S
from extproc.render.disagg import LABEL_PREFIX as DISAGG_LABEL_PREFIX
from extproc.render.envoy import (
    LOCAL_ORIGIN_EJECT_AFTER,
    RETRIABLE_STATUSES,
    RETRY_ON,
    h2_windows,
    internal_only_headers,
    runtime_flags,
    runtime_layer,
)
from extproc.render.envoy_tracing import collector_address, envoy_traces

Json = dict[str, Any]
Mode = Literal["envoy-gateway", "inference-pool", "all"]
MODES: tuple[Mode, ...] = ("envoy-gateway", "inference-pool", "all")

DEFAULT_IMAGE = "ghcr.io/fleet-extproc/fleet-extproc:0.1.0"
APP = "fleet-extproc"
PROCESSOR = "fleet-extproc"
CONFIG_DIR = "/etc/fleet"
CONFIG_KEY = "fleet.yaml"
REDIS_SECRET = "fleet-redis"
REDIS_SECRET_KEY = "url"
REDIS_ENV = "FLEET_REDIS_URL"
FALLBACK_ROUTE = "fleet-fallback"
ALL_CLUSTERS_BACKEND = "fleet-all-clusters"
POOL = "fleet-pool"
POOL_ROUTE = "fleet-inference-pool"
# The image's non-root user (Dockerfile).
RUN_AS = 10001

GATEWAY_API = "gateway.networking.k8s.io"
ENVOY_GATEWAY = "gateway.envoyproxy.io"
INFERENCE = "inference.networking.k8s.io"

# Gateway API: at most 16 rules per HTTPRoute (CRD maxItems).
MAX_RULES_PER_ROUTE = 16
# Envoy Gateway: at most 256 endpoints per Backend (CRD maxItems).
MAX_BACKEND_ENDPOINTS = 256

_FQDN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\.?$")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


class GatewayRenderError(ValueError):
    """The fleet config cannot be expressed with Gateway API / Envoy Gateway objects."""


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    namespace: str = "fleet"
    image: str = DEFAULT_IMAGE
    mode: Mode = "envoy-gateway"
    # The Gateway the routes attach to; rendered policies target it (ClientTrafficPolicy).
    gateway: str = "fleet"
    gateway_namespace: str | None = None
    pool_selector: tuple[tuple[str, str], ...] = (("app", "vllm"),)
    pool_ports: tuple[int, ...] = (8000,)
    # Needed in "all" mode: both the fleet routes and the pool route would otherwise claim every
    # host and path of the Gateway.
    pool_hostname: str | None = None

    @property
    def gateway_ns(self) -> str:
        return self.gateway_namespace or self.namespace


def parse_selector(text: str) -> tuple[tuple[str, str], ...]:
    """``app=vllm,role=decode`` -> (("app", "vllm"), ("role", "decode"))."""
    pairs: list[tuple[str, str]] = []
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise GatewayRenderError(f"--pool-selector {text!r}: expected KEY=VALUE[,KEY=VALUE]")
        pairs.append((key, value))
    return tuple(pairs)


# --- small helpers -------------------------------------------------------------------------


def _duration(ms: int) -> str:
    """Gateway API / Envoy Gateway duration: ``^([0-9]{1,5}(h|m|s|ms)){1,4}$``."""
    if ms <= 0:
        return "0s"
    hours, rest = divmod(ms, 3_600_000)
    if hours > 99_999:
        raise GatewayRenderError(f"duration {ms} ms does not fit a Gateway API duration")
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    parts = [(hours, "h"), (minutes, "m"), (seconds, "s"), (millis, "ms")]
    return "".join(f"{n}{unit}" for n, unit in parts if n)


def _quantity(n_bytes: int) -> str:
    for suffix, size in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n_bytes % size == 0:
            return f"{n_bytes // size}{suffix}"
    return str(n_bytes)


def _labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "extproc-gateway",
    }


def _meta(name: str, namespace: str, component: str) -> Json:
    return {"name": name, "namespace": namespace, "labels": _labels(component)}


def _object(api_version: str, kind: str, meta: Json, **body: Any) -> Json:
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, **body}


def _target(kind: str, name: str) -> Json:
    return {"group": GATEWAY_API, "kind": kind, "name": name}


def _selector_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "processor"}


# --- endpoints -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    is_ip: bool

    def to_backend(self) -> Json:
        if self.is_ip:
            return {"ip": {"address": self.host, "port": self.port}}
        return {"fqdn": {"hostname": self.host, "port": self.port}}


def parse_endpoint(hostport: str, where: str) -> Endpoint:
    host, _, port_text = hostport.rpartition(":")
    host = host.strip("[]")
    port = int(port_text)
    if not 0 < port < 65536:
        raise GatewayRenderError(f"{where}: port {port} is not a usable port")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        fqdn = host.lower()
        # Envoy Gateway refuses Backends that point at the proxy itself.
        if fqdn == "localhost" or not _FQDN.match(fqdn):
            raise GatewayRenderError(
                f"{where}: {host!r} is not a hostname an Envoy Gateway Backend accepts"
            ) from None
        return Endpoint(fqdn, port, is_ip=False)
    if ip.is_loopback or ip.is_unspecified:
        raise GatewayRenderError(
            f"{where}: {host} is a loopback/unspecified address, which Envoy Gateway Backends "
            "refuse (it would reach the proxy itself)"
        )
    return Endpoint(str(ip), port, is_ip=True)


def cluster_endpoints(runtime: Runtime) -> dict[str, list[Endpoint]]:
    out = {
        c.name: [
            parse_endpoint(e, f"clusters[{i}].endpoints[{j}]") for j, e in enumerate(c.endpoints)
        ]
        for i, c in enumerate(runtime.clusters)
    }
    kinds = {ep.is_ip for eps in out.values() for ep in eps}
    # Envoy Gateway builds one Envoy cluster per route rule from all its backendRefs and picks a
    # single discovery type for it (STRICT_DNS for FQDNs, EDS for IPs), and the catch-all rule
    # spans every cluster: a fleet must use one address kind throughout.
    if len(kinds) > 1:
        raise GatewayRenderError(
            "clusters mix IP and hostname endpoints; Envoy Gateway cannot put both in one route "
            "rule (the catch-all spans every cluster): use one kind throughout"
        )
    return out


# --- which x-fleet-route values exist ------------------------------------------------------


def route_values(runtime: Runtime) -> list[tuple[str, ...]]:
    """Every value the processor can put in x-fleet-route, as (primary,) or (primary, secondary).

    All ordered pairs of clusters (what render/envoy.py gives aggregate clusters for), plus a
    single-cluster route for any class (or class and model) whose placement set has one cluster:
    its Placement has no secondary and routes to the bare cluster name.
    """
    names = [c.name for c in runtime.clusters]
    values: list[tuple[str, ...]] = list(itertools.permutations(names, 2))
    policy = runtime.policy
    placers: list[Placer] = [*policy.placers.values(), *policy.model_placers.values()]
    singles = {p.names[0] for p in placers if len(p.names) == 1}
    values.extend((n,) for n in names if n in singles)
    return values


def route_header_value(value: Sequence[str]) -> str:
    # Must equal core.placement.Placement.route for the same clusters.
    return "__".join(value)


# --- processor workload --------------------------------------------------------------------


def render_config_map(opts: GatewayOptions, config_text: str) -> Json:
    return _object(
        "v1",
        "ConfigMap",
        _meta(PROCESSOR, opts.namespace, "processor"),
        data={CONFIG_KEY: config_text},
    )


def render_redis_secret(opts: GatewayOptions, url: str) -> Json:
    # Rendered from fleet.yaml so that the stream is complete; in production replace it with the
    # real credentials (sealed-secrets, external-secrets...) and drop it from the stream.
    return _object(
        "v1",
        "Secret",
        _meta(REDIS_SECRET, opts.namespace, "processor"),
        type="Opaque",
        stringData={REDIS_SECRET_KEY: url},
    )


def _probes(runtime: Runtime) -> Json:
    proc = runtime.config.processor
    return {
        # Liveness asks the gRPC health service: a wedged event loop stops answering it.
        "livenessProbe": {
            "grpc": {"port": proc.port},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        # Readiness over HTTP on the metrics port, so a pod leaves the Service before shutdown
        # while its gRPC streams drain.
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
    }


def processor_container(runtime: Runtime, opts: GatewayOptions) -> Json:
    """The processor's container: fleet.yaml from the ConfigMap mounted as volume "config"."""
    return _container(runtime, opts)


def _container(runtime: Runtime, opts: GatewayOptions) -> Json:
    proc = runtime.config.processor
    container: Json = {
        "name": "extproc",
        "image": opts.image,
        "command": ["extproc"],
        # fleet.yaml's processor.address names the Service; the pod itself listens everywhere.
        "args": ["serve", "--config", f"{CONFIG_DIR}/{CONFIG_KEY}", "--address", "0.0.0.0"],
        "ports": [
            {"name": "grpc", "containerPort": proc.port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": proc.metrics_port, "protocol": "TCP"},
        ],
        **_probes(runtime),
        # Memory follows the largest bodies in flight (each is held whole, BUFFERED mode); no CPU
        # limit, since CFS throttling shows up directly as ext_proc latency.
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if runtime.config.redis.url:
        container["env"] = [
            {
                "name": REDIS_ENV,
                "valueFrom": {"secretKeyRef": {"name": REDIS_SECRET, "key": REDIS_SECRET_KEY}},
            },
            *_session_secret_env(runtime),
        ]
    return container


# The replicas' shared label secret (extproc.config.label_secret): the Redis affinity keys and
# response links are keyed with it, so replicas share them only when they share it. Not
# rendered (a manifest is not a secret store); the operator creates it, e.g.
# kubectl create secret generic fleet-session --from-literal=secret=$(openssl rand -hex 32).
# Optional: without it each pod draws its own secret and logs a warning.
SESSION_SECRET = "fleet-session"
SESSION_SECRET_KEY = "secret"


def _session_secret_env(runtime: Runtime) -> list[Json]:
    session = runtime.config.session
    if session.label_secret_file or not session.label_secret_env:
        return []  # a mounted file, or no environment variable to read
    ref = {"name": SESSION_SECRET, "key": SESSION_SECRET_KEY, "optional": True}
    return [{"name": session.label_secret_env, "valueFrom": {"secretKeyRef": ref}}]


def render_deployment(runtime: Runtime, opts: GatewayOptions) -> Json:
    pod_labels = {**_labels("processor")}
    template: Json = {
        "metadata": {
            "labels": pod_labels,
            # A config change rolls the pods (the ConfigMap mount alone would hot-swap the file
            # without the processor noticing).
            "annotations": {"fleet-extproc/config-version": runtime.version},
        },
        "spec": {
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            # A deploy must not cut a running request: on SIGTERM the processor keeps serving
            # the ext_proc streams of requests in flight until they end (extproc.serve.drain);
            # Kubernetes must not SIGKILL it before its drain can end. No preStop hook: the
            # processor itself keeps taking new streams for processor.drain_delay_s after
            # SIGTERM, while the endpoint update reaches Envoy.
            "terminationGracePeriodSeconds": termination_grace_s(runtime.config),
            "containers": [_container(runtime, opts)],
            "volumes": [{"name": "config", "configMap": {"name": PROCESSOR}}],
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": _selector_labels()},
                }
            ],
        },
    }
    return _object(
        "apps/v1",
        "Deployment",
        _meta(PROCESSOR, opts.namespace, "processor"),
        spec={
            # redis.replicas is the replica count the budget ledger divides by when Redis is
            # unreachable (on_unavailable: local): the Deployment must run exactly that many.
            "replicas": runtime.config.redis.replicas,
            "selector": {"matchLabels": _selector_labels()},
            "template": template,
        },
    )


def render_service(runtime: Runtime, opts: GatewayOptions) -> Json:
    proc = runtime.config.processor
    return _object(
        "v1",
        "Service",
        _meta(PROCESSOR, opts.namespace, "processor"),
        spec={
            "type": "ClusterIP",
            "selector": _selector_labels(),
            "ports": [
                # ext_proc is gRPC: cleartext HTTP/2.
                {
                    "name": "grpc",
                    "port": proc.port,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c",
                },
                {
                    "name": "metrics",
                    "port": proc.metrics_port,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    )


def render_processor_config(runtime: Runtime, opts: GatewayOptions, config_text: str) -> list[Json]:
    """fleet.yaml as a ConfigMap, and the Redis URL as a Secret when there is one."""
    url = runtime.config.redis.url
    if url and urlsplit(url).password:
        # fleet.yaml travels as a ConfigMap, readable by anyone who can read the namespace.
        raise GatewayRenderError(
            "redis.url carries a password; keep it out of fleet.yaml and put the URL in the "
            f"{REDIS_SECRET} Secret (env {REDIS_ENV})"
        )
    objs = [render_config_map(opts, config_text)]
    if url:
        objs.append(render_redis_secret(opts, url))
    return objs


def render_processor(runtime: Runtime, opts: GatewayOptions, config_text: str) -> list[Json]:
    objs = render_processor_config(runtime, opts, config_text)
    objs += [render_deployment(runtime, opts), render_service(runtime, opts)]
    return objs


# --- Envoy Gateway: backends and routes ----------------------------------------------------


def backend_name(cluster: str, fallback: bool = False) -> str:
    return f"fleet-{cluster}-fallback" if fallback else f"fleet-{cluster}"


def render_backend(
    name: str, endpoints: Sequence[Endpoint], opts: GatewayOptions, fallback: bool
) -> Json:
    spec: Json = {"endpoints": [e.to_backend() for e in endpoints]}
    if fallback:
        # Priority 1 in the rule's Envoy cluster: used when the active Backends' health drops
        # (overprovisioning 1.4: below ~72 % healthy) or when a retry moves on to the next
        # priority (numAttemptsPerPriority in the BackendTrafficPolicy).
        spec["fallback"] = True
    return _object(
        ENVOY_GATEWAY + "/v1alpha1", "Backend", _meta(name, opts.namespace, "backend"), spec=spec
    )


def render_backends(
    runtime: Runtime, opts: GatewayOptions, endpoints: dict[str, list[Endpoint]]
) -> list[Json]:
    out: list[Json] = []
    for cluster in runtime.clusters:
        eps = endpoints[cluster.name]
        if len(eps) > MAX_BACKEND_ENDPOINTS:
            raise GatewayRenderError(
                f"cluster {cluster.name}: {len(eps)} endpoints, a Backend holds at most "
                f"{MAX_BACKEND_ENDPOINTS}"
            )
        out.append(render_backend(backend_name(cluster.name), eps, opts, fallback=False))
        out.append(render_backend(backend_name(cluster.name, True), eps, opts, fallback=True))
    return out


def _all_cluster_chunks(endpoints: dict[str, list[Endpoint]]) -> list[list[Endpoint]]:
    every = [e for eps in endpoints.values() for e in eps]
    chunks = [
        every[i : i + MAX_BACKEND_ENDPOINTS] for i in range(0, len(every), MAX_BACKEND_ENDPOINTS)
    ]
    if len(chunks) > MAX_RULES_PER_ROUTE:
        raise GatewayRenderError(f"{len(every)} endpoints do not fit one catch-all route rule")
    return chunks


def render_all_cluster_backends(
    endpoints: dict[str, list[Endpoint]], opts: GatewayOptions
) -> list[Json]:
    """One Backend over every endpoint of every cluster (chunked at 256): the catch-all's target.

    The same shape as the bootstrap's ``all_clusters`` cluster. One rule cannot list one
    backendRef per cluster: HTTPRoute caps backendRefs at 16 and fleets run to tens of clusters.
    """
    chunks = _all_cluster_chunks(endpoints)
    return [
        render_backend(
            f"{ALL_CLUSTERS_BACKEND}-{i}" if len(chunks) > 1 else ALL_CLUSTERS_BACKEND,
            chunk,
            opts,
            False,
        )
        for i, chunk in enumerate(chunks)
    ]


def _backend_ref(name: str) -> Json:
    return {"group": ENVOY_GATEWAY, "kind": "Backend", "name": name}


def _parent_ref(opts: GatewayOptions) -> Json:
    ref: Json = {"group": GATEWAY_API, "kind": "Gateway", "name": opts.gateway}
    if opts.gateway_ns != opts.namespace:
        ref["namespace"] = opts.gateway_ns
    return ref


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _timeouts(runtime: Runtime) -> Json:
    # Always explicit: "0s" disables the timeout (Gateway API), and with none set Envoy Gateway
    # leaves Envoy's 15 s route default, which cuts most generations.
    listener = runtime.config.listener
    timeouts = {"request": _duration(_ms(listener.route_timeout_s))}
    if listener.per_try_timeout_s > 0:
        # Per attempt, until the response begins (Envoy's per_try_timeout). Gateway API: it
        # must not exceed the request timeout when that one is set.
        if 0 < listener.route_timeout_s < listener.per_try_timeout_s:
            raise GatewayRenderError(
                "listener.per_try_timeout_s exceeds listener.route_timeout_s; Gateway API "
                "requires timeouts.backendRequest <= timeouts.request"
            )
        timeouts["backendRequest"] = _duration(_ms(listener.per_try_timeout_s))
    return timeouts


def pair_rule(value: Sequence[str], runtime: Runtime) -> Json:
    refs = [_backend_ref(backend_name(value[0]))]
    if len(value) > 1:
        refs.append(_backend_ref(backend_name(value[1], fallback=True)))
    return {
        # Rule names must be DNS subdomains: "." cannot occur in a cluster name, "__" cannot
        # occur in a rule name.
        "name": ".".join(value),
        "matches": [
            {
                "path": {"type": "PathPrefix", "value": "/"},
                "headers": [
                    {"type": "Exact", "name": ROUTE_HEADER, "value": route_header_value(value)}
                ],
            }
        ],
        "backendRefs": refs,
        "timeouts": _timeouts(runtime),
    }


def _http_route(name: str, rules: list[Json], opts: GatewayOptions, component: str) -> Json:
    return _object(
        GATEWAY_API + "/v1",
        "HTTPRoute",
        _meta(name, opts.namespace, component),
        spec={"parentRefs": [_parent_ref(opts)], "rules": rules},
    )


def health_path(clusters: Iterable[Cluster]) -> str | None:
    """The active health-check path shared by these clusters, or None when they differ."""
    paths = {c.health_path for c in clusters}
    return paths.pop() if len(paths) == 1 else None


# Envoy Gateway health-checks per route rule (each rule is one Envoy cluster), configured per
# HTTPRoute by a BackendTrafficPolicy. Routes are grouped by the health path all clusters of
# their rules share (None: the clusters differ, so only passive checks apply), and each group
# gets its own policy.
RouteGroups = dict[str | None, list[Json]]


def render_pair_routes(runtime: Runtime, opts: GatewayOptions) -> RouteGroups:
    by_name = {c.name: c for c in runtime.clusters}
    rules_by_path: dict[str | None, list[Json]] = {}
    for value in route_values(runtime):
        key = health_path(by_name[n] for n in value)
        rules_by_path.setdefault(key, []).append(pair_rule(value, runtime))
    groups: RouteGroups = {}
    index = 0
    for key in sorted(rules_by_path, key=lambda k: (k is None, k or "")):
        rules = rules_by_path[key]
        for start in range(0, len(rules), MAX_RULES_PER_ROUTE):
            chunk = rules[start : start + MAX_RULES_PER_ROUTE]
            route = _http_route(f"fleet-routes-{index:03d}", chunk, opts, "routes")
            groups.setdefault(key, []).append(route)
            index += 1
    return groups


def render_fallback_route(runtime: Runtime, opts: GatewayOptions, n_backends: int) -> Json:
    """Catch-all over every cluster: fail-open (processor down) and non-inference paths.

    A rule with a header match outranks one without (Gateway API match precedence), so a
    request carrying x-fleet-route never lands here.
    """
    if n_backends == 1:
        names = [ALL_CLUSTERS_BACKEND]
    else:
        names = [f"{ALL_CLUSTERS_BACKEND}-{i}" for i in range(n_backends)]
    rule = {
        "name": "all-clusters",
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [_backend_ref(n) for n in names],
        "timeouts": _timeouts(runtime),
    }
    return _http_route(FALLBACK_ROUTE, [rule], opts, "routes")


# --- Envoy Gateway: policies ---------------------------------------------------------------


def gateway_message_timeout_ms(runtime: Runtime) -> int:
    """The EnvoyExtensionPolicy's ``messageTimeout``: ``processor.message_timeout_ms``, plus
    the longest a request can wait for budget (config/drain.longest_wait_s) and the same 1 s
    headroom the processor's timer override gets.

    Envoy Gateway renders this one field into the ext_proc filter's ``message_timeout`` and
    has no ``max_message_timeout`` (its policy schema, v1alpha1), so Envoy ignores the
    processor's ``override_message_timeout`` (counted as override_message_timeout_ignored).
    A waiting request's body message stays unanswered for the whole wait, which starts once
    the body has reached the processor: with the bare message timeout the timer would cut it
    and the request would pass unplaced and unbudgeted (fail-open) or get a 503 (closed).
    The price: a processor that hangs with its streams open is given up on after this long
    instead of after ``message_timeout_ms``, on every request (the pod's liveness probe
    restarts a wedged event loop after ~30 s). Operators who want the short timer set their
    classes' ``wait.max_wait_s`` low (0: no waiting), and the timer follows.
    """
    proc = runtime.config.processor
    longest = longest_wait_s(runtime.config)
    if not longest:
        return proc.message_timeout_ms
    return proc.message_timeout_ms + math.ceil((longest + WAIT_TIMER_HEADROOM_S) * 1000)


def render_extension_policy(
    runtime: Runtime, opts: GatewayOptions, route_names: Sequence[str]
) -> Json:
    proc = runtime.config.processor
    ext_proc: Json = {
        "backendRefs": [{"group": "", "kind": "Service", "name": PROCESSOR, "port": proc.port}],
        "processingMode": {
            # Headers + whole body; no response phases: each extra phase costs a gRPC exchange.
            # The processor routes from the body answer (header mutation + clear_route_cache).
            "request": {"body": "Buffered"},
        },
        # The default 200 ms is too short to ship a multi-MB body to the processor; and the
        # timer must outlast a wait for budget (gateway_message_timeout_ms).
        "messageTimeout": _duration(gateway_message_timeout_ms(runtime)),
        # open: the request continues without x-fleet-route and takes the catch-all route.
        "failOpen": proc.failure_mode == "open",
        "statusOnError": 503,
    }
    return _object(
        ENVOY_GATEWAY + "/v1alpha1",
        "EnvoyExtensionPolicy",
        _meta(PROCESSOR, opts.namespace, "policy"),
        spec={"targetRefs": [_target("HTTPRoute", n) for n in route_names], "extProc": [ext_proc]},
    )


def _active_health_check(path: str) -> Json:
    # Same cadence as the bootstrap: a dead cluster is found within ~1 s even with no traffic.
    return {
        "type": "HTTP",
        "http": {"path": path},
        "interval": "1s",
        "timeout": "500ms",
        "unhealthyThreshold": 1,
        "healthyThreshold": 1,
    }


def _passive_health_check() -> Json:
    # The bootstrap's outlier detection (render/envoy.py _outlier_detection): eject on
    # local-origin failures (connect failures, resets, timeouts) only. An engine's own 429/503
    # is backpressure and its 500 a bad request: consecutive5XxErrors 0 switches the 5xx
    # detector off and consecutiveGatewayErrors is left unset (Envoy does not enforce it).
    # The policy has no failure-percentage detector: a host that accepts connections and resets
    # requests is not ejected here (the bootstrap's local-origin failure percentage does it).
    return {
        "splitExternalLocalOriginErrors": True,
        "consecutiveLocalOriginFailures": LOCAL_ORIGIN_EJECT_AFTER,
        "consecutive5XxErrors": 0,
        "interval": "1s",
        "baseEjectionTime": "10s",
        "maxEjectionPercent": 100,
    }


def render_traffic_policy(
    name: str, path: str | None, routes: Sequence[Json], opts: GatewayOptions
) -> Json:
    health: Json = {"passive": _passive_health_check()}
    if path is not None:
        health["active"] = _active_health_check(path)
    spec: Json = {
        "targetRefs": [_target("HTTPRoute", r["metadata"]["name"]) for r in routes],
        # Only what cannot have generated (render/envoy.py _retry_conditions), once. One
        # attempt per priority: the retry goes to the fallback Backend, like
        # previous_priorities in the bootstrap.
        "retry": {
            "numRetries": 1,
            "numAttemptsPerPriority": 1,
            "retryOn": {
                "triggers": list(RETRY_ON),
                "httpStatusCodes": list(RETRIABLE_STATUSES),
            },
        },
        "healthCheck": health,
    }
    return _object(
        ENVOY_GATEWAY + "/v1alpha1",
        "BackendTrafficPolicy",
        _meta(name, opts.namespace, "policy"),
        spec=spec,
    )


def _client_timeouts(runtime: Runtime) -> Json:
    # The bootstrap's HCM timers (render/envoy.py): receiving the request is bounded, the
    # response side is not ("0s" switches Envoy Gateway's 5 min stream idle default off).
    listener = runtime.config.listener
    http: Json = {
        "requestReceivedTimeout": _duration(_ms(listener.request_receive_timeout_s)),
        "streamIdleTimeout": _duration(_ms(listener.stream_idle_timeout_s)),
    }
    if listener.request_headers_timeout_s > 0:
        http["requestHeadersReceivedTimeout"] = _duration(_ms(listener.request_headers_timeout_s))
    return {"http": http}


def render_client_policy(runtime: Runtime, opts: GatewayOptions) -> Json:
    return _object(
        ENVOY_GATEWAY + "/v1alpha1",
        "ClientTrafficPolicy",
        # Policies attach only to targets in their own namespace.
        _meta(PROCESSOR, opts.gateway_ns, "policy"),
        spec={
            "targetRefs": [_target("Gateway", opts.gateway)],
            "connection": {
                # Long-context bodies are MBs of JSON; the default 32 KiB buffer gives 413.
                "bufferLimit": _quantity(runtime.config.processor.max_body_bytes + BUFFER_HEADROOM),
                # Per Envoy proxy, like the bootstrap's overload manager limit.
                "connectionLimit": {"value": runtime.config.listener.max_connections},
            },
            "timeout": _client_timeouts(runtime),
            # Same HTTP/2 limits as the bootstrap (render/envoy.py _http2_limits).
            "http2": {
                "maxConcurrentStreams": runtime.config.listener.max_streams_per_connection,
                "initialStreamWindowSize": _quantity(h2_windows(runtime)[0]),
                "initialConnectionWindowSize": _quantity(h2_windows(runtime)[1]),
            },
            # Same normalisation as the bootstrap: the processor and the engines see one
            # canonical path, so no spelling of an inference path escapes placement and budgets.
            "path": {"escapedSlashesAction": "UnescapeAndForward", "disableMergeSlashes": False},
            # Stripped before any filter: a client cannot pick its own cluster, class or tier,
            # even when the processor is down (fail-open). An auth filter (SecurityPolicy: JWT
            # claimToHeaders, extAuth headersToBackend) runs later and may set the tier. Same
            # list as the bootstrap's internal_only_headers.
            "headers": {"earlyRequestHeaders": {"remove": internal_only_headers(runtime)}},
        },
    )


def render_envoy_proxy(runtime: Runtime, opts: GatewayOptions) -> Json | None:
    """Envoy Gateway's EnvoyProxy carrying the runtime flags the processor relies on (the
    graceful ext_proc close, render/envoy.py runtime_flags); None when it relies on none.
    A Merge bootstrap adds our static layer after Envoy Gateway's own layers, keeping them
    (Merge appends to lists). The Gateway uses it once its spec.infrastructure.parametersRef
    (or its GatewayClass's parametersRef) names it: Envoy Gateway does not apply an EnvoyProxy
    nothing references."""
    flags = runtime_flags(runtime)
    tracing = envoy_traces(runtime)
    if not flags and not tracing:
        return None
    spec: Json = {}
    if flags:
        layers = {"layered_runtime": {"layers": [runtime_layer(flags)]}}
        spec["bootstrap"] = {"type": "Merge", "value": yaml.safe_dump(layers, sort_keys=False)}
    if tracing:
        spec["telemetry"] = {"tracing": _proxy_tracing(runtime, opts)}
    return _object(
        ENVOY_GATEWAY + "/v1alpha1",
        "EnvoyProxy",
        _meta(PROCESSOR, opts.gateway_ns, "proxy"),
        spec=spec,
    )


TRACE_COLLECTOR = "fleet-otel-collector"
# Envoy Gateway's sampling fraction: the ratio in ten-thousandths.
SAMPLING_DENOMINATOR = 10_000


def _proxy_tracing(runtime: Runtime, opts: GatewayOptions) -> Json:
    """Envoy Gateway's OpenTelemetry tracer, to the collector of tracing.endpoint (a Backend),
    sampling requests without a trace context at tracing.sampling_ratio (one with a context
    follows its parent's flag, as the processor does)."""
    cfg = runtime.config.tracing
    ratio = round(cfg.sampling_ratio * SAMPLING_DENOMINATOR)
    backend = {"group": ENVOY_GATEWAY, "kind": "Backend", "name": TRACE_COLLECTOR}
    if opts.gateway_ns != opts.namespace:
        backend["namespace"] = opts.namespace
    return {
        "samplingFraction": {"numerator": ratio, "denominator": SAMPLING_DENOMINATOR},
        "provider": {
            "type": "OpenTelemetry",
            "backendRefs": [backend],
        },
    }


def render_trace_collector(runtime: Runtime, opts: GatewayOptions) -> list[Json]:
    """The collector of tracing.endpoint as a Backend, when Envoy Gateway traces to it."""
    if not envoy_traces(runtime):
        return []
    host, port, _grpc = collector_address(runtime)
    endpoint = parse_endpoint(f"{host}:{port}", "tracing.endpoint")
    return [render_backend(TRACE_COLLECTOR, [endpoint], opts, fallback=False)]


def render_envoy_gateway(runtime: Runtime, opts: GatewayOptions) -> list[Json]:
    endpoints = cluster_endpoints(runtime)
    all_backends = render_all_cluster_backends(endpoints, opts)
    groups = render_pair_routes(runtime, opts)
    fallback = render_fallback_route(runtime, opts, len(all_backends))
    groups.setdefault(health_path(runtime.clusters), []).append(fallback)
    routes = [r for rs in groups.values() for r in rs]
    policies = [
        render_traffic_policy(f"fleet-{i:02d}" if len(groups) > 1 else "fleet", path, rs, opts)
        for i, (path, rs) in enumerate(groups.items())
    ]
    return [
        *render_backends(runtime, opts, endpoints),
        *all_backends,
        *routes,
        render_extension_policy(runtime, opts, [r["metadata"]["name"] for r in routes]),
        *policies,
    ]


# --- Inference Extension -------------------------------------------------------------------


def render_inference_pool(runtime: Runtime, opts: GatewayOptions) -> Json:
    if not opts.pool_ports:
        raise GatewayRenderError("inference-pool mode needs at least one --pool-port")
    proc = runtime.config.processor
    return _object(
        INFERENCE + "/v1",
        "InferencePool",
        _meta(POOL, opts.namespace, "pool"),
        spec={
            "selector": {"matchLabels": {**dict(opts.pool_selector), **pd_pool_labels(runtime)}},
            "targetPorts": [{"number": p} for p in opts.pool_ports],
            # The processor acts as the pool's Endpoint Picker over gRPC ext_proc.
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": PROCESSOR,
                "port": {"number": proc.port},
                "failureMode": "FailOpen" if proc.failure_mode == "open" else "FailClose",
            },
        },
    )


def pd_pool_labels(runtime: Runtime) -> dict[str, str]:
    """P/D: the pool holds the decode pods only. The processor never picks a prefill pod,
    but with the processor unreachable (FailOpen) the gateway balances over the whole pool; a
    prefill pod must not take whole requests then. The pods carry their cluster's role
    (render/disagg.py); a label selector cannot say "decode or both", so a P/D fleet whose
    other clusters mix the two keeps the configured selector."""
    roles = {c.role for c in runtime.config.clusters}
    if roles == {"prefill", "decode"}:
        return {f"{DISAGG_LABEL_PREFIX}role": "decode"}
    return {}


def refuse_sglang_protocol(runtime: Runtime) -> None:
    """SGLang's P/D protocol sends the request to the prefill endpoint too, through Envoy's
    request mirror chosen by a header (render/disagg.py). Neither Envoy Gateway's HTTPRoute
    (its RequestMirror filter names a fixed backend) nor the Inference Extension expresses
    that, so ``extproc gateway`` refuses it rather than render a fleet whose prefill servers
    never hear of the request."""
    pd = runtime.pd
    if pd is not None and pd.protocol == "sglang":
        raise GatewayRenderError(
            "disaggregation.protocol sglang needs Envoy's header-chosen request mirror: render "
            "plain Envoy (extproc envoy), or use protocol llm-d behind a Gateway"
        )


def render_pool_route(runtime: Runtime, opts: GatewayOptions) -> Json:
    spec: Json = {
        "parentRefs": [_parent_ref(opts)],
        "rules": [
            {
                "name": "pool",
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": INFERENCE, "kind": "InferencePool", "name": POOL}],
                "timeouts": _timeouts(runtime),
            }
        ],
    }
    if opts.pool_hostname:
        spec["hostnames"] = [opts.pool_hostname]
    return _object(
        GATEWAY_API + "/v1", "HTTPRoute", _meta(POOL_ROUTE, opts.namespace, "pool"), spec=spec
    )


# --- Inference Extension: a pool per model -------------------------------------------------

# The Inference Extension's model header: its body-based routing (BBR) copies the body's
# "model" into it, so HTTPRoutes can send each model to its own pool.
MODEL_HEADER = "X-Gateway-Model-Name"
# The pod label that says which model's pool a pod belongs to (added to --pool-selector).
MODEL_LABEL = "fleet-extproc/model"


def _model_slug(name: str) -> str:
    """A model name as a DNS-label-safe slug, unique by a hash suffix when it had to change."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40].strip("-")
    if slug == name:
        return slug
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    return f"{slug}-{digest}" if slug else digest


def model_pools(runtime: Runtime) -> list[tuple[str, list[str]]]:
    """(base model, every name routed to its pool: itself, its aliases, its adapters)."""
    served = runtime.policy.models.served()
    out = []
    for model in served:
        if model.base is not None:
            continue
        adapters = [m.name for m in served if m.base == model.name]
        out.append((model.name, [model.name, *model.aliases, *adapters]))
    return out


def render_model_pools(runtime: Runtime, opts: GatewayOptions) -> list[Json]:
    """One InferencePool per model (its pods carry ``fleet-extproc/model: <slug>``, as the
    Inference Extension keeps a pool per base model) and one HTTPRoute that sends each model's
    names, read from X-Gateway-Model-Name (set by the Inference Extension's body-based routing
    in front), to its pool. The processor is every pool's Endpoint Picker."""
    pools = model_pools(runtime)
    if len(pools) > MAX_RULES_PER_ROUTE:
        raise GatewayRenderError(
            f"{len(pools)} models: one pool route holds at most {MAX_RULES_PER_ROUTE} rules"
        )
    objs: list[Json] = []
    rules: list[Json] = []
    for model, names in pools:
        slug = _model_slug(model)
        pool = render_inference_pool(runtime, opts)
        pool["metadata"]["name"] = f"{POOL}-{slug}"
        pool["spec"]["selector"]["matchLabels"][MODEL_LABEL] = slug
        objs.append(pool)
        rules.append(
            {
                "name": f"model-{slug}",
                "matches": [
                    {
                        "path": {"type": "PathPrefix", "value": "/"},
                        "headers": [{"type": "Exact", "name": MODEL_HEADER, "value": n}],
                    }
                    for n in names
                ],
                "backendRefs": [
                    {"group": INFERENCE, "kind": "InferencePool", "name": pool["metadata"]["name"]}
                ],
                "timeouts": _timeouts(runtime),
            }
        )
    route = render_pool_route(runtime, opts)
    route["spec"]["rules"] = rules
    return [*objs, route]


# --- entry point ---------------------------------------------------------------------------


def render_manifests(
    runtime: Runtime, config_text: str, opts: GatewayOptions | None = None
) -> list[Json]:
    """Every object for ``opts.mode``, in apply order (config and workload first)."""
    opts = opts or GatewayOptions()
    refuse_sglang_protocol(runtime)
    if opts.mode == "all" and not opts.pool_hostname:
        raise GatewayRenderError(
            "mode all: give --pool-hostname, or the pool route and the fleet routes would both "
            "claim every host of the Gateway"
        )
    objs = render_processor(runtime, opts, config_text)
    objs.append(render_client_policy(runtime, opts))
    objs += render_trace_collector(runtime, opts)
    proxy = render_envoy_proxy(runtime, opts)
    if proxy is not None:
        objs.append(proxy)
    if opts.mode in ("envoy-gateway", "all"):
        objs += render_envoy_gateway(runtime, opts)
    if opts.mode in ("inference-pool", "all"):
        if runtime.policy.models.enabled:
            objs += render_model_pools(runtime, opts)
        else:
            objs += [render_inference_pool(runtime, opts), render_pool_route(runtime, opts)]
    return objs

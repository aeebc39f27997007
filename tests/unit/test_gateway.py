"""`extproc gateway`: Kubernetes manifests rendered from fleet.yaml, checked offline.

Every custom object is validated against the openAPIV3Schema of its kind and version from the
CRDs vendored in third_party/crds (Gateway API v1.6.1, Envoy Gateway, Inference Extension),
made strict: an unknown field fails, as it does with server-side field validation (kubectl's
default), instead of being silently pruned. CEL rules are not covered by a JSON Schema
validator; the ones these manifests could break are checked by hand below. Core kinds
(ConfigMap, Secret, Deployment, Service) ship no schema here, so their required structure and
cross-references are checked by hand.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from extproc import cli
from extproc.config import Runtime, compile_runtime, load_config, parse_config
from extproc.config.drain import longest_wait_s
from extproc.core.placement import Placement
from extproc.names import FLEET_HEADERS, PD_HEADERS, ROUTE_HEADER
from extproc.render.gateway import (
    GatewayOptions,
    GatewayRenderError,
    parse_selector,
    render_manifests,
)

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "third_party" / "crds"
COMPOSE_FLEET = REPO / "compose" / "fleet.yaml"

Json = dict[str, Any]
SchemaKey = tuple[str, str, str]
CORE_KINDS = {("", "v1", "ConfigMap"), ("", "v1", "Secret"), ("", "v1", "Service")}
CORE_KINDS |= {("apps", "v1", "Deployment")}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MODES = ("envoy-gateway", "inference-pool", "all")


# --- CRD schema index ----------------------------------------------------------------------


def _strict(schema: Json) -> Json:
    """Copy of a structural schema in which objects with declared properties reject others."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    return out


@cache
def crd_schemas() -> dict[SchemaKey, Json]:
    """(group, version, kind) -> strict openAPIV3Schema, from every CRD file in third_party/crds."""
    assert CRD_DIR.is_dir(), f"CRD schemas not found at {CRD_DIR}"
    index: dict[SchemaKey, Json] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                key = (spec["group"], version["name"], spec["names"]["kind"])
                index[key] = _strict(version["schema"]["openAPIV3Schema"])
    return index


def schema_key(obj: Json) -> SchemaKey:
    group, _, version = obj["apiVersion"].rpartition("/")
    return group, version, obj["kind"]


def validate_custom(obj: Json) -> None:
    key = schema_key(obj)
    schema = crd_schemas().get(key)
    assert schema is not None, f"no CRD schema for {key} in {CRD_DIR}"
    errors = sorted(
        jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path)
    )
    assert not errors, f"{key} {obj['metadata']['name']}: " + "; ".join(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]
    )


def test_crd_index_has_every_kind_the_renderer_emits() -> None:
    keys = set(crd_schemas())
    for kind in ("Backend", "BackendTrafficPolicy", "ClientTrafficPolicy", "EnvoyExtensionPolicy"):
        assert ("gateway.envoyproxy.io", "v1alpha1", kind) in keys
    assert ("gateway.networking.k8s.io", "v1", "HTTPRoute") in keys
    assert ("inference.networking.k8s.io", "v1", "InferencePool") in keys


def test_strict_schema_rejects_a_misspelled_field() -> None:
    # Guards the strictness itself: without it every typo would validate.
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "r"},
        "spec": {"rules": [{"backendRef": [{"name": "x"}]}]},
    }
    with pytest.raises(AssertionError, match="backendRef"):
        validate_custom(route)


# --- fleets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    runtime: Runtime
    text: str


def fleet_from_dict(data: Json) -> Fleet:
    text = yaml.safe_dump(data, sort_keys=False)
    return Fleet(compile_runtime(parse_config(data), text.encode()), text)


def fleet_data(n: int, **cluster_fields: Any) -> Json:
    clusters = [
        {"name": f"c{i}", "endpoints": [f"vllm-c{i}.inference.svc.cluster.local:8000"]}
        for i in range(1, n + 1)
    ]
    for c in clusters:
        c.update(cluster_fields)
    return {
        "version": 1,
        "listener": {"route_timeout_s": 90.5},
        "processor": {"failure_mode": "closed", "message_timeout_ms": 1500},
        "clusters": clusters,
        "redis": {"url": "redis://redis.fleet.svc:6379/0", "replicas": 3},
    }


@cache
def compose_fleet() -> Fleet:
    cfg, raw = load_config(COMPOSE_FLEET)
    return Fleet(compile_runtime(cfg, raw), raw.decode())


@cache
def forty_clusters() -> Fleet:
    return fleet_from_dict(fleet_data(40))


@cache
def mixed_fleet() -> Fleet:
    """Different health paths, IP endpoints, a class pinned to one cluster, several endpoints."""
    data = fleet_data(4)
    data["clusters"][0]["endpoints"] = ["10.0.0.1:8000", "10.0.0.2:8000"]
    data["clusters"][1]["endpoints"] = ["10.0.1.1:8000"]
    data["clusters"][2]["endpoints"] = ["10.0.2.1:9000"]
    data["clusters"][3]["endpoints"] = ["10.0.3.1:8000"]
    data["clusters"][2]["health_path"] = "/v1/health"
    data["clusters"][3]["health_path"] = "/v1/health"
    data["classes"] = [
        {"name": "pinned", "max_input_tokens": 100, "eligible": ["c2"]},
        {"name": "rest"},
    ]
    return fleet_from_dict(data)


@cache
def single_cluster() -> Fleet:
    """One cluster: no pairs at all, the processor routes to the bare cluster name."""
    return fleet_from_dict(fleet_data(1))


@cache
def models_fleet() -> Fleet:
    """Two models (one with an alias and a LoRA adapter), the small one on a single cluster."""
    data = fleet_data(4)
    big = {"name": "meta-llama/Llama-3.1-70B-Instruct", "aliases": ["llama-70b"]}
    data["clusters"][0]["models"] = [{**big, "adapters": ["sql-lora"]}]
    data["clusters"][1]["models"] = [big]
    data["clusters"][2]["models"] = [big]
    data["clusters"][3]["models"] = ["llama-8b"]
    return fleet_from_dict(data)


FLEETS = {
    "compose": compose_fleet,
    "forty": forty_clusters,
    "mixed": mixed_fleet,
    "single": single_cluster,
    "models": models_fleet,
}


def render(fleet: Fleet, mode: str = "envoy-gateway", **opts: Any) -> list[Json]:
    if mode == "all":
        opts.setdefault("pool_hostname", "pool.fleet.example")
    return render_manifests(fleet.runtime, fleet.text, GatewayOptions(mode=mode, **opts))  # type: ignore[arg-type]


def of_kind(objs: list[Json], kind: str) -> list[Json]:
    return [o for o in objs if o["kind"] == kind]


def by_name(objs: list[Json], kind: str) -> dict[str, Json]:
    return {o["metadata"]["name"]: o for o in of_kind(objs, kind)}


def one(objs: list[Json], kind: str) -> Json:
    found = of_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# --- schema validation of every object -----------------------------------------------------


def check_cel_subset(obj: Json) -> None:
    """The CEL rules (x-kubernetes-validations) these manifests could plausibly break."""
    spec = obj["spec"]
    kind = obj["kind"]
    if kind == "HTTPRoute":
        rules = spec["rules"]
        assert sum(len(r.get("matches", [])) for r in rules) < 128
        names = [r["name"] for r in rules if "name" in r]
        assert len(names) == len(set(names)), "rule names must be unique within a route"
    if kind == "Backend":
        kinds = {next(iter(e)) for e in spec["endpoints"]}
        assert "fqdn" not in kinds or kinds == {"fqdn"}, "fqdn endpoints cannot mix with others"
    if kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy", "ClientTrafficPolicy"):
        assert ("targetRef" in spec) != ("targetRefs" in spec)
        assert all(r["group"] == "gateway.networking.k8s.io" for r in spec["targetRefs"])
    if kind == "EnvoyExtensionPolicy":
        for ext in spec["extProc"]:
            for ref in ext["backendRefs"]:
                assert ref["kind"] in ("Service", "ServiceImport", "Backend")
                if ref["kind"] == "Service":
                    assert "port" in ref, "Service backendRefs need a port"
    if kind == "InferencePool":
        picker = spec["endpointPickerRef"]
        assert picker.get("kind", "Service") != "Service" or "port" in picker
        numbers = [p["number"] for p in spec["targetPorts"]]
        assert len(numbers) == len(set(numbers))


def check_metadata(obj: Json) -> None:
    meta = obj["metadata"]
    pattern = DNS_LABEL if obj["kind"] == "Service" else DNS_SUBDOMAIN
    assert pattern.match(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
    assert DNS_LABEL.match(meta["namespace"])
    for key, value in meta.get("labels", {}).items():
        assert len(value) <= 63 and re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", value)
        assert len(key.rpartition("/")[2]) <= 63


def check_objects(objs: list[Json]) -> None:
    """Unique names, valid metadata, every custom object valid for its CRD schema."""
    seen: set[tuple[str, str]] = set()
    for obj in objs:
        check_metadata(obj)
        ident = (obj["kind"], obj["metadata"]["name"])
        assert ident not in seen, f"duplicate object {ident}"
        seen.add(ident)
        if schema_key(obj) in CORE_KINDS:
            continue  # checked structurally in test_processor_workload_hangs_together
        validate_custom(obj)
        check_cel_subset(obj)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fleet_name", list(FLEETS))
def test_every_rendered_object_is_valid_for_its_kind(fleet_name: str, mode: str) -> None:
    objs = render(FLEETS[fleet_name](), mode)
    check_objects(objs)
    # The stream deserialises to the same objects (what kubectl apply reads).
    text = yaml.safe_dump_all(objs, sort_keys=False)
    assert list(yaml.safe_load_all(text)) == objs


# --- routes: every emittable x-fleet-route value has exactly one rule ----------------------


def fleet_rules(objs: list[Json]) -> Iterator[tuple[Json, Json]]:
    for route in of_kind(objs, "HTTPRoute"):
        if route["metadata"]["name"] == "fleet-inference-pool":
            continue
        for rule in route["spec"]["rules"]:
            yield route, rule


def rule_matches(rule: Json, path: str, headers: dict[str, str]) -> bool:
    for match in rule["matches"]:
        p = match.get("path", {"type": "PathPrefix", "value": "/"})
        assert p["type"] == "PathPrefix"
        if not path.startswith(p["value"]):
            continue
        if all(
            h.get("type", "Exact") == "Exact" and headers.get(h["name"]) == h["value"]
            for h in match.get("headers", [])
        ):
            return True
    return False


def winning_rules(objs: list[Json], path: str, headers: dict[str, str]) -> list[Json]:
    """Rules a Gateway would pick: among matches with equal path, most header matches wins."""
    matching = [rule for _, rule in fleet_rules(objs) if rule_matches(rule, path, headers)]
    if not matching:
        return []

    def header_count(rule: Json) -> int:
        return max(len(m.get("headers", [])) for m in rule["matches"])

    best = max(header_count(r) for r in matching)
    return [r for r in matching if header_count(r) == best]


def emittable_routes(runtime: Runtime, samples: int) -> set[str]:
    """x-fleet-route values the processor produces: real top-2 placement over random sessions,
    plus every ordered pair / single any class (or class and model) placer could produce in
    principle."""
    rng = random.Random(7)
    seen = set()
    # A model-aware fleet places among each (class, model)'s clusters too.
    placers = [*runtime.policy.placers.values(), *runtime.policy.model_placers.values()]
    for placer in placers:
        for _ in range(samples):
            seen.add(placer.top2(rng.getrandbits(64)).route)
    possible = set()
    for placer in placers:
        if len(placer.names) == 1:
            possible.add(Placement(placer.names[0], None).route)
        possible |= {Placement(p, s).route for p, s in itertools.permutations(placer.names, 2)}
    assert seen <= possible
    return possible


def backend_endpoints(backend: Json) -> list[str]:
    out = []
    for ep in backend["spec"]["endpoints"]:
        ((kind, addr),) = ep.items()
        host = addr["hostname"] if kind == "fqdn" else addr["address"]
        out.append(f"{host}:{addr['port']}")
    return out


@pytest.mark.parametrize("fleet_name", list(FLEETS))
def test_every_emittable_route_has_exactly_one_rule_primary_then_fallback(fleet_name: str) -> None:
    fleet = FLEETS[fleet_name]()
    objs = render(fleet)
    backends = by_name(objs, "Backend")
    clusters = {c.name: c for c in fleet.runtime.clusters}
    emittable = emittable_routes(fleet.runtime, samples=3000)
    for value in sorted(emittable):
        winners = winning_rules(objs, "/v1/chat/completions", {ROUTE_HEADER: value})
        assert len(winners) == 1, f"{value}: {len(winners)} rules"
        refs = winners[0]["backendRefs"]
        names = value.split("__")
        assert len(refs) == len(names)
        for i, (ref, cluster) in enumerate(zip(refs, names, strict=True)):
            assert (ref["group"], ref["kind"]) == ("gateway.envoyproxy.io", "Backend")
            backend = backends[ref["name"]]
            # First ref active, the secondary only as Envoy Gateway's fallback (priority 1).
            assert backend["spec"].get("fallback", False) is (i == 1)
            assert backend_endpoints(backend) == list(clusters[cluster].endpoints)
    header_values = {
        h["value"]
        for _, rule in fleet_rules(objs)
        for m in rule["matches"]
        for h in m.get("headers", [])
    }
    assert header_values == emittable, "rules for values the processor never emits"


@pytest.mark.parametrize("fleet_name", list(FLEETS))
def test_requests_without_route_header_take_the_catch_all_over_every_endpoint(
    fleet_name: str,
) -> None:
    fleet = FLEETS[fleet_name]()
    objs = render(fleet)
    backends = by_name(objs, "Backend")
    for path in ("/v1/chat/completions", "/health", "/"):
        winners = winning_rules(objs, path, {})
        assert len(winners) == 1
        assert winners[0]["name"] == "all-clusters"
    covered = [
        e for ref in winners[0]["backendRefs"] for e in backend_endpoints(backends[ref["name"]])
    ]
    expected = [e for c in fleet.runtime.clusters for e in c.endpoints]
    assert sorted(covered) == sorted(expected)
    assert not any(
        backends[ref["name"]]["spec"].get("fallback") for ref in winners[0]["backendRefs"]
    )


def test_forty_clusters_split_into_routes_of_at_most_sixteen_rules() -> None:
    objs = render(forty_clusters())
    pair_routes = [
        r for r in of_kind(objs, "HTTPRoute") if r["metadata"]["name"] != "fleet-fallback"
    ]
    assert sum(len(r["spec"]["rules"]) for r in pair_routes) == 40 * 39
    assert len(pair_routes) == math.ceil(40 * 39 / 16)
    assert all(1 <= len(r["spec"]["rules"]) <= 16 for r in pair_routes)
    assert len(of_kind(objs, "Backend")) == 2 * 40 + 1


def test_a_class_pinned_to_one_cluster_gets_a_bare_cluster_route() -> None:
    objs = render(mixed_fleet())
    (rule,) = winning_rules(objs, "/v1/messages", {ROUTE_HEADER: "c2"})
    assert [r["name"] for r in rule["backendRefs"]] == ["fleet-c2"]
    assert winning_rules(objs, "/v1/messages", {ROUTE_HEADER: "c1"})[0]["name"] == "all-clusters"


def test_route_timeouts_follow_listener_route_timeout() -> None:
    objs = render(forty_clusters(), "all")
    timeouts = {
        rule["timeouts"]["request"]
        for r in of_kind(objs, "HTTPRoute")
        for rule in r["spec"]["rules"]
    }
    assert timeouts == {"1m30s500ms"}  # route_timeout_s: 90.5
    data = fleet_data(2)
    data["listener"]["route_timeout_s"] = 0
    objs = render(fleet_from_dict(data))
    assert {rule["timeouts"]["request"] for _, rule in fleet_rules(objs)} == {"0s"}


# --- policies ------------------------------------------------------------------------------


@pytest.mark.parametrize("fleet_name", list(FLEETS))
def test_extension_policy_sends_headers_and_buffered_body_of_every_route_to_the_service(
    fleet_name: str,
) -> None:
    fleet = FLEETS[fleet_name]()
    proc = fleet.runtime.config.processor
    objs = render(fleet, "all")
    policy = one(objs, "EnvoyExtensionPolicy")
    targets = {t["name"] for t in policy["spec"]["targetRefs"]}
    assert targets == {r["metadata"]["name"] for r, _ in fleet_rules(objs)}
    assert "fleet-inference-pool" not in targets
    (ext,) = policy["spec"]["extProc"]
    assert ext["processingMode"] == {"request": {"body": "Buffered"}}  # no response phases
    assert ext["failOpen"] is (proc.failure_mode == "open")
    # The timer outlasts the longest wait for budget (test_message_timeout_covers_the_longest_wait).
    longest_ms = longest_wait_s(fleet.runtime.config) * 1000
    assert duration_ms(ext["messageTimeout"]) >= proc.message_timeout_ms + longest_ms
    (ref,) = ext["backendRefs"]
    service = by_name(objs, "Service")[ref["name"]]
    assert ref["port"] in [p["port"] for p in service["spec"]["ports"]]
    assert ref["port"] == proc.port


def test_message_timeout_is_exact() -> None:
    assert (
        one(render(forty_clusters()), "EnvoyExtensionPolicy")["spec"]["extProc"][0][
            "messageTimeout"
        ]
        == "1s500ms"
    )
    # compose's medium and long classes have budgets and the default 30 s wait: 2 s + 30 s +
    # 1 s (before flow control's waits it was the bare 2 s, which cut every longer wait).
    assert (
        one(render(compose_fleet()), "EnvoyExtensionPolicy")["spec"]["extProc"][0]["messageTimeout"]
        == "33s"
    )


def duration_ms(text: str) -> int:
    """A Gateway API duration (``1m2s500ms``) in milliseconds."""
    units = {"h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}
    parts = re.findall(r"([0-9]{1,5})(ms|h|m|s)", text)
    assert "".join(n + u for n, u in parts) == text, text
    return sum(int(n) * units[u] for n, u in parts)


def waiting_fleet(**wait: Any) -> Fleet:
    """Two budgeted classes that wait (4.5 s and ``wait``), one unbudgeted class."""
    data = fleet_data(3)
    data["classes"] = [
        {
            "name": "short",
            "max_input_tokens": 1000,
            "budget": {"max_concurrent": 8},
            "wait": {"max_wait_s": 4.5},
        },
        {"name": "free", "max_input_tokens": 5000},  # no budget: never waits
        {"name": "long", "budget": {"max_concurrent": 1}, "wait": wait},
    ]
    return fleet_from_dict(data)


def extension_timer(fleet: Fleet) -> str:
    policy = one(render(fleet), "EnvoyExtensionPolicy")
    validate_custom(policy)  # the vendored Envoy Gateway CRD's schema (duration pattern)
    timer: str = policy["spec"]["extProc"][0]["messageTimeout"]
    return timer


def test_message_timeout_covers_the_longest_wait() -> None:
    """Envoy Gateway's policy has no max_message_timeout, so the processor's timer override is
    ignored there: the one timer is message_timeout_ms + the longest budgeted wait + 1 s."""
    assert extension_timer(waiting_fleet(max_wait_s=12.25)) == "14s750ms"  # 1.5 + 12.25 + 1
    assert extension_timer(waiting_fleet(max_wait_s=0)) == "7s"  # the short class: 1.5 + 4.5 + 1
    assert extension_timer(waiting_fleet()) == "32s500ms"  # the large class's default 30 s
    assert extension_timer(waiting_fleet(max_wait_s=3600)) == "1h2s500ms"  # the schema allows it
    # Nothing budgeted waits (the unbudgeted class would wait 0.5 s by default): the bare timer.
    data = fleet_data(3)
    data["classes"] = [{"name": "free", "max_input_tokens": 5000}, {"name": "rest"}]
    assert extension_timer(fleet_from_dict(data)) == "1s500ms"
    data["classes"] = [{"name": "rest", "budget": {"max_concurrent": 2}, "wait": {"max_wait_s": 0}}]
    assert extension_timer(fleet_from_dict(data)) == "1s500ms"


@pytest.mark.parametrize("fleet_name", list(FLEETS))
def test_traffic_policies_retry_to_fallback_and_health_check_each_clusters_path(
    fleet_name: str,
) -> None:
    fleet = FLEETS[fleet_name]()
    clusters = {c.name: c for c in fleet.runtime.clusters}
    objs = render(fleet)
    backends = by_name(objs, "Backend")
    endpoint_cluster = {e: c.name for c in clusters.values() for e in c.endpoints}
    routes = by_name(objs, "HTTPRoute")
    targeted: list[str] = []
    for policy in of_kind(objs, "BackendTrafficPolicy"):
        spec = policy["spec"]
        retry = spec["retry"]
        # Changed with issue 12: only conditions under which no generation can have started
        # (a reset or a 504 after the engine had the request re-ran long generations).
        assert set(retry["retryOn"]["triggers"]) == {
            "connect-failure",
            "refused-stream",
            "reset-before-request",
            "retriable-status-codes",
        }
        assert retry["retryOn"]["httpStatusCodes"] == [429, 503]
        assert retry["numAttemptsPerPriority"] == 1 and retry["numRetries"] == 1
        passive = spec["healthCheck"]["passive"]
        # An engine's 503 is backpressure: only local-origin failures eject.
        assert passive["splitExternalLocalOriginErrors"] is True
        assert passive["consecutiveLocalOriginFailures"] >= 1
        assert passive["consecutive5XxErrors"] == 0 and "consecutiveGatewayErrors" not in passive
        names = [t["name"] for t in spec["targetRefs"]]
        targeted += names
        paths = {
            clusters[endpoint_cluster[e]].health_path
            for n in names
            for rule in routes[n]["spec"]["rules"]
            for ref in rule["backendRefs"]
            for e in backend_endpoints(backends[ref["name"]])
        }
        active = spec["healthCheck"].get("active")
        if len(paths) == 1:
            assert active is not None and active["type"] == "HTTP"
            assert active["http"]["path"] == paths.pop()
        else:
            assert active is None, "one active check per rule cannot serve two health paths"
    assert sorted(targeted) == sorted(routes), "every route in exactly one traffic policy"


def test_mixed_health_paths_keep_active_checks_where_paths_agree() -> None:
    objs = render(mixed_fleet())
    with_active = [
        p for p in of_kind(objs, "BackendTrafficPolicy") if "active" in p["spec"]["healthCheck"]
    ]
    assert {p["spec"]["healthCheck"]["active"]["http"]["path"] for p in with_active} == {
        "/health",
        "/v1/health",
    }


def test_client_policy_raises_buffer_limit_and_strips_fleet_headers() -> None:
    fleet = compose_fleet()
    policy = one(render(fleet, gateway="edge", gateway_namespace="gw"), "ClientTrafficPolicy")
    assert policy["metadata"]["namespace"] == "gw"
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge"}
    ]
    limit = policy["spec"]["connection"]["bufferLimit"]
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    value = int(limit[:-2]) * units[limit[-2:]] if limit[-2:] in units else int(limit)
    assert value == fleet.runtime.config.processor.max_body_bytes + (1 << 20)
    # Changed with issue 12: the tier header is stripped too (the compose fleet has one).
    # Changed with issue 18: so is llm-d's x-prefiller-host-port (the decode-side sidecar
    # dials whatever it names).
    tier = fleet.runtime.config.session.tier_header
    assert tier is not None
    remove = policy["spec"]["headers"]["earlyRequestHeaders"]["remove"]
    assert remove == [*FLEET_HEADERS, *PD_HEADERS, tier]
    assert policy["spec"]["connection"]["connectionLimit"] == {"value": 10_000}
    assert policy["spec"]["http2"] == {
        "maxConcurrentStreams": 100,
        # The stream window is the HTTP/2 stream's buffer limit in Envoy: the largest body's.
        "initialStreamWindowSize": "33Mi",
        "initialConnectionWindowSize": "33Mi",
    }
    assert policy["spec"]["path"] == {
        "escapedSlashesAction": "UnescapeAndForward",
        "disableMergeSlashes": False,
    }
    # Receiving the request is bounded, the response side is not.
    assert policy["spec"]["timeout"] == {
        "http": {
            "requestReceivedTimeout": "2m",
            "streamIdleTimeout": "0s",
            "requestHeadersReceivedTimeout": "10s",
        }
    }


def test_per_try_timeout_above_the_route_timeout_is_refused() -> None:
    data = fleet_data(2)
    data["listener"] = {"route_timeout_s": 10, "per_try_timeout_s": 20}
    with pytest.raises(GatewayRenderError, match="backendRequest"):
        render(fleet_from_dict(data))


def test_client_policy_strips_a_client_sent_tier_header() -> None:
    data = fleet_data(2)
    data["session"] = {"tier_header": "x-tier"}
    policy = one(render(fleet_from_dict(data)), "ClientTrafficPolicy")
    assert policy["spec"]["headers"]["earlyRequestHeaders"]["remove"] == [
        *FLEET_HEADERS,
        *PD_HEADERS,
        "x-tier",
    ]


def test_operator_timeouts_are_honoured() -> None:
    data = fleet_data(2)
    data["listener"] = {
        **data.get("listener", {}),
        "route_timeout_s": 600,
        "per_try_timeout_s": 30,
        "stream_idle_timeout_s": 120,
        "request_receive_timeout_s": 45,
        "request_headers_timeout_s": 0,
    }
    objs = render(fleet_from_dict(data))
    assert {json.dumps(rule["timeouts"]) for _, rule in fleet_rules(objs)} == {
        json.dumps({"request": "10m", "backendRequest": "30s"})
    }
    policy = one(objs, "ClientTrafficPolicy")
    assert policy["spec"]["timeout"] == {
        "http": {"requestReceivedTimeout": "45s", "streamIdleTimeout": "2m"}
    }


def test_routes_attach_to_the_gateway_in_its_namespace() -> None:
    objs = render(compose_fleet(), "all", gateway="edge", gateway_namespace="gw")
    for route in of_kind(objs, "HTTPRoute"):
        assert route["metadata"]["namespace"] == "fleet"
        assert route["spec"]["parentRefs"] == [
            {
                "group": "gateway.networking.k8s.io",
                "kind": "Gateway",
                "name": "edge",
                "namespace": "gw",
            }
        ]


# --- inference pool ------------------------------------------------------------------------


def test_inference_pool_picks_endpoints_through_the_processor_service() -> None:
    fleet = forty_clusters()
    objs = render(
        fleet,
        "inference-pool",
        pool_selector=parse_selector("app=vllm,role=decode"),
        pool_ports=(8000, 8001),
    )
    assert not of_kind(objs, "EnvoyExtensionPolicy") and not of_kind(objs, "Backend")
    pool = one(objs, "InferencePool")
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "vllm", "role": "decode"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    picker = pool["spec"]["endpointPickerRef"]
    service = by_name(objs, "Service")[picker["name"]]
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert picker["failureMode"] == "FailClose"  # this fleet is failure_mode: closed
    assert (
        one(render(compose_fleet(), "inference-pool"), "InferencePool")["spec"][
            "endpointPickerRef"
        ]["failureMode"]
        == "FailOpen"
    )
    (route,) = of_kind(objs, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
    ]


def test_a_model_aware_fleet_gets_a_pool_per_model_routed_by_the_model_header() -> None:
    objs = render(models_fleet(), "inference-pool")
    pools = by_name(objs, "InferencePool")
    assert len(pools) == 2
    (route,) = of_kind(objs, "HTTPRoute")
    by_pool = {r["backendRefs"][0]["name"]: r for r in route["spec"]["rules"]}
    assert set(by_pool) == set(pools)
    names_of = {
        pool: {h["value"] for m in rule["matches"] for h in m["headers"]}
        for pool, rule in by_pool.items()
    }
    assert sorted(names_of.values(), key=len) == [
        {"llama-8b"},
        {"meta-llama/Llama-3.1-70B-Instruct", "llama-70b", "sql-lora"},
    ]
    for name, pool in pools.items():
        labels = pool["spec"]["selector"]["matchLabels"]
        slug = labels.pop("fleet-extproc/model")
        assert labels == {"app": "vllm"} and name == f"fleet-pool-{slug}"
        assert re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", slug) and len(slug) <= 63
        assert all(
            h["name"] == "X-Gateway-Model-Name"
            for m in by_pool[name]["matches"]
            for h in m["headers"]
        )
    # A fleet without models keeps its one pool.
    assert len(of_kind(render(mixed_fleet(), "inference-pool"), "InferencePool")) == 1


def test_all_mode_scopes_the_pool_route_to_its_hostname() -> None:
    objs = render(compose_fleet(), "all", pool_hostname="pool.example.com")
    pool_route = by_name(objs, "HTTPRoute")["fleet-inference-pool"]
    assert pool_route["spec"]["hostnames"] == ["pool.example.com"]
    assert len(of_kind(objs, "Deployment")) == 1
    with pytest.raises(GatewayRenderError, match="pool-hostname"):
        render_manifests(compose_fleet().runtime, "", GatewayOptions(mode="all"))


# --- processor workload (core kinds, checked by hand) --------------------------------------


def container_port(container: Json, port: int | str) -> Json:
    for p in container["ports"]:
        if port in (p["name"], p["containerPort"]):
            return dict(p)
    raise AssertionError(f"container exposes no port {port!r}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fleet_name", list(FLEETS))
def test_processor_workload_hangs_together(fleet_name: str, mode: str) -> None:
    fleet = FLEETS[fleet_name]()
    cfg = fleet.runtime.config
    objs = render(fleet, mode, image="registry.example/extproc:1.2.3")
    config_map = one(objs, "ConfigMap")
    assert parse_config(yaml.safe_load(config_map["data"]["fleet.yaml"])) == cfg

    deployment = one(objs, "Deployment")
    assert deployment["apiVersion"] == "apps/v1"
    spec = deployment["spec"]
    assert spec["replicas"] == cfg.redis.replicas
    pod = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example/extproc:1.2.3"
    argv = container["command"] + container["args"]
    assert argv[:2] == ["extproc", "serve"]
    config_path = argv[argv.index("--config") + 1]
    assert argv[argv.index("--address") + 1] == "0.0.0.0"
    (mount,) = container["volumeMounts"]
    assert config_path == f"{mount['mountPath']}/fleet.yaml"
    volume = {v["name"]: v for v in pod["spec"]["volumes"]}[mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]

    assert container_port(container, "grpc")["containerPort"] == cfg.processor.port
    assert container_port(container, "metrics")["containerPort"] == cfg.processor.metrics_port
    live, ready = container["livenessProbe"], container["readinessProbe"]
    assert container_port(container, live["grpc"]["port"])["name"] == "grpc"
    assert ready["httpGet"]["path"] == "/readyz"
    assert container_port(container, ready["httpGet"]["port"])["name"] == "metrics"
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["securityContext"]["runAsNonRoot"] is True

    env = {e["name"]: e for e in container["env"]}
    assert set(env) == {"FLEET_REDIS_URL", "FLEET_SESSION_SECRET"}
    ref = env["FLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = by_name(objs, "Secret")[ref["name"]]
    assert secret["stringData"][ref["key"]] == cfg.redis.url
    # The replicas' shared label secret (keys the Redis affinity entries): the operator's own
    # Secret, never rendered, optional so that a pod without it still starts.
    session_ref = env["FLEET_SESSION_SECRET"]["valueFrom"]["secretKeyRef"]
    assert session_ref == {"name": "fleet-session", "key": "secret", "optional": True}
    assert session_ref["name"] not in by_name(objs, "Secret")

    service = by_name(objs, "Service")["fleet-extproc"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    for port in service["spec"]["ports"]:
        assert container_port(container, port["targetPort"])
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    for obj in objs:
        assert obj["metadata"]["namespace"] == "fleet"


def test_without_redis_there_is_no_secret_and_no_env() -> None:
    data = fleet_data(2)
    del data["redis"]
    objs = render(fleet_from_dict(data))
    assert not of_kind(objs, "Secret")
    assert "env" not in one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoints", "message"),
    [
        (["localhost:8000"], "not a hostname"),
        (["127.0.0.1:8000"], "loopback"),
        (["Bad_Host:8000"], "not a hostname"),
        (["10.0.0.1:8000", "vllm.example:8000"], "mix IP and hostname"),
    ],
    ids=["localhost", "loopback-ip", "underscore", "mixed-kinds"],
)
def test_endpoints_envoy_gateway_would_refuse_fail_rendering(
    endpoints: list[str], message: str
) -> None:
    data = fleet_data(2)
    data["clusters"][0]["endpoints"] = endpoints
    with pytest.raises(GatewayRenderError, match=message):
        render(fleet_from_dict(data))


def test_a_redis_password_never_lands_in_the_config_map() -> None:
    data = fleet_data(2)
    data["redis"]["url"] = "redis://:hunter2@redis:6379/0"
    with pytest.raises(GatewayRenderError, match="password"):
        render(fleet_from_dict(data))


def test_selector_syntax_is_checked() -> None:
    assert parse_selector("app=vllm") == (("app", "vllm"),)
    for bad in ("app", "=x", "app=v v"):
        with pytest.raises(GatewayRenderError):
            parse_selector(bad)


# --- CLI -----------------------------------------------------------------------------------


def test_cli_writes_a_multi_document_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "manifests.yaml"
    argv = [
        "gateway",
        "--config",
        str(COMPOSE_FLEET),
        "--mode",
        "all",
        "--pool-hostname",
        "p.example",
    ]
    argv += ["--namespace", "llm", "--pool-port", "8000", "--pool-port", "8001", "-o", str(out)]
    assert cli.main(argv) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# Rendered by `extproc gateway --mode all`")
    objs = [d for d in yaml.safe_load_all(text) if d]
    assert all(o["metadata"]["namespace"] == "llm" for o in objs)
    kinds = {o["kind"] for o in objs}
    assert {"InferencePool", "EnvoyExtensionPolicy", "Deployment", "HTTPRoute"} <= kinds
    pool = one(objs, "InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    # fleet.yaml travels verbatim, comments included, as a literal block.
    assert one(objs, "ConfigMap")["data"]["fleet.yaml"] == COMPOSE_FLEET.read_text(encoding="utf-8")
    assert "fleet.yaml: |" in text


def test_cli_reports_render_errors_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "fleet.yaml"
    data = fleet_data(2)
    data["clusters"][1]["endpoints"] = ["127.0.0.1:8000"]
    bad.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert cli.main(["gateway", "--config", str(bad)]) == 2
    assert "loopback" in capsys.readouterr().err
    assert cli.main(["gateway", "--config", str(COMPOSE_FLEET), "--mode", "all"]) == 2
    assert "--pool-hostname" in capsys.readouterr().err


# --- EnvoyProxy: the runtime flags the processor relies on --------------------------------


def test_envoy_proxy_merges_the_graceful_close_flag_into_envoy_gateways_bootstrap() -> None:
    """processor.envoy_graceful_close (the default): the EnvoyProxy's Merge bootstrap adds one
    static layer with the flag; Merge appends it after Envoy Gateway's own layers."""
    for mode in MODES:
        proxy = one(render(compose_fleet(), mode), "EnvoyProxy")
        assert proxy["metadata"]["namespace"] == "fleet"
        bootstrap = proxy["spec"]["bootstrap"]
        assert bootstrap["type"] == "Merge"
        assert yaml.safe_load(bootstrap["value"]) == {
            "layered_runtime": {
                "layers": [
                    {
                        "name": "fleet_extproc",
                        "static_layer": {
                            "envoy.reloadable_features.ext_proc_graceful_grpc_close": True
                        },
                    }
                ]
            }
        }


def test_no_envoy_proxy_when_the_processor_expects_an_envoy_without_the_flag() -> None:
    data = yaml.safe_load(COMPOSE_FLEET.read_text())
    data["processor"]["envoy_graceful_close"] = False
    assert of_kind(render(fleet_from_dict(data)), "EnvoyProxy") == []

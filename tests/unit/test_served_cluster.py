"""Which cluster served, from Envoy's response attributes; placement around unready primaries;
the rendered endpoint tags and filter attributes that make the first possible."""

from __future__ import annotations

from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc.config import compile_runtime, parse_config
from extproc.core.failover import around_unready, endpoint_owners
from extproc.core.placement import Placement
from extproc.names import (
    EXT_PROC_ATTRIBUTES_KEY,
    SERVED_ATTRIBUTES,
    SERVED_METADATA_NAMESPACE,
)
from extproc.protocol.attributes import served_cluster
from extproc.render.envoy import render_bootstrap

KNOWN = ("c1", "c2", "c3")
OWNERS = {"127.0.0.1:8001": "c1", "127.0.0.1:8002": "c2"}
# What Envoy 1.40 sent for a host of the rendered cluster c2 (captured from a real run).
C2_METADATA = (
    'filter_metadata { key: "fleet-extproc" value { fields { key: "cluster" '
    'value { string_value: "c2" } } } } '
)


def _attributes(**fields: Any) -> dict[str, Any]:
    request = ep.ProcessingRequest()
    struct = struct_pb2.Struct()
    struct.update(fields)
    request.attributes[EXT_PROC_ATTRIBUTES_KEY].CopyFrom(struct)
    return dict(request.attributes)


def test_host_metadata_names_the_serving_cluster() -> None:
    attrs = _attributes(**{"xds.upstream_host_metadata": C2_METADATA, "upstream.address": "x"})
    assert served_cluster(attrs, KNOWN, OWNERS) == "c2"


def test_address_is_the_fallback_for_untagged_hosts() -> None:
    attrs = _attributes(**{"xds.upstream_host_metadata": "", "upstream.address": "127.0.0.1:8001"})
    assert served_cluster(attrs, KNOWN, OWNERS) == "c1"


def test_unknown_or_missing_gives_none() -> None:
    assert served_cluster({}, KNOWN, OWNERS) is None
    assert served_cluster(_attributes(**{"upstream.address": "10.0.0.9:80"}), KNOWN, OWNERS) is None
    foreign = C2_METADATA.replace('"c2"', '"elsewhere"')
    attrs = _attributes(**{"xds.upstream_host_metadata": foreign})
    assert served_cluster(attrs, KNOWN, OWNERS) is None
    # Garbage text (not parseable) is ignored, not an exception.
    garbage = _attributes(**{"xds.upstream_host_metadata": "fleet-extproc {{{"})
    assert served_cluster(garbage, KNOWN, OWNERS) is None


def test_endpoint_owners_drop_shared_addresses() -> None:
    owners = endpoint_owners({"a": ("h:1", "h:2"), "b": ("h:2", "h:3")})
    assert owners == {"h:1": "a", "h:3": "b"}


def test_around_unready() -> None:
    placement = Placement("c1", "c2")
    ranked = ["c1", "c2", "c3"]
    assert around_unready(placement, ranked, frozenset(KNOWN)) == placement
    assert around_unready(placement, ranked, frozenset({"c2", "c3"})) == Placement("c2", "c3")
    assert around_unready(placement, ranked, frozenset({"c3"})) == Placement("c3", None)
    # Nothing known ready: the probes may be wrong, hashing's answer stands.
    assert around_unready(placement, ranked, frozenset()) == placement


def _runtime(budget: bool) -> Any:
    classes = [{"name": "all", "budget": {"max_concurrent": 4}}] if budget else [{"name": "all"}]
    return compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [
                    {"name": "c1", "endpoints": ["127.0.0.1:8001"]},
                    {"name": "c2", "endpoints": ["127.0.0.1:8002", "127.0.0.1:8003"]},
                ],
                "classes": classes,
            }
        )
    )


def _filter(config: dict[str, Any]) -> dict[str, Any]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    typed: dict[str, Any] = hcm["typed_config"]["http_filters"][0]["typed_config"]
    return typed


def test_every_endpoint_carries_its_cluster() -> None:
    config = render_bootstrap(_runtime(budget=True))
    tags: dict[str, list[str]] = {}
    for cluster in config["static_resources"]["clusters"]:
        for group in cluster.get("load_assignment", {}).get("endpoints", []):
            for lb in group["lb_endpoints"]:
                meta = lb.get("metadata", {}).get("filter_metadata", {})
                if SERVED_METADATA_NAMESPACE in meta:
                    tags.setdefault(cluster["name"], []).append(
                        meta[SERVED_METADATA_NAMESPACE]["cluster"]
                    )
    assert tags == {"c1": ["c1"], "c2": ["c2", "c2"], "all_clusters": ["c1", "c2", "c2"]}


def test_response_attributes_only_when_responses_are_observed() -> None:
    budgeted = _filter(render_bootstrap(_runtime(budget=True)))
    # Response phases are asked for per inference request (a mode override the filter allows).
    assert budgeted["processing_mode"]["response_header_mode"] == "SKIP"
    assert budgeted["allow_mode_override"] is True
    assert budgeted["response_attributes"] == list(SERVED_ATTRIBUTES)
    plain_runtime = _runtime(budget=False)
    plain = _filter(render_bootstrap(plain_runtime))
    assert plain["processing_mode"]["response_header_mode"] == "SKIP"
    assert "response_attributes" not in plain
    # Without response phases, overrides are allowed only for the header path (it skips the
    # request body: processor.read_body, on by default; tests/unit/test_render_envoy.py).
    assert not plain_runtime.response_phases and plain_runtime.decide_at_headers
    assert plain["allow_mode_override"] is True

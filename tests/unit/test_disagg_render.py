"""`extproc gateway` for a P/D fleet: a DisaggregatedSet per island, valid against the vendored
lws CRD, labelled so that the fleet's clusters, roles and topology can be read back."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from extproc.config import compile_runtime, parse_config
from extproc.render.disagg import (
    LABEL_PREFIX,
    DisaggRenderError,
    has_roles,
    node_label,
    render_disaggregated_sets,
)
from tests.unit.test_gateway import _strict
from tests.unit.test_pd import pd_config

CRD = Path(__file__).resolve().parents[2] / "third_party/crds/lws"
CRD_FILE = CRD / "disaggregatedset.x-k8s.io_disaggregatedsets.yaml"


@cache
def schema() -> dict[str, Any]:
    """The vendored DisaggregatedSet v1 schema, strict (unknown fields rejected)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    doc = yaml.load(CRD_FILE.read_text(encoding="utf-8"), Loader=loader)
    assert doc["spec"]["names"]["kind"] == "DisaggregatedSet"
    (version,) = [v for v in doc["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])


def validate(obj: dict[str, Any]) -> None:
    assert obj["apiVersion"] == "disaggregatedset.x-k8s.io/v1"
    errors = list(jsonschema.Draft7Validator(schema()).iter_errors(obj))
    assert not errors, "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])


def test_the_strict_schema_rejects_a_misspelled_field() -> None:
    bad = {
        "apiVersion": "disaggregatedset.x-k8s.io/v1",
        "kind": "DisaggregatedSet",
        "metadata": {"name": "x"},
        "spec": {"roles": [], "placement": {}},
    }
    with pytest.raises(AssertionError, match="placement"):
        validate(bad)


def sets_of(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    runtime = compile_runtime(parse_config(cfg, "t.yaml"))
    assert has_roles(runtime)
    return render_disaggregated_sets(runtime, "fleet")


def test_one_valid_disaggregated_set_per_island_placed_by_topology() -> None:
    cfg = pd_config()
    objs = sets_of(cfg)
    assert [o["metadata"]["name"] for o in objs] == ["fleet-ib-1", "fleet-ib-2"]
    for obj in objs:
        validate(obj)
        assert obj["spec"]["placementPolicy"] == {
            "type": "ExclusiveTopology",
            "topology": node_label("island"),
        }
    # The fleet read back from the pod labels: names, roles, topology, one replica per endpoint.
    derived = {}
    for obj in objs:
        for role in obj["spec"]["roles"]:
            template = role["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            labels = template["metadata"]["labels"]
            name = labels[f"{LABEL_PREFIX}cluster"]
            assert role["name"] == name
            derived[name] = (
                labels[f"{LABEL_PREFIX}role"],
                {k: labels[f"{LABEL_PREFIX}{k}"] for k in ("nvlink", "island")},
                role["spec"]["replicas"],
            )
            assert template["spec"]["nodeSelector"] == {
                node_label("nvlink"): labels[f"{LABEL_PREFIX}nvlink"]
            }
            names = [c["name"] for c in template["spec"]["containers"]]
            # Decode pods run llm-d's sidecar (it reads x-prefiller-host-port) before vLLM.
            assert names == (
                ["vllm"]
                if labels[f"{LABEL_PREFIX}role"] == "prefill"
                else [
                    "routing-sidecar",
                    "vllm",
                ]
            )
    expected = {c["name"]: (c["role"], c["topology"], len(c["endpoints"])) for c in cfg["clusters"]}
    assert derived == expected


def test_a_fleet_that_does_not_fit_a_disaggregated_set_is_refused() -> None:
    cfg = pd_config()
    del cfg["clusters"][1]["topology"]["island"]
    with pytest.raises(DisaggRenderError, match="no 'island' topology label"):
        sets_of(cfg)
    cfg = pd_config()
    cfg["clusters"] = [c for c in cfg["clusters"] if c["name"] != "p2"]
    with pytest.raises(DisaggRenderError, match="island 'ib-2' has 1 clusters"):
        sets_of(cfg)


def test_the_inference_pool_of_a_pd_fleet_selects_its_decode_pods() -> None:
    # Gateway (inference-pool) mode: the processor is the pool's endpoint picker and names the
    # prefiller in the same answer (x-prefiller-host-port, as llm-d's scheduler does as an EPP);
    # the pool itself holds the decode pods only, so that fail-open never sends a whole
    # request to a prefill pod. Pods carry their cluster's role (render_disaggregated_sets).
    from extproc.render.gateway import GatewayOptions, render_inference_pool

    opts = GatewayOptions(mode="inference-pool", pool_ports=(8000,))
    runtime = compile_runtime(parse_config(pd_config(), "t.yaml"))
    selector = render_inference_pool(runtime, opts)["spec"]["selector"]["matchLabels"]
    configured = dict(opts.pool_selector)
    assert selector == {**configured, f"{LABEL_PREFIX}role": "decode"}
    decode_pods = [
        role["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
        for s in render_disaggregated_sets(runtime, "ns")
        for role in s["spec"]["roles"]
        if role["metadata"]["labels"][f"{LABEL_PREFIX}role"] == "decode"
    ]
    assert decode_pods and all(
        selector.items() - configured.items() <= labels.items() for labels in decode_pods
    )
    # A fleet without roles keeps the configured selector.
    plain = compile_runtime(
        parse_config({"version": 1, "clusters": [{"name": "a", "endpoints": ["h:1"]}]}, "t.yaml")
    )
    assert render_inference_pool(plain, opts)["spec"]["selector"]["matchLabels"] == configured


def test_gateway_modes_refuse_sglangs_protocol() -> None:
    from extproc.render.gateway import GatewayOptions, GatewayRenderError, render_manifests

    cfg = pd_config()
    cfg["disaggregation"] = {"protocol": "sglang"}
    runtime = compile_runtime(parse_config(cfg, "t.yaml"))
    for mode in ("envoy-gateway", "inference-pool"):
        with pytest.raises(GatewayRenderError, match="request mirror"):
            render_manifests(runtime, "", GatewayOptions(mode=mode, pool_ports=(8000,)))

"""`extproc gateway --disagg grove`: a Grove PodCliqueSet per island and a ClusterTopologyBinding,
valid against the vendored Grove CRDs, labelled as the lws rendering labels its pods, and packed
where the router assumes the fabric is shared (checked over random topologies)."""

from __future__ import annotations

import asyncio
import random
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config import compile_runtime, parse_config
from extproc.core.pd import CROSS
from extproc.render.disagg import LABEL_PREFIX, render_disaggregated_sets
from extproc.render.grove import (
    BINDING,
    KAI_SCHEDULER,
    GroveOptions,
    GroveRenderError,
    packed_together,
    render_grove,
)
from tests.unit import test_disagg_render
from tests.unit.test_gateway import _strict

CRD = Path(__file__).resolve().parents[2] / "third_party/crds/grove"
Json = dict[str, Any]


@cache
def schemas() -> dict[str, Json]:
    """kind -> the vendored Grove v1alpha1 schema, strict (unknown fields rejected)."""
    out: dict[str, Json] = {}
    for path in sorted(CRD.glob("*.yaml")):
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
        (version,) = [v for v in doc["spec"]["versions"] if v["name"] == "v1alpha1"]
        out[doc["spec"]["names"]["kind"]] = _strict(version["schema"]["openAPIV3Schema"])
    assert set(out) == {"PodCliqueSet", "ClusterTopologyBinding"}
    return out


def validate(obj: Json) -> None:
    assert obj["apiVersion"] == "grove.io/v1alpha1"
    errors = list(jsonschema.Draft7Validator(schemas()[obj["kind"]]).iter_errors(obj))
    assert not errors, "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])


def fleet(islands: int = 2, domains: int = 2) -> dict[str, Any]:
    """islands x NVLink domains, a decode and a prefill cluster in each domain."""
    clusters = []
    for i in range(islands):
        for d in range(domains):
            topo = {"nvlink": f"nvl-{i}-{d}", "island": f"ib-{i}"}
            for role in ("decode", "prefill"):
                n = len(clusters)
                clusters.append(
                    {
                        "name": f"{role[0]}{i}{d}",
                        "endpoints": [f"10.{i}.{d}.{n}:8000"],
                        "role": role,
                        "topology": topo,
                    }
                )
    return {
        "version": 1,
        "topology": {
            "levels": [
                {"name": "nvlink", "gbytes_per_s": 900},
                {"name": "island", "gbytes_per_s": 50},
            ]
        },
        "clusters": clusters,
        "classes": [
            {"name": "short", "max_input_tokens": 2048},
            {"name": "long", "disaggregated": True},
        ],
    }


def grove_of(cfg: dict[str, Any], opts: GroveOptions | None = None) -> list[Json]:
    return render_grove(compile_runtime(parse_config(cfg, "t.yaml")), opts or GroveOptions())


def test_the_strict_schema_rejects_a_misspelled_field() -> None:
    (binding, *_) = grove_of(fleet())
    bad = {**binding, "spec": {**binding["spec"], "level": []}}
    with pytest.raises(AssertionError, match="level"):
        validate(bad)


def _clique_labels(sets: list[Json]) -> dict[str, dict[str, str]]:
    return {
        c["labels"][f"{LABEL_PREFIX}cluster"]: c["labels"]
        for s in sets
        for c in s["spec"]["template"]["cliques"]
        if f"{LABEL_PREFIX}cluster" in c["labels"]
    }


def test_two_islands_of_two_nvlink_domains_in_both_renderings() -> None:
    cfg = fleet()
    runtime = compile_runtime(parse_config(cfg, "t.yaml"))
    lws = render_disaggregated_sets(runtime, "fleet")
    for obj in lws:
        test_disagg_render.validate(obj)
    objs = render_grove(runtime, GroveOptions())
    for obj in objs:
        validate(obj)
    binding, *sets = objs
    assert binding["kind"] == "ClusterTopologyBinding" and binding["metadata"]["name"] == BINDING
    # Broadest to narrowest, on the node labels the lws rendering selects nodes by.
    assert binding["spec"]["levels"] == [
        {"domain": "island", "key": f"{LABEL_PREFIX}island"},
        {"domain": "nvlink", "key": f"{LABEL_PREFIX}nvlink"},
        {"domain": "host", "key": "kubernetes.io/hostname"},
    ]
    assert [s["metadata"]["name"] for s in sets] == [o["metadata"]["name"] for o in lws]
    for s in sets:
        template = s["spec"]["template"]
        assert template["topologyConstraint"] == {
            "topologyName": BINDING,
            "pack": {"required": "island"},
        }
        groups = template["podCliqueScalingGroups"]
        assert len(groups) == 2
        for group in groups:
            assert group["topologyConstraint"] == {"pack": {"required": "nvlink"}}
            assert sorted(group["cliqueNames"])[0].startswith("d")  # a decode and a prefill
        for clique in template["cliques"]:
            assert clique["spec"]["roleName"] in ("prefill", "decode")
            assert clique["topologyConstraint"] == {"pack": {"required": "nvlink"}}
            assert "schedulerName" not in clique["spec"]["podSpec"]
    # The pods carry the same labels in both renderings (cluster, role, every level).
    lws_labels = {
        role["name"]: role["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
        for o in lws
        for role in o["spec"]["roles"]
    }
    assert _clique_labels(sets) == lws_labels
    sizes = {
        c["name"]: c["spec"]["replicas"] for s in sets for c in s["spec"]["template"]["cliques"]
    }
    assert sizes == {c["name"]: len(c["endpoints"]) for c in cfg["clusters"]}


def test_kai_schedules_every_pod_and_binds_its_topology() -> None:
    opts = GroveOptions(scheduler="kai", kai_queue="inference", kai_topology="fabric")
    binding, *sets = grove_of(fleet(), opts)
    for obj in (binding, *sets):
        validate(obj)
    assert binding["spec"]["schedulerTopologyBindings"] == [
        {"schedulerName": KAI_SCHEDULER, "topologyReference": "fabric"}
    ]
    for s in sets:
        assert s["metadata"]["labels"]["kai.scheduler/queue"] == "inference"
        for clique in s["spec"]["template"]["cliques"]:
            assert clique["spec"]["podSpec"]["schedulerName"] == KAI_SCHEDULER
    # Without a named KAI Topology, Grove creates it from the levels: no binding entry.
    binding, *_ = grove_of(fleet(), GroveOptions(scheduler="kai"))
    assert "schedulerTopologyBindings" not in binding["spec"]


def test_the_router_clique_runs_envoy_and_the_processor_in_every_set() -> None:
    cfg = fleet()
    cfg["redis"] = {"url": "redis://redis:6379/0", "replicas": 2}
    objs = grove_of(cfg, GroveOptions(router=True, scheduler="kai"))
    config_map, service, sets = objs[1], objs[2], objs[3:]
    for obj in (objs[0], *sets):
        validate(obj)
    bootstrap = yaml.safe_load(config_map["data"]["envoy.yaml"])
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["address"] == "0.0.0.0"
    extproc = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "extproc")
    (endpoint,) = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert service["spec"]["selector"] == {f"{LABEL_PREFIX}role": "router"}
    for s in sets:
        (router,) = [c for c in s["spec"]["template"]["cliques"] if c["name"] == "router"]
        pod = router["spec"]["podSpec"]
        assert [c["name"] for c in pod["containers"]] == ["envoy", "extproc"]
        assert pod["schedulerName"] == KAI_SCHEDULER
        assert {v["configMap"]["name"] for v in pod["volumes"]} == {"fleet-extproc", "fleet-envoy"}
    # One processor per set: the ledger's outage share must divide by that many.
    cfg["redis"]["replicas"] = 3
    with pytest.raises(GroveRenderError, match=r"set redis\.replicas to 2"):
        grove_of(cfg, GroveOptions(router=True))


def test_a_fleet_grove_cannot_pack_is_refused() -> None:
    # A third level between the set (island) and the scaling group (NVLink) cannot be required.
    cfg = fleet()
    cfg["topology"]["levels"].insert(1, {"name": "rack", "gbytes_per_s": 100})
    for cluster in cfg["clusters"]:
        cluster["topology"] = {**cluster["topology"], "rack": "r1"}
    with pytest.raises(GroveRenderError, match="needs 1 or 2 levels, has 3"):
        grove_of(cfg)
    # Grove domains are DNS labels: no underscore.
    cfg = fleet()
    cfg["topology"]["levels"][0]["name"] = "nv_link"
    for cluster in cfg["clusters"]:
        topo = dict(cluster["topology"])
        topo["nv_link"] = topo.pop("nvlink")
        cluster["topology"] = topo
    with pytest.raises(GroveRenderError, match="'nv_link': a Grove topology domain"):
        grove_of(cfg)
    cfg = fleet()
    cfg["clusters"][0]["topology"] = {"nvlink": "nvl-0-0"}
    with pytest.raises(GroveRenderError, match="no 'island' topology label"):
        grove_of(cfg)


def test_the_cli_renders_grove_and_refuses_its_flags_without_it(tmp_path: Path) -> None:
    from extproc.cli import main

    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet()), encoding="utf-8")
    out = tmp_path / "out.yaml"
    args = ["gateway", "--config", str(path), "-o", str(out)]
    assert main([*args, "--disagg", "grove", "--scheduler", "kai"]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(out.read_text(encoding="utf-8")) if d]
    assert kinds.count("PodCliqueSet") == 2 and "ClusterTopologyBinding" in kinds
    assert "DisaggregatedSet" not in kinds and "HTTPRoute" in kinds
    assert main([*args, "--grove-router"]) == 2
    assert main([*args, "--disagg", "grove", "--kai-topology", "x"]) == 2
    assert main(args) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(out.read_text(encoding="utf-8")) if d]
    assert "DisaggregatedSet" in kinds and "PodCliqueSet" not in kinds


# -- what the scheduler is required to keep together = what the router assumes ------------------


def required_packs(objs: list[Json]) -> dict[tuple[str, str], str]:
    """(cluster, cluster) -> the narrowest level both are required to share, read from the
    manifests alone (the binding maps domains to node-label keys, i.e. fleet levels)."""
    binding, *sets = objs
    level_of = {
        lvl["domain"]: lvl["key"].removeprefix(LABEL_PREFIX) for lvl in binding["spec"]["levels"]
    }
    out: dict[tuple[str, str], str] = {}
    for s in sets:
        template = s["spec"]["template"]
        cluster_of = {
            c["name"]: c["labels"][f"{LABEL_PREFIX}cluster"]
            for c in template["cliques"]
            if f"{LABEL_PREFIX}cluster" in c["labels"]
        }
        island = level_of[template["topologyConstraint"]["pack"]["required"]]
        for a in cluster_of.values():
            for b in cluster_of.values():
                out[(a, b)] = island
        for group in template.get("podCliqueScalingGroups", []):
            level = level_of[group["topologyConstraint"]["pack"]["required"]]
            members = [cluster_of[n] for n in group["cliqueNames"]]
            for a in members:
                for b in members:
                    out[(a, b)] = level
    return out


@st.composite
def topologies(draw: st.DrawFn) -> dict[str, Any]:
    islands = draw(st.integers(1, 3))
    clusters: list[dict[str, Any]] = []
    for i in range(islands):
        for d in range(draw(st.integers(1, 3))):
            # At least a decode and a prefill cluster (c0, c1) in the first domain.
            for _ in range(draw(st.integers(2 if i == d == 0 else 1, 3))):
                n = len(clusters)
                topo = {"island": f"ib-{i}"}
                if draw(st.integers(0, 4)):  # now and then a cluster with no NVLink label
                    topo["nvlink"] = f"nvl-{i}-{d}"
                role = "decode" if n == 0 else "prefill" if n == 1 else None
                clusters.append(
                    {
                        "name": f"c{n}",
                        "endpoints": [f"10.0.{n}.{e}:8000" for e in range(draw(st.integers(1, 2)))],
                        "role": role or draw(st.sampled_from(["prefill", "decode"])),
                        "topology": topo,
                    }
                )
    cfg = fleet()
    cfg["clusters"] = clusters
    cfg["disaggregation"] = {
        "cross_island": draw(st.booleans()),
        "topology_aware": draw(st.booleans()),
        "group_level": draw(st.sampled_from([None, "nvlink", "island"])),
    }
    return cfg


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=topologies(), seed=st.integers(0, 2**32 - 1))
def test_every_pair_the_router_may_choose_is_inside_the_required_pack(
    cfg: dict[str, Any], seed: int
) -> None:
    runtime = compile_runtime(parse_config(cfg, "t.yaml"))
    objs = render_grove(runtime, GroveOptions())
    for obj in objs:
        validate(obj)
    packed = required_packs(objs)
    pd = runtime.pd
    assert pd is not None
    rng = random.Random(seed)
    pool = pd.pools["long"]
    decode = [c["name"] for c in cfg["clusters"] if c["role"] == "decode"]
    addresses = [ep.address for ep in pool]
    chosen = 0
    for _ in range(40):
        target = rng.choice(decode)
        ready = frozenset(a for a in addresses if rng.random() < 0.7)
        inflight = {a: rng.randrange(4) for a in addresses}
        choice = pd.choose("long", target, rng.getrandbits(64), inflight, ready)
        assert choice is not None
        if choice.endpoint is None:
            continue  # colocated: the decode target prefills itself
        chosen += 1
        # The router's relation is the level at which the manifests require the pair packed;
        # a cross-island pair (only when cross_island allows it) is in two sets, none shared.
        required = packed.get((target, choice.endpoint.cluster), CROSS)
        assert choice.relation == required, (target, choice)
        # explain says the same, from the layout rather than the manifests.
        said = packed_together(runtime.config, target, choice.endpoint.cluster)
        assert (said["level"] if said else CROSS) == required
        if not cfg["disaggregation"]["cross_island"]:
            assert required != CROSS
    assert chosen or len(addresses) <= 2


def test_explain_names_the_clique_and_domain_of_both_ends() -> None:
    from extproc.explain import explain_offline

    runtime = compile_runtime(parse_config(fleet(), "t.yaml"))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"word " * 3000 + b'"}]}'
    result = asyncio.run(
        explain_offline(runtime, "/v1/chat/completions", {"x-session-id": "s1"}, body)
    )
    prefill = result["prefill"]
    assert isinstance(prefill, dict)
    ends = prefill["ends"]
    decode_end, prefill_end = ends["decode"], ends["prefill"]
    assert decode_end["cluster"] == result["primary"]
    assert prefill_end["cluster"] == prefill["cluster"]
    for end in (decode_end, prefill_end):
        grove = end["grove"]
        assert grove["clique"] == end["cluster"]
        assert grove["podcliqueset"] == f"fleet-{end['topology']['island']}"
        assert grove["pack_required"] == "nvlink"
        assert grove["pack_domain"] == end["topology"]["nvlink"]
    # The router keeps prefill in the decode target's NVLink domain here: one scaling group.
    assert prefill["relation"] == "nvlink"
    assert decode_end["grove"]["scaling_group"] == prefill_end["grove"]["scaling_group"]
    assert prefill["packed_together"] == {
        "level": "nvlink",
        "domain": decode_end["topology"]["nvlink"],
    }

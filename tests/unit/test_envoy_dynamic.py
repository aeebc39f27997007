"""File-based CDS: what the processor publishes to Envoy around a reload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from extproc.config import Runtime, compile_runtime, parse_config
from extproc.core.models import MODEL_POOL_PREFIX, model_pool_name
from extproc.render.envoy import FALLBACK_CLUSTER
from extproc.render.envoy_dynamic import (
    ENDPOINTS_TYPE,
    endpoints_path,
    split_bootstrap,
    union_endpoints,
    write_cds,
    write_cds_union,
)


def runtime(names: list[str]) -> Runtime:
    doc = {
        "version": 1,
        "clusters": [
            {"name": n, "endpoints": [f"127.0.0.1:{8000 + i}"]} for i, n in enumerate(names)
        ],
    }
    return compile_runtime(parse_config(doc))


def names(path: Path) -> set[str]:
    return {r["name"] for r in yaml.safe_load(path.read_text())["resources"]}


def test_bootstrap_keeps_only_the_processor_cluster_static(tmp_path: Path) -> None:
    bootstrap, cds = split_bootstrap(runtime(["c1", "c2"]), str(tmp_path / "cds.yaml"))
    assert [c["name"] for c in bootstrap["static_resources"]["clusters"]] == ["extproc"]
    assert bootstrap["dynamic_resources"]["cds_config"]["path_config_source"]["path"].endswith(
        "cds.yaml"
    )
    assert {r["name"] for r in cds["resources"]} == {"c1", "c2", "all_clusters", "c1__c2", "c2__c1"}


def test_reload_publishes_the_union_before_the_new_set(tmp_path: Path) -> None:
    path = tmp_path / "cds.yaml"
    old, new = runtime(["c1", "c2", "c3"]), runtime(["c1", "c2", "c4"])
    write_cds(old, str(path))
    write_cds_union(old, new, str(path))
    union = names(path)
    # Clusters only the old config names stay until the switch; the new ones exist before it.
    assert {"c3", "c1__c3", "c4", "c4__c1", "c1__c4"} <= union
    write_cds(new, str(path))
    final = names(path)
    assert "c3" not in final and "c1__c3" not in final and "c4" in final
    assert not list(tmp_path.glob(".cds.yaml.*"))  # atomic writes leave no temp files


# --- issue 21: the pool's endpoints by EDS ----------------------------------------------------


def pool_runtime(n: int, per: int = 2, drop: str | None = None) -> Runtime:
    doc = {
        "version": 1,
        "processor": {"mode": "endpoint_picker"},
        "clusters": [
            {"name": f"c{i}", "endpoints": [f"127.0.0.1:{9000 + i * per + j}" for j in range(per)]}
            for i in range(n)
            if f"c{i}" != drop
        ],
    }
    return compile_runtime(parse_config(doc))


def localities(path: Path) -> dict[str, int]:
    doc = yaml.safe_load(path.read_text())
    assert [r["@type"] for r in doc["resources"]] == [ENDPOINTS_TYPE]
    return {
        loc["locality"]["sub_zone"]: len(loc["lb_endpoints"])
        for loc in doc["resources"][0]["endpoints"]
    }


def test_the_pool_takes_its_endpoints_from_the_eds_file_beside_the_cds_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cds.yaml"
    write_cds(pool_runtime(40), str(path))
    (pool,) = [r for r in yaml.safe_load(path.read_text())["resources"]]
    assert pool["name"] == "all_clusters" and pool["type"] == "EDS"
    assert "load_assignment" not in pool
    source = pool["eds_cluster_config"]["eds_config"]["path_config_source"]["path"]
    assert source == str(endpoints_path(path)) and source.endswith("cds.endpoints.json")
    # Health checks and outlier detection stay on the (per host) pool cluster.
    assert pool["health_checks"] and pool["outlier_detection"]
    assert localities(endpoints_path(path)) == {f"c{i}": 2 for i in range(40)}


def test_a_reload_of_the_pool_changes_only_its_endpoints_union_first(tmp_path: Path) -> None:
    path = tmp_path / "cds.yaml"
    old, new = pool_runtime(40), pool_runtime(41, drop="c7")
    write_cds(old, str(path))
    cds_before = path.read_text().replace(old.version, "V")
    write_cds_union(old, new, str(path))
    # The pool cluster itself is unchanged (Envoy keeps it, its hosts and their checks).
    assert path.read_text().replace(f"{old.version}+{new.version}", "V") == cds_before
    union = localities(endpoints_path(path))
    assert "c7" in union and "c40" in union and len(union) == 41
    write_cds(new, str(path))
    final = localities(endpoints_path(path))
    assert "c7" not in final and "c40" in final and len(final) == 40


def test_a_pool_of_host_names_keeps_its_endpoints_inline(tmp_path: Path) -> None:
    """EDS carries IP addresses only: names need the STRICT_DNS cluster's own resolver."""
    doc = {
        "version": 1,
        "processor": {"mode": "endpoint_picker"},
        "clusters": [{"name": f"c{i}", "endpoints": [f"engine-{i}:8000"]} for i in range(3)],
    }
    path = tmp_path / "cds.yaml"
    write_cds(compile_runtime(parse_config(doc)), str(path))
    (pool,) = yaml.safe_load(path.read_text())["resources"]
    assert pool["type"] == "STRICT_DNS" and pool["load_assignment"]["endpoints"]
    assert not endpoints_path(path).exists()


# --- issue 23: a model-aware fleet's model pools on the same EDS path -------------------------


def models_runtime(serving: dict[str, list[str]]) -> Runtime:
    doc = {
        "version": 1,
        "processor": {"mode": "endpoint_picker"},
        "clusters": [
            {
                "name": name,
                "endpoints": [f"127.0.0.1:{9100 + 2 * int(name[1:]) + j}" for j in range(2)],
                "models": models,
            }
            for name, models in serving.items()
        ],
    }
    return compile_runtime(parse_config(doc))


SERVING = {"c0": ["big"], "c1": ["big"], "c2": ["big", "small"], "c3": ["small"]}


def cds_clusters(path: Path) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in yaml.safe_load(path.read_text())["resources"]}


def test_model_pools_take_their_endpoints_by_eds_one_file_each(tmp_path: Path) -> None:
    path = tmp_path / "cds.yaml"
    write_cds(models_runtime(SERVING), str(path))
    resources = cds_clusters(path)
    big, small = model_pool_name("big"), model_pool_name("small")
    assert sorted(n for n in resources if n.startswith(MODEL_POOL_PREFIX)) == sorted([big, small])
    for name in (FALLBACK_CLUSTER, big, small):
        cluster = resources[name]
        assert cluster["type"] == "EDS" and "load_assignment" not in cluster, name
        source = cluster["eds_cluster_config"]["eds_config"]["path_config_source"]["path"]
        # One file per pool: Envoy's EDS takes exactly one ClusterLoadAssignment per update.
        assert source == str(endpoints_path(path, name)), name
    assert endpoints_path(path, FALLBACK_CLUSTER) == endpoints_path(path)
    assert localities(endpoints_path(path)) == {"c0": 2, "c1": 2, "c2": 2, "c3": 2}
    assert localities(endpoints_path(path, big)) == {"c0": 2, "c1": 2, "c2": 2}
    assert localities(endpoints_path(path, small)) == {"c2": 2, "c3": 2}
    # Each endpoint is actively checked once, by the pool of every endpoint (issue 23): a
    # model's pool only ever gets requests with their hosts named, which override_host takes
    # whatever their health. Outlier detection (passive) stays on every pool.
    assert resources[FALLBACK_CLUSTER]["health_checks"]
    for name in (big, small):
        assert "health_checks" not in resources[name], name
        assert (
            resources[name]["outlier_detection"] == resources[FALLBACK_CLUSTER]["outlier_detection"]
        )


def test_a_reload_changes_only_the_model_pools_endpoints_union_first(tmp_path: Path) -> None:
    path = tmp_path / "cds.yaml"
    big, small = model_pool_name("big"), model_pool_name("small")
    old = models_runtime(SERVING)
    # c4 joins serving big; c3 leaves and c2 stops serving small: no small pool any more.
    new = models_runtime({"c0": ["big"], "c1": ["big"], "c2": ["big"], "c4": ["big"]})
    write_cds(old, str(path))
    big_before = cds_clusters(path)[big]
    write_cds_union(old, new, str(path))
    union = cds_clusters(path)
    # The big pool's cluster is the same (Envoy keeps it and its hosts); only its endpoints
    # change, the union of both first; the small pool stays until the switch, as it was.
    assert union[big] == big_before and small in union
    assert set(localities(endpoints_path(path, big))) == {"c0", "c1", "c2", "c4"}
    assert localities(endpoints_path(path, small)) == {"c2": 2, "c3": 2}
    assert {c["cluster_name"] for c in union_endpoints(old, new)} == {FALLBACK_CLUSTER, big, small}
    write_cds(new, str(path))
    final = cds_clusters(path)
    assert small not in final and final[big] == big_before
    assert set(localities(endpoints_path(path, big))) == {"c0", "c1", "c2", "c4"}
    assert set(localities(endpoints_path(path))) == {"c0", "c1", "c2", "c4"}

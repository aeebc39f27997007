"""File-based CDS: what the processor publishes to Envoy around a reload."""

from __future__ import annotations

from pathlib import Path

import yaml

from extproc.config import Runtime, compile_runtime, parse_config
from extproc.render.envoy_dynamic import (
    ENDPOINTS_TYPE,
    endpoints_path,
    split_bootstrap,
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

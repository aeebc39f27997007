"""File-based CDS: what the processor publishes to Envoy around a reload."""

from __future__ import annotations

from pathlib import Path

import yaml

from extproc.config import Runtime, compile_runtime, parse_config
from extproc.render.envoy_dynamic import split_bootstrap, write_cds, write_cds_union


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

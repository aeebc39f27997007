"""Envoy with file-based dynamic clusters (CDS from a watched file).

The listener, the ext_proc filter and the routes never change when the fleet changes: routes
select clusters by the ``x-fleet-route`` header. Only the cluster set does (inference clusters,
their (primary, secondary) aggregates, the fallback cluster), so only clusters are dynamic.
Envoy watches the CDS file and applies a new version when the file is *moved* into place, so
writers must write a temporary file in the same directory and rename it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from extproc.config.runtime import Runtime
from extproc.render.envoy import EXTPROC_CLUSTER, EnvoyOptions, render_bootstrap

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"


def split_bootstrap(
    runtime: Runtime, cds_path: str, opts: EnvoyOptions | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(bootstrap with CDS from ``cds_path``, the CDS file's contents)."""
    full = render_bootstrap(runtime, opts)
    clusters = full["static_resources"]["clusters"]
    static = [c for c in clusters if c["name"] == EXTPROC_CLUSTER]
    dynamic = [c for c in clusters if c["name"] != EXTPROC_CLUSTER]
    full["static_resources"]["clusters"] = static
    # The static routes name clusters that arrive by CDS (all_clusters, the aggregates); tell
    # Envoy not to insist they exist when the bootstrap loads.
    for listener in full["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                route_config = network_filter["typed_config"].get("route_config")
                if route_config is not None:
                    route_config["validate_clusters"] = False
    full["dynamic_resources"] = {
        "cds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(Path(cds_path).resolve())},
        }
    }
    # Envoy needs a node identity when it reads dynamic resources.
    full["node"] = {"id": "fleet-extproc", "cluster": "fleet-extproc"}
    cds = {
        "version_info": runtime.version,
        "resources": [{"@type": CLUSTER_TYPE, **c} for c in dynamic],
    }
    return full, cds


def write_atomically(path: str | Path, text: str) -> None:
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_cds(runtime: Runtime, cds_path: str, opts: EnvoyOptions | None = None) -> None:
    _bootstrap, cds = split_bootstrap(runtime, cds_path, opts)
    write_atomically(cds_path, yaml.safe_dump(cds, sort_keys=False))


def write_cds_union(
    old: Runtime, new: Runtime, cds_path: str, opts: EnvoyOptions | None = None
) -> None:
    """A CDS file with the clusters of both configs (the new definition wins on a name clash):
    the safe intermediate step of a reload (see extproc.serve.service)."""
    _b, old_cds = split_bootstrap(old, cds_path, opts)
    _b, new_cds = split_bootstrap(new, cds_path, opts)
    names = {r["name"] for r in new_cds["resources"]}
    resources = new_cds["resources"] + [r for r in old_cds["resources"] if r["name"] not in names]
    union = {"version_info": f"{old.version}+{new.version}", "resources": resources}
    write_atomically(cds_path, yaml.safe_dump(union, sort_keys=False))

"""Envoy with file-based dynamic clusters (CDS from a watched file).

The listener, the ext_proc filter and the routes never change when the fleet changes: routes
select clusters by the ``x-fleet-route`` header. Only the cluster set does (inference clusters,
their (primary, secondary) aggregates, the fallback cluster), so only clusters are dynamic.
Envoy watches the CDS file and applies a new version when the file is *moved* into place, so
writers must write a temporary file in the same directory and rename it.

The pool data path (one cluster holding every endpoint) takes its endpoints by EDS, from a
second file beside the CDS file (``endpoints_path``, JSON): a fleet change then rewrites only the
pool's endpoint list, and the pool cluster itself stays as it is. Replacing the cluster by CDS
instead re-creates it with every host, their health-check sessions and connection pools; at
512 x 8 that was the bulk of a one-cluster reload (BENCHMARKS.md "Scale"). A model-aware fleet's
per-model pools (render/envoy.py _model_pools) take theirs the same way, one file each: Envoy's
EDS takes exactly one ClusterLoadAssignment per update of a cluster's subscription, and a file
subscription hands the cluster every resource in the file ("Unexpected EDS resource length").
(Over gRPC, Envoy hands each cluster only the assignment it subscribed to.) EDS carries IP
addresses only, so a pool with host names (STRICT_DNS) keeps its endpoints inline.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import orjson
import yaml

from extproc.config.runtime import Runtime
from extproc.core.models import MODEL_POOL_PREFIX
from extproc.render.envoy import EXTPROC_CLUSTER, FALLBACK_CLUSTER, EnvoyOptions, render_bootstrap

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINTS_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# Where the pool's endpoints come from: the file beside the CDS file, the processor's gRPC
# xDS server (extproc/protocol/xds.py), or inline in the cluster (the design before EDS).
PoolEndpoints = Literal["file", "grpc", "inline"]

Json = dict[str, Any]


def endpoints_path(cds_path: str | Path, cluster: str = FALLBACK_CLUSTER) -> Path:
    """A pool's EDS file, beside the CDS file (the pool of every endpoint:
    ``<cds>.endpoints.json``; a model's pool: ``<cds>.endpoints.<pool>.json``). JSON whatever the
    CDS file's format (Envoy reads a file by its extension): PyYAML's emitter took 2 s of CPU
    for the 4,096 endpoints of 512 x 8, on the processor's event loop at every reload; orjson
    takes 3 ms."""
    path = Path(cds_path).resolve()
    own = "" if cluster == FALLBACK_CLUSTER else f".{cluster}"
    return path.with_name(f"{path.stem}.endpoints{own}.json")


def processor_source() -> Json:
    """An xDS config source on the processor's own gRPC port (the static extproc cluster)."""
    return {
        "resource_api_version": "V3",
        "api_config_source": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}}],
            # The node identity once per stream, not on every ACK.
            "set_node_on_first_message_only": True,
        },
    }


def _eds_source(source: PoolEndpoints, cds_path: str, cluster: str) -> Json:
    if source == "file":
        return {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(endpoints_path(cds_path, cluster))},
        }
    return processor_source()


def _is_eds_pool(runtime: Runtime, cluster: Json) -> bool:
    """The pool of every endpoint or a model's pool, of IP addresses (STATIC)."""
    name = cluster["name"]
    pool = name == FALLBACK_CLUSTER or name.startswith(MODEL_POOL_PREFIX)
    return runtime.endpoint_picker and pool and cluster.get("type") == "STATIC"


def pool_to_eds(
    runtime: Runtime, clusters: list[Json], source: Callable[[str], Json]
) -> list[Json]:
    """Move the pools' endpoints out of their clusters (in place): their ClusterLoadAssignments;
    ``source``: a cluster's EDS config source, by its name."""
    assignments = []
    for cluster in clusters:
        if _is_eds_pool(runtime, cluster):
            assignments.append(cluster.pop("load_assignment"))
            cluster["type"] = "EDS"
            cluster["eds_cluster_config"] = {"eds_config": source(cluster["name"])}
    return assignments


def split_bootstrap(
    runtime: Runtime, cds_path: str, opts: EnvoyOptions | None = None, pool: PoolEndpoints = "file"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(bootstrap with CDS from ``cds_path``, the CDS file's contents); ``pool``: where the
    pool's endpoints come from (``write_cds`` writes the EDS file)."""
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
    if pool != "inline":
        pool_to_eds(runtime, dynamic, lambda name: _eds_source(pool, cds_path, name))
    cds = {
        "version_info": runtime.version,
        "resources": [{"@type": CLUSTER_TYPE, **c} for c in dynamic],
    }
    return full, cds


def pool_endpoints(runtime: Runtime, opts: EnvoyOptions | None = None) -> list[Json]:
    """The pools' ClusterLoadAssignments as EDS serves them (none in the pairs design, or for
    pools of host names, which keep them inline)."""
    clusters = render_bootstrap(runtime, opts)["static_resources"]["clusters"]
    return pool_to_eds(runtime, clusters, lambda _name: {})


def union_endpoints(old: Runtime, new: Runtime, opts: EnvoyOptions | None = None) -> list[Json]:
    """The pools' endpoints of both configs: in each pool of the new one, every locality (fleet
    cluster) of the new one and those of the old one that the new one dropped (they go with the
    final write, after the switch); a pool only the old one has, as it was."""
    fresh = pool_endpoints(new, opts)
    if not fresh:
        return fresh
    names = {cla["cluster_name"] for cla in fresh}
    for cla in pool_endpoints(old, opts):
        if cla["cluster_name"] not in names:
            fresh.append(cla)
            continue
        target = next(t for t in fresh if t["cluster_name"] == cla["cluster_name"])
        localities = {loc["locality"]["sub_zone"] for loc in target["endpoints"]}
        target["endpoints"] += [
            loc for loc in cla["endpoints"] if loc["locality"]["sub_zone"] not in localities
        ]
    return fresh


def endpoints_doc(version: str, assignments: list[Json]) -> Json:
    return {
        "version_info": version,
        "resources": [{"@type": ENDPOINTS_TYPE, **a} for a in assignments],
    }


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


def _write_endpoints(cds_path: str, version: str, assignments: list[Json]) -> None:
    """The EDS files go first: a pool cluster the CDS file creates finds its endpoints. One
    file per pool (module docstring). A file of a pool the fleet no longer has stays behind,
    read by no cluster."""
    for assignment in assignments:
        doc = endpoints_doc(version, [assignment])
        path = endpoints_path(cds_path, assignment["cluster_name"])
        write_atomically(path, orjson.dumps(doc).decode())


def write_cds(runtime: Runtime, cds_path: str, opts: EnvoyOptions | None = None) -> None:
    _write_endpoints(cds_path, runtime.version, pool_endpoints(runtime, opts))
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
    version = f"{old.version}+{new.version}"
    _write_endpoints(cds_path, version, union_endpoints(old, new, opts))
    union = {"version_info": version, "resources": resources}
    write_atomically(cds_path, yaml.safe_dump(union, sort_keys=False))

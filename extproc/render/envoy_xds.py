"""Envoy with its clusters from the processor over gRPC xDS (CDS) instead of a file.

The same split as the CDS file (extproc/render/envoy_dynamic.py: the listener, filter, routes
and the processor's own cluster stay static; the inference clusters, their aggregates and the
fallback cluster are dynamic), but ``cds_config`` names the processor's gRPC cluster: the
processor serves the clusters itself (extproc/protocol/xds.py, ``extproc serve --xds-cds``).
No shared volume, and a reload reaches Envoy in one gRPC message. The pool data path's
cluster takes its endpoints by EDS from the same server (``pool_endpoints``): a fleet change
then updates the endpoint list only, not the cluster.
"""

from __future__ import annotations

from typing import Any

from extproc.config.runtime import Runtime
from extproc.render.envoy import EnvoyOptions
from extproc.render.envoy_dynamic import processor_source, split_bootstrap

Json = dict[str, Any]


def xds_bootstrap(runtime: Runtime, opts: EnvoyOptions | None = None) -> Json:
    bootstrap, _cds = split_bootstrap(runtime, "/dev/null", opts, pool="grpc")
    bootstrap["dynamic_resources"] = {"cds_config": processor_source()}
    return bootstrap


def dynamic_clusters(runtime: Runtime, opts: EnvoyOptions | None = None) -> list[Json]:
    """The clusters the processor serves over CDS (without the CDS file's "@type" keys)."""
    _bootstrap, cds = split_bootstrap(runtime, "/dev/null", opts, pool="grpc")
    return [{k: v for k, v in r.items() if k != "@type"} for r in cds["resources"]]


def union_clusters(old: Runtime, new: Runtime, opts: EnvoyOptions | None = None) -> list[Json]:
    """The clusters of both configs (the new definition wins on a name clash): the safe first
    step of a reload, as with the CDS file (see extproc.serve.service)."""
    fresh = dynamic_clusters(new, opts)
    names = {c["name"] for c in fresh}
    return fresh + [c for c in dynamic_clusters(old, opts) if c["name"] not in names]

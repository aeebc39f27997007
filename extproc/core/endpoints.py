"""Endpoint picking (Inference Extension mode): which pod-level endpoints serve a request.

The processor names endpoints instead of clusters: the first ready endpoint of each cluster in
the session's preference order, at most ``count`` of them from distinct clusters — the primary
cluster's first, then the secondary's as the fallback Envoy tries on retry. Within a cluster the
endpoint is chosen by rendezvous on the same session point, so a session keeps its endpoint (and
that endpoint's KV cache) while the endpoint set is stable.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from extproc.core.placement import cluster_seed, mix64


def endpoint_order(point: int, endpoints: Sequence[str]) -> list[str]:
    return sorted(endpoints, key=lambda e: mix64(point ^ cluster_seed(e)), reverse=True)


def pick_endpoints(
    point: int,
    ranked_clusters: Sequence[str],
    endpoints: Mapping[str, Sequence[str]],
    ready: Collection[str],
    count: int = 2,
) -> list[str]:
    """Up to ``count`` ready endpoints from distinct clusters, in preference order."""
    picked: list[str] = []
    for cluster in ranked_clusters:
        for endpoint in endpoint_order(point, endpoints.get(cluster, ())):
            if endpoint in ready:
                picked.append(endpoint)
                break
        if len(picked) == count:
            break
    return picked

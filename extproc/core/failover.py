"""Failover facts the processor learns about, as pure functions.

- :func:`endpoint_owners`: which cluster an upstream address belongs to, for Envoy's
  ``upstream.address`` response attribute (a failed-over request names its real server);
- :func:`around_unready`: the placement when the processor's own probes say the hash primary
  has no ready endpoint: the request is placed (and its budget charged) on the next ready
  cluster directly, instead of being admitted against a dead cluster's budget and then
  served by the secondary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from extproc.core.placement import Placement


def endpoint_owners(endpoints: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """address -> cluster, for the addresses that belong to exactly one cluster."""
    owners: dict[str, str] = {}
    shared: set[str] = set()
    for cluster, addresses in endpoints.items():
        for address in addresses:
            if owners.setdefault(address, cluster) != cluster:
                shared.add(address)
    for address in shared:
        del owners[address]
    return owners


def around_unready(placement: Placement, ranked: Sequence[str], ready: frozenset[str]) -> Placement:
    """``placement`` unless its primary is not ready; then the first two ready clusters in the
    order (primary, secondary, the rest of ``ranked``). With no cluster known ready the
    placement stands: the probes may be wrong, and Envoy's own health checks still decide."""
    if placement.primary in ready:
        return placement
    order = [placement.primary]
    if placement.secondary is not None:
        order.append(placement.secondary)
    order += [c for c in ranked if c not in order]
    alive = [c for c in order if c in ready]
    if not alive:
        return placement
    return Placement(alive[0], alive[1] if len(alive) > 1 else None)

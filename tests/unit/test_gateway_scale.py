"""Gateway API rendering at 512 clusters (issue 21): the pool rendering stays linear.

The envoy-gateway rendering has one HTTPRoute rule per ordered (primary, secondary) pair, so its
object count grows as N·(N-1); the inference-pool rendering (the processor as the pool's
Endpoint Picker, naming the primary's endpoint then the secondary's) has the same objects at
any size, and only the fleet.yaml in its ConfigMap grows, linearly. Both are validated against
the vendored CRD schemas, the pool one at 512 clusters of 8 endpoints.
"""

from __future__ import annotations

from typing import Any

import yaml

from tests.unit.test_gateway import check_objects, fleet_data, fleet_from_dict, of_kind, render

# A ConfigMap's data is limited to 1 MiB by the API server.
CONFIG_MAP_LIMIT = 1 << 20


def fleet_of(n: int, endpoints: int = 1) -> Any:
    data = fleet_data(n)
    for i, cluster in enumerate(data["clusters"], start=1):
        cluster["endpoints"] = [
            f"vllm-c{i}-{j}.inference.svc.cluster.local:8000" for j in range(endpoints)
        ]
    return fleet_from_dict(data)


def rules(objs: list[dict[str, Any]]) -> int:
    return sum(len(r["spec"]["rules"]) for r in of_kind(objs, "HTTPRoute"))


def test_pair_routes_grow_quadratically_and_the_pool_stays_flat() -> None:
    pairs = {n: rules(render(fleet_of(n), "envoy-gateway")) for n in (8, 16, 32)}
    # One rule per ordered pair, plus the catch-all route's rule(s).
    assert all(n * (n - 1) <= pairs[n] <= n * (n - 1) + 2 for n in pairs), pairs
    pool = {n: render(fleet_of(n), "inference-pool") for n in (8, 512)}
    assert [o["kind"] for o in pool[8]] == [o["kind"] for o in pool[512]]
    assert rules(pool[512]) == 1


def test_the_pool_rendering_at_512_clusters_is_valid_for_every_kind() -> None:
    objs = render(fleet_of(512, endpoints=8), "inference-pool")
    check_objects(objs)
    (config_map,) = of_kind(objs, "ConfigMap")
    size = sum(len(v.encode()) for v in config_map["data"].values())
    assert size < CONFIG_MAP_LIMIT, size
    # The fleet inside is the whole fleet: 512 clusters x 8 endpoints.
    fleet = yaml.safe_load(next(iter(config_map["data"].values())))
    assert len(fleet["clusters"]) == 512
    assert sum(len(c["endpoints"]) for c in fleet["clusters"]) == 4096

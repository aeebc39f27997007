"""The pool data path in a model-aware fleet (issue 23): one Envoy pool per base model, the
route that reaches it, and the processor naming it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime, with_discovered_models
from extproc.core.models import MODEL_POOL_PREFIX, model_pool_name
from extproc.names import ROUTE_HEADER
from extproc.pipeline.explain import explain_engine
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.protocol.responses import DESTINATION_HEADER, endpoint_response
from extproc.render.envoy import FALLBACK_CLUSTER, EnvoyOptions, render_bootstrap
from tests.unit.test_engine_render import clusters, routes
from tests.unit.test_render_envoy import validate

BIG = "meta-llama/Llama-3.1-70B-Instruct"
SMALL = "llama-8b"
SERVING: dict[str, list[Any]] = {
    "c1": [{"name": BIG, "adapters": ["sql-lora"]}],
    "c2": [BIG],
    "c3": [BIG, SMALL],
    "c4": [SMALL],
}


def runtime(mode: str = "endpoint_picker", **extra: Any) -> Runtime:
    doc: dict[str, Any] = {
        "version": 1,
        "processor": {"mode": mode},
        "clusters": [
            {
                "name": name,
                "endpoints": [f"127.0.0.1:{18300 + 2 * i + j}" for j in range(2)],
                "models": models,
            }
            for i, (name, models) in enumerate(SERVING.items())
        ],
        **extra,
    }
    return compile_runtime(parse_config(doc))


def localities(cluster: dict[str, Any]) -> set[str]:
    return {e["locality"]["sub_zone"] for e in cluster["load_assignment"]["endpoints"]}


def test_a_pool_per_base_model_beside_the_pool_of_every_endpoint(tmp_path: Path) -> None:
    rt = runtime()
    config = render_bootstrap(rt, EnvoyOptions(mode="extproc"))
    by_name = clusters(config)
    big, small = model_pool_name(BIG), model_pool_name(SMALL)
    assert big.startswith(MODEL_POOL_PREFIX) and "/" not in big and big != small
    # Two pools (the adapter shares its base's), each with its model's localities only.
    pools = sorted(n for n in by_name if n.startswith(MODEL_POOL_PREFIX))
    assert pools == sorted([big, small])
    assert localities(by_name[big]) == {"c1", "c2", "c3"}
    assert localities(by_name[small]) == {"c3", "c4"}
    assert localities(by_name[FALLBACK_CLUSTER]) == {"c1", "c2", "c3", "c4"}
    for name in pools:
        pool = by_name[name]
        assert pool["load_assignment"]["cluster_name"] == name
        # The same host selection, outlier detection and stats as the pool of every endpoint.
        for key in ("load_balancing_policy", "outlier_detection", "track_cluster_stats"):
            assert pool[key] == by_name[FALLBACK_CLUSTER][key], key
        # No active checks of its own since issue 23's dedup (render/envoy.py _model_pools
        # says why): each endpoint is checked once, by the pool of every endpoint.
        assert "health_checks" not in pool
    assert by_name[FALLBACK_CLUSTER]["health_checks"]
    # The pool route first: x-fleet-route naming a pool, with the pool's retry policy.
    pool_route, fallback = routes(config)
    (match,) = pool_route["match"]["headers"]
    assert match == {"name": ROUTE_HEADER, "string_match": {"prefix": MODEL_POOL_PREFIX}}
    assert pool_route["route"]["cluster_header"] == ROUTE_HEADER
    assert pool_route["route"]["retry_policy"] == fallback["route"]["retry_policy"]
    validate(config, tmp_path)


def test_no_models_or_route_mode_render_no_model_pools() -> None:
    plain = compile_runtime(
        parse_config(
            {
                "version": 1,
                "processor": {"mode": "endpoint_picker"},
                "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:18400"]}],
            }
        )
    )
    config = render_bootstrap(plain, EnvoyOptions(mode="extproc"))
    assert not [n for n in clusters(config) if n.startswith(MODEL_POOL_PREFIX)]
    assert len(routes(config)) == 1
    paired = render_bootstrap(runtime("route"), EnvoyOptions(mode="extproc"))
    assert not [n for n in clusters(paired) if n.startswith(MODEL_POOL_PREFIX)]
    # The header route and the fallback, and since route-mode adapter affinity (issue 23) the
    # route to all_clusters for a LoRA adapter's named engines (test_engine_render.py).
    assert len(routes(paired)) == 3


def decide(rt: Runtime, model: str, session: str) -> Routed:
    pipeline = Pipeline(RuntimeHolder(rt), Metrics(CollectorRegistry()))
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    headers = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
        "x-session-id": session,
    }
    outcome = asyncio.run(pipeline.decide(headers, body, 0.0))
    assert isinstance(outcome, Routed)
    return outcome


def test_the_processor_routes_each_request_to_its_models_pool() -> None:
    rt = runtime()
    for model, pool in ((BIG, BIG), ("sql-lora", BIG), (SMALL, SMALL)):
        for session in range(20):
            routed = decide(rt, model, f"s-{session}")
            assert routed.pool == model_pool_name(pool), (model, routed)
            answer = endpoint_response(
                routed.route, routed.facts, routed.endpoints or (), None, None, routed.pool
            )
            sets = {
                h.header.key: h.header.raw_value.decode()
                for h in answer.request_body.response.header_mutation.set_headers
            }
            assert sets[ROUTE_HEADER] == routed.pool
            assert sets[DESTINATION_HEADER] == ",".join(routed.endpoints or ())
            assert answer.request_body.response.clear_route_cache
            assert explain_engine(rt, routed)["pool"] == routed.pool
    # Without a pool: no route header and the route stays (the pool of every endpoint).
    routed = decide(rt, SMALL, "s-0")
    plain = endpoint_response(routed.route, routed.facts, routed.endpoints or ())
    assert not plain.request_body.response.clear_route_cache
    keys = [h.header.key for h in plain.request_body.response.header_mutation.set_headers]
    assert ROUTE_HEADER not in keys


def test_a_cluster_only_discovery_added_to_a_model_is_in_no_pool() -> None:
    rt = runtime(model_routing={"discovery": True})
    # c4 starts listing the big model: placements there cannot use the big pool (Envoy's
    # pool has no c4 endpoint), so they go to the pool of every endpoint.
    grown = with_discovered_models(rt, {"c4": frozenset({(BIG, None), (SMALL, None)})})
    pools = set()
    for session in range(60):
        routed = decide(grown, BIG, f"s-{session}")
        on_c4 = any(e in grown.endpoints["c4"] for e in routed.endpoints or ())
        assert routed.pool == (None if on_c4 else model_pool_name(BIG)), routed
        pools.add(routed.pool)
    assert pools == {None, model_pool_name(BIG)}

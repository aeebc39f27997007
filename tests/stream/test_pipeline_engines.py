"""Engine choice through the pipeline: the picker's bounded load counts what it holds and gives
it back on release; route mode sends the engine key; explain names the engine."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime, with_discovered_models
from extproc.core.endpoints import endpoint_order, engine_cap, engine_key
from extproc.pipeline.explain import explain_outcome
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.protocol.responses import RouteAnswers

CHAT = "/v1/chat/completions"
ENGINES = 4


def doc(mode: str, **engines: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "processor": {"mode": mode},
        "clusters": [
            {"name": f"c{i}", "endpoints": [f"10.0.{i}.{j}:8000" for j in range(ENGINES)]}
            for i in (1, 2)
        ],
        "engines": engines,
    }


def headers(sid: str) -> dict[str, str]:
    return {
        ":method": "POST",
        ":path": CHAT,
        "content-type": "application/json",
        "x-session-id": sid,
    }


BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def pipeline_for(mode: str, **engines: Any) -> tuple[Pipeline, CollectorRegistry]:
    runtime = compile_runtime(parse_config(doc(mode, **engines)))
    registry = CollectorRegistry()
    return Pipeline(RuntimeHolder(runtime), Metrics(registry)), registry


async def test_picker_bounds_a_hot_session_and_release_gives_the_slots_back() -> None:
    pipeline, registry = pipeline_for("endpoint_picker", balance_factor=1.25)
    held: list[Routed] = []
    for _ in range(12):  # one hot session, nothing finishes
        outcome = await pipeline.decide(headers("hot"), BODY, 1.0)
        assert isinstance(outcome, Routed) and outcome.endpoints
        held.append(outcome)
    primary = held[0].route.placement.primary
    engines = pipeline.runtime.endpoints[primary]
    per_engine: dict[str, int] = {}
    for outcome in held:
        assert outcome.endpoints is not None
        first = outcome.endpoints[0]
        assert first in engines  # the spill stays inside the primary cluster
        per_engine[first] = per_engine.get(first, 0) + 1
    assert max(per_engine.values()) <= engine_cap(len(held) - 1, ENGINES, 1.25)
    # The session's own engine is the most loaded one: it is the first choice until full.
    point = held[0].facts.session.point
    own = endpoint_order(point, engines)[0]
    assert per_engine[own] == max(per_engine.values())
    counted = registry.get_sample_value("fleet_engine_requests_total", {"engine": own})
    assert counted == per_engine[own]
    for outcome in held:
        await pipeline.release(outcome.hold)
        await pipeline.release(outcome.hold)  # idempotent
    again = await pipeline.decide(headers("hot"), BODY, 2.0)
    assert isinstance(again, Routed) and again.endpoints is not None
    assert again.endpoints[0] == own  # everything given back: sticky again
    explained = explain_outcome(pipeline.runtime, again)
    assert explained["engine"] == {
        "chosen_by": "processor rendezvous",
        "engine": own,
        "cluster_engines": list(engines),
    }


async def test_picker_without_a_bound_keeps_the_hot_session_on_one_engine() -> None:
    pipeline, _ = pipeline_for("endpoint_picker", balance_factor=None)
    firsts = set()
    for _ in range(8):
        outcome = await pipeline.decide(headers("hot"), BODY, 1.0)
        assert isinstance(outcome, Routed) and outcome.endpoints
        firsts.add(outcome.endpoints[0])
    assert len(firsts) == 1


async def test_picker_round_robin_spreads_a_session() -> None:
    pipeline, _ = pipeline_for("endpoint_picker", affinity="round_robin")
    firsts = set()
    for _ in range(40):
        outcome = await pipeline.decide(headers("s"), BODY, 1.0)
        assert isinstance(outcome, Routed) and outcome.endpoints
        firsts.add(outcome.endpoints[0])
        await pipeline.release(outcome.hold)
    assert len(firsts) == ENGINES


async def test_route_mode_sends_the_engine_key_only_when_sticky() -> None:
    pipeline, _ = pipeline_for("route")
    outcome = await pipeline.decide(headers("alice"), BODY, 1.0)
    assert isinstance(outcome, Routed) and outcome.endpoints is None
    assert outcome.engine_key == engine_key(outcome.facts.session.digest)
    explained = explain_outcome(pipeline.runtime, outcome)
    assert explained["engine"]["chosen_by"] == "envoy maglev"  # type: ignore[index]
    assert explained["engine"]["x-fleet-engine-key"] == outcome.engine_key  # type: ignore[index]
    spread, _ = pipeline_for("route", affinity="round_robin")
    plain = await spread.decide(headers("alice"), BODY, 1.0)
    assert isinstance(plain, Routed) and plain.engine_key is None


async def test_usage_is_counted_per_engine_envoy_names_the_serving_host() -> None:
    runtime = compile_runtime(
        parse_config({**doc("route"), "processor": {"mode": "route", "inspect_usage": True}})
    )
    registry = CollectorRegistry()
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry))
    outcome = await pipeline.decide(headers("alice"), BODY, 1.0)
    assert isinstance(outcome, Routed)
    served = "10.0.1.2:8000"  # Envoy's upstream.address: the engine its Maglev chose
    hold = outcome.hold
    assert not pipeline.observe_response(
        hold, {"content-type": "application/json"}, 1.1, None, served
    )
    usage = {
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4},
        }
    }
    await pipeline.observe_response_body(hold, orjson.dumps(usage), True, 1.2)
    value = registry.get_sample_value
    # Route mode: the processor never named the engine; Envoy's word counts the request.
    assert value("fleet_engine_requests_total", {"engine": served}) is None
    assert value("fleet_engine_served_requests_total", {"engine": served}) == 1
    assert value("fleet_engine_input_tokens_total", {"engine": served, "cache": "hit"}) == 4
    assert value("fleet_engine_input_tokens_total", {"engine": served, "cache": "miss"}) == 6
    assert value("fleet_engine_output_tokens_total", {"engine": served}) == 3
    # A model-agnostic fleet: the model label is empty.
    cost = value("fleet_engine_token_cost_dollars_total", {"engine": served, "model": ""})
    assert cost is not None and cost > 0


def _lora_runtime(mode: str, loaded_on: dict[str, str]) -> Runtime:
    """Two clusters serving "m"; discovery found the adapter "sql-lora" on the engines
    ``loaded_on`` names (cluster -> engine)."""
    data = {
        **doc(mode),
        "models": [{"name": "sql-lora", "base": "m"}],
        "model_routing": {"discovery": True},
    }
    for cluster in data["clusters"]:
        cluster["models"] = ["m"]
    runtime = compile_runtime(parse_config(data))
    listed = {e: frozenset({("m", None)}) for c in runtime.endpoints.values() for e in c}
    clusters = {c: frozenset({("m", None)}) for c in runtime.endpoints}
    for cluster, engine in loaded_on.items():
        listed[engine] = frozenset({("m", None), ("sql-lora", "m")})
        clusters[cluster] = frozenset({("m", None), ("sql-lora", "m")})
    return with_discovered_models(runtime, clusters, listed)


async def test_picker_prefers_the_engines_an_adapter_is_loaded_on() -> None:
    # Model discovery found the adapter "sql-lora" (of base "m") on one engine of c1 only.
    loaded_on = "10.0.1.2:8000"
    grown = _lora_runtime("endpoint_picker", {"c1": loaded_on})
    assert grown.adapter_engines == {"sql-lora": frozenset({loaded_on})}
    pipeline = Pipeline(RuntimeHolder(grown), Metrics(CollectorRegistry()))
    lora = orjson.dumps({"model": "sql-lora", "messages": [{"role": "user", "content": "q"}]})
    firsts: collections.Counter[str] = collections.Counter()
    base_firsts: collections.Counter[str] = collections.Counter()
    for i in range(40):
        outcome = await pipeline.decide(headers(f"s-{i}"), lora, 1.0)
        assert isinstance(outcome, Routed) and outcome.endpoints
        # The adapter's loaded cluster first (core.models), then its loaded engine in it.
        assert outcome.route.placement.primary == "c1"
        firsts[outcome.endpoints[0]] += 1
        await pipeline.release(outcome.hold)
        base = await pipeline.decide(headers(f"s-{i}"), BODY, 1.0)
        assert isinstance(base, Routed) and base.endpoints
        base_firsts[base.endpoints[0]] += 1
        await pipeline.release(base.hold)
    assert firsts == {loaded_on: 40}, firsts
    # The base model's requests are not drawn to it: they spread over all eight engines.
    assert len(base_firsts) > 4, base_firsts


async def test_route_mode_names_an_adapters_loaded_engines_and_hashes_everything_else() -> None:
    loaded = {"c1": "10.0.1.2:8000", "c2": "10.0.2.3:8000"}
    runtime = _lora_runtime("route", loaded)
    registry = CollectorRegistry()
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry))
    lora = orjson.dumps({"model": "sql-lora", "messages": [{"role": "user", "content": "q"}]})
    answers = RouteAnswers()
    held: list[Routed] = []
    for i in range(40):
        outcome = await pipeline.decide(headers(f"s-{i}"), lora, 1.0)
        assert isinstance(outcome, Routed) and outcome.endpoints is None
        placement = outcome.route.placement
        # The primary's loaded engine, then one of the secondary's (the retry's host: its loaded
        # one until the held requests fill it, core.endpoints.adapter_engines).
        assert outcome.engines[0] == loaded[placement.primary]
        assert outcome.engines[1] in runtime.endpoints[placement.secondary or ""]
        assert outcome.engine_key is not None  # the hash still has its key (fail-open)
        # The answer routes to the cluster of every endpoint with the names in envoy.lb.
        answer = answers.route(outcome.route, outcome.facts, engines=outcome.engines)
        mutation = answer.request_body.response.header_mutation
        sets = {h.header.key: h.header.raw_value for h in mutation.set_headers}
        assert sets["x-fleet-route"] == b"all_clusters"
        assert sets["x-fleet-primary"] == placement.primary.encode()
        lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
        assert lb.fields["x-gateway-destination-endpoint"].string_value == ",".join(outcome.engines)
        assert explain_outcome(runtime, outcome)["engine"]["engine"] == outcome.engines[0]
        held.append(outcome)
        # The base model: nothing named, the pair and its hash on the engine key, as before.
        base = await pipeline.decide(headers(f"s-{i}"), BODY, 1.0)
        assert isinstance(base, Routed) and base.engines == () and base.engine_key is not None
        plain = answers.route(base.route, base.facts, engine_key=base.engine_key)
        assert not plain.HasField("dynamic_metadata")
        await pipeline.release(base.hold)
    # Every adapter request counted on its named engine (bounded load), given back on release.
    counts = collections.Counter(o.engines[0] for o in held)
    assert set(counts) <= set(loaded.values()) and sum(counts.values()) == 40
    assert dict(pipeline._engine_inflight) == counts
    for outcome in held:
        await pipeline.release(outcome.hold)
    assert pipeline._engine_inflight == {}
    # Nothing held: the secondary's loaded engine is the retry's host.
    for i in range(20):
        outcome = await pipeline.decide(headers(f"s-{i}"), lora, 1.0)
        assert isinstance(outcome, Routed)
        placement = outcome.route.placement
        assert outcome.engines == (loaded[placement.primary], loaded[placement.secondary or ""])
        await pipeline.release(outcome.hold)
    # An engine that stopped answering discovery is not named (and none other is in c1).
    gone = dataclasses.replace(
        runtime, listing_endpoints=runtime.listing_endpoints - {loaded["c1"]}
    )
    pipeline = Pipeline(RuntimeHolder(gone), Metrics(CollectorRegistry()))
    for i in range(20):
        outcome = await pipeline.decide(headers(f"s-{i}"), lora, 1.0)
        assert isinstance(outcome, Routed)
        named = outcome.engines
        if outcome.route.placement.primary == "c1":
            assert named == ()
        else:
            assert named[0] == loaded["c2"] and named[1] != loaded["c1"]

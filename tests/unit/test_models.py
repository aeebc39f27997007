"""Multi-model fleets: fleet.yaml models, placement among a model's clusters, 404 / 503.

Placement properties are checked on seeded uniform session points, as in test_placement.py:
the session-key digest is a uniform hash, so that is what placement sees in production.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.config import ConfigError, compile_runtime, parse_config
from extproc.config.runtime import Runtime, with_discovered_models
from extproc.core.api import BadRequest, ErrorStyle
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.models import ModelUnavailable, UnknownModel
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.model_discovery import parse_model_list
from extproc.pipeline.outcomes import ModelList, Passthrough, Routed, Unavailable
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder

KEYS = 20_000
BIG = "llama-70b"
SMALL = "llama-8b"


def points(n: int = KEYS, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def fleet(serving: dict[str, list[Any]], **extra: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "clusters": [
            {"name": name, "endpoints": [f"127.0.0.1:{8000 + i}"], "models": models}
            for i, (name, models) in enumerate(serving.items())
        ],
        **extra,
    }


def runtime_of(data: dict[str, Any]) -> Runtime:
    return compile_runtime(parse_config(data, "test.yaml"))


def two_models(n_big: int = 6, n_small: int = 4) -> dict[str, list[Any]]:
    serving: dict[str, list[Any]] = {f"b{i}": [BIG] for i in range(n_big)}
    serving.update({f"s{i}": [SMALL] for i in range(n_small)})
    return serving


def facts(
    runtime: Runtime, model: str | None, session: str, path: str = "/v1/chat/completions"
) -> RequestFacts:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if model is not None:
        body["model"] = model
    if path == "/v1/messages":
        body["max_tokens"] = 8
    headers = {"content-type": "application/json", "x-session-id": session}
    parsed = parse_request(
        path, headers, orjson.dumps(body), runtime.key_rules, runtime.parse_limits
    )
    assert isinstance(parsed, RequestFacts)
    return parsed


def placed_primaries(runtime: Runtime, model: str) -> dict[int, tuple[str, str | None]]:
    """Placement of every point for ``model`` in the short class (the points stand for session
    hashes; the model's placer is what the policy uses)."""
    cls = runtime.policy.classes[0].name
    placer = runtime.policy.model_placers[(cls, model)]
    out: dict[int, tuple[str, str | None]] = {}
    for p in points():
        placement = placer.top2(p)
        out[p] = (placement.primary, placement.secondary)
    return out


def test_a_fleet_without_models_places_as_before() -> None:
    data = {
        "version": 1,
        "clusters": [{"name": f"c{i}", "endpoints": [f"h:{i + 1}"]} for i in range(4)],
    }
    runtime = runtime_of(data)
    assert not runtime.policy.models.enabled
    # Any model name, or none, is placed over every cluster exactly as the class placer says.
    for model in ("anything", "", None):
        f = facts(runtime, model, "s1")
        route = runtime.policy.place(f)
        assert not isinstance(route, (UnknownModel, ModelUnavailable))
        assert route.model == ""
        assert route.placement == runtime.policy.placers[route.request_class.name].top2(
            f.session.point
        )


def test_requests_are_placed_only_on_clusters_serving_their_model() -> None:
    runtime = runtime_of(fleet(two_models()))
    for i in range(300):
        for model, prefix in ((BIG, "b"), (SMALL, "s")):
            route = runtime.policy.place(facts(runtime, model, f"sess-{i}"))
            assert not isinstance(route, (UnknownModel, ModelUnavailable))
            assert route.model == model
            assert route.placement.primary.startswith(prefix)
            assert route.placement.secondary is not None
            assert route.placement.secondary.startswith(prefix)
            assert route.placement.secondary != route.placement.primary


def test_placement_among_a_models_clusters_is_balanced() -> None:
    runtime = runtime_of(fleet(two_models(n_big=8)))
    placed = placed_primaries(runtime, BIG)
    primaries = Counter(p for p, _ in placed.values())
    secondaries = Counter(s for _, s in placed.values())
    assert len(primaries) == 8 and len(secondaries) == 8
    mean = KEYS / 8
    assert max(primaries.values()) / mean < 1.06, primaries
    assert max(secondaries.values()) / mean < 1.06, secondaries


def test_other_models_clusters_changing_moves_no_session() -> None:
    before = runtime_of(fleet(two_models()))
    serving = two_models()
    del serving["s0"]  # the small model loses a cluster ...
    serving["s9"] = [SMALL]  # ... and gains another
    serving["b0"] = [BIG]
    after = runtime_of(fleet(serving))
    assert placed_primaries(before, BIG) == placed_primaries(after, BIG)


def test_removing_a_models_cluster_moves_only_its_sessions_to_their_secondary() -> None:
    before = placed_primaries(runtime_of(fleet(two_models())), BIG)
    serving = two_models()
    del serving["b2"]
    after = placed_primaries(runtime_of(fleet(serving)), BIG)
    moved = [p for p in before if before[p][0] != after[p][0]]
    assert all(before[p][0] == "b2" for p in moved)  # only b2's sessions moved ...
    assert all(after[p][0] == before[p][1] for p in moved)  # ... each to its planned secondary
    share = len(moved) / KEYS
    assert 1 / 6 * 0.9 < share < 1 / 6 * 1.1, share  # ≈ 1/N of the model's sessions


def test_adding_a_cluster_to_a_model_takes_about_one_nth() -> None:
    before = placed_primaries(runtime_of(fleet(two_models())), BIG)
    serving = two_models()
    serving["b6"] = [BIG]
    after = placed_primaries(runtime_of(fleet(serving)), BIG)
    moved = [p for p in before if before[p][0] != after[p][0]]
    assert all(after[p][0] == "b6" for p in moved)
    assert 1 / 7 * 0.9 < len(moved) / KEYS < 1 / 7 * 1.1


def test_placement_is_intersected_with_the_class_eligible_set() -> None:
    data = fleet(
        two_models(),
        classes=[
            {"name": "short", "max_input_tokens": 2048, "eligible": ["b0", "b1", "s0"]},
            {"name": "long"},
        ],
    )
    runtime = runtime_of(data)
    for i in range(100):
        big = runtime.policy.place(facts(runtime, BIG, f"e-{i}"))
        small = runtime.policy.place(facts(runtime, SMALL, f"e-{i}"))
        assert not isinstance(big, (UnknownModel, ModelUnavailable))
        assert {big.placement.primary, big.placement.secondary} == {"b0", "b1"}
        # One small cluster in the class: no secondary.
        assert not isinstance(small, (UnknownModel, ModelUnavailable))
        assert (small.placement.primary, small.placement.secondary) == ("s0", None)


def test_aliases_resolve_to_their_model_and_share_its_placement() -> None:
    serving: dict[str, list[Any]] = {
        "c1": [{"name": BIG, "aliases": ["big"]}],
        "c2": [{"name": BIG, "aliases": ["big"]}],
        "c3": [SMALL],
    }
    runtime = runtime_of(fleet(serving))
    for i in range(50):
        by_name = runtime.policy.place(facts(runtime, BIG, f"a-{i}"))
        by_alias = runtime.policy.place(facts(runtime, "big", f"a-{i}"))
        assert by_name == by_alias


def test_an_adapter_prefers_the_clusters_where_it_is_loaded() -> None:
    lora = {"name": BIG, "adapters": ["sql-lora"]}
    serving: dict[str, list[Any]] = {
        "b0": [BIG],
        "b1": [lora],
        "b2": [BIG],
        "b3": [lora],
        "s0": [SMALL],
    }
    runtime = runtime_of(fleet(serving))
    primaries: Counter[str] = Counter()
    for i in range(400):
        route = runtime.policy.place(facts(runtime, "sql-lora", f"l-{i}"))
        assert not isinstance(route, (UnknownModel, ModelUnavailable))
        assert route.model == "sql-lora"
        assert {route.placement.primary, route.placement.secondary} == {"b1", "b3"}
        primaries[route.placement.primary] += 1
    assert min(primaries.values()) > 150, primaries  # both loaded clusters take sessions
    # Loaded on one cluster only: it is the primary, the secondary another base cluster.
    serving["b3"] = [BIG]
    runtime = runtime_of(fleet(serving))
    for i in range(100):
        route = runtime.policy.place(facts(runtime, "sql-lora", f"l-{i}"))
        assert not isinstance(route, (UnknownModel, ModelUnavailable))
        assert route.placement.primary == "b1"
        assert route.placement.secondary in {"b0", "b2", "b3"}
    assert not isinstance(route, (UnknownModel, ModelUnavailable))
    ranked = runtime.policy.placer(route).ranked(1234)
    assert ranked[0] == "b1" and sorted(ranked[1:]) == ["b0", "b2", "b3"]


def test_a_declared_adapter_runs_on_its_base_clusters() -> None:
    runtime = runtime_of(fleet(two_models(), models=[{"name": "chat-lora", "base": SMALL}]))
    route = runtime.policy.place(facts(runtime, "chat-lora", "d"))
    assert not isinstance(route, (UnknownModel, ModelUnavailable))
    assert route.placement.primary.startswith("s")


def test_unknown_and_missing_models_are_refused() -> None:
    runtime = runtime_of(fleet(two_models()))
    assert runtime.policy.place(facts(runtime, "gpt-9", "u")) == UnknownModel("gpt-9")
    assert runtime.policy.place(facts(runtime, None, "u")) == UnknownModel("")
    with pytest.raises(LookupError, match="gpt-9"):
        runtime.policy.route(facts(runtime, "gpt-9", "u"))


def test_a_declared_model_without_clusters_is_unavailable_not_unknown() -> None:
    runtime = runtime_of(fleet(two_models(), models=[{"name": "llama-405b"}]))
    miss = runtime.policy.place(facts(runtime, "llama-405b", "x"))
    assert miss == ModelUnavailable("llama-405b", "short", 5)
    # Not in the /v1/models union: nothing serves it.
    assert [m.name for m in runtime.policy.models.served()] == [BIG, SMALL]


def decide(runtime: Runtime, model: str | None, path: str = "/v1/chat/completions") -> object:
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(CollectorRegistry()))
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if model is not None:
        body["model"] = model
    headers = {":method": "POST", ":path": path, "content-type": "application/json"}
    return asyncio.run(pipeline.decide(headers, orjson.dumps(body), 0.0))


def test_the_pipeline_answers_404_400_503_in_the_apis_format() -> None:
    runtime = runtime_of(fleet(two_models(), models=[{"name": "llama-405b"}]))
    openai = decide(runtime, "gpt-9")
    assert openai == BadRequest(
        404, "The model `gpt-9` does not exist", "model_not_found", ErrorStyle.OPENAI, "model"
    )
    anthropic = decide(runtime, "claude-9", "/v1/messages")
    assert isinstance(anthropic, BadRequest) and anthropic.status == 404
    assert anthropic.style.value == "anthropic"
    missing = decide(runtime, None)
    assert isinstance(missing, BadRequest) and missing.status == 400 and missing.param == "model"
    unavailable = decide(runtime, "llama-405b")
    assert isinstance(unavailable, Unavailable)
    assert unavailable.miss.retry_after_s == 5
    routed = decide(runtime, SMALL)
    assert isinstance(routed, Routed) and routed.route.placement.primary.startswith("s")


def config_problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "test.yaml")
    return info.value.problems


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            fleet({"c1": [BIG], "c2": []}),
            "clusters[1].models: required when any cluster lists models (clusters[0] does)",
        ),
        (
            fleet(
                {"c1": [{"name": BIG, "aliases": ["x"]}], "c2": [{"name": SMALL, "aliases": ["x"]}]}
            ),
            "clusters[1].models[0].aliases[0]: 'x' is already the alias of 'llama-70b' at "
            "clusters[0].models[0].aliases[0]",
        ),
        (
            fleet({"c1": [BIG, {"name": SMALL, "aliases": [BIG]}]}),
            "clusters[0].models[1].aliases[0]: 'llama-70b' is already the model of 'llama-70b' "
            "at clusters[0].models[0]",
        ),
        (
            fleet(
                {
                    "c1": [{"name": BIG, "adapters": ["l"]}],
                    "c2": [{"name": SMALL, "adapters": ["l"]}],
                }
            ),
            "clusters[1].models[0].adapters[0]: 'l' is already the adapter of 'llama-70b' at "
            "clusters[0].models[0].adapters[0]",
        ),
        (
            fleet({"c1": [BIG]}, models=[{"name": "m", "budgets": {"nope": {}}}]),
            "models[0].budgets.nope: no class named 'nope'",
        ),
        (
            {
                "version": 1,
                "clusters": [{"name": "c1", "endpoints": ["h:1"]}],
                "models": [{"name": "m"}],
            },
            "models: needs clusters that list the models they serve (clusters[].models)",
        ),
    ],
)
def test_ambiguous_model_names_are_refused_with_their_path(
    data: dict[str, Any], expected: str
) -> None:
    assert expected in config_problems(data)


def listing(runtime: Runtime, path: str, **headers: str) -> object:
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(CollectorRegistry()))
    return asyncio.run(pipeline.decide({":method": "GET", ":path": path, **headers}, None, 0.0))


def test_v1_models_lists_the_union_of_what_clusters_serve() -> None:
    serving: dict[str, list[Any]] = {
        "c1": [{"name": "org/Big-70B", "aliases": ["big"], "adapters": ["sql-lora"]}],
        "c2": ["small"],
    }
    runtime = runtime_of(fleet(serving, models=[{"name": "planned-405b"}]))
    answer = listing(runtime, "/v1/models")
    assert isinstance(answer, ModelList)
    doc = orjson.loads(answer.body)
    assert doc["object"] == "list"
    by_id = {m["id"]: m for m in doc["data"]}
    # The declared model no cluster serves is not listed.
    assert sorted(by_id) == ["big", "org/Big-70B", "small", "sql-lora"]
    assert by_id["big"]["root"] == "org/Big-70B"
    assert by_id["sql-lora"]["parent"] == "org/Big-70B"
    assert all(m["object"] == "model" for m in doc["data"])
    one = listing(runtime, "/v1/models/org%2FBig-70B?x=1")
    assert isinstance(one, ModelList) and orjson.loads(one.body)["id"] == "org/Big-70B"
    missing = listing(runtime, "/v1/models/nope")
    assert isinstance(missing, BadRequest) and missing.status == 404
    anthropic = listing(runtime, "/v1/models", **{"anthropic-version": "2023-06-01"})
    assert isinstance(anthropic, ModelList)
    adoc = orjson.loads(anthropic.body)
    assert adoc["first_id"] == "big" and adoc["has_more"] is False
    assert {m["type"] for m in adoc["data"]} == {"model"}
    # A model-agnostic fleet passes /v1/models through to a cluster, as before.
    agnostic = runtime_of({"version": 1, "clusters": [{"name": "c1", "endpoints": ["h:1"]}]})
    assert isinstance(listing(agnostic, "/v1/models"), Passthrough)


def test_a_models_own_class_budget_is_its_own_compartment() -> None:
    data = fleet(
        two_models(),
        classes=[
            {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 8}},
            {"name": "long"},
        ],
        models=[{"name": BIG, "budgets": {"short": {"max_concurrent": 2}}}],
    )
    runtime = runtime_of(data)
    big = runtime.policy.route(facts(runtime, BIG, "b"))
    small = runtime.policy.route(facts(runtime, SMALL, "b"))
    assert big.request_class.name == f"short@{BIG}" and big.request_class.budget.max_concurrent == 2
    assert small.request_class.name == "short" and small.request_class.budget.max_concurrent == 8
    assert runtime.policy.class_named(f"short@{BIG}") == big.request_class
    compartment = runtime.policy.clusters_of(big.request_class, runtime.cluster_names)
    assert sorted(compartment) == [f"b{i}" for i in range(6)]
    # Its largest request must fit, as for a class's own budget.
    data["models"] = [{"name": BIG, "budgets": {"short": {"max_inflight_tokens": 100}}}]
    assert (
        "models[0].budgets.short.max_inflight_tokens: must be >= max_input_tokens - 1 (2047) "
        "or the largest requests of the class never fit"
    ) in config_problems(data)


def test_a_models_prices_cost_its_usage_and_the_fleet_prices_are_the_default() -> None:
    data = fleet(
        two_models(),
        processor={"inspect_usage": True},
        models=[{"name": BIG, "prices": {"cached_input": 1, "uncached_input": 10, "output": 100}}],
    )
    runtime = runtime_of(data)
    registry = CollectorRegistry()
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry))
    usage = orjson.dumps({"usage": {"prompt_tokens": 1000, "completion_tokens": 10}})
    costs = {}
    for model in (BIG, SMALL):
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "x"}]})
        headers = {
            ":method": "POST",
            ":path": "/v1/chat/completions",
            "content-type": "application/json",
        }
        routed = asyncio.run(pipeline.decide(headers, body, 0.0))
        assert isinstance(routed, Routed) and routed.hold.usage_model == model
        cluster = routed.route.placement.primary
        asyncio.run(pipeline.observe_response_body(routed.hold, usage, True, 0.0))
        costs[model] = registry.get_sample_value(
            "fleet_token_cost_dollars_total", {"cluster": cluster, "model": model}
        )
    # $ per million tokens: 1000 uncached input + 10 output.
    assert costs[BIG] == pytest.approx((1000 * 10 + 10 * 100) / 1e6)
    assert costs[SMALL] == pytest.approx((1000 * 3.0 + 10 * 15.0) / 1e6)


def test_discovered_models_add_to_the_configured_floor() -> None:
    serving: dict[str, list[Any]] = {
        "c1": [{"name": BIG, "aliases": ["big"]}],
        "c2": [BIG],
        "c3": [SMALL],
    }
    runtime = runtime_of(fleet(serving, model_routing={"discovery": True}))
    found = {
        # c1 lists only an alias of its model and a new adapter of it (vLLM's parent field):
        # its configured model stays (the floor), the adapter is loaded there.
        "c1": frozenset({("big", None), ("sql-lora", BIG)}),
        # c2 lists nothing (down): it keeps its configured model.
        "c2": frozenset(),
        # c3 lists a model the config does not know, and the big model under its alias.
        "c3": frozenset({(SMALL, None), ("new-model", None), ("big", None)}),
    }
    grown = with_discovered_models(runtime, found)
    models = grown.policy.models
    assert set(models.models) == {BIG, SMALL, "new-model", "sql-lora"}
    assert models.models[BIG].clusters == ("c1", "c2", "c3")
    assert models.models["sql-lora"].loaded == ("c1",)
    assert models.models["new-model"].clusters == ("c3",)
    route = grown.policy.place(facts(grown, "new-model", "n"))
    assert not isinstance(route, (UnknownModel, ModelUnavailable))
    assert route.placement.primary == "c3"
    # The cost metrics' model label: fleet.yaml's models by name, discovery's as "other"
    # (an endpoint may list any number of names), the empty model as itself.
    assert grown.model_label(BIG) == BIG and grown.model_label("sql-lora") == "other"
    assert grown.model_label("new-model") == "other" and grown.model_label("") == ""
    # Applied again with nothing found: back to the configured lists exactly.
    assert with_discovered_models(grown, {}).policy.models == runtime.policy.models
    # Off: the runtime is returned untouched.
    plain = runtime_of(fleet(serving))
    assert with_discovered_models(plain, found) is plain


def test_model_lists_are_parsed_defensively() -> None:
    body = orjson.dumps(
        {"object": "list", "data": [{"id": "a"}, {"id": "l", "parent": "a"}, {"id": 3}, "x"]}
    )
    assert parse_model_list(body) == frozenset({("a", None), ("l", "a")})
    assert parse_model_list(b"not json") is None
    assert parse_model_list(b'{"data": 1}') is None
    assert parse_model_list(b"[]") is None


def test_discovery_needs_a_configured_floor() -> None:
    data = {
        "version": 1,
        "clusters": [{"name": "c1", "endpoints": ["h:1"]}],
        "model_routing": {"discovery": True},
    }
    assert (
        "model_routing.discovery: needs clusters[].models (the floor discovery adds to)"
        in config_problems(data)
    )


def test_a_model_aware_fleet_never_decides_at_headers() -> None:
    # The model is in the body: deciding on the headers (a trusted session header, the
    # default read_body: when_needed) would place every request as if it named no model.
    headers = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
        "x-session-id": "h",
        "content-length": "64",
    }
    aware = runtime_of(fleet(two_models()))
    agnostic = runtime_of({"version": 1, "clusters": [{"name": "c1", "endpoints": ["h:1"]}]})
    assert aware.decide_at_headers and agnostic.decide_at_headers
    for runtime, decided in ((aware, False), (agnostic, True)):
        pipeline = Pipeline(RuntimeHolder(runtime), Metrics(CollectorRegistry()))
        outcome = asyncio.run(pipeline.decide_headers(headers, 0.0))
        assert (outcome is not None) == decided, outcome

"""A multi-model fleet through a real Envoy: simulated clusters that serve different models
(each answers vLLM's 404 for any other), clients on the official ``openai`` and ``anthropic``
SDKs and on plain HTTP.

c1, c2 serve "big" (alias "big-latest"); c3 serves "big" and "small"; c4 serves "small" and
"tiny", so c4 is tiny's only cluster. "huge" is declared fleet-wide but no cluster serves it.
Model discovery is on: c2 later starts serving "extra", which fleet.yaml does not list. The last
test removes c4, so it runs last. The first test runs its own fleet in the pool data path
(endpoint-picker mode), where each model has its own Envoy pool.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import anthropic
import openai
import orjson
import pytest

from extproc.config import load_runtime
from extproc.core.models import model_pool_name
from extproc.harness.launch import FleetStack, SimSpec, wait_until
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.predict import PURE_HASH, placement_for

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
SERVING = {
    "c1": ["big"],
    "c2": ["big"],
    "c3": ["big", "small"],
    "c4": ["small", "tiny"],
}


@pytest.fixture(scope="module")
def models_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    big = {"name": "big", "aliases": ["big-latest"]}
    stack = FleetStack(
        tmp_path_factory.mktemp("models"),
        clusters=4,
        cluster_models={"c1": [big], "c2": [big], "c3": [big, "small"], "c4": ["small", "tiny"]},
        fleet_overrides={
            "models": [{"name": "huge"}, {"name": "tiny"}],
            "model_routing": {"discovery": True, "discovery_interval_s": 0.5},
            # Pure hashing predicts first turns (no balance spills): tests model routing.
            "affinity": PURE_HASH,
        },
    )
    with stack:
        yield stack


def body(model: str, session: int, turn: int) -> bytes:
    messages = [
        {"role": "user", "content": f"session {session} turn {t}: why?"} for t in range(turn + 1)
    ]
    return orjson.dumps({"model": model, "messages": messages, "max_tokens": 2})


def sdk_clients(stack: FleetStack) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    """The official SDKs pointed at the stack's Envoy, without their own retries."""
    base = f"http://127.0.0.1:{stack.listener_port}"
    return (
        openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0),
        anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0),
    )


def serving_clusters(model: str) -> set[str]:
    return {name for name, models in SERVING.items() if model in models}


@pytest.fixture(params=["file", "xds"])
def pooled_models(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetStack]:
    # The linear-scale (pool) data path: the processor names the endpoints, and in a
    # model-aware fleet routes each request to its model's own pool. Every pool takes its
    # endpoints by EDS: from a file of its own beside the CDS file, or from the processor's
    # gRPC xDS server.
    stack = FleetStack(
        tmp_path_factory.mktemp(f"pooled-models-{request.param}"),
        clusters=3,
        cluster_models={"c1": ["big"], "c2": ["big"], "c3": ["small"]},
        # Pure hashing predicts first turns (no balance spills): tests model routing.
        fleet_overrides={"processor": {"mode": "endpoint_picker"}, "affinity": PURE_HASH},
        dynamic_cds=request.param == "file",
        xds_cds=request.param == "xds",
    )
    with stack:
        yield stack


def test_pool_mode_routes_each_model_through_its_own_pool(
    pooled_models: FleetStack, make_client: MakeClient
) -> None:
    stack = pooled_models
    client = make_client(stack.listener_port)
    pools = {m: model_pool_name(m) for m in ("big", "small")}
    pooled_serving = {"big": {"c1", "c2"}, "small": {"c3"}}

    def sent_to(pool: str) -> int:
        return stack.envoy_stat(f"cluster.{pool}.upstream_rq_total")

    before = {m: sent_to(p) for m, p in pools.items()}
    everyone = stack.envoy_stat("cluster.all_clusters.upstream_rq_total")
    counts: collections.Counter[str] = collections.Counter()
    for session in range(12):
        for model in ("big", "small"):
            status, hdrs, data = client.post_json(CHAT, body(model, session, 0))
            assert status == 200, (model, data, dump_logs(stack))
            assert hdrs["x-served-by"] in pooled_serving[model]
            counts[model] += 1
    # Envoy counted every request in its model's pool, none in the pool of every endpoint.
    for model, pool in pools.items():
        assert sent_to(pool) - before[model] == counts[model], (model, pool)
    assert stack.envoy_stat("cluster.all_clusters.upstream_rq_total") == everyone
    # Each pool got its endpoints by EDS (no inline endpoints in the CDS resources), exactly
    # its model's; only the pool of every endpoint runs active health checks (each endpoint is
    # checked once, not once per pool it is in).
    hosts: dict[str, set[str]] = collections.defaultdict(set)
    for cluster, address in stack.host_health():
        hosts[cluster].add(address)
    for model, pool in pools.items():
        mine = {stack.engine_address(e) for c in pooled_serving[model] for e in stack.engines_of(c)}
        assert hosts[pool] == mine, (model, hosts)
        assert stack.envoy_stat(f"cluster.{pool}.update_success") >= 1, pool
        assert stack.envoy_stat(f"cluster.{pool}.health_check.attempt") == 0, pool
    assert stack.envoy_stat("cluster.all_clusters.health_check.attempt") > 0
    # An engine of big killed under sequential traffic: Envoy tries the named endpoint, the
    # connection is refused, and the retry takes the next named one (the secondary's): no
    # request fails, though the big pool does not health-check it.
    stack.sims["c1"].kill()
    for session in range(12):
        status, hdrs, data = client.post_json(CHAT, body("big", session, 1))
        assert status == 200, (data, dump_logs(stack))
        assert hdrs["x-served-by"] == "c2"


def test_every_request_lands_on_a_cluster_serving_its_model_and_sticks(
    models_fleet: FleetStack, make_client: MakeClient
) -> None:
    runtime = load_runtime(models_fleet.fleet_path)
    client = make_client(models_fleet.listener_port)
    served: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    spread: dict[str, set[str]] = collections.defaultdict(set)
    for session in range(16):
        headers = {"x-session-id": f"m-{session}"}
        for model in ("big", "big-latest", "small", "tiny"):
            for turn in range(3):
                payload = body(model, session, turn)
                status, hdrs, data = client.post_json(CHAT, payload, headers)
                assert status == 200, (model, data, dump_logs(models_fleet))
                where = hdrs["x-served-by"]
                assert where in serving_clusters("big" if model == "big-latest" else model)
                assert where == placement_for(runtime, CHAT, payload, headers).primary
                served[(model, session)].add(where)
                spread[model].add(where)
    # Stickiness per model: one cluster per (model, session) over its turns; the alias is
    # the same model, so a session lands where it does under the canonical name.
    assert all(len(where) == 1 for where in served.values()), served
    assert all(served[("big", s)] == served[("big-latest", s)] for s in range(16))
    # Each model's sessions spread over all of its clusters.
    assert spread["big"] == {"c1", "c2", "c3"} and spread["small"] == {"c3", "c4"}


def test_an_unknown_model_gets_404_in_each_apis_format(models_fleet: FleetStack) -> None:
    oai, ant = sdk_clients(models_fleet)
    with pytest.raises(openai.NotFoundError) as found:
        oai.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert found.value.status_code == 404
    assert found.value.code == "model_not_found"
    assert found.value.body == {
        "message": "The model `gpt-nope` does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(anthropic.NotFoundError) as missing:
        ant.messages.create(
            model="claude-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert missing.value.status_code == 404
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `claude-nope` does not exist"},
    }


def test_v1_models_lists_the_union_of_the_fleet(models_fleet: FleetStack) -> None:
    oai, ant = sdk_clients(models_fleet)
    listed = {m.id: m for m in oai.models.list()}
    # Not "huge": declared, but no cluster serves it.
    assert sorted(listed) == ["big", "big-latest", "small", "tiny"]
    assert oai.models.retrieve("small").id == "small"
    assert sorted(m.id for m in ant.models.list()) == ["big", "big-latest", "small", "tiny"]


def test_a_declared_model_without_clusters_gets_503_with_a_retry_hint(
    models_fleet: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(models_fleet.listener_port)
    status, hdrs, data = client.post_json(CHAT, body("huge", 0, 0))
    assert status == 503, data
    assert hdrs["retry-after"] == "5"
    assert orjson.loads(data)["error"]["code"] == "model_unavailable"


def test_a_model_an_endpoint_starts_listing_is_discovered_and_routed(
    models_fleet: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(models_fleet.listener_port)
    assert client.post_json(CHAT, body("extra", 0, 0))[0] == 404
    # c2's engine now also serves "extra" (fleet.yaml does not say so).
    spec = models_fleet.sim_specs["c2"]
    models_fleet.sim_specs["c2"] = SimSpec(
        "c2", spec.port, (*spec.args[:-1], "big,big-latest,extra")
    )
    models_fleet.restart_sim("c2")

    def extra_routed() -> bool:
        return client.post_json(CHAT, body("extra", 0, 0))[0] == 200

    wait_until(extra_routed, 20, f"discovery of extra:\n{dump_logs(models_fleet)}", 0.2)
    for session in range(6):
        status, hdrs, _ = client.post_json(CHAT, body("extra", session, 0))
        assert status == 200 and hdrs["x-served-by"] == "c2"
    # The floor stays: c2 still serves big, and the union lists the new model.
    status, hdrs, _ = client.post_json(CHAT, body("big", 0, 0), {"x-session-id": "m-0"})
    assert status == 200
    status, _, data = client.request("GET", "/v1/models")
    assert "extra" in [m["id"] for m in orjson.loads(data)["data"]]


def test_removing_the_last_cluster_of_a_model_gives_503(
    models_fleet: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(models_fleet.listener_port)
    headers = {"x-session-id": "last"}
    assert client.post_json(CHAT, body("tiny", 1, 0), headers)[0] == 200
    # c4's engine dies, fleet.yaml unchanged and no probing (processor.probe_clusters off):
    # the processor still places tiny on c4 and Envoy answers its own 503 (no upstream). It
    # comes as a JSON error both SDKs read, with the same retry hint as the processor's 503.
    models_fleet.sims["c4"].kill()
    oai, ant = sdk_clients(models_fleet)
    with pytest.raises(openai.InternalServerError) as down:
        oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert down.value.status_code == 503
    assert down.value.response.headers["retry-after"] == "5"
    assert down.value.response.headers["content-type"] == "application/json"
    error = orjson.loads(down.value.response.content)["error"]
    assert error["type"] == "gateway_error" and error["message"], error
    with pytest.raises(anthropic.InternalServerError) as ant_down:
        ant.messages.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert ant_down.value.status_code == 503
    assert ant_down.value.response.headers["retry-after"] == "5"
    assert orjson.loads(ant_down.value.response.content)["type"] == "error"
    models_fleet.remove_cluster("c4")

    def tiny_refused() -> bool:
        # The processor's 503, not Envoy's for the stopped c4 before the reload was applied.
        status, _, data = client.post_json(CHAT, body("tiny", 1, 0), headers)
        return status == 503 and b"model_unavailable" in data

    wait_until(tiny_refused, 20, f"the reload to drop c4:\n{dump_logs(models_fleet)}", 0.2)
    status, hdrs, data = client.post_json(MESSAGES, body("tiny", 1, 0), headers)
    assert status == 503 and hdrs["retry-after"] == "5"
    assert orjson.loads(data)["type"] == "error"
    # The model's other clusters and the other models are untouched: small now only on c3.
    for session in range(8):
        status, hdrs, _ = client.post_json(CHAT, body("small", session, 0))
        assert status == 200 and hdrs["x-served-by"] == "c3"

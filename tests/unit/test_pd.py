"""Disaggregated prefill/decode: the prefill choice (extproc.core.pd) and its config."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.config import ConfigError, compile_runtime, parse_config
from extproc.core.admission import Reject
from extproc.core.pd import (
    COLOCATED,
    CROSS,
    PrefillEndpoint,
    PrefillParams,
    Topology,
    choose_prefill,
)
from extproc.ledger.gate import build_gate
from extproc.ledger.tenant_limits import TenantLimits
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Rejected, Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder

TOPO = Topology(("nvlink", "island"), (900e9, 50e9), 12.5e9)
PARAMS = PrefillParams(saturation_factor=1.25, min_inflight=4)


def ep(address: str, nvlink: str | None, island: str | None) -> PrefillEndpoint:
    return PrefillEndpoint(address, f"p-{address}", (nvlink, island))


POOL = (
    ep("a1:1", "nvl-a", "ib-1"),
    ep("a2:1", "nvl-a", "ib-1"),
    ep("b1:1", "nvl-b", "ib-1"),
    ep("b2:1", "nvl-b", "ib-1"),
    ep("c1:1", "nvl-c", "ib-2"),
    ep("c2:1", "nvl-c", "ib-2"),
)
DECODE_A = ("nvl-a", "ib-1")


def choose(
    labels: tuple[str | None, ...] = DECODE_A,
    point: int = 7,
    inflight: dict[str, int] | None = None,
    ready: frozenset[str] | None = None,
    params: PrefillParams = PARAMS,
) -> Any:
    return choose_prefill(labels, POOL, point, inflight or {}, ready, TOPO, params)


def test_relation_is_the_narrowest_shared_level() -> None:
    assert TOPO.relation(("nvl-a", "ib-1"), ("nvl-a", "ib-1")) == 0
    assert TOPO.relation(("nvl-a", "ib-1"), ("nvl-b", "ib-1")) == 1
    assert TOPO.relation(("nvl-a", "ib-1"), ("nvl-c", "ib-2")) == 2
    # A missing label shares nothing at that level.
    assert TOPO.relation((None, "ib-1"), (None, "ib-1")) == 1
    assert TOPO.relation_name(2) == CROSS
    # 1.34 GB (70B GQA, 4k tokens) in 1.5 ms over NVLink, 27 ms in the island, 107 ms across.
    kv = 4096 * 327_680
    assert TOPO.transfer_s(kv, 0) == pytest.approx(kv / 900e9)
    assert TOPO.transfer_s(kv, 1) == pytest.approx(0.0268, abs=1e-3)
    assert TOPO.transfer_s(kv, 2) == pytest.approx(0.107, abs=1e-3)


def test_prefill_stays_in_the_decode_targets_nvlink_domain_and_follows_the_prefix() -> None:
    picks = collections.Counter(choose(point=p).address for p in range(400))
    assert set(picks) == {"a1:1", "a2:1"}
    # Both members of the domain get a share (the hash spreads prefixes) ...
    assert min(picks.values()) > 120
    # ... and one prefix always lands on the same prefiller (its prefix cache).
    assert {choose(point=12345).address for _ in range(5)} == {choose(point=12345).address}
    assert choose().relation == "nvlink"
    assert choose().reason == "affinity"


def test_fallback_order_nvlink_then_island_then_cross_then_colocated() -> None:
    ready = frozenset({"b1:1", "b2:1", "c1:1", "c2:1"})
    first = choose(ready=ready)
    assert first.address in {"b1:1", "b2:1"}
    assert (first.relation, first.reason) == ("island", "fallback")
    other = choose(ready=frozenset({"c1:1", "c2:1"}))
    assert (other.relation, other.reason) == (CROSS, "fallback")
    none = choose(ready=frozenset())
    assert none.endpoint is None and none.address is None
    assert (none.relation, none.reason) == (COLOCATED, "none")
    # Cross-island prefill off: colocated instead of the slowest link.
    island_only = PrefillParams(cross_island=False)
    assert choose(ready=frozenset({"c1:1"}), params=island_only).relation == COLOCATED


def test_a_saturated_hashed_prefiller_yields_to_the_least_loaded_in_the_island() -> None:
    hashed = choose(point=99).address
    other = "a2:1" if hashed == "a1:1" else "a1:1"
    # Below min_inflight (4 here): load is not looked at.
    assert choose(point=99, inflight={hashed: 3}).address == hashed
    # Saturated: the least loaded candidate of the island, narrowest level first on a tie.
    busy = choose(point=99, inflight={hashed: 6, other: 1, "b1:1": 1, "b2:1": 1})
    assert (busy.address, busy.reason, busy.relation) == (other, "load", "nvlink")
    spill = choose(point=99, inflight={hashed: 6, other: 6, "b1:1": 1, "b2:1": 2})
    assert (spill.address, spill.reason, spill.relation) == ("b1:1", "load", "island")
    # Equal load is not saturation: the prefix keeps its prefiller.
    same = {e.address: 6 for e in POOL}
    assert choose(point=99, inflight=same).address == hashed
    # Load never leaves the island: idle cross-island prefillers do not count.
    far_idle = {hashed: 6, other: 6, "b1:1": 6, "b2:1": 6}
    assert choose(point=99, inflight=far_idle).relation == "nvlink"
    # The processor's default: one prefill in flight is a queue; an idle island peer takes it.
    eager = PrefillParams()
    assert choose(point=99, inflight={hashed: 1}, params=eager).address == other


def test_a_decode_target_without_labels_takes_any_prefiller() -> None:
    choice = choose(labels=(None, None))
    assert choice.relation == CROSS and choice.address is not None
    assert choice.reason == "affinity"


# -- config ---------------------------------------------------------------------------------


def pd_config(**class_overrides: Any) -> dict[str, Any]:
    long: dict[str, Any] = {"name": "long", "disaggregated": True, **class_overrides}
    return {
        "version": 1,
        "topology": {
            "levels": [
                {"name": "nvlink", "gbytes_per_s": 900},
                {"name": "island", "gbytes_per_s": 50},
            ],
            "cross_gbytes_per_s": 12.5,
        },
        "clusters": [
            {
                "name": "d1",
                "endpoints": ["127.0.0.1:8001"],
                "role": "decode",
                "topology": {"nvlink": "nvl-a", "island": "ib-1"},
            },
            {
                "name": "d2",
                "endpoints": ["127.0.0.1:8002"],
                "role": "decode",
                "topology": {"nvlink": "nvl-c", "island": "ib-2"},
            },
            {
                "name": "p1",
                "endpoints": ["127.0.0.1:8101", "127.0.0.1:8102"],
                "role": "prefill",
                "topology": {"nvlink": "nvl-a", "island": "ib-1"},
            },
            {
                "name": "p2",
                "endpoints": ["127.0.0.1:8201"],
                "role": "prefill",
                "topology": {"nvlink": "nvl-c", "island": "ib-2"},
            },
        ],
        "classes": [{"name": "short", "max_input_tokens": 2048}, long],
    }


def test_prefill_clusters_take_no_sessions_and_form_the_pool() -> None:
    runtime = compile_runtime(parse_config(pd_config(), "t.yaml"))
    assert runtime.pd is not None
    for placer in runtime.policy.placers.values():
        assert set(placer.names) == {"d1", "d2"}
    pool = runtime.pd.pools["long"]
    assert [e.address for e in pool] == ["127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8201"]
    assert "short" not in runtime.pd.pools
    assert runtime.pd.prefill_classes["long"].name == "long/prefill"
    assert runtime.pd.topology.bandwidth(1) == 50e9
    choice = runtime.pd.choose("long", "d2", 5, {}, None)
    assert choice is not None and choice.address == "127.0.0.1:8201"
    assert runtime.pd.choose("short", "d2", 5, {}, None) is None


def test_without_a_disaggregated_class_there_is_no_pd_plan() -> None:
    cfg = pd_config()
    cfg["classes"][1]["disaggregated"] = False
    assert compile_runtime(parse_config(cfg, "t.yaml")).pd is None


def problems(cfg: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(cfg, "t.yaml")
    return info.value.problems


def test_pd_config_errors_name_the_field() -> None:
    cfg = pd_config()
    cfg["clusters"][0]["topology"]["rack"] = "r1"
    assert any(
        p.startswith("clusters[0].topology.rack: not a topology level") for p in problems(cfg)
    )
    cfg = pd_config(eligible=["p1"])
    assert any(
        p.startswith("classes[1].eligible[0]: 'p1' is a prefill-only") for p in problems(cfg)
    )
    cfg = pd_config(prefill_eligible=["d1", "nope"])
    found = problems(cfg)
    assert any(
        p.startswith("classes[1].prefill_eligible[0]: 'd1' has role 'decode'") for p in found
    )
    assert any(p.startswith("classes[1].prefill_eligible[1]: no cluster named") for p in found)
    cfg = pd_config()
    cfg["classes"][0]["prefill_eligible"] = ["p1"]
    assert any("need disaggregated: true" in p for p in problems(cfg))
    cfg = pd_config()
    for c in cfg["clusters"]:
        c["role"] = "both" if c["role"] == "prefill" else c["role"]
    assert "classes[1].disaggregated: no cluster has role 'prefill'" in problems(cfg)
    cfg = pd_config()
    cfg["clusters"] = [c for c in cfg["clusters"] if c["role"] == "prefill"]
    assert any(p.startswith("clusters: every cluster is prefill-only") for p in problems(cfg))
    cfg = pd_config()
    cfg["classes"][0] = {
        "name": "short",
        "max_input_tokens": 2048,
        "disaggregated": True,
        "prefill_budget": {"max_inflight_tokens": 100},
    }
    assert any(p.startswith("classes[0].prefill_budget.max_inflight_tokens") for p in problems(cfg))


# -- the pipeline -----------------------------------------------------------------------------


def chat(text: str, session: str) -> tuple[dict[str, str], bytes]:
    headers = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
        "x-session-id": session,
    }
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    return headers, body


def pipeline_of(cfg: dict[str, Any]) -> Pipeline:
    runtime = compile_runtime(parse_config(cfg, "t.yaml"))
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, lambda: 0.0, __import__("random").Random(1))
    return Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)


def test_pipeline_signals_an_island_prefiller_and_keeps_prefill_budget_apart() -> None:
    cfg = pd_config(prefill_budget={"max_inflight_tokens": 3000})
    pipe = pipeline_of(cfg)
    long_text = "word " * 2000  # ~2,500 tokens at 4 bytes per token: the long class

    async def run() -> None:
        outcomes = []
        for i in range(40):
            out = await pipe.decide(*chat(long_text, f"s{i}"), 0.0)
            outcomes.append(out)
        routed = [o for o in outcomes if isinstance(o, Routed)]
        rejected = [o for o in outcomes if isinstance(o, Rejected)]
        # One long prefill fits each prefill cluster's budget at a time; the rest get 429s
        # from the prefill pool while decode (unbudgeted) took every routed one.
        assert len(routed) == 2
        assert rejected and all(r.reject.status == 429 for r in rejected)
        assert {r.reject.class_name for r in rejected} == {"long/prefill"}
        assert all(r.reject.retry_after_s is not None for r in rejected)
        labels = {"d1": ("nvl-a", "ib-1"), "d2": ("nvl-c", "ib-2")}
        for r in routed:
            assert r.prefill is not None and r.prefill.endpoint is not None
            assert r.prefill.relation == "nvlink"
            assert r.prefill.endpoint.labels == labels[r.route.placement.primary]
        # Short requests are colocated (no prefiller) and unaffected by the prefill pool.
        short = await pipe.decide(*chat("hi", "s-short"), 0.0)
        assert isinstance(short, Routed) and short.prefill is None
        for r in routed:
            await pipe.release(r.hold)
            assert not r.hold.held
        again = await pipe.decide(*chat(long_text, "s0"), 0.0)
        assert isinstance(again, Routed) and again.prefill is not None
        await pipe.release(again.hold)
        assert pipe._prefill_inflight == {}

    asyncio.run(run())


def test_a_prefill_reject_gives_the_decode_reservation_back() -> None:
    cfg = pd_config(budget={"max_concurrent": 1}, prefill_budget={"max_inflight_tokens": 2})
    cfg["classes"][1].pop("max_input_tokens", None)
    pipe = pipeline_of(cfg)

    async def run() -> None:
        gate = pipe.gate
        assert gate is not None
        # A long prompt can never fit the prefill pool's 2 tokens: a 413 from the prefill pool,
        # after the decode pool had admitted it ...
        out = await pipe.decide(*chat("word " * 3000, "s1"), 0.0)
        assert isinstance(out, Rejected) and out.reject.class_name == "long/prefill"
        assert isinstance(out.reject, Reject) and out.reject.status == 413
        # ... and gave its decode slot back.
        assert gate.held == 0

    asyncio.run(run())


def test_a_prefill_reject_gives_the_tenant_its_slot_and_tokens_back() -> None:
    # Without Redis the tenant is charged before the decode budget; the prefill pool then
    # refuses (a 413: 2 tokens): the request was not served, so its tenant keeps nothing.
    cfg = pd_config(budget={"max_concurrent": 1}, prefill_budget={"max_inflight_tokens": 2})
    cfg["classes"][1].pop("max_input_tokens", None)
    rate = 100_000
    cfg["flow"] = {"tenant_header": "x-tenant", "tenant_limit": {"tokens_per_minute": rate}}
    runtime = compile_runtime(parse_config(cfg, "t.yaml"))
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, lambda: 0.0, __import__("random").Random(1))
    # The tenant counted on a clock that stands still: its bucket moves only by charges.
    still = TenantLimits(lambda: 0.0)
    pipe = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate, tenant_limits=still)

    async def run() -> None:
        headers, body = chat("word " * 3000, "s1")
        headers["x-tenant"] = "t1"
        out = await pipe.decide(headers, body, 0.0)
        assert isinstance(out, Rejected) and out.reject.class_name == "long/prefill"
        assert out.reject.status == 413
        assert gate.held == 0
        facts = out.facts
        tenant = pipe._tenant(pipe.runtime, headers, facts)
        use = still.use(tenant.key, runtime.flow.limit_for(tenant.key))
        assert use.inflight == 0 and use.bucket_tokens == rate
        # A request that is served draws from the bucket (what the refusal gave back).
        short_headers, short_body = chat("hi", "s2")
        short_headers["x-tenant"] = "t1"
        served = await pipe.decide(short_headers, short_body, 0.0)
        assert isinstance(served, Routed)
        await pipe.release(served.hold)
        use = still.use(tenant.key, runtime.flow.limit_for(tenant.key))
        assert use.inflight == 0 and use.bucket_tokens == rate - served.facts.input_tokens

    asyncio.run(run())


def test_a_502_from_the_sidecar_skips_that_prefiller_until_the_mark_expires() -> None:
    pipe = pipeline_of(pd_config())
    text = "word " * 2000

    async def run() -> None:
        first = await pipe.decide(*chat(text, "s1"), 0.0)
        assert isinstance(first, Routed) and first.prefill is not None
        dead = first.prefill.address
        assert dead is not None
        assert ":status" in pipe.response_headers_wanted(first.hold)
        pipe.observe_response(first.hold, {":status": "502"}, 1.0)
        await pipe.release(first.hold)
        again = await pipe.decide(*chat(text, "s1"), 2.0)
        assert isinstance(again, Routed) and again.prefill is not None
        assert again.prefill.address not in (None, dead)
        # Same nvlink domain: p1 has a second endpoint.
        assert again.prefill.relation == "nvlink"
        await pipe.release(again.hold)
        later = await pipe.decide(*chat(text, "s1"), 1.0 + 5.1)
        assert isinstance(later, Routed) and later.prefill is not None
        assert later.prefill.address == dead
        await pipe.release(later.hold)

    asyncio.run(run())


def test_down_endpoints_are_skipped_by_the_core() -> None:
    hashed = choose(point=3).address
    assert choose_prefill(DECODE_A, POOL, 3, {}, None, TOPO, PARAMS, frozenset({hashed})).address
    assert (
        choose_prefill(DECODE_A, POOL, 3, {}, None, TOPO, PARAMS, frozenset({hashed})).address
        != hashed
    )


def test_pooling_the_island_spreads_prefixes_over_its_nvlink_domains() -> None:
    pooled = PrefillParams(min_inflight=4, pool_tier=1)
    picks = collections.Counter(choose(point=p, params=pooled).address for p in range(400))
    assert set(picks) == {"a1:1", "a2:1", "b1:1", "b2:1"}
    relations = {choose(point=p, params=pooled).relation for p in range(400)}
    assert relations == {"nvlink", "island"}
    # The config's default pools the widest level; group_level names another one.
    runtime = compile_runtime(parse_config(pd_config(), "t.yaml"))
    assert runtime.pd is not None and runtime.pd.params.pool_tier == 1
    cfg = pd_config()
    cfg["disaggregation"] = {"group_level": "nvlink"}
    runtime = compile_runtime(parse_config(cfg, "t.yaml"))
    assert runtime.pd is not None and runtime.pd.params.pool_tier == 0
    cfg["disaggregation"] = {"group_level": "rack"}
    assert "disaggregation.group_level: 'rack' is not a topology level" in problems(cfg)


def test_explain_shows_the_prefiller_and_the_transfer_cost() -> None:
    from extproc.pipeline.explain import explain_outcome

    pipe = pipeline_of(pd_config())

    async def run() -> dict[str, object]:
        out = await pipe.preview(*chat("word " * 2000, "s1"), 0.0)
        assert isinstance(out, Routed)
        return explain_outcome(pipe.runtime, out)

    prefill = asyncio.run(run())["prefill"]
    assert isinstance(prefill, dict)
    assert prefill["relation"] == "nvlink" and prefill["reason"] == "affinity"
    assert str(prefill["endpoint"]).startswith("127.0.0.1:8")
    # ~2,500 tokens x 327,680 B over NVLink (900 GB/s): about a millisecond.
    assert 0.5 < float(str(prefill["kv_transfer_ms"])) < 2.0


def test_envoy_sends_nothing_to_prefill_clusters_by_itself() -> None:
    from extproc.render.envoy import FALLBACK_CLUSTER, render_bootstrap

    runtime = compile_runtime(parse_config(pd_config(), "t.yaml"))
    clusters = {c["name"]: c for c in render_bootstrap(runtime)["static_resources"]["clusters"]}
    fallback = clusters[FALLBACK_CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ports = {e["endpoint"]["address"]["socket_address"]["port_value"] for e in fallback}
    assert ports == {8001, 8002}  # the decode clusters only, for fail-open
    pairs = {n for n in clusters if "__" in n}
    assert pairs == {"d1__d2", "d2__d1"}


@pytest.mark.parametrize(("protocol", "marks"), [("sglang", True), ("llm-d", False)])
def test_an_sglang_decode_500_skips_that_prefiller(protocol: str, marks: bool) -> None:
    cfg = pd_config()
    cfg.setdefault("disaggregation", {})["protocol"] = protocol
    pipe = pipeline_of(cfg)
    text = "word " * 2000

    async def run() -> None:
        first = await pipe.decide(*chat(text, "s1"), 0.0)
        assert isinstance(first, Routed) and first.prefill is not None
        dead = first.prefill.address
        # SGLang's decode half could not join the prefill's bootstrap room; with llm-d's
        # protocol a 500 is the engine's own answer and says nothing about the prefiller.
        pipe.observe_response(first.hold, {":status": "500"}, 1.0)
        await pipe.release(first.hold)
        again = await pipe.decide(*chat(text, "s1"), 2.0)
        assert isinstance(again, Routed) and again.prefill is not None
        assert (again.prefill.address != dead) is marks
        await pipe.release(again.hold)

    asyncio.run(run())

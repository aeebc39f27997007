"""``extproc bench routing --workload tenant-flood``: the workload generator and the report
compute what they claim (no Envoy, no clusters: the parts that are pure)."""

from __future__ import annotations

import math
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml

from extproc.bench.fairness_stats import jain, pct
from extproc.bench.routing import SimProfile
from extproc.bench.routing_tenants import (
    ARMS,
    FLOOD,
    FLOOD_BOUNDS,
    STEADY,
    TENANT_HEADER,
    Arm,
    ArmRun,
    FloodShape,
    RunContext,
    TenantWorkload,
    add_baseline_ratios,
    arm_report,
    parse_arms,
    steady_tenants,
    targets,
    tenant_flood_workload,
    with_edge_tenant,
)
from extproc.config import compile_runtime, parse_config
from extproc.harness.launch import envoy_binary
from extproc.harness.prompts import canonical_prompt, count_tokens
from extproc.harness.replay import ReplayOptions, ReplayResult, RequestOutcome
from extproc.harness.workload import ReplayRequest
from extproc.render.envoy import EnvoyOptions, render_bootstrap


def test_jain_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert jain([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    # (1 + 3)^2 / (2 * (1 + 9)) = 16 / 20
    assert jain([1.0, 3.0]) == pytest.approx(0.8)
    assert math.isnan(jain([0.0, 0.0]))


def test_pct_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted on purpose
    assert pct(values, 99) == 99.0
    assert pct(values, 50) == 50.0
    assert pct(values, 100) == 100.0
    assert pct([7.0], 99) == 7.0
    assert math.isnan(pct([], 99))


# -- the workload -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workload() -> TenantWorkload:
    return tenant_flood_workload(FloodShape(seconds=100.0), prefill_tps=20_000.0, seed=3)


def test_every_steady_tenant_asks_alike_and_the_flood_asks_several_times_the_long_cluster(
    workload: TenantWorkload,
) -> None:
    shape = workload.shape
    assert [r.arrival_s for r in workload.requests] == sorted(
        r.arrival_s for r in workload.requests
    )
    long_asks = Counter(
        t for t, r in zip(workload.tenants, workload.requests, strict=True) if r.kind != "short"
    )
    steady = [long_asks[t] for t in steady_tenants()]
    assert len(steady) == STEADY and min(steady) >= 1 and max(steady) - min(steady) <= 1
    # Together the steady tenants ask steady_share of c2's prefill rate (one period each).
    period = shape.steady_period_s(20_000.0)
    assert STEADY * shape.steady_tokens / period == pytest.approx(shape.steady_share * 20_000.0)
    flood = [r for r in workload.requests if r.kind == "flood"]
    assert {workload.tenants[workload.requests.index(r)] for r in flood} == {FLOOD}
    assert shape.flood_rate * shape.flood_tokens > 3 * 20_000.0  # a flood: > 3x c2's prefill
    assert 0.5 * shape.seconds * shape.flood_rate < len(flood) < 1.5 * shape.seconds
    assert {
        workload.tenants[i] for i, r in enumerate(workload.requests) if r.kind == "short"
    } <= set(steady_tenants())


def test_each_request_is_in_its_class_carries_its_tenants_key_and_counts_as_the_cluster_does(
    workload: TenantWorkload,
) -> None:
    bounds = workload.shape.bounds
    seen: set[str] = set()
    for tenant, request in zip(workload.tenants, workload.requests, strict=True):
        assert request.headers == (("authorization", f"Bearer sk-{tenant}"),)
        klass = bounds.classify(request.input_tokens)
        assert klass == ("short" if request.kind == "short" else "long")
        if request.kind not in seen:  # one of each kind: the flood's prompts are large
            seen.add(request.kind)
            text = canonical_prompt(request.api, request.materialize())
            assert count_tokens(text) == request.input_tokens
    assert seen == {"steady", "flood", "short"}
    bodies = [r.materialize() for r in workload.requests[:40]]
    texts = [b["messages"][0]["content"] for b in bodies]
    assert len(set(texts)) == len(texts)  # no two prompts alike: no prefix-cache effects


def test_the_same_seed_gives_the_same_requests_and_without_the_flood_keeps_the_rest() -> None:
    shape = FloodShape(seconds=60.0)
    a = tenant_flood_workload(shape, 20_000.0, seed=5)
    b = tenant_flood_workload(shape, 20_000.0, seed=5)
    assert [(r.arrival_s, r.kind) for r in a.requests] == [
        (r.arrival_s, r.kind) for r in b.requests
    ]
    calm = a.without_flood()
    assert FLOOD not in calm.tenants and "flood" not in {r.kind for r in calm.requests}
    kept = [(t, r.arrival_s) for t, r in zip(a.tenants, a.requests, strict=True) if t != FLOOD]
    assert [(t, r.arrival_s) for t, r in zip(calm.tenants, calm.requests, strict=True)] == kept


def test_the_edge_names_the_tenant_ahead_of_ext_proc_after_the_strip(tmp_path: Path) -> None:
    runtime = compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:9"]}],
                "flow": {"tenant_header": TENANT_HEADER},
            }
        )
    )
    bootstrap = with_edge_tenant(render_bootstrap(runtime, EnvoyOptions(mode="extproc")))
    (listener,) = bootstrap["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    typed = hcm["typed_config"]
    names = [f["name"] for f in typed["http_filters"]]
    assert names[:2] == ["envoy.filters.http.lua", "envoy.filters.http.ext_proc"], names
    # A client's x-tenant is stripped before any filter runs: only the edge's reaches ext_proc.
    assert TENANT_HEADER in typed["route_config"]["internal_only_headers"]
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


# -- the report ---------------------------------------------------------------------------------


def _request(at: float, kind: str, tokens: int) -> ReplayRequest:
    body = {"model": "sim", "messages": [{"role": "user", "content": "x"}]}
    return ReplayRequest(
        at, "openai-chat", "/v1/chat/completions", body, None, False, kind, tokens, True, 8
    )


def _outcome(index: int, request: ReplayRequest, ok: bool, ttft: float) -> RequestOutcome:
    return RequestOutcome(
        index=index,
        kind=request.kind,
        klass=FLOOD_BOUNDS.classify(request.input_tokens),
        outcome="2xx" if ok else "429",
        status=200 if ok else 429,
        scheduled_s=request.arrival_s,
        sent_s=request.arrival_s,  # origin 0, speedup 1: sent at its arrival
        ttft_s=ttft if ok else 0.0,
        latency_s=ttft,
        prompt_tokens=None,
        cached_tokens=None,
        served_by=None,
        retries=0,
        delayed=False,
        in_burst=False,
        session_id=None,
        input_tokens=request.input_tokens,
        retry_after=None if ok else "3",
    )


def _arm_run(arm: Arm, rows: list[tuple[float, str, str, int, bool, float]]) -> ArmRun:
    shape = FloodShape(seconds=100.0, warmup_s=10.0)
    rows = sorted(rows)
    requests = tuple(_request(at, kind, tokens) for at, _t, kind, tokens, _ok, _f in rows)
    workload = TenantWorkload(shape, requests, tuple(t for _a, t, *_ in rows), "hand-made")
    outcomes = tuple(_outcome(i, requests[i], ok, ttft) for i, (*_x, ok, ttft) in enumerate(rows))
    result = ReplayResult("http://127.0.0.1:1", outcomes, 0, 1.0)
    return ArmRun(arm, workload, result, len(rows), 0, {"too_long": 1.0}, {})


def _context() -> RunContext:
    profile = SimProfile(2, 2_000_000, 20_000.0, 50.0, 64, 1.0, 64)
    return RunContext(profile, ReplayOptions(speedup=1.0), [], Path("."), None)


def test_the_report_computes_jain_shares_ttfts_and_the_account() -> None:
    rows: list[tuple[float, str, str, int, bool, float]] = []
    for i, tenant in enumerate(steady_tenants()):
        rows.append((1.0 + i / 100, tenant, "steady", 10_000, True, 9.0))  # before the warm-up
        for k in range(2):
            ok = tenant != "steady00"  # one steady tenant gets nothing: 429s
            rows.append((20.0 + i + k / 2, tenant, "steady", 10_000, ok, 0.5 + i / 100))
    rows += [
        (30.0, FLOOD, "flood", 80_000, True, 4.0),
        (31.0, FLOOD, "flood", 80_000, True, 75.0),  # its first token after the window's end
        (32.0, FLOOD, "flood", 80_000, False, 0.0),
        (40.0, "steady03", "short", 400, True, 0.1),
        (41.0, "steady04", "short", 400, True, 0.3),
    ]
    report = arm_report(_arm_run(Arm("tokens", "tokens", flood=True), rows), _context())
    # 19 tenants served 20,000 tokens each, one none: 19^2 / (20 * 19) = 0.95.
    assert report["jain_steady"] == pytest.approx(0.95)
    served = [20_000.0] * 19 + [0.0, 160_000.0]
    assert report["served_tokens"][FLOOD] == 160_000.0
    assert report["jain_all"] == pytest.approx(sum(served) ** 2 / (21 * sum(v * v for v in served)))
    assert report["flood_share"] == pytest.approx(160_000 / 540_000)
    # Prefill ended in [10, 100): the 20 sent before the warm-up (first token at 10.0-10.2 s),
    # the 38 served after it, and the flood's first; the second's first token came at 106 s.
    assert report["long_busy"] == pytest.approx((58 * 10_000 + 80_000) / (20_000.0 * 90))
    a = report["account"]
    assert a["steady"] == {
        "requests": 60,
        "2xx": 58,
        "429": 2,
        "429_with_retry_after": 2,
        "other": 0,
    }
    assert a["flood"]["requests"] == 3 and a["flood"]["429"] == 1
    assert a["all"]["requests"] == len(rows) == report["outcomes_recorded"]
    assert report["steady_429_share"] == pytest.approx(2 / 60)
    # The 38 steady TTFTs after the warm-up are 0.51 .. 0.69 (the pre-warm-up 9.0 s left out).
    assert report["steady_ttft_p99_s"] == pytest.approx(0.69)
    assert report["short_ttft_p99_s"] == pytest.approx(0.3)
    assert report["long_waits"] == {"too_long": 1.0}


def test_ratios_are_against_the_no_flood_arm_and_targets_say_what_was_met() -> None:
    reports = {
        "no_flood": {"steady_ttft_p99_s": 0.5, "short_ttft_p99_s": 0.02},
        "tokens": {"steady_ttft_p99_s": 2.0, "short_ttft_p99_s": 0.021},
    }
    add_baseline_ratios(reports)
    assert reports["no_flood"]["steady_ttft_p99_vs_no_flood"] == pytest.approx(1.0)
    assert reports["tokens"]["steady_ttft_p99_vs_no_flood"] == pytest.approx(4.0)
    assert reports["tokens"]["short_ttft_p99_vs_no_flood"] == pytest.approx(1.05)
    account = {"all": {"requests": 3, "2xx": 2, "429": 1, "429_with_retry_after": 0, "other": 0}}
    for r in reports.values():
        r.update(jain_steady=0.97, account=account, requests=3, outcomes_recorded=3, skipped=0)
    met = [t.met for t in targets(reports)]
    assert met == [True, True, False]  # Jain, the short class; the 429 without retry-after


def test_arms_parse_in_the_order_given() -> None:
    assert [a.name for a in parse_arms("tokens,no_flood")] == ["tokens", "no_flood"]
    assert [a.name for a in parse_arms(None)] == [a.name for a in ARMS]
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arms("tokens,lottery")

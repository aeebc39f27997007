"""The pure admission core: class boundaries, budget math, retry hints, 413 vs 429, headers."""

from __future__ import annotations

import math
import re
from random import Random
from typing import Any

import pytest

from extproc.config.load import parse_config
from extproc.config.runtime import Runtime, compile_runtime
from extproc.core.admission import (
    MAX_RETRY_AFTER_S,
    NO_SIGNAL_WAIT_S,
    RELEASE_RATE_TAU_S,
    Admitted,
    Attempt,
    CompartmentUsage,
    Demand,
    LedgerAnswer,
    Reason,
    Reject,
    ReleaseStats,
    TenantClaim,
    Ticket,
    jittered_seconds,
    plan,
    request_tokens,
    unavailable,
    verdict,
)
from extproc.core.api import Api
from extproc.core.decide import Route
from extproc.core.facts import RequestFacts
from extproc.core.fleet import Budget, effective_burst
from extproc.core.flow import TenantLimit, WaitPolicy
from extproc.core.keys import KeySource, hash_key
from extproc.core.placement import Placement
from extproc.core.ratelimit_headers import format_duration, rate_limit_headers
from extproc.pipeline import step as steps

CLUSTERS = ["c1", "c2", "c3", "c4"]


def fleet(**overrides: Any) -> Runtime:
    doc: dict[str, Any] = {
        "version": 1,
        "clusters": [
            {"name": n, "endpoints": [f"127.0.0.1:{8000 + i}"]} for i, n in enumerate(CLUSTERS)
        ],
        "session": {"tier_header": "x-tier"},
        "classes": [
            {
                "name": "short-gold",
                "max_input_tokens": 2048,
                "tiers": ["gold"],
                "budget": {"max_inflight_tokens": 40_000, "max_concurrent": 16},
            },
            {
                "name": "short",
                "max_input_tokens": 2048,
                "budget": {"max_inflight_tokens": 20_000, "max_concurrent": 8},
            },
            {
                "name": "medium",
                "max_input_tokens": 100_000,
                "eligible": ["c2", "c3"],
                "budget": {"tokens_per_second": 5_000, "burst_tokens": 150_000},
            },
            {"name": "long"},
        ],
    }
    doc.update(overrides)
    return compile_runtime(parse_config(doc))


def facts(
    input_tokens: int, max_output: int | None = None, tier: str | None = None, session: str = "s"
) -> RequestFacts:
    return RequestFacts(
        api=Api.OPENAI_CHAT,
        model="m",
        session=hash_key(KeySource.HEADER, session.encode()),
        input_tokens=input_tokens,
        max_output_tokens=max_output,
        tier=tier,
        stream=False,
        body_bytes=input_tokens * 4,
    )


def planned(rt: Runtime, f: RequestFacts) -> Demand | Reject | None:
    return plan(request_tokens(f), rt.policy.route(f))


# -- class boundaries ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("input_tokens", "tier", "expected"),
    [
        (1, None, "short"),
        (2047, None, "short"),
        (2048, None, "medium"),  # max_input_tokens is exclusive
        (2047, "gold", "short-gold"),
        (2048, "gold", "medium"),  # a tier class covers only its own token band
        (2047, "silver", "short"),  # unknown tier falls through to the untiered class
        (99_999, None, "medium"),
        (100_000, None, None),  # "long" has no budget: no ledger call at all
    ],
    ids=[
        "tiny-is-short",
        "just-below-bound-is-short",
        "at-bound-is-next-class",
        "gold-below-bound",
        "gold-at-bound-is-medium",
        "other-tier-is-untiered",
        "top-of-medium",
        "unbudgeted-class-needs-no-ledger",
    ],
)
def test_demand_is_charged_to_the_class_of_the_request(
    input_tokens: int, tier: str | None, expected: str | None
) -> None:
    rt = fleet()
    f = facts(input_tokens, tier=tier)
    demand = planned(rt, f)
    if expected is None:
        assert demand is None
        return
    assert isinstance(demand, Demand)
    cls = next(c for c in rt.policy.classes if c.name == expected)
    assert demand.class_name == expected
    assert demand.budget == cls.budget
    assert demand.limits == cls.budget.resolved()


def test_demand_is_charged_to_the_primary_cluster_within_the_eligible_set() -> None:
    rt = fleet()
    seen = set()
    for i in range(200):
        f = facts(50_000, session=f"session-{i}")
        route = rt.policy.route(f)
        demand = plan(request_tokens(f), route)
        assert isinstance(demand, Demand)
        assert demand.cluster == route.placement.primary
        seen.add(demand.cluster)
    assert seen == {"c2", "c3"}


# -- budget math --------------------------------------------------------------------------------


def test_cost_is_the_estimated_input_only() -> None:
    assert request_tokens(facts(1000)) == 1000
    assert request_tokens(facts(1000, max_output=300)) == 1000


def test_share_splits_every_capped_dimension_and_keeps_caps_capped() -> None:
    whole = Budget(
        max_inflight_tokens=1001, max_concurrent=3, tokens_per_second=90.0, burst_tokens=7
    )
    part = whole.share(2)
    assert part.max_inflight_tokens == 1001 // 2
    assert part.max_concurrent == 1
    assert part.tokens_per_second == pytest.approx(45.0)
    assert part.burst_tokens == 3
    assert 2 * part.max_inflight_tokens <= whole.max_inflight_tokens
    # A tiny cap stays a cap (0 would mean "unlimited").
    assert Budget(max_concurrent=1).share(4).max_concurrent == 1
    assert Budget(max_concurrent=0).share(4).max_concurrent == 0
    assert whole.share(1) == whole


def test_burst_defaults_to_one_second_of_refill() -> None:
    assert effective_burst(Budget(tokens_per_second=250.5)) == 251
    assert effective_burst(Budget(tokens_per_second=100, burst_tokens=900)) == 900
    assert effective_burst(Budget(max_inflight_tokens=10)) == 0


# -- 413 vs 429 ---------------------------------------------------------------------------------


# A catch-all class with a budget smaller than the inputs it accepts: only there can a request
# outgrow its class's whole budget (a bounded class's budget is validated to hold its largest).
CAPPED_LONG = [
    {"name": "short", "max_input_tokens": 2048},
    {"name": "long", "budget": {"max_inflight_tokens": 20_000, "max_concurrent": 8}},
]
RATED_LONG = [
    {"name": "short", "max_input_tokens": 2048},
    {"name": "long", "budget": {"tokens_per_second": 5_000, "burst_tokens": 150_000}},
]


def test_request_exactly_the_size_of_the_budget_is_admissible() -> None:
    rt = fleet(classes=CAPPED_LONG)
    demand = planned(rt, facts(20_000, max_output=4096))
    assert isinstance(demand, Demand)
    assert demand.tokens == 20_000


def test_request_larger_than_the_inflight_budget_is_413_not_429() -> None:
    rt = fleet(classes=CAPPED_LONG)
    reject = planned(rt, facts(20_001))
    assert isinstance(reject, Reject)
    assert reject.status == 413
    assert reject.reason is Reason.EXCEEDS_BUDGET
    assert reject.retry_after_s is None
    assert "never be admitted" in reject.message
    assert "20001" in reject.message and "20000" in reject.message
    headers = dict(rate_limit_headers(reject))
    assert "retry-after" not in headers
    assert "ratelimit" not in headers
    assert headers["x-ratelimit-limit-tokens"] == "20000"
    assert headers["x-fleet-class"] == "long"


def test_request_larger_than_the_burst_is_413() -> None:
    rt = fleet(classes=RATED_LONG)
    fits = planned(rt, facts(150_000, max_output=60_000))
    assert isinstance(fits, Demand)
    reject = planned(rt, facts(150_001))
    assert isinstance(reject, Reject)
    assert reject.status == 413
    assert "burst" in reject.message


# -- verdicts and retry hints -------------------------------------------------------------------


def demand_for(limits: Budget, tokens: int) -> Demand:
    budget = Budget(
        limits.max_inflight_tokens,
        limits.max_concurrent,
        limits.tokens_per_second,
        limits.burst_tokens,
    )
    return Demand("c1", "short", tokens, budget, limits)


def refused(
    usage: CompartmentUsage, released: ReleaseStats | None = None, now: float = 100.0
) -> LedgerAnswer:
    return LedgerAnswer(False, None, usage, released or ReleaseStats(), now)


def steady(rate_per_s: float, tokens_each: float, now: float) -> ReleaseStats:
    """Counters after a long run of releases at a constant rate (the decayed sum's limit)."""
    n = rate_per_s * RELEASE_RATE_TAU_S
    return ReleaseStats(n, n * tokens_each, at=now, since=now - 1000 * RELEASE_RATE_TAU_S)


def test_granted_answer_is_an_admission_carrying_the_ticket() -> None:
    d = demand_for(Budget(max_inflight_tokens=100), 10)
    ticket = Ticket("c1", "short", 10, "lease-1", "memory")
    out = verdict(
        d, LedgerAnswer(True, ticket, CompartmentUsage(10, 1), ReleaseStats(), 0.0), Random(1)
    )
    assert isinstance(out, Admitted)
    assert out.ticket == ticket


def test_inflight_wait_comes_from_the_observed_token_release_rate() -> None:
    limits = Budget(max_inflight_tokens=10_000)
    d = demand_for(limits, 3_000)
    # 9000 in flight + 3000 wanted = 2000 over; 400 tokens/s complete → 5 s.
    ans = refused(CompartmentUsage(9_000, 5), steady(2.0, 200.0, 100.0))
    wait = (9_000 + 3_000 - 10_000) / 400.0
    for seed in range(50):
        out = verdict(d, ans, Random(seed))
        assert isinstance(out, Reject)
        assert out.status == 429 and out.reason is Reason.INFLIGHT_TOKENS
        assert out.retry_after_s is not None
        assert math.ceil(wait) <= out.retry_after_s <= math.ceil(wait * 1.5)
        assert out.reset_s == pytest.approx(wait, rel=1e-9)
        assert out.remaining_tokens == 1_000
        assert out.limit_tokens == 10_000


def test_faster_completions_give_shorter_retry_hints() -> None:
    d = demand_for(Budget(max_inflight_tokens=10_000), 3_000)
    slow = verdict(d, refused(CompartmentUsage(9_000, 5), steady(0.5, 200.0, 100.0)), Random(7))
    fast = verdict(d, refused(CompartmentUsage(9_000, 5), steady(20.0, 200.0, 100.0)), Random(7))
    assert isinstance(slow, Reject) and isinstance(fast, Reject)
    assert slow.retry_after_s is not None and fast.retry_after_s is not None
    assert fast.retry_after_s < slow.retry_after_s


def test_concurrency_wait_uses_the_request_completion_rate() -> None:
    d = demand_for(Budget(max_concurrent=4), 10)
    ans = refused(CompartmentUsage(40, 4), steady(0.25, 10.0, 100.0))  # one completion every 4 s
    out = verdict(d, ans, Random(3))
    assert isinstance(out, Reject) and out.reason is Reason.CONCURRENCY
    assert out.retry_after_s is not None and 4 <= out.retry_after_s <= 6
    assert out.limit_tokens is None and out.reset_s is None  # no token dimension to report


def test_token_bucket_wait_is_the_refill_time() -> None:
    limits = Budget(tokens_per_second=100.0, burst_tokens=5_000)
    d = demand_for(limits, 1_200)
    out = verdict(d, refused(CompartmentUsage(0, 0, bucket_tokens=200.0)), Random(11))
    assert isinstance(out, Reject) and out.reason is Reason.TOKEN_RATE
    assert out.reset_s == pytest.approx(10.0)
    assert out.retry_after_s is not None and 10 <= out.retry_after_s <= 15
    headers = dict(rate_limit_headers(out))
    assert headers["x-ratelimit-reset-tokens"] == "10s"
    assert headers["x-ratelimit-remaining-tokens"] == "200"
    assert headers["x-ratelimit-limit-tokens"] == "5000"


def test_binding_dimension_is_the_one_with_the_longest_wait() -> None:
    limits = Budget(
        max_inflight_tokens=1_000, max_concurrent=2, tokens_per_second=10.0, burst_tokens=1_000
    )
    d = demand_for(limits, 500)
    ans = refused(CompartmentUsage(900, 2, bucket_tokens=0.0), steady(1.0, 100.0, 100.0))
    out = verdict(d, ans, Random(5))
    assert isinstance(out, Reject)
    # inflight: 400 over at 100 tok/s = 4 s; concurrency: 1 at 1/s = 1 s; bucket: 500/10 = 50 s.
    assert out.reason is Reason.TOKEN_RATE
    assert out.retry_after_s is not None and out.retry_after_s >= 50


def test_without_any_completion_observed_the_hint_is_a_short_jittered_probe() -> None:
    d = demand_for(Budget(max_concurrent=1), 10)
    hints = {
        r.retry_after_s
        for seed in range(200)
        if isinstance(r := verdict(d, refused(CompartmentUsage(10, 1)), Random(seed)), Reject)
    }
    assert min(h for h in hints if h is not None) >= 1
    assert max(h for h in hints if h is not None) <= math.ceil(NO_SIGNAL_WAIT_S * 1.5) + 1
    assert len(hints) > 1  # jittered, not a constant


def test_retry_after_is_deterministic_per_seed_and_jittered_across_seeds() -> None:
    d = demand_for(Budget(max_inflight_tokens=10_000), 3_000)
    ans = refused(
        CompartmentUsage(9_500, 5), steady(1.0, 100.0, 100.0)
    )  # 2500 over at 100 tok/s = 25 s

    def hint(seed: int) -> int | None:
        out = verdict(d, ans, Random(seed))
        assert isinstance(out, Reject)
        return out.retry_after_s

    assert hint(42) == hint(42)
    values = {hint(s) for s in range(100)}
    assert len(values) >= 5
    assert all(v is not None and 25 <= v <= 38 for v in values)


def test_retry_after_is_capped() -> None:
    assert jittered_seconds(1e9, Random(0)) == MAX_RETRY_AFTER_S
    assert jittered_seconds(0.0, Random(0)) >= 1


def test_local_share_too_small_for_the_request_is_429_local_share() -> None:
    whole = Budget(max_inflight_tokens=10_000)
    d = demand_for(whole, 8_000).shared(2)
    out = verdict(d, refused(CompartmentUsage(0, 0)), Random(1))
    assert isinstance(out, Reject)
    assert out.status == 429 and out.reason is Reason.LOCAL_SHARE
    assert "unreachable" in out.message


def test_closed_policy_reject_is_503_with_a_retry_hint() -> None:
    d = demand_for(Budget(max_concurrent=3), 10)
    out = unavailable(d, 1.0, Random(2))
    assert out.status == 503 and out.reason is Reason.LEDGER_UNAVAILABLE
    headers = dict(rate_limit_headers(out))
    assert int(headers["retry-after"]) >= 1
    assert out.code == "service_unavailable"


# -- release-rate estimate ----------------------------------------------------------------------


def test_release_rate_decays_when_completions_stop() -> None:
    stats = steady(4.0, 100.0, 100.0)
    assert stats.rates(100.0)[0] == pytest.approx(4.0, rel=0.01)
    later = stats.rates(100.0 + RELEASE_RATE_TAU_S)[0]
    assert later == pytest.approx(4.0 / math.e, rel=0.01)
    assert ReleaseStats().rates(50.0) == (0.0, 0.0)


def test_release_rate_is_bias_corrected_right_after_start() -> None:
    # Two releases 0.5 s and 1.5 s after counting started, as the ledgers record them.
    tau = RELEASE_RATE_TAU_S
    n = math.exp(-1.0 / tau) + 1.0
    stats = ReleaseStats(n, n * 10, at=11.5, since=10.0)
    rate = stats.rates(11.5)[0]
    # Uncorrected it would read n / tau ≈ 0.19/s; two completions in ~1.5 s is ~1.3/s.
    assert 1.0 < rate < 2.0


# -- headers ------------------------------------------------------------------------------------

SF_STRING = r'"[a-z0-9_-]+"'
PARAM = r';[a-z][a-z0-9-]*=(?:\d+|"[a-z-]+")'
ITEM = re.compile(rf"^{SF_STRING}(?:{PARAM})+$")
REGISTERED_UNITS = {"requests", "content-bytes", "concurrent-requests"}


def parse_sf_list(value: str) -> list[tuple[str, dict[str, str]]]:
    """A small parser for the Lists of Items these headers use (RFC 9651 subset)."""
    out = []
    for raw in value.split(", "):
        assert ITEM.match(raw), raw
        name, *params = raw.split(";")
        out.append((name.strip('"'), dict(p.split("=", 1) for p in params)))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_ietf_fields_follow_the_draft_syntax_and_agree_with_retry_after(seed: int) -> None:
    rng = Random(seed)
    limits = Budget(
        max_inflight_tokens=rng.randrange(1_000, 100_000),
        max_concurrent=rng.randrange(1, 64),
        tokens_per_second=rng.uniform(10, 5_000),
        burst_tokens=100_000,
    )
    d = demand_for(limits, rng.randrange(1, 1_000))
    usage = CompartmentUsage(
        inflight_tokens=rng.randrange(0, limits.max_inflight_tokens + 1),
        concurrent=limits.max_concurrent,  # at least this dimension refuses
        bucket_tokens=rng.uniform(0, 2_000),
    )
    out = verdict(d, refused(usage, steady(rng.uniform(0.1, 10), 500.0, 100.0)), rng)
    assert isinstance(out, Reject)
    headers = rate_limit_headers(out)
    names = [h for h, _ in headers]
    assert all(h == h.lower() for h in names)
    values = dict(headers)
    retry_after = int(values["retry-after"])
    assert retry_after >= 1

    policies = parse_sf_list(values["ratelimit-policy"])
    assert {n for n, _ in policies} == {"short-inflight", "short-concurrency", "short-rate"}
    for _name, params in policies:
        assert int(params["q"]) >= 0
        if "qu" in params:
            assert params["qu"].strip('"') in REGISTERED_UNITS
        if "w" in params:
            assert int(params["w"]) >= 1
    limits_now = parse_sf_list(values["ratelimit"])
    assert [n for n, _ in limits_now] == [n for n, _ in policies]
    refused_some = False
    for _name, params in limits_now:
        assert int(params["r"]) >= 0
        if "t" in params:
            refused_some = True
            # The draft: Retry-After SHOULD NOT point earlier than the effective window.
            assert 0 <= int(params["t"]) <= retry_after
    assert refused_some


def test_openai_headers_report_the_binding_token_dimension() -> None:
    d = demand_for(Budget(max_inflight_tokens=10_000), 3_000)
    out = verdict(d, refused(CompartmentUsage(9_000, 5), steady(2.0, 200.0, 100.0)), Random(1))
    assert isinstance(out, Reject)
    values = dict(rate_limit_headers(out))
    assert values["x-ratelimit-limit-tokens"] == "10000"
    assert values["x-ratelimit-remaining-tokens"] == "1000"
    assert values["x-ratelimit-reset-tokens"] == "5s"
    assert values["x-fleet-class"] == "short"
    assert out.code == "rate_limit_exceeded"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.02, "20ms"),
        (0.0001, "1ms"),
        (1.0, "1s"),
        (1.2, "2s"),
        (59.0, "59s"),
        (90.0, "1m30s"),
        (360.0, "6m0s"),
        (3661.0, "1h1m1s"),
    ],
)
def test_reset_duration_uses_openai_style(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# -- a tenant's own limits in the reservation -----------------------------------------------------


def test_plan_carries_the_tenant_and_reserves_for_an_unbudgeted_class_only_with_limits() -> None:
    rt = fleet()
    claim = TenantClaim("t", TenantLimit(max_concurrent=2))
    short = rt.policy.route(facts(100))
    budgeted = plan(100, short, claim)
    assert isinstance(budgeted, Demand) and budgeted.tenant == claim
    assert budgeted.shared(2).tenant == TenantClaim("t", TenantLimit(max_concurrent=1))
    long = rt.policy.route(facts(500_000))
    assert long.request_class.name == "long"
    assert plan(500_000, long) is None
    assert plan(500_000, long, TenantClaim("t")) is None  # counted only: nothing to reserve
    uncapped = plan(500_000, long, claim)
    assert isinstance(uncapped, Demand) and uncapped.limits == Budget() and uncapped.tenant == claim


def test_a_tenants_refusal_is_answered_at_once_not_placed_elsewhere_or_queued() -> None:
    rt = fleet()
    route = rt.policy.route(facts(100))
    claim = TenantClaim("t", TenantLimit(max_concurrent=1))
    tenant_429 = Reject(429, "short", "c1", "tenant", Reason.TENANT_CONCURRENCY)
    needs: list[object] = []

    def perform(need: object) -> object:
        needs.append(need)
        if isinstance(need, steps.QueueDepth):
            return 0
        assert isinstance(need, steps.Reserve)
        assert need.demand.tenant == claim
        return Attempt(tenant_429, need.demand, None)

    step = steps.admission_step(100, route, lambda: [route], WaitPolicy(30.0, 8), claim)
    assert steps.drive(step, perform) is tenant_429
    assert [type(n).__name__ for n in needs] == ["QueueDepth", "Reserve"]


def _full_or_room(queued: dict[str, int], room: set[str], needs: list[object]) -> Any:
    """A fake perform: ``queued`` waiters per cluster, budget free only on ``room``."""

    def perform(need: object) -> object:
        needs.append(need)
        if isinstance(need, steps.QueueDepth):
            return queued.get(need.cluster, 0)
        if isinstance(need, steps.Reserve):
            demand = need.demand
            if demand.cluster in room and not need.look:
                ticket = Ticket(demand.cluster, demand.class_name, demand.tokens, "t", "memory")
                return Attempt(Admitted(demand, ticket, CompartmentUsage()), demand, None)
            full = Reject(429, demand.class_name, demand.cluster, "full", Reason.CONCURRENCY)
            return Attempt(full, demand, None)
        if isinstance(need, steps.JoinQueue):
            return "queued"
        return None

    return perform


def test_a_new_session_is_not_placed_on_a_cluster_whose_queue_has_waiters() -> None:
    """Placement takes another cluster's free budget only where nobody waits for it: a
    cluster with waiters is skipped (its freed budget is its queue head's), the next one
    without waiters is taken; with waiters everywhere the request queues on its primary."""
    short = fleet().policy.route(facts(100)).request_class
    route = Route(Placement("c1", None), short)
    others = [Route(Placement(c, None), short) for c in ("c2", "c3")]
    wait = WaitPolicy(30.0, 8)

    needs: list[object] = []
    perform = _full_or_room({"c2": 3}, {"c2", "c3"}, needs)
    outcome = steps.drive(steps.admission_step(100, route, lambda: others, wait), perform)
    assert isinstance(outcome, steps.Placed) and outcome.route.placement.primary == "c3"
    reserved = [n.demand.cluster for n in needs if isinstance(n, steps.Reserve)]
    assert reserved == ["c1", "c3"]

    needs.clear()
    perform = _full_or_room({"c2": 3, "c3": 1}, {"c2", "c3"}, needs)
    outcome = steps.drive(steps.admission_step(100, route, lambda: others, wait), perform)
    assert outcome == "queued"
    assert not any(isinstance(n, steps.RememberPlacement) for n in needs)

    # A class that does not wait has no queues to respect: the first with room is taken.
    needs.clear()
    perform = _full_or_room({}, {"c2", "c3"}, needs)
    outcome = steps.drive(steps.admission_step(100, route, lambda: others, WaitPolicy()), perform)
    assert isinstance(outcome, steps.Placed) and outcome.route.placement.primary == "c2"
    assert not any(isinstance(n, steps.QueueDepth) for n in needs)

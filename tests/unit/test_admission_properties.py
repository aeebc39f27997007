"""Property tests over the whole admission core: every clock, idle time, budget, usage and
request size gives a finite decision and a retry hint within [1 s, MAX_RETRY_AFTER_S].

The values a ledger reports come from outside this process (Redis replies, another replica's
releases hours ago), so the strategies range over every finite float, denormals included,
and over NaN and infinities where a reply could carry them.
"""

from __future__ import annotations

import math
from random import Random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extproc.config.load import ConfigError, parse_config
from extproc.core.admission import (
    MAX_RETRY_AFTER_S,
    RELEASE_RATE_TAU_S,
    Admitted,
    CompartmentUsage,
    Demand,
    LedgerAnswer,
    Reject,
    ReleaseStats,
    Ticket,
    bounded_wait,
    jittered_seconds,
    plan,
    unavailable,
    verdict,
)
from extproc.core.decide import Route
from extproc.core.fleet import Budget, RequestClass
from extproc.core.placement import Placement
from extproc.core.ratelimit_headers import format_duration, rate_limit_headers

SIZES = st.integers(min_value=0, max_value=2**53)
CAPS = st.one_of(st.just(0), st.integers(min_value=1, max_value=2**48))
RATES = st.one_of(
    st.just(0.0),
    st.just(math.inf),
    st.floats(min_value=5e-324, max_value=1e15, allow_nan=False, allow_infinity=False),
)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
CLOCK = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False)


@st.composite
def budgets(draw: st.DrawFn) -> Budget:
    return Budget(draw(CAPS), draw(CAPS), draw(RATES), draw(CAPS))


@st.composite
def answers(draw: st.DrawFn) -> LedgerAnswer:
    granted = draw(st.booleans())
    usage = CompartmentUsage(draw(SIZES), draw(SIZES), draw(ANY_FLOAT))
    released = ReleaseStats(
        draw(st.one_of(st.just(0.0), st.floats(min_value=0.0, allow_nan=False))),
        draw(st.floats(min_value=0.0, allow_nan=False)),
        draw(CLOCK),
        draw(CLOCK),
    )
    ticket = Ticket("c1", "short", 1, "lease", "memory") if granted else None
    return LedgerAnswer(granted, ticket, usage, released, draw(CLOCK))


def assert_hints_bounded(reject: Reject) -> None:
    assert reject.retry_after_s is not None
    assert 1 <= reject.retry_after_s <= MAX_RETRY_AFTER_S
    if reject.reset_s is not None:
        assert math.isfinite(reject.reset_s)
        assert 0 <= reject.reset_s <= MAX_RETRY_AFTER_S
    for q in reject.quotas:
        assert q.remaining >= 0
        if q.reset_s is not None:
            assert 1 <= q.reset_s <= MAX_RETRY_AFTER_S
        if q.window_s is not None:
            assert 1 <= q.window_s < 10**15
    headers = dict(rate_limit_headers(reject))
    assert 1 <= int(headers["retry-after"]) <= MAX_RETRY_AFTER_S


@settings(max_examples=400, deadline=None)
@given(budgets(), SIZES, answers(), st.integers(min_value=1, max_value=64), st.randoms())
@example(
    # The reported crash: over budget ~7,200 s after the last release; the decayed rate is
    # denormal, deficit / rate is inf and math.ceil(inf) raised OverflowError.
    Budget(max_inflight_tokens=40_000),
    30_000,
    LedgerAnswer(
        False,
        None,
        CompartmentUsage(30_000, 3, 0.0),
        ReleaseStats(5.0, 50_000.0, 0.0, -100.0),
        7_200.0,
    ),
    1,
    Random(1),
)
def test_verdict_is_total_and_hints_are_bounded(
    budget: Budget, tokens: int, answer: LedgerAnswer, replicas: int, rng: Random
) -> None:
    limits = budget.resolved().share(replicas)
    demand = Demand("c1", "short", tokens, budget, limits)
    outcome = verdict(demand, answer, rng)
    if answer.granted:
        assert isinstance(outcome, Admitted)
        return
    assert isinstance(outcome, Reject) and outcome.status == 429
    assert_hints_bounded(outcome)


@settings(max_examples=300, deadline=None)
@given(budgets(), SIZES)
def test_plan_is_total_and_413_only_when_nothing_could_admit(budget: Budget, tokens: int) -> None:
    cls = RequestClass("short", budget=budget)
    out = plan(tokens, Route(Placement("c1", "c2"), cls))
    if not budget.enforced:
        assert out is None
        return
    limits = budget.resolved()
    cap = limits.largest_admissible
    if isinstance(out, Reject):
        assert out.status == 413
        assert cap is not None and tokens > cap
        for q in out.quotas:
            assert q.window_s is None or 1 <= q.window_s < 10**15
        dict(rate_limit_headers(out))
    else:
        assert isinstance(out, Demand)
        assert cap is None or tokens <= cap
        assert out.limits == limits  # the whole configured budget, never a share


@settings(max_examples=300, deadline=None)
@given(ANY_FLOAT, st.randoms())
def test_jittered_seconds_and_unavailable_are_bounded(wait: float, rng: Random) -> None:
    assert 1 <= jittered_seconds(wait, rng) <= MAX_RETRY_AFTER_S
    demand = Demand("c1", "short", 1, Budget(max_concurrent=1), Budget(0, 1))
    reject = unavailable(demand, wait, rng)
    assert reject.status == 503
    assert reject.retry_after_s is not None and 1 <= reject.retry_after_s <= MAX_RETRY_AFTER_S
    bounded = bounded_wait(wait)
    assert 0 <= bounded <= MAX_RETRY_AFTER_S
    format_duration(bounded)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(min_value=0.0, allow_nan=False),
    st.floats(min_value=0.0, allow_nan=False),
    CLOCK,
    CLOCK,
    CLOCK,
)
def test_release_rates_never_raise_and_are_not_negative(
    count: float, tokens: float, at: float, since: float, now: float
) -> None:
    req, tok = ReleaseStats(count, tokens, at, since).rates(now, RELEASE_RATE_TAU_S)
    for rate in (req, tok):
        assert math.isnan(rate) or rate >= 0


def test_denormal_decay_window_gives_the_longest_hint_not_a_crash() -> None:
    """Every second of the idle window the issue measured (7,050-7,450 s) answers a 429."""
    budget = Budget(max_inflight_tokens=40_000, max_concurrent=4)
    demand = Demand("c1", "short", 30_000, budget, budget.resolved())
    for idle in range(7_000, 7_500):
        answer = LedgerAnswer(
            False,
            None,
            CompartmentUsage(30_000, 4, 0.0),
            ReleaseStats(3.0, 9_000.0, 0.0, -5.0),
            idle,
        )
        reject = verdict(demand, answer, Random(idle))
        assert isinstance(reject, Reject)
        assert_hints_bounded(reject)


def test_an_infinite_token_rate_is_a_config_error() -> None:
    doc = {
        "version": 1,
        "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:8001"]}],
        "classes": [{"name": "short", "budget": {"tokens_per_second": "inf"}}],
    }
    with pytest.raises(ConfigError, match="tokens_per_second"):
        parse_config(doc)

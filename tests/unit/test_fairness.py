"""Fair shares among tenants inside a class (extproc/core/flow.py, core/tenants.py,
core/tenant_limits.py, ledger/tenant_limits.py): token-weighted order, its bound, tenants as
keyed labels, per-tenant limits and the 429 that names them."""

from __future__ import annotations

from random import Random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config.load import ConfigError, parse_config
from extproc.config.runtime import flow_params
from extproc.core.admission import Reason
from extproc.core.api import ErrorStyle
from extproc.core.flow import Fairness, FairQueue, FlowParams, TenantFallback, TenantLimit
from extproc.core.ratelimit_headers import rate_limit_headers
from extproc.core.tenant_limits import TenantUse, refusal, share
from extproc.core.tenants import resolve_tenant, tenant_key
from extproc.ledger.tenant_limits import TenantLimits, TenantSlot

SECRET = b"s" * 32


@settings(max_examples=300, deadline=None)
@given(
    tenants=st.lists(
        st.tuples(
            st.sampled_from([1.0, 2.0, 0.5]),  # weight
            st.lists(st.integers(1, 1_000_000), min_size=1, max_size=6),  # request sizes
        ),
        min_size=2,
        max_size=5,
    ),
    served=st.integers(min_value=1, max_value=80),
)
def test_token_fairness_bound_while_backlogged(
    tenants: list[tuple[float, list[int]]], served: int
) -> None:
    """Tokens fairness: while tenants a and b both wait, the tokens they were served (per
    weight) differ by at most one largest request of each: |S_a/w_a - S_b/w_b| <=
    s_max(a)/w_a + s_max(b)/w_b, whatever their request sizes (the FairQueue docstring's
    bound). A tenant of million-token requests cannot take fifty times a small one's share."""
    flow = FlowParams(fairness=Fairness.TOKENS)
    q: FairQueue[tuple[int, int]] = FairQueue()
    backlog = 60
    for i in range(backlog):  # interleaved arrivals; sizes cycle through each tenant's list
        for t, (weight, sizes) in enumerate(tenants):
            size = sizes[i % len(sizes)]
            q.push((t, size), f"t{t}", weight, size, service=flow.service(size))
    got = [0] * len(tenants)
    left = [backlog] * len(tenants)
    for _ in range(served):
        item = q.pop()
        assert item is not None
        t, size = item
        got[t] += size
        left[t] -= 1
        if min(left) == 0:
            break
        for a, (wa, sa) in enumerate(tenants):
            for b, (wb, sb) in enumerate(tenants):
                gap = abs(got[a] / wa - got[b] / wb)
                assert gap <= max(sa) / wa + max(sb) / wb + 1e-6


def test_tokens_fairness_serves_a_small_tenant_before_a_flood_drains() -> None:
    """A flood of million-token requests queued first; a steady tenant's five 20k requests
    that arrive after it are all served before the flood's next one under tokens fairness
    (unit costs: one flood request between each of them; FIFO: after the whole flood)."""

    def floods_before_steadys_last(fairness: Fairness) -> int:
        flow = FlowParams(fairness=fairness)
        q: FairQueue[str] = FairQueue()
        for i in range(11):
            q.push(f"flood{i}", "flood", 1.0, 1_000_000, service=flow.service(1_000_000))
        assert q.pop() == "flood0"  # the flood's first is being served when steady arrives
        for i in range(5):
            q.push(f"steady{i}", "steady", 1.0, 20_000, service=flow.service(20_000))
        n = 0
        while (item := q.pop()) != "steady4":
            assert item is not None
            n += item.startswith("flood")
        return n

    assert floods_before_steadys_last(Fairness.TOKENS) == 0
    assert floods_before_steadys_last(Fairness.REQUESTS) == 4
    assert floods_before_steadys_last(Fairness.FIFO) == 10


def test_output_is_charged_while_contended_and_idle_time_is_not_banked() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a1", "a", service=100)
    q.push("b1", "b", service=100)
    assert q.pop() == "a1"
    # a's output (charged once known) puts its next request behind b's next one.
    q.charge("a", 500)
    q.push("a2", "a", service=100)
    q.push("b2", "b", service=100)
    assert [q.pop(), q.pop(), q.pop()] == ["b1", "b2", "a2"]
    # Idle: nothing is owed; a tenant arriving now starts at V like everyone else.
    q.charge("a", 10_000)  # no queue: no effect
    q.push("c1", "c", service=100)
    q.push("a3", "a", service=100)
    assert [q.pop(), q.pop()] == ["c1", "a3"]


def test_a_tenant_that_was_away_starts_at_the_least_counter_still_waiting() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push(f"busy{i}", "busy", service=10)
    for _ in range(3):
        q.pop()
    # Arriving now, "late" starts at V (the tag last served), not at zero: it is served next
    # once, then alternates with busy; it cannot jump the queue with credit for its absence
    # (from zero, all three of its requests would go first).
    assert q.place_for("late") == 0
    for i in range(3):
        q.push(f"late{i}", "late", service=10)
    assert [q.pop() for _ in range(5)] == ["late0", "busy3", "late1", "busy4", "late2"]


@pytest.mark.parametrize("fairness", [Fairness.TOKENS, Fairness.REQUESTS, Fairness.FIFO])
def test_a_newcomer_behind_a_flood_counts_only_the_waiters_it_would_follow(
    fairness: Fairness,
) -> None:
    """The wait estimate's count: under fair order a tenant arriving behind another tenant's
    200 waiters follows only the flood's waiters tagged no later than its own start (its
    head), not all 200; under FIFO it follows every one of them."""
    flow = FlowParams(fairness=fairness)
    q: FairQueue[str] = FairQueue()
    for i in range(200):
        claim = flow.claim("flood", None, 50_000)
        q.push(f"f{i}", claim.tenant, claim.weight, 50_000, service=claim.service)
    n, tokens = q.ahead_for("steady")
    if fairness is Fairness.FIFO:
        assert (n, tokens) == (200, 200 * 50_000)
    else:
        assert (n, tokens) == (1, 50_000)  # the flood's head: its tag is V, like the newcomer's
    # The estimate names the newcomer's actual place: pushed, it is served after exactly n.
    claim = flow.claim("steady", None, 1_000)
    seq = q.push("s0", claim.tenant, claim.weight, 1_000, service=claim.service)
    assert q.ahead_of(seq) == (n, tokens)
    # The flooding tenant's own next request follows its whole backlog under any order.
    assert q.ahead_for("flood")[0] == 201


def test_fifo_is_arrival_order() -> None:
    flow = FlowParams(fairness=Fairness.FIFO)
    q: FairQueue[str] = FairQueue()
    for name, tenant, size in (("x", "a", 10**6), ("y", "b", 1), ("z", "a", 5)):
        q.push(name, tenant, 1.0, size, service=flow.service(size))
    assert [q.pop(), q.pop(), q.pop()] == ["x", "y", "z"]


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["push", "pop", "remove"]), st.integers(0, 3)),
        min_size=1,
        max_size=80,
    )
)
def test_a_waiter_that_leaves_is_never_served_and_none_is_lost(ops: list[tuple[str, int]]) -> None:
    """A waiter whose client disconnects (remove) is never served; every other is served
    exactly once, in the queue's order."""
    q: FairQueue[int] = FairQueue()
    live: dict[int, int] = {}  # item -> id
    served: list[int] = []
    gone: set[int] = set()
    serial = 0
    for op, arg in ops:
        if op == "push":
            serial += 1
            live[serial] = q.push(serial, f"t{arg}", 1.0 + arg, 1, service=10.0 ** (arg + 1))
        elif op == "pop" and live:
            item = q.pop()
            assert item is not None and item in live
            del live[item]
            served.append(item)
        elif op == "remove" and live:
            item = sorted(live)[arg % len(live)]
            assert q.remove(live.pop(item))
            gone.add(item)
            assert not q.remove(-1)
    while (item := q.pop()) is not None:
        served.append(item)
        del live[item]
    assert not live and len(q) == 0
    assert len(served) == len(set(served)) and not gone & set(served)
    assert set(served) | gone == set(range(1, serial + 1))


def test_tenant_from_the_trusted_header_else_the_fallback() -> None:
    headers = {"x-tenant": "acme", "authorization": "Bearer sk-123", "x-tier": "gold"}
    by_header = resolve_tenant(headers, "gold", "x-tenant", TenantFallback.TIER, SECRET)
    assert by_header.source == "header" and by_header.key == tenant_key("acme")
    no_header = {k: v for k, v in headers.items() if k != "x-tenant"}
    by_key = resolve_tenant(no_header, "gold", "x-tenant", TenantFallback.API_KEY, SECRET)
    by_x_api_key = resolve_tenant(
        {"x-api-key": "sk-123"}, None, None, TenantFallback.API_KEY, SECRET
    )
    assert by_key.source == "api_key" and by_key.key == by_x_api_key.key
    by_tier = resolve_tenant(no_header, "gold", "x-tenant", TenantFallback.TIER, SECRET)
    assert by_tier.source == "tier" and by_tier.key != by_key.key
    shared = resolve_tenant(no_header, "gold", "x-tenant", TenantFallback.NONE, SECRET)
    assert shared.source == "shared"
    assert resolve_tenant({}, None, None, TenantFallback.TIER, SECRET) == shared


def test_tenant_is_never_its_raw_value_and_labels_are_keyed() -> None:
    name = "customer-acme@example.com"
    one = resolve_tenant({"x-tenant": name}, None, "x-tenant", TenantFallback.TIER, SECRET)
    other = resolve_tenant({"x-tenant": name}, None, "x-tenant", TenantFallback.TIER, b"o" * 32)
    for value in (one.key, one.label, other.label):
        assert name not in value and "acme" not in value
    # Shared state agrees across replicas whatever their secret; labels do not.
    assert one.key == other.key and one.label != other.label


def test_named_tenants_compile_to_their_keys() -> None:
    cfg = parse_config(
        {
            "version": 1,
            "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:8000"]}],
            "flow": {
                "tenant_header": "x-tenant",
                "tenant_limit": {"max_concurrent": 4},
                "tenants": {"big": {"weight": 3, "tokens_per_minute": 60000}},
            },
        }
    )
    flow = flow_params(cfg.flow)
    big = tenant_key("big")
    assert flow.weight(None, big) == 3 and flow.weight(None, tenant_key("small")) == 1
    assert flow.limit_for(big) == TenantLimit(4, 60000)
    assert flow.limit_for(tenant_key("small")) == TenantLimit(4, None)
    assert flow.fairness is Fairness.TOKENS and flow.limits_tenants


def test_named_tenants_need_the_tenant_header() -> None:
    with pytest.raises(ConfigError, match=r"flow\.tenants: needs flow\.tenant_header"):
        parse_config(
            {
                "version": 1,
                "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:8000"]}],
                "flow": {"tenants": {"big": {"weight": 2}}},
            }
        )


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tenant_concurrency_and_token_rate() -> None:
    clock = _Clock()
    limits = TenantLimits(clock)
    own = TenantLimit(max_concurrent=2, tokens_per_minute=600)
    a = limits.take("a", 100, own)
    b = limits.take("a", 100, own)
    assert isinstance(a, TenantSlot) and isinstance(b, TenantSlot)
    third = limits.take("a", 100, own)
    assert third == TenantUse(2, 400.0)  # over its concurrency
    assert isinstance(limits.take("other", 100, own), TenantSlot)  # tenants are separate
    limits.give(a)
    over_rate = limits.take("a", 500, own)
    assert isinstance(over_rate, TenantUse) and over_rate.bucket_tokens == 400.0
    clock.now += 10.0  # 10 s refill 100 tokens
    assert isinstance(limits.take("a", 500, own), TenantSlot)
    # A request larger than the whole bucket waits for a full one rather than forever.
    limits.give(b)
    clock.now += 60.0
    assert isinstance(limits.take("big", 10_000, own), TenantSlot)


def test_idle_tenants_are_forgotten() -> None:
    clock = _Clock()
    limits = TenantLimits(clock)
    own = TenantLimit(max_concurrent=1)
    for i in range(1100):
        slot = limits.take(f"t{i}", 1, own)
        assert isinstance(slot, TenantSlot)
        limits.give(slot)
    clock.now += 61.0
    held = limits.take("busy", 1, own)
    assert isinstance(held, TenantSlot)
    assert len(limits) < 1100


def test_each_replica_enforces_its_share() -> None:
    assert share(TenantLimit(10, 6000), 3) == TenantLimit(3, 2000)
    assert share(TenantLimit(1, None), 4) == TenantLimit(1, None)


def test_the_429_names_the_tenants_limit_not_the_class() -> None:
    own = TenantLimit(max_concurrent=2, tokens_per_minute=6000)
    reject = refusal(own, TenantUse(2, 5000.0), 100, "long", "c1", Random(1))
    assert reject.status == 429 and reject.reason is Reason.TENANT_CONCURRENCY
    assert "tenant" in reject.message and "own limit" in reject.message
    headers = dict(rate_limit_headers(reject, ErrorStyle.OPENAI))
    assert '"tenant-concurrency";q=2;qu="concurrent-requests"' in headers["ratelimit-policy"]
    assert '"tenant-rate";q=6000;fleet-unit="tokens";w=60' in headers["ratelimit-policy"]
    assert headers["ratelimit"].startswith('"tenant-concurrency";r=0')
    assert headers["x-ratelimit-limit-tokens"] == "6000"
    assert "long-" not in headers["ratelimit-policy"]  # no class quota in it
    anthropic = dict(rate_limit_headers(reject, ErrorStyle.ANTHROPIC, wall_now=1.8e9))
    assert anthropic["anthropic-ratelimit-requests-limit"] == "2"
    assert anthropic["anthropic-ratelimit-tokens-limit"] == "6000"

    rate = refusal(own, TenantUse(0, 50.0), 650, "long", "c1", Random(1))
    assert rate.reason is Reason.TENANT_TOKEN_RATE
    # 600 tokens missing at 100 tokens/s: 6 s, plus jitter.
    assert rate.retry_after_s is not None and 6 <= rate.retry_after_s <= 8
    assert "tokens per minute" in rate.message


def test_a_waiter_that_leaves_unserved_is_not_charged_to_its_tenant() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("other", "o", service=100)
    gone = q.push("big", "a", service=10_000)
    q.push("small", "a", service=10)
    assert q.counter("a") == 10_010
    assert q.remove(gone)
    # Its 10,000 are given back; the waiter already queued keeps its tag (every replica's copy
    # of a fleet-wide order stays the same), a later one starts from the refunded counter.
    assert q.counter("a") == 10
    q.push("later", "a", service=10)
    assert [q.pop(), q.pop(), q.pop()] == ["other", "later", "small"]


def test_bench_fairness_rows_show_token_fairness_sharing_a_contended_class() -> None:
    """``extproc bench fairness`` on a short virtual run: every row is computed, and under
    heavy load token fairness gives the flooding tenant about its 1/21 share where unit costs
    give it several times that (the run is deterministic for a seed)."""
    from extproc.bench.fairness import HEADER, Shape, rows

    table = {(r[0], r[1]): dict(zip(HEADER, r, strict=True)) for r in rows(Shape(240.0), 3)}
    assert len(table) == 10
    tokens, requests = table["heavy", "tokens"], table["heavy", "requests"]
    assert float(tokens["Jain all"]) >= 0.95 > float(requests["Jain all"])
    assert float(tokens["flood share"]) < 0.1 < float(requests["flood share"])
    # Work-conserving: with light steady tenants the flood takes what they leave.
    light = table["light", "tokens"]
    assert float(light["flood share"]) > 0.4 and float(light["long util"]) > 0.85
    assert float(table["light", "fifo"]["steady 429"]) > float(light["steady 429"])


def test_top_tenants_keep_the_heavy_hitters_in_bounded_memory() -> None:
    from extproc.core.top_tenants import OTHER, TopTenants

    top = TopTenants(3)
    rng = Random(7)
    total = 0.0
    for i in range(5000):
        label = "heavy" if i % 3 == 0 else f"t{rng.randrange(500)}"
        tokens = 100.0 if label == "heavy" else 10.0
        top.add(label, tokens, 1)
        total += tokens
    rows = top.rows()
    assert len(rows) == 4 and rows[-1][0] == OTHER  # three tenants and "other", never more
    assert rows[0][0] == "heavy"  # served more than total / N: always kept, ranked first
    assert sum(tokens for _, tokens, _ in rows) == total  # nothing lost or counted twice
    assert sum(n for _, _, n in rows) == 5000


def test_bench_admission_measures_the_fair_queue_beside_fifo() -> None:
    from extproc.bench.fair_queue_cost import memory_rows, tenant_us

    rows = memory_rows(50)
    assert [(r.where, r.fairness) for r in rows] == [("memory", "fifo"), ("memory", "tokens")]
    assert all(len(r.join_leave_us) == 50 and min(r.join_leave_us) > 0 for r in rows)
    assert len(tenant_us(30)) == 30

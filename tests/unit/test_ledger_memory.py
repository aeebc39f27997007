"""The in-memory ledger and the gate in embedded mode (no Redis configured)."""

from __future__ import annotations

import asyncio
from random import Random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.config.load import parse_config
from extproc.config.runtime import Runtime, compile_runtime
from extproc.core.admission import (
    Admitted,
    Demand,
    Reason,
    Reject,
    Ticket,
    plan,
    request_tokens,
)
from extproc.core.api import Api
from extproc.core.facts import RequestFacts
from extproc.core.fleet import Budget
from extproc.core.keys import KeySource, hash_key
from extproc.ledger.gate import build_gate
from extproc.ledger.memory import MemoryLedger


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def demand(limits: Budget, tokens: int, cluster: str = "c1", cls: str = "short") -> Demand:
    budget = Budget(
        limits.max_inflight_tokens,
        limits.max_concurrent,
        limits.tokens_per_second,
        limits.burst_tokens,
    )
    return Demand(cluster, cls, tokens, budget, limits)


async def test_reserve_enforces_inflight_tokens_and_release_gives_them_back() -> None:
    ledger = MemoryLedger(FakeClock())
    d = demand(Budget(max_inflight_tokens=1000), 400)
    a1, a2, a3 = [await ledger.reserve(d) for _ in range(3)]
    assert a1.granted and a2.granted and not a3.granted
    assert a2.usage.inflight_tokens == 800 and a2.usage.concurrent == 2
    assert a3.usage.inflight_tokens == 800  # a refusal changes nothing
    assert a1.ticket is not None
    assert await ledger.release(a1.ticket) is True
    assert (await ledger.reserve(d)).granted


async def test_release_is_idempotent_and_never_goes_negative() -> None:
    ledger = MemoryLedger(FakeClock())
    d = demand(Budget(max_concurrent=2), 10)
    ans = await ledger.reserve(d)
    assert ans.ticket is not None
    assert await ledger.release(ans.ticket) is True
    assert await ledger.release(ans.ticket) is False
    unknown = Ticket("c9", "nope", 5, "m999", "memory")
    assert await ledger.release(unknown) is False
    usage = (await ledger.usage("c1", "short", d.limits)).usage
    assert (usage.inflight_tokens, usage.concurrent) == (0, 0)


async def test_compartments_are_independent_per_cluster_and_class() -> None:
    ledger = MemoryLedger(FakeClock())
    lim = Budget(max_concurrent=1)
    assert (await ledger.reserve(demand(lim, 1, "c1", "short"))).granted
    assert not (await ledger.reserve(demand(lim, 1, "c1", "short"))).granted
    assert (await ledger.reserve(demand(lim, 1, "c2", "short"))).granted
    assert (await ledger.reserve(demand(lim, 1, "c1", "long"))).granted


async def test_concurrent_reservations_never_overshoot() -> None:
    ledger = MemoryLedger(FakeClock())
    d = demand(Budget(max_inflight_tokens=10_000, max_concurrent=37), 100)
    answers = await asyncio.gather(*(ledger.reserve(d) for _ in range(500)))
    granted = [a for a in answers if a.granted]
    assert len(granted) == 37
    assert max(a.usage.concurrent for a in answers) == 37
    assert len({a.ticket.lease for a in granted if a.ticket}) == 37


async def test_token_bucket_refills_at_the_configured_rate() -> None:
    clock = FakeClock()
    ledger = MemoryLedger(clock)
    lim = Budget(tokens_per_second=100.0, burst_tokens=1000)
    d = demand(lim, 600)
    first = await ledger.reserve(d)
    assert first.granted and first.usage.bucket_tokens == pytest.approx(400.0)
    assert not (await ledger.reserve(d)).granted
    clock.t += 1.5  # +150 tokens: 550 < 600
    refused = await ledger.reserve(d)
    assert not refused.granted and refused.usage.bucket_tokens == pytest.approx(550.0)
    clock.t += 0.5
    assert (await ledger.reserve(d)).granted
    clock.t += 3600
    full = await ledger.usage("c1", "short", lim)
    assert full.usage.bucket_tokens == pytest.approx(1000.0)  # capped at the burst


async def test_release_rate_estimate_tracks_the_real_completion_rate() -> None:
    clock = FakeClock()
    ledger = MemoryLedger(clock)
    d = demand(Budget(max_concurrent=1000), 250)
    rate = 5.0  # completions per second
    for step in range(300):  # 60 s
        ans = await ledger.reserve(d)
        assert ans.ticket is not None
        clock.t += 1 / rate
        await ledger.release(ans.ticket)
        if step == 10:  # ~2 s in: the bias correction already gives the right magnitude
            early = (await ledger.usage("c1", "short", d.limits)).released.rates(clock.t)
            assert early[0] == pytest.approx(rate, rel=0.25)
    snap = await ledger.usage("c1", "short", d.limits)
    req_rate, tok_rate = snap.released.rates(snap.now)
    assert req_rate == pytest.approx(rate, rel=0.05)
    assert tok_rate == pytest.approx(rate * 250, rel=0.05)


# -- the gate, embedded mode ----------------------------------------------------------------------


def runtime(replicas: int = 1, long_budget: dict[str, Any] | None = None, **budget: Any) -> Runtime:
    doc = {
        "version": 1,
        "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:8001"]}],
        "classes": [
            {"name": "short", "max_input_tokens": 1001, "budget": budget},
            {"name": "long", "budget": long_budget or {}},
        ],
        "redis": {"replicas": replicas},
    }
    return compile_runtime(parse_config(doc))


def request(input_tokens: int, max_output: int | None = None) -> RequestFacts:
    return RequestFacts(
        api=Api.OPENAI_CHAT,
        model="m",
        session=hash_key(KeySource.HEADER, b"s"),
        input_tokens=input_tokens,
        max_output_tokens=max_output,
        tier=None,
        stream=False,
        body_bytes=input_tokens * 4,
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_gate_admits_rejects_and_gauges_return_to_zero() -> None:
    rt = runtime(max_inflight_tokens=1000, max_concurrent=3)
    registry = CollectorRegistry()
    gate = build_gate(rt, registry, FakeClock(), Random(1))
    await gate.start()
    f = request(150, max_output=50)  # costs its 150 input tokens; the output cap does not count
    route = rt.policy.route(f)
    outcomes = [await gate.admit(f, route) for _ in range(4)]
    admitted = [o for o in outcomes if isinstance(o, Admitted)]
    rejects = [o for o in outcomes if isinstance(o, Reject)]
    assert len(admitted) == 3 and len(rejects) == 1
    assert rejects[0].status == 429 and rejects[0].reason is Reason.CONCURRENCY
    labels = {"cluster": "c1", "request_class": "short"}
    assert sample(registry, "fleet_budget_inflight_tokens", **labels) == 450
    assert sample(registry, "fleet_budget_inflight_requests", **labels) == 3
    assert sample(registry, "fleet_budget_limit_tokens", **labels) == 1000
    assert sample(registry, "fleet_budget_limit_requests", **labels) == 3
    assert sample(registry, "fleet_admissions_total", request_class="short", result="admitted") == 3
    assert (
        sample(
            registry,
            "fleet_admission_rejections_total",
            request_class="short",
            status="429",
            reason="concurrency",
        )
        == 1
    )
    assert sample(registry, "fleet_ledger_mode", mode="local") == 1
    for o in admitted:
        await gate.release(o.ticket)
        await gate.release(o.ticket)  # idempotent
    assert gate.held == 0
    assert sample(registry, "fleet_budget_inflight_tokens", **labels) == 0
    assert sample(registry, "fleet_budget_inflight_requests", **labels) == 0
    assert sample(registry, "fleet_ledger_leases_held", ledger="memory") == 0
    await gate.close()


async def test_gate_skips_the_ledger_for_unbudgeted_classes_and_413s_oversized_requests() -> None:
    rt = runtime(max_inflight_tokens=1000)
    registry = CollectorRegistry()
    gate = build_gate(rt, registry, FakeClock(), Random(1))
    big = request(5000)  # the "long" class: no budget
    assert await gate.admit(big, rt.policy.route(big)) is None
    assert gate.held == 0
    assert (
        sample(registry, "fleet_admissions_total", request_class="long", result="unbudgeted") == 1
    )

    capped = runtime(max_inflight_tokens=1000, long_budget={"max_inflight_tokens": 3000})
    registry = CollectorRegistry()
    gate = build_gate(capped, registry, FakeClock(), Random(1))
    huge = request(5000)  # the catch-all "long" class, over its whole 3000-token budget
    out = await gate.admit(huge, capped.policy.route(huge))
    assert isinstance(out, Reject) and out.status == 413
    assert gate.held == 0
    assert sample(registry, "fleet_admissions_total", request_class="long", result="too_large") == 1


async def test_embedded_replicas_each_enforce_their_share() -> None:
    rt = runtime(replicas=4, max_concurrent=8)
    gate = build_gate(rt, CollectorRegistry(), FakeClock(), Random(1))
    f = request(10)
    route = rt.policy.route(f)
    results = [await gate.admit(f, route) for _ in range(5)]
    assert sum(isinstance(r, Admitted) for r in results) == 8 // 4


async def test_releasing_a_ticket_the_gate_never_issued_changes_nothing() -> None:
    rt = runtime(max_concurrent=2)
    registry = CollectorRegistry()
    gate = build_gate(rt, registry, FakeClock(), Random(1))
    f = request(10)
    out = await gate.admit(f, rt.policy.route(f))
    assert isinstance(out, Admitted)
    foreign = Ticket(out.ticket.cluster, out.ticket.class_name, 10, "elsewhere:1", "redis")
    await gate.release(foreign)
    assert gate.held == 1
    labels = {"cluster": out.ticket.cluster, "request_class": "short"}
    assert sample(registry, "fleet_budget_inflight_requests", **labels) == 1
    await gate.release(out.ticket)
    assert gate.held == 0
    assert sample(registry, "fleet_budget_inflight_requests", **labels) == 0


def test_plan_for_the_gate_uses_the_primary_cluster() -> None:
    rt = runtime(max_concurrent=2)
    f = request(10)
    route = rt.policy.route(f)
    d = plan(request_tokens(f), route)
    assert isinstance(d, Demand) and d.cluster == route.placement.primary

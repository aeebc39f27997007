"""A tenant's own limits as explain shows them and as the local fallback enforces them, against
a real redis-server: explain reads the tenant's fleet-wide count (its live leases and bucket)
without writing anything; while Redis is unreachable the 429 names the replica's share it
enforces and a budget refusal takes nothing from the tenant's bucket; a tenant refused at the
head of the queue is counted as that, not as a timed-out wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from random import Random
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry

from extproc.core.admission import Admitted, Demand, Reason, Reject, TenantClaim
from extproc.core.api import ErrorStyle
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.flow import TenantLimit
from extproc.core.ratelimit_headers import rate_limit_headers
from extproc.ledger.gate import build_gate
from extproc.ledger.redis import tenant_keys
from extproc.pipeline.outcomes import Rejected, Routed, Waiting
from extproc.pipeline.pipeline import Pipeline
from tests.stream.test_flow import BODY, CHAT, doc, headers, make, sample, session_on, wait_until
from tests.stream.test_ledger_redis import request, runtime
from tests.support.redis_server import RedisServer

# ~4,000 estimated input tokens: a bucket of 600,000 a minute refills 10,000 a second.
BIG_BODY = orjson.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "a line of a long prompt. " * 640}]}
)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def facts_of(pipeline: Pipeline, hdrs: dict[str, str], body: bytes) -> RequestFacts:
    rt = pipeline.runtime
    facts = parse_request(CHAT, hdrs, body, rt.key_rules, rt.parse_limits)
    assert isinstance(facts, RequestFacts)
    return facts


def redis_writes(probe: redis.Redis) -> int:
    """Writes Redis has applied since its last save (every write counts, scripts' too)."""
    return int(probe.info("persistence")["rdb_changes_since_last_save"])


async def test_explain_reads_the_tenants_fleet_wide_count_without_writing(
    server: RedisServer,
) -> None:
    rate = 600_000
    limited = doc(
        redis={"url": server.url, "replicas": 2, "timeout_ms": 2000},
        **{"classes": [{"name": "long", "budget": {"max_concurrent": 16}}]},
    )
    limited["flow"]["tenant_limit"] = {"max_concurrent": 8, "tokens_per_minute": rate}
    a, gate_a, _ = await make(limited)
    b, gate_b, _ = await make(limited)
    try:
        held: list[Routed] = []
        for pipeline, sid in ((a, "s1"), (a, "s2"), (b, "s3")):
            outcome = await pipeline.decide(headers(sid, "t1"), BIG_BODY, 1.0)
            assert isinstance(outcome, Routed)
            held.append(outcome)
        hdrs = headers("s4", "t1")
        facts = facts_of(a, hdrs, BIG_BODY)
        primary = held[0].route.placement.primary
        (leases, state) = tenant_keys("fleet", a._tenant(a.runtime, hdrs, facts).key)
        with redis.Redis.from_url(server.url) as probe:
            # A lease whose holder died: it no longer counts, and a look does not reap it.
            probe.zadd(leases, {"dead:1": 1.0})
            writes = redis_writes(probe)
            view = await a.tenant_view(hdrs, facts, primary, "long")
            assert redis_writes(probe) == writes, "explain wrote to Redis"
            assert probe.zscore(leases, "dead:1") == 1.0
            stored = probe.hmget(state, "level", "level_at")
            seconds, micros = probe.time()
        limits: dict[str, Any] = view["limits"]  # type: ignore[assignment]
        assert limits["counted_in"] == "redis"
        # Both replicas' requests: the fleet-wide count, not this replica's two.
        assert limits["inflight"] == 3
        assert limits["max_concurrent"] == 8 and limits["tokens_per_minute"] == rate
        # The bucket as the next reserve would see it: drawn by the three requests (the
        # level they left, refilled at most up to the instant read after the look).
        level, at = float(stored[0]), float(stored[1])
        refilled = min(rate, level + (seconds + micros / 1e6 - at) * rate / 60)
        assert level - 0.1 <= limits["bucket_tokens"] <= refilled + 0.1
        # The look took no lease: the tenant may still start its other five.
        for pipeline in (a, b):
            again = await pipeline.tenant_view(hdrs, facts, primary, "long")
            assert again["limits"]["inflight"] == 3  # type: ignore[index]
        for outcome in held:
            await (a if outcome is not held[2] else b).release(outcome.hold)
        view = await b.tenant_view(hdrs, facts, primary, "long")
        assert view["limits"]["inflight"] == 0  # type: ignore[index]
    finally:
        await gate_a.close()
        await gate_b.close()


async def test_explain_without_redis_shows_this_replicas_count() -> None:
    memory = doc(**{"classes": [{"name": "long", "budget": {"max_concurrent": 16}}]})
    memory["flow"]["tenant_limit"] = {"max_concurrent": 8}
    pipeline, gate, _ = await make(memory)
    try:
        outcome = await pipeline.decide(headers("s1", "t1"), BODY, 1.0)
        assert isinstance(outcome, Routed)
        hdrs = headers("s2", "t1")
        view = await pipeline.tenant_view(
            hdrs, facts_of(pipeline, hdrs, BODY), outcome.route.placement.primary, "long"
        )
        limits: dict[str, Any] = view["limits"]  # type: ignore[assignment]
        assert limits["counted_in"] == "memory" and limits["inflight"] == 1
        assert limits["bucket_tokens"] is None  # no tokens-per-minute limit
        await pipeline.release(outcome.hold)
    finally:
        await gate.close()


async def test_redis_down_the_tenants_429_names_the_share_it_enforces(
    server: RedisServer,
) -> None:
    rt = runtime(server.url, budget={"max_concurrent": 100}, replicas=2, timeout_ms=300)
    gate = build_gate(rt, CollectorRegistry(), time.monotonic, Random(1), probe_interval_s=60.0)
    await gate.start()
    facts = request(rt)
    route = rt.policy.route(facts)
    limits = route.request_class.budget.resolved()
    claim = TenantClaim("t1", TenantLimit(max_concurrent=4, tokens_per_minute=1000))
    want = Demand(route.placement.primary, "short", 10, route.request_class.budget, limits, claim)
    server.kill()
    held = [(await gate.attempt(want)).outcome for _ in range(2)]  # its share: 4 / 2 replicas
    assert all(isinstance(o, Admitted) and o.ticket.store == "memory" for o in held)
    # The look a request takes while others wait in this replica's queue, and the reserve.
    for reserve in (False, True):
        refused = (await gate.attempt(want, reserve=reserve)).outcome
        assert isinstance(refused, Reject) and refused.reason is Reason.TENANT_CONCURRENCY
        got = dict(rate_limit_headers(refused, ErrorStyle.ANTHROPIC, time.time()))
        assert '"tenant-concurrency";q=2;' in got["ratelimit-policy"], got
        assert '"tenant-rate";q=500;' in got["ratelimit-policy"], got
        assert got["x-ratelimit-limit-tokens"] == "500"
        assert got["anthropic-ratelimit-requests-limit"] == "2"
        assert got["anthropic-ratelimit-tokens-limit"] == "500"
    where, own, use = await gate.tenant_use(claim)
    assert where == "local" and own.limit == TenantLimit(2, 500) and use.inflight == 2
    for o in held:
        assert isinstance(o, Admitted)
        await gate.release(o.ticket)
    await gate.close()


async def test_redis_down_a_budget_refusal_takes_nothing_from_the_tenants_bucket(
    server: RedisServer,
) -> None:
    # One replica of two: the class's share is 1 request, the tenant's 500 tokens a minute.
    rt = runtime(server.url, budget={"max_concurrent": 2}, replicas=2, timeout_ms=300)
    now = [1000.0]  # a still clock: the bucket refills only when the test says so
    gate = build_gate(rt, CollectorRegistry(), lambda: now[0], Random(1))
    await gate.start()
    facts = request(rt)
    route = rt.policy.route(facts)
    budget = route.request_class.budget
    cluster = route.placement.primary
    claim = TenantClaim("t1", TenantLimit(tokens_per_minute=1000))
    big = Demand(cluster, "short", 300, budget, budget.resolved(), claim)
    other = Demand(cluster, "short", 10, budget, budget.resolved(), TenantClaim("t2"))
    server.kill()
    holder = (await gate.attempt(other)).outcome
    assert isinstance(holder, Admitted) and holder.ticket.store == "memory"
    refused = (await gate.attempt(big)).outcome
    assert isinstance(refused, Reject)
    assert refused.reason in (Reason.CONCURRENCY, Reason.LOCAL_SHARE)
    await gate.release(holder.ticket)
    # The bucket still holds its 500 (not the 200 left had the refused request kept its 300).
    admitted = (await gate.attempt(big)).outcome
    assert isinstance(admitted, Admitted), admitted
    _, _, use = await gate.tenant_use(claim)
    assert use.bucket_tokens == 200 and use.inflight == 1
    await gate.release(admitted.ticket)
    await gate.close()


async def test_a_tenant_refused_at_the_head_of_the_queue_is_counted_as_such(
    server: RedisServer,
) -> None:
    queued = doc(wait_s=60.0, redis={"url": server.url, "timeout_ms": 2000})
    queued["flow"]["tenant_limit"] = {"max_concurrent": 1}
    pipeline, gate, registry = await make(queued)
    try:
        blocker = await pipeline.decide(headers(session_on(pipeline, "c1", "x"), "t0"), BODY, 1.0)
        assert isinstance(blocker, Routed) and blocker.route.placement.primary == "c1"
        # t1 waits on c1 (its tenant has nothing in flight yet) ...
        waiting = await pipeline.decide(
            headers(session_on(pipeline, "c1", "w"), "t1"), BODY, 2.0, wait=False
        )
        assert isinstance(waiting, Waiting)
        task = asyncio.create_task(waiting.resume())
        await wait_until(lambda: gate.waiters.depth("c1", "long") == 1)
        # ... while another of its requests is admitted on c2: t1 is at its limit.
        running = await pipeline.decide(headers(session_on(pipeline, "c2", "y"), "t1"), BODY, 3.0)
        assert isinstance(running, Routed) and running.route.placement.primary == "c2"
        await pipeline.release(blocker.hold)  # the waiter heads c1 with room, over its tenant's
        outcome = await asyncio.wait_for(task, timeout=30)
        assert isinstance(outcome, Rejected)
        assert outcome.reject.reason is Reason.TENANT_CONCURRENCY
        waits = {
            result: sample(registry, "fleet_flow_waits_total", request_class="long", result=result)
            for result in ("tenant_limit", "timeout")
        }
        assert waits == {"tenant_limit": 1, "timeout": 0}
        await pipeline.release(running.hold)
        assert gate.held == 0 and len(gate.waiters) == 0
    finally:
        await gate.close()

"""A tenant's own limits in the Redis ledger, against a real redis-server: its requests in
flight and its tokens-per-minute bucket are counted fleet-wide by the reserve that admits the
request (reserve.lua, one round trip), given back with the lease (release.lua), renewed with it
(renew.lua) and reaped with it when its holder stops renewing."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from extproc.core.admission import Admitted, Demand, Reason, Reject, TenantClaim, Ticket
from extproc.core.fleet import Budget
from extproc.core.flow import TenantLimit
from extproc.core.ratelimit_headers import rate_limit_headers
from extproc.ledger.redis import RedisLedger, tenant_keys
from tests.stream.test_ledger_redis import client_calls, gate_for, request, runtime, sample
from tests.support.redis_server import RedisServer

HANG_S = 60.0
BUDGET = Budget(max_concurrent=100)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def demand(cluster: str, tenant: str, limit: TenantLimit, tokens: int = 10) -> Demand:
    return Demand(cluster, "short", tokens, BUDGET, BUDGET, TenantClaim(tenant, limit))


def live_leases(server: RedisServer, tenant: str) -> int:
    """The tenant's unexpired leases, read from Redis directly (its own clock)."""
    with redis.Redis.from_url(server.url) as probe:
        seconds, micros = probe.time()
        return int(
            probe.zcount(tenant_keys("fleet", tenant)[0], f"({seconds + micros / 1e6}", "+inf")
        )


async def ledgers(server: RedisServer, n: int, lease_ttl_s: float = 30.0) -> list[RedisLedger]:
    out = [
        RedisLedger.from_url(server.url, timeout_s=30.0, lease_ttl_s=lease_ttl_s) for _ in range(n)
    ]
    for ledger in out:
        await ledger.load()
    return out


async def test_max_concurrent_is_one_count_over_replicas_and_compartments(
    server: RedisServer,
) -> None:
    a, b = await ledgers(server, 2)
    limit = TenantLimit(max_concurrent=3)
    # Alternating replicas and clusters: one count for the tenant, whatever admits it.
    answers = [
        await (a if i % 2 == 0 else b).reserve(demand("c1" if i < 2 else "c2", "t1", limit))
        for i in range(4)
    ]
    assert [x.granted for x in answers] == [True, True, True, False]
    refused = answers[3]
    assert refused.tenant_refused and refused.tenant_inflight == 3
    # Refused by its tenant: the compartment was not charged.
    assert refused.usage.concurrent == 1
    # Another tenant is not held back by it.
    other = await b.reserve(demand("c2", "t2", limit))
    assert other.granted and not other.tenant_refused and other.tenant_inflight == 1
    assert live_leases(server, "t1") == 3

    first = answers[0].ticket
    assert first is not None and first.tenant == "t1"
    assert await b.release(first)  # released by another replica than the one that admitted it
    assert live_leases(server, "t1") == 2
    again = await b.reserve(demand("c1", "t1", limit))
    assert again.granted and again.tenant_inflight == 3
    for x in [*answers[1:3], again, other]:
        assert x.ticket is not None
        await a.release(x.ticket)
    assert live_leases(server, "t1") == live_leases(server, "t2") == 0
    await a.close()
    await b.close()


async def test_tokens_per_minute_is_one_bucket_over_replicas(server: RedisServer) -> None:
    a, b = await ledgers(server, 2)
    limit = TenantLimit(tokens_per_minute=100)
    first = await a.reserve(demand("c1", "t1", limit, tokens=60))
    assert first.granted and first.tenant_bucket == pytest.approx(40, abs=1)
    second = await b.reserve(demand("c2", "t1", limit, tokens=60))
    assert not second.granted and second.tenant_refused
    assert 40 <= second.tenant_bucket < 60
    # A refusal takes nothing from the bucket: a request that fits it is admitted.
    small = await b.reserve(demand("c2", "t1", limit, tokens=30))
    assert small.granted and small.tenant_bucket < 20
    await a.close()
    await b.close()


async def test_a_retried_reserve_counts_the_tenant_once(server: RedisServer) -> None:
    (a,) = await ledgers(server, 1)
    limit = TenantLimit(max_concurrent=2)
    lease = a.new_lease()
    first = await a.reserve(demand("c1", "t1", limit), lease)
    retried = await a.reserve(demand("c1", "t1", limit), lease)
    assert first.granted and retried.granted
    assert live_leases(server, "t1") == 1
    await a.close()


async def test_a_cancelled_reserve_gives_the_tenant_back(server: RedisServer) -> None:
    (a,) = await ledgers(server, 1)
    limit = TenantLimit(max_concurrent=1)
    lease = a.new_lease()
    assert (await a.reserve(demand("c1", "t1", limit), lease)).granted
    # The caller never saw the answer (timeout): the gate cancels the lease it chose.
    assert await a.cancel("c1", "short", lease, "t1")
    assert live_leases(server, "t1") == 0
    assert (await a.reserve(demand("c1", "t1", limit))).granted
    await a.close()


async def test_renewal_keeps_the_tenant_and_a_dead_holders_leases_lapse(
    server: RedisServer,
) -> None:
    ttl = 1.0
    holder, other = await ledgers(server, 2, lease_ttl_s=ttl)
    limit = TenantLimit(max_concurrent=2)
    held: list[Ticket] = []
    for cluster in ("c1", "c2"):
        answer = await holder.reserve(demand(cluster, "t1", limit))
        assert answer.ticket is not None
        held.append(answer.ticket)
    assert not (await other.reserve(demand("c1", "t1", limit))).granted
    # Renewed for three TTLs: the tenant's count stays (its leases are renewed with theirs).
    until = time.monotonic() + 3 * ttl
    while time.monotonic() < until:
        assert await holder.renew(held) == []
        assert live_leases(server, "t1") == 2
        await asyncio.sleep(ttl / 4)
    # The holder stops renewing (it died): the next reserve reaps its leases for the tenant.
    deadline = time.monotonic() + ttl + HANG_S
    while not (answer := await other.reserve(demand("c1", "t1", limit))).granted:
        assert answer.tenant_refused
        assert time.monotonic() < deadline, "a dead holder's leases kept counting for its tenant"
        await asyncio.sleep(0.05)
    assert answer.tenant_inflight == 1
    await holder.close()
    await other.close()


async def test_the_gate_answers_the_tenants_429_in_one_round_trip(server: RedisServer) -> None:
    rt = runtime(server.url, budget={"max_concurrent": 100})
    a, b = await gate_for(rt), await gate_for(rt)
    facts = request(rt)
    route = rt.policy.route(facts)
    limits = route.request_class.budget.resolved()
    cluster = route.placement.primary
    claim = TenantClaim("t1", TenantLimit(max_concurrent=3))
    want = Demand(cluster, "short", 10, route.request_class.budget, limits, claim)
    warm = await a.attempt(want)  # opens the pooled connections
    assert isinstance(warm.outcome, Admitted)
    await a.release(warm.outcome.ticket)
    warm = await b.attempt(want)
    assert isinstance(warm.outcome, Admitted)
    await b.release(warm.outcome.ticket)

    with redis.Redis.from_url(server.url) as probe:
        probe.ping()
        before = client_calls(probe)
        outcomes = [(await (a if i % 2 == 0 else b).attempt(want)).outcome for i in range(5)]
        after = client_calls(probe)
    assert +(after - before) == Counter({"evalsha": 5})  # one round trip each, refusals too
    admitted = [o for o in outcomes if isinstance(o, Admitted)]
    assert len(admitted) == 3
    refused = outcomes[3]
    assert isinstance(refused, Reject) and refused.status == 429
    assert refused.reason is Reason.TENANT_CONCURRENCY
    policy = dict(rate_limit_headers(refused))["ratelimit-policy"]
    assert '"tenant-concurrency";q=3' in policy, policy
    for o in admitted:
        await a.release(o.ticket)
        await b.release(o.ticket)
    assert live_leases(server, "t1") == 0
    again = await b.attempt(want)
    assert isinstance(again.outcome, Admitted)
    await b.release(again.outcome.ticket)
    await a.close()
    await b.close()


async def test_redis_down_falls_back_to_a_share_of_the_tenants_limit(server: RedisServer) -> None:
    rt = runtime(server.url, budget={"max_concurrent": 100}, replicas=2, timeout_ms=300)
    registry = CollectorRegistry()
    gate = await gate_for(rt, registry, probe_interval_s=0.2)
    facts = request(rt)
    route = rt.policy.route(facts)
    limits = route.request_class.budget.resolved()
    claim = TenantClaim("t1", TenantLimit(max_concurrent=4))
    want = Demand(route.placement.primary, "short", 10, route.request_class.budget, limits, claim)
    server.kill()
    # Like the class budget: this replica's share (4 / 2 replicas), the failure counted.
    outcomes = [(await gate.attempt(want)).outcome for _ in range(3)]
    assert [type(o).__name__ for o in outcomes] == ["Admitted", "Admitted", "Reject"]
    assert all(o.ticket.store == "memory" for o in outcomes[:2] if isinstance(o, Admitted))
    refused = outcomes[2]
    assert isinstance(refused, Reject) and refused.reason is Reason.TENANT_CONCURRENCY
    assert '"tenant-concurrency";q=2' in dict(rate_limit_headers(refused))["ratelimit-policy"]
    assert sample(registry, "fleet_ledger_redis_errors_total", op="reserve") >= 1
    first = outcomes[0]
    assert isinstance(first, Admitted)
    await gate.release(first.ticket)  # the local tenant slot comes back with the ticket
    assert isinstance((await gate.attempt(want)).outcome, Admitted)
    await gate.close()


async def test_over_its_limit_a_tenant_is_refused_not_queued_behind_waiters(
    server: RedisServer,
) -> None:
    (a,) = await ledgers(server, 1)
    limit = TenantLimit(max_concurrent=1)
    held = await a.reserve(demand("c1", "t1", limit), queue="-")
    assert held.granted
    # Someone waits for the compartment: a new request does not pass them...
    joined = await a.join("c1", "short", a.new_ticket(), "t2", 1.0, 10, 8)
    assert joined.joined
    behind = await a.reserve(demand("c1", "t3", limit), queue="-")
    assert not behind.granted and behind.behind and not behind.tenant_refused
    # ...but one over its tenant's own limit is refused for that, at once (it would not queue).
    over = await a.reserve(demand("c1", "t1", limit), queue="-")
    assert not over.granted and over.tenant_refused and over.tenant_inflight == 1
    # A look (no reservation) says so too.
    seen = await a.usage("c1", "short", BUDGET, TenantClaim("t1", limit), 10)
    assert seen.tenant_refused and not seen.granted
    assert not (await a.usage("c1", "short", BUDGET, TenantClaim("t4", limit), 10)).tenant_refused
    await a.close()

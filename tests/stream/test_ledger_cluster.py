"""The Redis ledger on a real local Redis Cluster (three primaries, one replica each, all
``redis-server --cluster-enabled yes`` on 127.0.0.1): one slot per compartment, one shared
budget, and a primary failover that leaks nothing beyond the lease TTL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from extproc.core.admission import Admitted, Demand, Reject, TenantClaim, Ticket
from extproc.core.affinity import Decision, Override
from extproc.core.fleet import Budget
from extproc.core.flow import TenantLimit
from extproc.core.placement import Placement
from extproc.harness.launch import free_port
from extproc.ledger.base import LedgerUnavailable
from extproc.ledger.redis import RedisLedger, compartment_keys, queue_keys, tenant_keys
from extproc.ledger.waiters import listen_for_releases
from extproc.pipeline.fleet_state import PROBE_INTERVAL_S, FleetState, RedisSessions
from extproc.pipeline.metrics import Metrics
from tests.stream.test_fleet_state import PARAMS, SECRET, facts
from tests.stream.test_ledger_redis import HANG_S, gate_for, request, runtime, sample
from tests.support.redis_server import RedisClusterServers, command


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(masters=3, replicas=1) as servers:
        yield servers


class _Freed:
    """Records the wake-ups the release listener hands to the waiters."""

    def __init__(self) -> None:
        self.seen: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    def freed(self, cluster: str, class_name: str) -> None:
        self.seen.put_nowait((cluster, class_name))


async def test_release_notices_reach_waiters_through_a_cluster(
    cluster: RedisClusterServers,
) -> None:
    """The release listener subscribes through a fresh cluster client (regression: it raised
    KeyError at subscribe, before the client had its slot map, and died at start)."""
    ledger = RedisLedger.from_url(cluster.url, timeout_s=2.0)
    await ledger.load()
    freed = _Freed()
    subscribed = asyncio.Event()
    task = asyncio.create_task(listen_for_releases(ledger, freed, 0.2, subscribed))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(subscribed.wait(), 10)
        demand = Demand("c1", "notices", 10, Budget(max_concurrent=2), Budget(0, 2))
        answer = await ledger.reserve(demand)
        assert answer.ticket is not None
        await ledger.release(answer.ticket)
        assert await asyncio.wait_for(freed.seen.get(), 10) == ("c1", "notices")
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ledger.close()


def redis_errors(registry: CollectorRegistry) -> float:
    """Failed or timed-out Redis ledger calls, all operations together."""
    return sum(
        s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == "fleet_ledger_redis_errors_total"
    )


async def usage(url: str, cluster: str, limits: Budget) -> tuple[int, int]:
    ledger = RedisLedger.from_url(url, timeout_s=2.0)
    try:
        seen = (await ledger.usage(cluster, "short", limits)).usage
    finally:
        await ledger.close()
    return seen.inflight_tokens, seen.concurrent


def test_every_ledger_key_lives_in_one_slot(cluster: RedisClusterServers) -> None:
    """A tenant's count spans compartments: on a cluster every ledger key shares one slot, so
    one script call reaches the compartment and the tenant."""
    keys = [
        *compartment_keys("fleet", "c1", "short", one_slot=True),
        *compartment_keys("fleet", "c2", "long", one_slot=True),
        *queue_keys("fleet", "c2", "long", one_slot=True),
        *tenant_keys("fleet", "ab" * 16, one_slot=True),
    ]
    slots = {command(cluster.seed_port, "CLUSTER", "KEYSLOT", k).strip() for k in keys}
    assert len(slots) == 1, keys


async def test_a_tenants_limit_is_one_count_over_compartments_on_a_cluster(
    cluster: RedisClusterServers,
) -> None:
    a = RedisLedger.from_url(cluster.url, timeout_s=2.0)
    b = RedisLedger.from_url(cluster.url, timeout_s=2.0)
    assert a.one_slot
    await a.load()
    await b.load()
    budget = Budget(max_concurrent=10)
    claim = TenantClaim("cd" * 16, TenantLimit(max_concurrent=2))
    try:
        answers = [
            await ledger.reserve(Demand(name, "tenants", 10, budget, budget, claim))
            for ledger, name in ((a, "c1"), (b, "c2"), (a, "c3"))
        ]
        assert [x.granted for x in answers] == [True, True, False]
        assert answers[2].tenant_refused and answers[2].tenant_inflight == 2
        first = answers[0].ticket
        assert first is not None
        assert await b.release(first)
        again = await b.reserve(Demand("c3", "tenants", 10, budget, budget, claim))
        assert again.granted
        # Renewal reaches the tenant's key in the same call (no CROSSSLOT).
        held = [t for t in (answers[1].ticket, again.ticket) if t is not None]
        assert await b.renew(held) == []
        for t in held:
            await b.release(t)
    finally:
        await a.close()
        await b.close()


async def test_one_budget_shared_by_two_gates_on_a_cluster(cluster: RedisClusterServers) -> None:
    budget = {"max_inflight_tokens": 1_000_000, "max_concurrent": 4}
    # Generous: this test is about the shared budget, not latency on a busy machine.
    rt = runtime(cluster.url, budget=budget, timeout_ms=3000)
    a, b = await gate_for(rt), await gate_for(rt)
    facts = request(rt, "cluster-shared")
    route = rt.policy.route(facts)
    limits = route.request_class.budget.resolved()
    storm = await asyncio.gather(*(g.admit(facts, route) for _ in range(20) for g in (a, b)))
    winners = [o for o in storm if isinstance(o, Admitted)]
    assert all(w.ticket.store == "redis" for w in winners)
    assert len(winners) == 4
    assert all(isinstance(o, Reject) and o.status == 429 for o in storm if o not in winners)
    assert await usage(cluster.url, route.placement.primary, limits) == (
        sum(w.ticket.tokens for w in winners),
        4,
    )
    await a.renew_once()
    await b.renew_once()
    for w in winners:
        await a.release(w.ticket)
        await b.release(w.ticket)
    assert await usage(cluster.url, route.placement.primary, limits) == (0, 0)
    await a.close()
    await b.close()


async def test_primary_failover_recovers_the_budget_and_leaks_nothing(
    cluster: RedisClusterServers,
) -> None:
    ttl = 3.0
    budget = {"max_inflight_tokens": 1_000_000, "max_concurrent": 6}
    rt = runtime(cluster.url, budget=budget, lease_ttl_s=ttl, timeout_ms=200)
    registry = CollectorRegistry()
    gate = await gate_for(rt, registry, probe_interval_s=0.2)
    facts = request(rt, "cluster-failover")
    route = rt.policy.route(facts)
    name = route.placement.primary
    limits = route.request_class.budget.resolved()
    held: list[Ticket] = []
    deadline = time.monotonic() + HANG_S
    while len(held) < 3:
        out = await gate.admit(facts, route)
        assert isinstance(out, Admitted)
        if out.ticket.store == "redis":
            held.append(out.ticket)
        else:  # the first call on a busy machine can miss the timeout: not this test's subject
            await gate.release(out.ticket)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.25)

    victim = cluster.primary_for(compartment_keys("fleet", name, "short", one_slot=True)[0])
    errors_before = redis_errors(registry)
    cluster.node(victim).kill()
    killed = time.monotonic()
    stores: list[str] = []
    # Admissions keep being answered (locally while the shard has no primary) and go back
    # to the shared budget once the replica has taken over: answered from memory first, then
    # from Redis again. Each admit and the whole wait are bounded against a hang only.
    while "memory" not in stores or stores[-1] != "redis":
        out = await asyncio.wait_for(gate.admit(facts, route), HANG_S)
        if isinstance(out, Admitted):
            stores.append(out.ticket.store)
            await gate.release(out.ticket)
        assert time.monotonic() - killed < HANG_S, ("never served the budget again", stores)
        await asyncio.sleep(0.05)
    # The answers from memory were the gate's fallback on failed Redis calls (the dead
    # primary), not a gate that stopped asking.
    assert redis_errors(registry) > errors_before
    cluster.wait_ok()

    # The three leases taken before the kill survived on the promoted replica (or lapsed:
    # replication is asynchronous); renewal keeps what survived.
    await gate.renew_once()
    for t in held:
        await gate.release(t)
    assert gate.held == 0
    assert (
        sample(registry, "fleet_budget_inflight_requests", cluster=name, request_class="short") == 0
    )
    # What is left in Redis (a lease the failover left behind) lapses after the TTL: waited
    # for, bounded against a hang only.
    deadline = time.monotonic() + ttl + HANG_S
    while await usage(cluster.url, name, limits) != (0, 0) or gate.unsettled:
        assert time.monotonic() < deadline, "a lease outlived its TTL after the failover"
        await asyncio.sleep(0.1)
    # The whole budget is admissible again.
    full = [await gate.admit(facts, route) for _ in range(6)]
    assert all(isinstance(o, Admitted) and o.ticket.store == "redis" for o in full)
    assert isinstance(await gate.admit(facts, route), Reject)
    for o in full:
        assert isinstance(o, Admitted)
        await gate.release(o.ticket)
    assert await usage(cluster.url, name, limits) == (0, 0)
    await gate.close()
    cluster.node(victim).start()  # back as a replica of the new primary
    cluster.wait_ok()


async def test_the_session_store_runs_on_the_cluster_url_too(cluster: RedisClusterServers) -> None:
    """The processor opens its affinity session store on the same redis.url as the ledger, so
    a redis+cluster:// URL must work there as well (seen marks and overrides)."""
    sessions = RedisSessions.from_url(cluster.url, timeout_s=2.0)
    try:
        key = b"\x01" * 16
        assert await sessions.lookup(key, 100.0, 60.0) == (False, None)
        seen, override = await sessions.lookup(key, 101.0, 60.0)
        assert seen is True and override is None
        await sessions.write(key, Override("c2", 130.0), 101.0)
        seen, override = await sessions.lookup(key, 102.0, 60.0)
        assert seen is True and override is not None and override.cluster == "c2"
    finally:
        await sessions.close()


async def test_an_unreachable_cluster_is_an_outage_not_a_crash() -> None:
    """The cluster client raises RedisClusterException (not a RedisError) when it cannot build
    its slot map; the ledger reports it as unavailable like any outage (regression: the gate's
    start raised it at load ~40 and the fault matrix run died)."""
    ledger = RedisLedger.from_url(f"redis+cluster://127.0.0.1:{free_port()}", timeout_s=0.5)
    with pytest.raises(LedgerUnavailable):
        await ledger.load()
    with pytest.raises(LedgerUnavailable):
        await ledger.ping()
    await ledger.close()


async def test_an_unreachable_cluster_leaves_the_session_store_on_memory() -> None:
    """The affinity store has the ledger's gap closed too: the cluster client's
    RedisClusterException (no node reachable for its slot map) is not a RedisError, and it
    escaped every shared-store call, failing the request's stream instead of falling back to
    the replica's memory (as any other outage does)."""
    sessions = RedisSessions.from_url(f"redis+cluster://127.0.0.1:{free_port()}", timeout_s=0.5)
    state = FleetState(Metrics(CollectorRegistry()), shared=sessions)
    registry = state.metrics.registry
    f = facts("cluster-down")
    step = PROBE_INTERVAL_S + 1.0  # each call is due to try Redis again
    try:
        assert (await state.view(f, "c1", step, PARAMS)).seen is False
        override = Override("c2", 10 * step)
        decision = Decision(Placement("c2", "c1"), "spilled", override)
        await state.remember(f, decision, 2 * step)
        seen = await state.view(f, "c1", 3 * step, PARAMS)
        assert seen.seen is True and seen.override == override  # the memory answered
        assert await state.follow("resp-1", SECRET, 4 * step) is None
        await state.learn("resp-1", f.session, SECRET, 5 * step, 60.0)
        assert await state.follow("resp-1", SECRET, 6 * step) == f.session
    finally:
        await state.close()
    for op in ("lookup", "write", "link_get", "link_set"):
        assert sample(registry, "fleet_affinity_store_errors_total", op=op) >= 1, op

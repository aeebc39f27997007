"""Flow control through the pipeline with the real gate (in memory, and Redis shared by two
gates): a new session placed on its next candidate and staying there, existing sessions never
moved, waits woken by releases, cancellation leaving nothing held, overflow and too-long waits
refused at once, timeouts answered with an updated hint."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Overrides
from extproc.core.admission import Admitted, Demand, request_tokens
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.fleet import Budget
from extproc.core.flow import FairClaim, FairQueue
from extproc.ledger.gate import build_gate
from extproc.ledger.redis import TICKET_LEASE_S, RedisLedger, queue_keys
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Rejected, Routed, Waiting
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from tests.support.redis_server import RedisClusterServers, RedisServer

CHAT = "/v1/chat/completions"


def doc(
    wait_s: float = 0.0, max_queue: int = 8, place: bool = False, **extra: Any
) -> dict[str, Any]:
    return {
        "version": 1,
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"]} for i in (1, 2, 3)],
        "classes": [
            {
                "name": "long",
                "budget": {"max_concurrent": 1},
                "wait": {"max_wait_s": wait_s, "max_queue": max_queue},
            },
        ],
        "flow": {"place_new_sessions": place, "tenant_header": "x-tenant"},
        **extra,
    }


def headers(sid: str, tenant: str = "t") -> dict[str, str]:
    return {
        ":method": "POST",
        ":path": CHAT,
        "content-type": "application/json",
        "x-session-id": sid,
        "x-tenant": tenant,
    }


BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]})


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def make(d: dict[str, Any], redis_url: str | None = None) -> tuple[Pipeline, Any, Any]:
    runtime = compile_runtime(parse_config(d), overrides=Overrides(redis_url=redis_url))
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(1))
    await gate.start()
    return Pipeline(RuntimeHolder(runtime), Metrics(registry), gate), gate, registry


@pytest.fixture
async def memory_pipeline() -> AsyncIterator[Any]:
    made: list[Any] = []

    async def factory(d: dict[str, Any]) -> tuple[Pipeline, Any, Any]:
        made.append(await make(d))
        return made[-1]  # type: ignore[no-any-return]

    yield factory
    for _pipeline, gate, _registry in made:
        await gate.close()


def session_on(pipeline: Pipeline, cluster: str, prefix: str) -> str:
    """A session id whose hash primary is ``cluster``."""
    runtime = pipeline.runtime
    placer = runtime.policy.placers["long"]
    for i in range(10_000):
        sid = f"{prefix}{i}"
        facts = parse_request(CHAT, headers(sid), BODY, runtime.key_rules, runtime.parse_limits)
        assert isinstance(facts, RequestFacts)
        if placer.ranked(facts.session.point)[0] == cluster:
            return sid
    raise AssertionError("no session found")


async def test_new_session_is_placed_on_next_candidate_and_stays(memory_pipeline: Any) -> None:
    pipeline, gate, registry = await memory_pipeline(doc(place=True))
    busy = await pipeline.decide(headers(session_on(pipeline, "c1", "old")), BODY, 1.0)
    assert isinstance(busy, Routed) and busy.route.placement.primary == "c1"
    new = session_on(pipeline, "c1", "new")
    first = await pipeline.decide(headers(new), BODY, 2.0)
    assert isinstance(first, Routed) and first.kind == "placed"
    placed_on = first.route.placement.primary
    assert placed_on != "c1"
    assert sample(registry, "fleet_flow_placements_total", request_class="long") == 1
    await pipeline.release(first.hold)
    await pipeline.release(busy.hold)
    # Later turns follow the placement although the hash primary has room again.
    later = await pipeline.decide(headers(new), BODY, 3.0)
    assert isinstance(later, Routed) and later.route.placement.primary == placed_on
    assert later.kind == "override"
    await pipeline.release(later.hold)
    assert gate.held == 0


async def test_existing_session_is_never_moved(memory_pipeline: Any) -> None:
    pipeline, gate, _registry = await memory_pipeline(doc(place=True))
    sid = session_on(pipeline, "c1", "s")
    first = await pipeline.decide(headers(sid), BODY, 1.0)
    assert isinstance(first, Routed) and first.route.placement.primary == "c1"
    # Its own next turn while the first still runs: c1 is full, the session is not new.
    second = await pipeline.decide(headers(sid), BODY, 2.0)
    assert isinstance(second, Rejected) and second.reject.status == 429
    assert second.route.placement.primary == "c1"
    await pipeline.release(first.hold)
    assert gate.held == 0


async def test_waiters_are_woken_by_releases_in_fair_order(memory_pipeline: Any) -> None:
    pipeline, gate, registry = await memory_pipeline(doc(wait_s=30.0))
    sid = session_on(pipeline, "c1", "w")
    first = await pipeline.decide(headers(sid), BODY, 1.0)
    assert isinstance(first, Routed)
    order: list[str] = []

    async def waiter(tenant: str) -> Routed:
        outcome = await pipeline.decide(headers(sid, tenant), BODY, 2.0)
        assert isinstance(outcome, Routed)
        order.append(tenant)
        return outcome

    tasks = [asyncio.create_task(waiter(t)) for t in ("a", "a", "b")]
    await wait_until(lambda: gate.waiters.depth("c1", "long") == 3)
    assert sample(registry, "fleet_flow_queue_depth", cluster="c1", request_class="long") == 3
    hold = first.hold
    for _ in range(3):
        await pipeline.release(hold)
        done, _ = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        finished = done.pop()
        tasks.remove(finished)
        hold = finished.result().hold
        assert gate.held == 1  # never more than the budget
    await pipeline.release(hold)
    # FIFO within tenant a, and b (equal weight) is not starved behind a's second request.
    assert order == ["a", "b", "a"]
    assert sample(registry, "fleet_flow_waits_total", request_class="long", result="admitted") == 3
    assert gate.held == 0 and len(gate.waiters) == 0


async def test_cancelled_waiter_leaves_at_once_holding_nothing(memory_pipeline: Any) -> None:
    pipeline, gate, registry = await memory_pipeline(doc(wait_s=30.0))
    sid = session_on(pipeline, "c1", "x")
    first = await pipeline.decide(headers(sid), BODY, 1.0)
    assert isinstance(first, Routed)
    deferred = await pipeline.decide(headers(sid), BODY, 2.0, wait=False)
    assert isinstance(deferred, Waiting) and deferred.max_wait_s == 30.0
    task = asyncio.create_task(deferred.resume())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deferred.cancel()  # what the shell's finally does; idempotent
    assert len(gate.waiters) == 0
    assert sample(registry, "fleet_flow_waits_total", request_class="long", result="cancelled") == 1
    await pipeline.release(first.hold)
    assert gate.held == 0
    # A Waiting dropped before resume (the stream ended between the two) leaves too.
    blocker = await pipeline.decide(headers(sid), BODY, 3.0)
    assert isinstance(blocker, Routed)
    dropped = await pipeline.decide(headers(sid), BODY, 4.0, wait=False)
    assert isinstance(dropped, Waiting)
    dropped.cancel()
    assert len(gate.waiters) == 0
    await pipeline.release(blocker.hold)
    assert gate.held == 0


async def test_overflow_and_timeout_get_429_with_hints(memory_pipeline: Any) -> None:
    pipeline, gate, registry = await memory_pipeline(doc(wait_s=1.5, max_queue=1))
    sid = session_on(pipeline, "c1", "o")
    first = await pipeline.decide(headers(sid), BODY, 1.0)
    assert isinstance(first, Routed)
    queued = asyncio.create_task(pipeline.decide(headers(sid), BODY, 2.0))
    await wait_until(lambda: gate.waiters.depth("c1", "long") == 1)
    overflow = await pipeline.decide(headers(sid), BODY, 2.0)
    assert isinstance(overflow, Rejected) and overflow.reject.status == 429
    assert "already wait" in overflow.reject.message
    assert sample(registry, "fleet_flow_waits_total", request_class="long", result="overflow") == 1
    timed_out = await asyncio.wait_for(queued, timeout=10)
    assert isinstance(timed_out, Rejected) and timed_out.reject.status == 429
    assert "waited" in timed_out.reject.message and timed_out.reject.retry_after_s
    assert sample(registry, "fleet_flow_waits_total", request_class="long", result="timeout") == 1
    await pipeline.release(first.hold)
    assert gate.held == 0 and len(gate.waiters) == 0


async def test_estimated_wait_beyond_max_is_refused_at_once(memory_pipeline: Any) -> None:
    pipeline, gate, registry = await memory_pipeline(doc(wait_s=0.5))
    sid = session_on(pipeline, "c1", "e")
    # One release just observed: about one release a second, so a wait of ~1 s is expected.
    warm = await pipeline.decide(headers(sid), BODY, 0.0)
    assert isinstance(warm, Routed)
    await pipeline.release(warm.hold)
    first = await pipeline.decide(headers(sid), BODY, 1.0)
    assert isinstance(first, Routed)
    refused = await pipeline.decide(headers(sid), BODY, 2.0)
    assert isinstance(refused, Rejected) and refused.reject.status == 429
    assert "estimated wait exceeds" in refused.reject.message
    assert sample(registry, "fleet_flow_waits_total", request_class="long", result="too_long") == 1
    await pipeline.release(first.hold)
    assert gate.held == 0


@pytest.mark.parametrize("fairness", ["tokens", "requests", "fifo"])
async def test_a_steady_tenant_behind_a_flood_waits_instead_of_being_refused(
    fairness: str,
) -> None:
    """A flooding tenant fills the queue as far as its own estimated wait allows; a steady
    tenant arriving behind it would follow only the flood's head under fair order, so its
    estimate fits and it waits, and is served right after that head. Under FIFO it would
    follow every flood waiter: refused at once as too long."""
    d = doc(wait_s=5.0)
    d["flow"]["fairness"] = fairness
    now = [100.0]  # the gate's clock, still: the release rate seen is one release, ~1/s
    runtime = compile_runtime(parse_config(d))
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, lambda: now[0], random.Random(1))
    await gate.start()
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)
    try:
        sid = session_on(pipeline, "c1", "f")
        warm = await pipeline.decide(headers(sid, "flood"), BODY, 0.0)
        assert isinstance(warm, Routed)
        await pipeline.release(warm.hold)
        first = await pipeline.decide(headers(sid, "flood"), BODY, 1.0)
        assert isinstance(first, Routed)
        flood: list[Waiting] = []
        while True:
            outcome = await pipeline.decide(headers(sid, "flood"), BODY, 2.0, wait=False)
            if not isinstance(outcome, Waiting):
                break
            flood.append(outcome)
        assert isinstance(outcome, Rejected) and "estimated wait exceeds" in outcome.reject.message
        assert len(flood) >= 3  # the flood queued several, up to its own estimate
        steady = await pipeline.decide(headers(sid, "steady"), BODY, 3.0, wait=False)
        if fairness == "fifo":
            assert isinstance(steady, Rejected)
            assert "estimated wait exceeds" in steady.reject.message
        else:
            assert isinstance(steady, Waiting)
            served = [asyncio.create_task(w.resume()) for w in (flood[0], steady)]
            await pipeline.release(first.hold)
            head = await asyncio.wait_for(served[0], timeout=10)
            assert isinstance(head, Routed)
            await pipeline.release(head.hold)
            after = await asyncio.wait_for(served[1], timeout=10)
            assert isinstance(after, Routed)  # next after the flood's head, as estimated
            await pipeline.release(after.hold)
        for waiting in flood:
            waiting.cancel()
        if fairness == "fifo":
            await pipeline.release(first.hold)
        assert gate.held == 0 and len(gate.waiters) == 0
    finally:
        await gate.close()


async def wait_until(check: Any) -> None:
    """Poll ``check`` until true, bounded (10 s: the machine may be loaded)."""
    async with asyncio.timeout(10.0):
        while True:
            if check():
                return
            await asyncio.sleep(0.005)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


async def wake_latency(
    server: RedisServer | RedisClusterServers,
    poll_ms: int,
    rounds: int,
    timeout_ms: int = 1000,
    wait_s: float = 30.0,
    admit_within_s: float = 10.0,
) -> tuple[list[float], dict[str, float]]:
    """Two replicas sharing one Redis ledger: a request waits on B, A releases; the time from
    A's release to B's admission, per round. ``poll_ms`` large = pub/sub alone."""
    d = doc(wait_s=wait_s)
    d["flow"]["redis_poll_ms"] = poll_ms
    # The gate waits up to 4 x timeout_ms at start for its release subscription.
    d["redis"] = {"timeout_ms": timeout_ms}
    a, gate_a, _ = await make(d, server.url)
    b, gate_b, registry_b = await make(d, server.url)
    sid = session_on(a, "c1", "r")
    waits: list[float] = []
    try:
        for _ in range(rounds):
            first = await a.decide(headers(sid), BODY, 1.0)
            assert isinstance(first, Routed) and first.hold.ticket is not None
            assert first.hold.ticket.store == "redis"
            waiting = asyncio.create_task(b.decide(headers(sid), BODY, 2.0))
            await wait_until(lambda: gate_b.waiters.depth("c1", "long") == 1)
            released = time.monotonic()
            await a.release(first.hold)
            admitted = await asyncio.wait_for(waiting, timeout=admit_within_s)
            waits.append(time.monotonic() - released)
            assert isinstance(admitted, Routed) and admitted.hold.ticket is not None
            await b.release(admitted.hold)
        counts = {
            result: sample(
                registry_b, "fleet_flow_waits_total", request_class="long", result=result
            )
            for result in ("admitted", "timeout")
        }
        assert gate_a.held == 0 and gate_b.held == 0
        return waits, counts
    finally:
        await gate_a.close()
        await gate_b.close()


async def test_replicas_sharing_redis_wake_waiters_fleet_wide(server: RedisServer) -> None:
    # Re-checking every hour, waiting up to ten minutes, each admission awaited a minute at
    # most (against a hang): every admission came from the release notice, on any machine.
    _waits, counts = await wake_latency(
        server, poll_ms=3_600_000, rounds=5, wait_s=600.0, admit_within_s=60.0
    )
    assert counts == {"admitted": 5, "timeout": 0}


def notices_only(max_queue: int = 8) -> dict[str, Any]:
    """Waiters are woken by release notices alone (the periodic re-check every 30 s), so an
    order seen within a test's bounds is the queue's."""
    d = doc(wait_s=30.0, max_queue=max_queue)
    d["flow"]["redis_poll_ms"] = 30_000
    d["redis"] = {"timeout_ms": 1000}
    return d


async def test_replicas_on_a_redis_cluster_wake_waiters_by_notices() -> None:
    # A release on any shard reaches the subscriber (Redis Cluster forwards every PUBLISH).
    with RedisClusterServers(masters=3, replicas=0) as cluster:
        # A cluster client first learns the slot map: allow a slow start on a loaded machine.
        # Re-checking every hour: every admission came from the release notice.
        _waits, counts = await wake_latency(
            cluster,
            poll_ms=3_600_000,
            rounds=3,
            timeout_ms=3000,
            wait_s=600.0,
            admit_within_s=60.0,
        )
    assert counts == {"admitted": 3, "timeout": 0}


async def two_replicas(
    server: RedisServer, max_queue: int = 8
) -> tuple[tuple[Pipeline, Any, Any], tuple[Pipeline, Any, Any]]:
    """Two gates sharing one Redis ledger."""
    d = notices_only(max_queue)
    return await make(d, server.url), await make(d, server.url)


async def test_queue_is_fleet_wide_in_order_and_length(server: RedisServer) -> None:
    (a, gate_a, _), (b, gate_b, registry_b) = await two_replicas(server, max_queue=4)
    try:
        sid = session_on(a, "c1", "q")
        first = await a.decide(headers(sid), BODY, 1.0)
        assert isinstance(first, Routed) and first.hold.ticket is not None
        order: list[str] = []

        async def waiter(pipeline: Pipeline, name: str, tenant: str) -> tuple[Pipeline, Routed]:
            outcome = await pipeline.decide(headers(sid, tenant), BODY, 2.0)
            assert isinstance(outcome, Routed), outcome
            order.append(name)
            return pipeline, outcome

        # Arrivals alternate between the replicas, each after the previous one queued.
        # Tenant x thrice, y once (equal weights): fair order x1, y1 (tied with x1's tag,
        # after it by arrival), x2, x3, whichever replica each waits on.
        arrivals = [(a, "x1@a", "x"), (b, "x2@b", "x"), (a, "x3@a", "x"), (b, "y1@b", "y")]
        tasks = []
        for i, (pipeline, name, tenant) in enumerate(arrivals, 1):
            tasks.append(asyncio.create_task(waiter(pipeline, name, tenant)))
            await wait_until(lambda i=i: len(gate_a.waiters) + len(gate_b.waiters) == i)
        # max_queue counts both replicas' waiters: a fifth overflows on either replica,
        # although each holds only two.
        for pipeline in (a, b):
            overflow = await pipeline.decide(headers(sid, "z"), BODY, 2.0)
            assert isinstance(overflow, Rejected) and overflow.reject.status == 429
            assert "4 requests already wait" in overflow.reject.message, overflow.reject
        holder: tuple[Pipeline, Routed] = (a, first)
        for served in range(1, 5):
            await holder[0].release(holder[1].hold)
            done, _ = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, order  # one release, one admission, fleet-wide
            finished = done.pop()
            tasks.remove(finished)
            holder = finished.result()
            assert len(order) == served
        await holder[0].release(holder[1].hold)
        assert order == ["x1@a", "y1@b", "x2@b", "x3@a"]
        assert gate_a.held == 0 and gate_b.held == 0
        assert len(gate_a.waiters) == 0 and len(gate_b.waiters) == 0
        assert sample(registry_b, "fleet_flow_waits_total", request_class="long", result="overflow")
    finally:
        await gate_a.close()
        await gate_b.close()


async def flood_queue(pipeline: Pipeline, sid: str) -> tuple[Routed, list[Waiting]]:
    """One release seen (about one a second: Redis's clock runs, so the rate seen only falls
    from there), the budget taken, then tenant ``flood`` queued on ``pipeline`` as far as its
    own estimated wait allows: (the request holding the budget, the flood's waiters)."""
    warm = await pipeline.decide(headers(sid, "flood"), BODY, 0.0)
    assert isinstance(warm, Routed)
    await pipeline.release(warm.hold)
    first = await pipeline.decide(headers(sid, "flood"), BODY, 1.0)
    assert isinstance(first, Routed)
    flood: list[Waiting] = []
    while True:
        outcome = await pipeline.decide(headers(sid, "flood"), BODY, 2.0, wait=False)
        if not isinstance(outcome, Waiting):
            break
        flood.append(outcome)
    assert isinstance(outcome, Rejected) and "estimated wait exceeds" in outcome.reject.message
    assert len(flood) >= 3, len(flood)  # the flood queued several, up to its own estimate
    return first, flood


@pytest.mark.parametrize("fairness", ["tokens", "requests", "fifo"])
async def test_a_steady_tenant_behind_a_fleet_wide_flood_waits_instead_of_being_refused(
    server: RedisServer, fairness: str
) -> None:
    """Two replicas sharing one Redis ledger: a flooding tenant fills the fleet-wide queue
    through replica a as far as its own estimated wait allows; a steady tenant arriving on
    replica b would follow only the flood's head in the fleet-wide fair order (reserve.lua
    counts the tickets tagged no later than the steady tenant's own tag), so explain says it
    would wait, it waits, and it is admitted right after that head, before the rest of the
    flood. Under FIFO it would follow every flood ticket: refused at once as too long."""
    d = notices_only(max_queue=64)
    d["classes"][0]["wait"]["max_wait_s"] = 30.0
    d["flow"]["fairness"] = fairness
    a, gate_a, _ = await make(d, server.url)
    b, gate_b, _ = await make(d, server.url)
    try:
        sid = session_on(a, "c1", "f")
        first, flood = await flood_queue(a, sid)
        steady_headers = headers(sid, "steady")
        facts = parse_request(
            CHAT, steady_headers, BODY, b.runtime.key_rules, b.runtime.parse_limits
        )
        assert isinstance(facts, RequestFacts)
        cls = b.runtime.policy.class_named("long")
        assert cls is not None
        preview = await gate_b.flow_preview(
            "c1", cls, request_tokens(facts), b.tenant_key(steady_headers, facts)
        )
        assert preview["queued"] == len(flood), preview
        steady = await b.decide(steady_headers, BODY, 3.0, wait=False)
        if fairness == "fifo":
            assert preview["ahead"] == len(flood) and preview["would"] == "too_long", preview
            assert isinstance(steady, Rejected)
            assert "estimated wait exceeds" in steady.reject.message
            await a.release(first.hold)
        else:
            assert preview["ahead"] == 1 and preview["would"] == "wait", preview
            assert isinstance(steady, Waiting), steady
            served = [asyncio.create_task(w.resume()) for w in (flood[0], steady)]
            await a.release(first.hold)
            head = await asyncio.wait_for(served[0], timeout=10)
            assert isinstance(head, Routed)
            await a.release(head.hold)
            # Next after the flood's head, as estimated, while the rest of it still waits.
            after = await asyncio.wait_for(served[1], timeout=10)
            assert isinstance(after, Routed)
            assert gate_a.waiters.depth("c1", "long") == len(flood) - 1
            await b.release(after.hold)
        for waiting in flood:
            waiting.cancel()
        assert len(gate_a.waiters) == 0 and len(gate_b.waiters) == 0
        assert gate_a.held == 0 and gate_b.held == 0
    finally:
        await gate_a.close()
        await gate_b.close()


async def test_dead_replicas_waiters_lapse_and_stop_blocking(server: RedisServer) -> None:
    # Re-checking every hour, waiting up to ten minutes: within the minute allowed (against a
    # hang) only the once-a-lease re-check of a waiter behind another replica's can admit it.
    d = notices_only()
    d["flow"]["redis_poll_ms"] = 3_600_000
    d["classes"][0]["wait"]["max_wait_s"] = 600.0
    a, gate_a, _ = await make(d, server.url)
    ledger = RedisLedger.from_url(server.url, timeout_s=1.0)
    expiry_key = queue_keys(ledger.prefix, "c1", "long", ledger.one_slot)[1]
    # Each attempt of a's waiter: (admitted, answered "another replica's waiter is ahead").
    attempts: list[tuple[bool, bool]] = []
    attempt = gate_a.attempt

    async def recorded(demand: Demand, *, reserve: bool = True, ticket: str | None = None) -> Any:
        done = await attempt(demand, reserve=reserve, ticket=ticket)
        if ticket is not None:
            behind = done.answer is not None and done.answer.behind
            attempts.append((isinstance(done.outcome, Admitted), behind))
        return done

    gate_a.attempt = recorded
    dead = RedisLedger.from_url(server.url, timeout_s=1.0)
    renewing = None
    try:
        sid = session_on(a, "c1", "d")
        first = await a.decide(headers(sid), BODY, 1.0)
        assert isinstance(first, Routed)
        # Another replica queues a request and renews its ticket, as a live replica does...
        ghost = await dead.join("c1", "long", dead.new_ticket(), "t", 1.0, 1, 8)
        assert ghost.joined and ghost.ahead == 0
        lost: list[str] = []

        async def renew() -> None:
            while not lost:
                lost.extend(await dead.touch("c1", "long", [ghost.ticket]))
                await asyncio.sleep(TICKET_LEASE_S / 6)

        renewing = asyncio.create_task(renew())
        survivor = asyncio.create_task(a.decide(headers(sid), BODY, 2.0))
        await wait_until(lambda: gate_a.waiters.depth("c1", "long") == 1)
        await a.release(first.hold)
        # ...so a's waiter, which tried when it queued and again when woken by the release
        # (or its re-check), stays behind it.
        await wait_until(lambda: len(attempts) >= 2)
        assert attempts[:2] == [(False, True)] * 2, attempts
        assert not survivor.done() and not lost
        # ...then dies: its ticket is never renewed nor withdrawn.
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        await dead.close()
        admitted = await asyncio.wait_for(survivor, timeout=60.0)
        assert isinstance(admitted, Routed)
        # Admitted only once the lapsed ticket was reaped (a live one would still be queued),
        # on a re-check no release announced; refused behind it until then.
        assert await ledger.client.zscore(expiry_key, ghost.ticket) is None
        assert attempts[-1] == (True, False), attempts
        assert all(seen == (False, True) for seen in attempts[:-1]), attempts
        await a.release(admitted.hold)
        assert gate_a.held == 0
    finally:
        if renewing is not None:
            renewing.cancel()
        await ledger.close()
        await dead.close()
        await gate_a.close()


@pytest.fixture(scope="module")
def module_redis() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


# ("join", tenant) | ("serve", 0) | ("leave", nth live waiter) | ("charge", tenant)
Op = tuple[str, int]
WEIGHTS = (1.0, 2.0, 0.5)  # tenant i's weight
SIZES = (1, 20_000, 1_000_000)  # tenant i's request tokens (tokens fairness: its service)

ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, len(WEIGHTS) - 1)),
        st.tuples(st.just("serve"), st.just(0)),
        st.tuples(st.just("leave"), st.integers(0, 7)),
        st.tuples(st.just("charge"), st.integers(0, len(WEIGHTS) - 1)),
    ),
    min_size=1,
    max_size=40,
)
EXAMPLES = itertools.count()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(ops=ops_strategy)
def test_fleet_wide_queue_serves_in_the_fair_queues_order(
    module_redis: RedisServer, ops: list[Op]
) -> None:
    """queue.lua and reserve.lua put every replica's waiters in the order of the core's
    FairQueue (FIFO per tenant, token-weighted fair across tenants), so its fairness bound
    (tests/unit/test_flow.py) holds fleet-wide: joins of requests of different sizes from
    two replicas, admissions of the head, withdrawals and output charges in any order give
    the same service order as one FairQueue, and reserve.lua counts the waiters a newcomer
    of each tenant would follow as FairQueue.ahead_for does."""
    asyncio.run(_same_order_as_fair_queue(module_redis.url, ops, f"fq{next(EXAMPLES)}"))


async def _same_order_as_fair_queue(url: str, ops: list[Op], prefix: str) -> None:
    replicas = [RedisLedger.from_url(url, prefix=prefix, timeout_s=2.0) for _ in range(2)]
    model: FairQueue[str] = FairQueue()
    ids: dict[str, int] = {}  # ticket -> model id
    live: list[str] = []
    unbounded = Demand("c1", "long", 1, Budget(), Budget())
    try:
        for step, (op, arg) in enumerate(ops):
            ledger = replicas[step % 2]
            if op == "join":
                claim = FairClaim(f"t{arg}", WEIGHTS[arg], float(SIZES[arg]))
                joined = await ledger.join(
                    "c1", "long", ledger.new_ticket(), claim.tenant, claim.increment, 1, 1000
                )
                assert joined.joined
                ids[joined.ticket] = model.push(
                    joined.ticket, claim.tenant, claim.weight, 1, service=claim.service
                )
                live.append(joined.ticket)
                assert joined.tag == model._ids[ids[joined.ticket]].tag
            elif op == "serve" and live:
                head = model.head()
                assert head is not None
                for other in live:
                    if other != head:  # nobody but the head gets in
                        refused = await ledger.reserve(unbounded, queue=other)
                        assert not refused.granted and refused.behind
                granted = await ledger.reserve(unbounded, queue=head)
                assert granted.granted and granted.ticket is not None
                await ledger.release(granted.ticket)
                assert model.pop() == head
                live.remove(head)
            elif op == "leave" and live:
                gone = live.pop(arg % len(live))
                assert await ledger.leave("c1", "long", gone)
                assert model.remove(ids[gone])
            elif op == "charge":
                # Output served to a tenant: its later requests queue further back.
                output = 2.0 * SIZES[arg]
                await ledger.charge("c1", "long", f"t{arg}", output / WEIGHTS[arg])
                model.charge(f"t{arg}", output, WEIGHTS[arg])
            for tenant in range(len(WEIGHTS)):
                # What a newcomer of each tenant would follow, as the model's ahead_for.
                peek = await ledger.usage("c1", "long", Budget(), queue_tenant=f"t{tenant}")
                assert peek.queued == len(model) == len(live)
                follows = (peek.queued_ahead, peek.queued_ahead_tokens)
                assert follows == model.ahead_for(f"t{tenant}"), (step, tenant)
    finally:
        for ledger in replicas:
            await ledger.close()

"""A tenant is charged only for the requests it is served, through the pipeline with the real
gate: without Redis (the pipeline counts the tenant in memory), with Redis (counted in the
reserve, against a real redis-server) and with Redis down (the gate's local fallback). A
request refused by its class budget, timed out in the queue, or whose client left while it
waited gives its tenant's slot and tokens back, once; a request that was served (routed, then
its stream ended, or admitted after a wait) keeps its charge, and holds its tenant's slot
while it runs. A waiter that the closed policy answers with 503 is counted as that, and a
refusal by the tenant's own limits is counted alike on both paths."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Overrides
from extproc.core.admission import Reason
from extproc.ledger.gate import AdmissionGate, build_gate
from extproc.ledger.redis import tenant_keys
from extproc.ledger.tenant_limits import TenantLimits
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Rejected, Routed, Waiting
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from tests.stream.test_flow import BODY, doc, headers, sample, session_on, wait_until
from tests.stream.test_tenant_limit_views import facts_of
from tests.support.redis_server import RedisServer

RATE = 1000  # the tenant's tokens per minute
WAIT_S = {"refused": 0.0, "timed_out": 1.5, "cancelled_waiting": 30.0, "dropped": 30.0}


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@dataclass
class Setup:
    pipeline: Pipeline
    gate: AdmissionGate
    registry: CollectorRegistry
    server: RedisServer | None


async def build(
    mode: str,
    wait_s: float,
    server: RedisServer,
    poll_ms: int = 500,
    tenant_max: int = 4,
    **redis_cfg: Any,
) -> Setup:
    """Three clusters of one request each (class ``long``), every session on its hash primary;
    the tenant may run ``tenant_max`` requests and draw RATE tokens a minute. ``memory``: no
    Redis, the tenant counted on a clock that stands still (its bucket changes only by what is
    charged and given back)."""
    d = doc(wait_s=wait_s)
    d["flow"]["tenant_limit"] = {"max_concurrent": tenant_max, "tokens_per_minute": RATE}
    d["flow"]["redis_poll_ms"] = poll_ms
    d["affinity"] = {"balance_factor": 0}  # a new session starts on its hash primary
    url = None if mode == "memory" else server.url
    if url is not None:
        d["redis"] = {"timeout_ms": 300, **redis_cfg}
    rt = compile_runtime(parse_config(d), overrides=Overrides(redis_url=url))
    registry = CollectorRegistry()
    gate = build_gate(rt, registry, time.monotonic, random.Random(1))
    await gate.start()
    still = TenantLimits(lambda: 1000.0)
    pipeline = Pipeline(RuntimeHolder(rt), Metrics(registry), gate, tenant_limits=still)
    return Setup(pipeline, gate, registry, None if url is None else server)


def tenant_key(pipeline: Pipeline, hdrs: dict[str, str]) -> str:
    facts = facts_of(pipeline, hdrs, BODY)
    return pipeline._tenant(pipeline.runtime, hdrs, facts).key


async def tenant_state(setup: Setup, tenant: str) -> tuple[int, float]:
    """(requests in flight, tokens charged) of ``tenant``: without Redis as its counts stand
    (no refill: the clock stands still); with Redis as the last reserve left them (the level
    stored at that reserve, before any refill)."""
    pipeline = setup.pipeline
    hdrs = headers("probe", tenant)
    if setup.server is None:
        view = await pipeline.tenant_view(hdrs, facts_of(pipeline, hdrs, BODY), "c1", "long")
        limits: dict[str, Any] = view["limits"]  # type: ignore[assignment]
        assert limits["counted_in"] == "memory"
        return limits["inflight"], RATE - limits["bucket_tokens"]
    leases, state = tenant_keys("fleet", tenant_key(pipeline, hdrs))
    with redis.Redis.from_url(setup.server.url) as probe:
        seconds, micros = probe.time()
        live = int(probe.zcount(leases, f"({seconds + micros / 1e6}", "+inf"))
        level = probe.hget(state, "level")
    return live, 0.0 if level is None else RATE - float(level)


async def not_served(setup: Setup, case: str, sid: str, tenant: str) -> None:
    """A request of ``tenant`` on c1, whose budget is held: refused, timed out, or left while
    waiting (its resume cancelled, or the Waiting dropped before it was resumed)."""
    pipeline, gate = setup.pipeline, setup.gate
    if case in ("refused", "timed_out"):
        outcome = await pipeline.decide(headers(sid, tenant), BODY, 2.0)
        assert isinstance(outcome, Rejected) and outcome.reject.status == 429
        assert outcome.reject.reason not in (Reason.TENANT_CONCURRENCY, Reason.TENANT_TOKEN_RATE)
        if case == "timed_out":
            assert "waited" in outcome.reject.message, outcome.reject.message
        return
    waiting = await pipeline.decide(headers(sid, tenant), BODY, 2.0, wait=False)
    assert isinstance(waiting, Waiting)
    if case == "cancelled_waiting":
        task = asyncio.create_task(waiting.resume())
        await wait_until(lambda: gate.waiters.depth("c1", "long") == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    waiting.cancel()  # what the shell's finally does (idempotent)
    assert len(gate.waiters) == 0


WAIT_RESULT = {"timed_out": "timeout", "cancelled_waiting": "cancelled", "dropped": "cancelled"}


@pytest.mark.parametrize("case", list(WAIT_S))
@pytest.mark.parametrize("mode", ["memory", "redis"])
async def test_a_request_not_served_gives_its_tenant_back_exactly_its_charge(
    mode: str, case: str, server: RedisServer
) -> None:
    setup = await build(mode, WAIT_S[case], server)
    pipeline, gate = setup.pipeline, setup.gate
    try:
        blocker = await pipeline.decide(headers(session_on(pipeline, "c1", "b"), "t0"), BODY, 1.0)
        assert isinstance(blocker, Routed) and blocker.route.placement.primary == "c1"
        # The tenant is served one request on c2: what it is charged, and must stay charged.
        running = await pipeline.decide(headers(session_on(pipeline, "c2", "r"), "t1"), BODY, 1.0)
        assert isinstance(running, Routed) and running.route.placement.primary == "c2"
        tokens = facts_of(pipeline, headers("x", "t1"), BODY).input_tokens
        assert tokens > 0
        assert await tenant_state(setup, "t1") == (1, tokens)
        await not_served(setup, case, session_on(pipeline, "c1", "n"), "t1")
        # Given back once: neither kept (2 x tokens charged) nor given twice (the running
        # request's slot or charge lost).
        assert await tenant_state(setup, "t1") == (1, tokens)
        if case in WAIT_RESULT:
            waits = sample(
                setup.registry,
                "fleet_flow_waits_total",
                request_class="long",
                result=WAIT_RESULT[case],
            )
            assert waits == 1
        # The served request's stream ends (the client may have left mid-stream: it was
        # served): its slot goes back, its tokens stay charged.
        await pipeline.release(running.hold)
        assert await tenant_state(setup, "t1") == (0, tokens)
        await pipeline.release(blocker.hold)
        assert gate.held == 0 and len(gate.waiters) == 0
    finally:
        await gate.close()


@pytest.mark.parametrize("mode", ["memory", "redis"])
async def test_a_request_admitted_after_waiting_holds_its_tenants_slot_and_charge(
    mode: str, server: RedisServer
) -> None:
    setup = await build(mode, 30.0, server)
    pipeline, gate = setup.pipeline, setup.gate
    try:
        blocker = await pipeline.decide(headers(session_on(pipeline, "c1", "b"), "t0"), BODY, 1.0)
        assert isinstance(blocker, Routed)
        tokens = facts_of(pipeline, headers("x", "t1"), BODY).input_tokens
        # decide() waits as the shell does: resume(), then cancel() whatever the outcome.
        waiter = asyncio.create_task(
            pipeline.decide(headers(session_on(pipeline, "c1", "w"), "t1"), BODY, 2.0)
        )
        await wait_until(lambda: gate.waiters.depth("c1", "long") == 1)
        await pipeline.release(blocker.hold)
        admitted = await asyncio.wait_for(waiter, timeout=30)
        assert isinstance(admitted, Routed)
        # Running: its tenant's slot is held and its tokens charged.
        assert await tenant_state(setup, "t1") == (1, tokens)
        await pipeline.release(admitted.hold)
        assert await tenant_state(setup, "t1") == (0, tokens)
        assert gate.held == 0 and len(gate.waiters) == 0
    finally:
        await gate.close()


@pytest.mark.parametrize("case", ["timed_out", "cancelled_waiting", "dropped"])
async def test_redis_down_a_request_not_served_leaves_its_tenant_uncharged(
    case: str, server: RedisServer
) -> None:
    setup = await build("redis", WAIT_S[case], server)
    pipeline, gate = setup.pipeline, setup.gate
    try:
        server.kill()
        blocker = await pipeline.decide(headers(session_on(pipeline, "c1", "b"), "t0"), BODY, 1.0)
        assert isinstance(blocker, Routed) and blocker.hold.ticket is not None
        assert blocker.hold.ticket.store == "memory"
        await not_served(setup, case, session_on(pipeline, "c1", "n"), "t1")
        hdrs = headers("probe", "t1")
        view = await pipeline.tenant_view(hdrs, facts_of(pipeline, hdrs, BODY), "c1", "long")
        limits: dict[str, Any] = view["limits"]  # type: ignore[assignment]
        assert limits["counted_in"] == "local"
        # Nothing taken: no request in flight, its bucket full.
        assert limits["inflight"] == 0 and limits["bucket_tokens"] == RATE
        await pipeline.release(blocker.hold)
        assert gate.held == 0 and len(gate.waiters) == 0
    finally:
        await gate.close()


async def test_a_waiter_answered_503_by_the_closed_policy_is_counted_as_unavailable(
    server: RedisServer,
) -> None:
    # The head re-checks Redis every 20 ms: its next look finds it gone.
    setup = await build("redis", 30.0, server, poll_ms=20, on_unavailable="closed")
    pipeline, gate, registry = setup.pipeline, setup.gate, setup.registry
    try:
        blocker = await pipeline.decide(headers(session_on(pipeline, "c1", "b"), "t0"), BODY, 1.0)
        assert isinstance(blocker, Routed)
        waiter = asyncio.create_task(
            pipeline.decide(headers(session_on(pipeline, "c1", "w"), "t1"), BODY, 2.0)
        )
        await wait_until(lambda: gate.waiters.depth("c1", "long") == 1)
        server.kill()
        outcome = await asyncio.wait_for(waiter, timeout=30)
        assert isinstance(outcome, Rejected) and outcome.reject.status == 503
        assert outcome.reject.reason is Reason.LEDGER_UNAVAILABLE
        waits = {
            result: sample(registry, "fleet_flow_waits_total", request_class="long", result=result)
            for result in ("unavailable", "timeout")
        }
        assert waits == {"unavailable": 1, "timeout": 0}
        await pipeline.release(blocker.hold)
        assert len(gate.waiters) == 0
    finally:
        await gate.close()


@pytest.mark.parametrize("mode", ["memory", "redis"])
async def test_a_tenant_limit_refusal_is_counted_alike_with_and_without_redis(
    mode: str, server: RedisServer
) -> None:
    setup = await build(mode, 0.0, server, tenant_max=1)
    pipeline, gate, registry = setup.pipeline, setup.gate, setup.registry
    try:
        running = await pipeline.decide(headers(session_on(pipeline, "c2", "r"), "t1"), BODY, 1.0)
        assert isinstance(running, Routed)
        refused = await pipeline.decide(headers(session_on(pipeline, "c3", "o"), "t1"), BODY, 1.0)
        assert isinstance(refused, Rejected)
        assert refused.reject.reason is Reason.TENANT_CONCURRENCY
        counts = (
            sample(
                registry,
                "fleet_requests_total",
                api="openai.chat",
                request_class="long",
                outcome="tenant_concurrency",
            ),
            sample(
                registry,
                "fleet_admission_rejections_total",
                request_class="long",
                status="429",
                reason="tenant_concurrency",
            ),
            sample(registry, "fleet_admissions_total", request_class="long", result="rejected"),
        )
        assert counts == (1, 1, 1)
        await pipeline.release(running.hold)
        assert await tenant_state(setup, "t1") == (0, running.facts.input_tokens)
        assert gate.held == 0
    finally:
        await gate.close()

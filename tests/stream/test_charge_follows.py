"""The budget charge follows the cluster that serves a request (issue 13): a request Envoy
failed over is re-charged to the serving cluster, in memory and in a real Redis; with
probing, a request whose primary has no ready endpoint is placed on and charged to the next
cluster from the start."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.core.fleet import Budget
from extproc.ledger.gate import build_gate
from extproc.pipeline.endpoint_health import EndpointHealth
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Rejected, Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from tests.stream.test_pipeline import headers
from tests.support.flow import NO_PLACEMENT, refused_at_once
from tests.support.redis_server import RedisServer

CLUSTERS = ("c1", "c2", "c3")


def runtime(redis_url: str | None = None) -> Runtime:
    doc: dict[str, Any] = {
        "version": 1,
        "clusters": [
            {"name": c, "endpoints": [f"127.0.0.1:80{i:02d}"]} for i, c in enumerate(CLUSTERS)
        ],
        "classes": refused_at_once([{"name": "all", "budget": {"max_concurrent": 2}}]),
        "flow": NO_PLACEMENT,
        # Pure hashing places the sessions the tests pick by their hash primary: they test the
        # charge's move, not balance (bounded placement would spill some of them).
        "affinity": {"balance_factor": 0},
    }
    if redis_url:
        doc["redis"] = {"url": redis_url, "timeout_ms": 2000}
    return compile_runtime(parse_config(doc))


def body(i: int) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]})


async def routed_with_primary(pipeline: Pipeline, primary: str, start: int = 0) -> Routed:
    """Decide sessions until one is placed on ``primary`` (holding its budget)."""
    for i in range(start, start + 500):
        preview = await pipeline.preview(headers(f"s{i}"), body(i), 1.0)
        if isinstance(preview, Routed) and preview.route.placement.primary == primary:
            outcome = await pipeline.decide(headers(f"s{i}"), body(i), 1.0)
            assert isinstance(outcome, Routed), outcome
            return outcome
    raise AssertionError(f"no session hashes to {primary}")


async def usage(pipeline: Pipeline, cluster: str) -> int:
    assert pipeline.gate is not None
    seen = await pipeline.gate.usage(cluster, "all", Budget(max_concurrent=2))
    count = seen["concurrent"]
    assert isinstance(count, int)
    return count


@pytest.fixture
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


async def _failover_moves_the_charge(rt: Runtime) -> None:
    registry = CollectorRegistry()
    gate = build_gate(rt, registry, time.monotonic, random.Random(1))
    await gate.start()
    pipeline = Pipeline(RuntimeHolder(rt), Metrics(registry), gate)
    try:
        first = await routed_with_primary(pipeline, "c1")
        secondary = first.route.placement.secondary
        assert secondary is not None
        assert (await usage(pipeline, "c1"), await usage(pipeline, secondary)) == (1, 0)
        # The response headers say another cluster served (Envoy failed over).
        assert pipeline.response_headers_wanted(first.hold)  # a budget: the phase is read
        pipeline.observe_response(first.hold, {}, 2.0, envoy_served=secondary)
        await pipeline.charge_served(first.hold)
        assert first.hold.ticket is not None and first.hold.ticket.cluster == secondary
        assert (await usage(pipeline, "c1"), await usage(pipeline, secondary)) == (0, 1)
        # The secondary's budget (2) now counts the moved request: one more fits, then 429.
        other = await routed_with_primary(pipeline, secondary, start=1000)
        third = None
        for i in range(2000, 2500):
            preview = await pipeline.preview(headers(f"s{i}"), body(i), 3.0)
            if isinstance(preview, Routed) and preview.route.placement.primary == secondary:
                third = await pipeline.decide(headers(f"s{i}"), body(i), 3.0)
                break
        assert isinstance(third, Rejected) and third.reject.status == 429
        moved = registry.get_sample_value(
            "fleet_budget_charges_moved_total", {"request_class": "all", "result": "moved"}
        )
        assert moved == 1
        await pipeline.release(first.hold)
        await pipeline.release(other.hold)
        assert gate.held == 0
        assert [await usage(pipeline, c) for c in CLUSTERS] == [0, 0, 0]
    finally:
        await gate.close()


async def test_failover_moves_the_charge_in_memory() -> None:
    await _failover_moves_the_charge(runtime())


async def test_failover_moves_the_charge_in_redis(redis_url: str) -> None:
    await _failover_moves_the_charge(runtime(redis_url))


async def test_a_full_secondary_still_takes_the_charge_and_counts_it() -> None:
    rt = runtime()
    registry = CollectorRegistry()
    gate = build_gate(rt, registry, time.monotonic, random.Random(1))
    pipeline = Pipeline(RuntimeHolder(rt), Metrics(registry), gate)
    held = [await routed_with_primary(pipeline, "c2", start=i * 1000) for i in range(2)]
    failed_over = await routed_with_primary(pipeline, "c1", start=5000)
    pipeline.observe_response(failed_over.hold, {}, 2.0, envoy_served="c2")
    await pipeline.charge_served(failed_over.hold)
    assert await usage(pipeline, "c2") == 3  # over its budget of 2: the request runs there
    over = registry.get_sample_value(
        "fleet_budget_charges_moved_total", {"request_class": "all", "result": "over_budget"}
    )
    assert over == 1
    for routed in [*held, failed_over]:
        await pipeline.release(routed.hold)
    assert gate.held == 0 and await usage(pipeline, "c2") == 0


async def test_probed_down_primary_is_placed_around_and_charged_there() -> None:
    rt = runtime()
    registry = CollectorRegistry()
    gate = build_gate(rt, registry, time.monotonic, random.Random(1))
    health = EndpointHealth(rt.endpoints, {})
    # As the probes would leave it with c1's only endpoint dead.
    health.ready = frozenset(e for c in ("c2", "c3") for e in rt.endpoints[c])
    pipeline = Pipeline(RuntimeHolder(rt), Metrics(registry), gate, endpoint_health=health)
    outcomes = [await pipeline.decide(headers(f"s{i}"), body(i), 1.0) for i in range(40)]
    routed = [o for o in outcomes if isinstance(o, Routed)]
    assert routed and all(o.route.placement.primary != "c1" for o in routed)
    assert all(o.route.placement.secondary != "c1" for o in routed)
    # Charged where they will run; c1's budget untouched; beyond c2 + c3's budgets: 429.
    assert await usage(pipeline, "c1") == 0
    assert await usage(pipeline, "c2") == 2 and await usage(pipeline, "c3") == 2
    assert len(routed) == 4
    moved_off = registry.get_sample_value("fleet_placed_around_unready_total", {"cluster": "c1"})
    assert moved_off is not None and moved_off > 0
    for o in routed:
        await pipeline.release(o.hold)
    assert gate.held == 0

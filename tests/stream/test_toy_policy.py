"""A new admission policy goes in one place, the admission step (extproc/pipeline/step.py),
and all three drivers follow without further work: the processor (``Pipeline.decide``),
``explain``'s preview (``Pipeline.preview``) and the fleet simulator (``run_policy``).

The toy policy, added here only: a request of more than ``LIMIT`` estimated input tokens is
refused with a 413 of its own, on every cluster, before any budget is consulted."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.core.admission import Reason, Reject, plan
from extproc.core.decide import Route
from extproc.core.fleet import Budget
from extproc.ledger.gate import build_gate
from extproc.pipeline import step as steps
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Rejected, Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.sim.engine import SERVED
from extproc.sim.model import FleetShape
from extproc.sim.scenario import SimOptions, simulate
from extproc.sim.traffic import base_from_trace, mooncake_like

TOY = "toy: this fleet takes no request over the limit"
ORIGINAL = steps.admission_step


def toy_step(limit: int, original: Callable[..., steps.Step]) -> Callable[..., steps.Step]:
    # The step's other inputs pass through untouched, whatever they are: the toy decides on
    # the request's tokens and route alone.
    def admission_step(tokens: int, route: Route, *rest: Any, **named: Any) -> steps.Step:
        if tokens > limit and plan(tokens, route) is not None:
            cls, cluster = route.request_class.name, route.placement.primary
            return Reject(413, cls, cluster, TOY, Reason.EXCEEDS_BUDGET)
        return (yield from original(tokens, route, *rest, **named))

    return admission_step


def request(words: int, sid: str) -> tuple[dict[str, str], bytes]:
    headers = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
        "x-session-id": sid,
    }
    text = " ".join(f"w{k}" for k in range(words))
    return headers, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


async def test_a_toy_admission_policy_is_seen_by_the_processor_explain_and_the_simulator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limit = 100
    monkeypatch.setattr(steps, "admission_step", toy_step(limit, ORIGINAL))

    runtime = compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i}"]} for i in (1, 2)],
                "classes": [{"name": "all", "budget": {"max_concurrent": 8}}],
            }
        )
    )
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(1))
    await gate.start()
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)
    try:
        small, large = request(10, "a"), request(400, "b")
        # explain's preview, then the processor itself.
        for decide in (pipeline.preview, pipeline.decide):
            refused = await decide(*large, 1.0)
            assert isinstance(refused, Rejected) and refused.reject.message == TOY
            routed = await decide(*small, 1.0)
            assert isinstance(routed, Routed)
            await pipeline.release(routed.hold)
        assert gate.held == 0
    finally:
        await gate.close()

    # The simulator, a budgeted long class: its requests over the limit all end in a 413 at
    # once (no retries), the others are served or refused by the budget as before.
    sim_limit = 128_000  # about the median long request of this trace
    monkeypatch.setattr(steps, "admission_step", toy_step(sim_limit, ORIGINAL))
    _summary, runs, prepared = simulate(
        SimOptions(
            sessions=1500,
            shape=FleetShape(4, spares=0, utilisation=0.5, kv_share=0.5, seed=3),
            seed=5,
            events=(),
            policies=("hash-2+bulkheads",),
            long_budget=Budget(max_concurrent=4),
        ),
        base=base_from_trace(mooncake_like(seed=11, sessions=1500, duration_s=300.0)),
    )
    run = runs["hash-2+bulkheads"]
    traffic = prepared.scenario.traffic
    templates = np.asarray(traffic.templates)
    tokens = np.asarray(traffic.t_input)[templates]
    long_ = np.asarray(traffic.t_class)[templates] == 2
    over = long_ & (tokens > sim_limit)
    assert over.sum() > 5 and (long_ & ~over).sum() > 5
    assert (run.status[over] == 413).all() and (run.rejections[over] == 0).all()
    assert (run.status[long_ & ~over] != 413).all()
    assert (run.status[long_ & ~over] == SERVED).any()

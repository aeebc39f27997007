"""The pipeline driven directly (no gRPC): preview changes nothing and predicts decide; release
gives back exactly what decide took; outcomes for bad input and other paths."""

from __future__ import annotations

import random
import time
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.core.api import BadRequest
from extproc.ledger.gate import build_gate
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Passthrough, Rejected, Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from tests.support.flow import NO_PLACEMENT, refused_at_once

CHAT = "/v1/chat/completions"


def doc(**extra: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"]} for i in (1, 2, 3)],
        "classes": refused_at_once(
            [
                {"name": "short", "max_input_tokens": 200, "budget": {"max_concurrent": 1}},
                {"name": "long", "budget": {"max_inflight_tokens": 300}},
            ]
        ),
        "affinity": {"enabled": True},
        "flow": NO_PLACEMENT,
        **extra,
    }


def headers(sid: str, path: str = CHAT) -> dict[str, str]:
    return {
        ":method": "POST",
        ":path": path,
        "content-type": "application/json",
        "x-session-id": sid,
    }


def body(text: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_preview_changes_nothing_and_predicts_the_decision() -> None:
    runtime = compile_runtime(parse_config(doc()))
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(1))
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)
    try:
        first = await pipeline.preview(headers("a"), body("hi"), 10.0)
        again = await pipeline.preview(headers("a"), body("hi"), 10.0)
        assert isinstance(first, Routed) and isinstance(again, Routed)
        assert (first.route, first.kind) == (again.route, again.kind)
        assert len(pipeline.fleet.memory) == 0  # no session marked
        assert gate.held == 0
        routed = {"api": "openai.chat", "request_class": "short", "outcome": "routed"}
        assert sample(registry, "fleet_requests_total", **routed) == 0  # nothing counted
        decided = await pipeline.decide(headers("a"), body("hi"), 10.0)
        assert sample(registry, "fleet_requests_total", **routed) == 1
        assert isinstance(decided, Routed)
        assert (decided.route, decided.kind) == (first.route, first.kind)
        assert gate.held == 1 and pipeline.fleet.load.inflight(decided.route.placement.primary) == 1
        # The class allows one request at a time: the preview cannot know (the ledger decides at
        # the instant of the request), the decision does.
        assert isinstance(await pipeline.preview(headers("a"), body("hi"), 10.5), Routed)
        second = await pipeline.decide(headers("a"), body("hi"), 10.5)
        assert isinstance(second, Rejected) and second.reject.status == 429
        await pipeline.release(decided.hold)
        await pipeline.release(decided.hold)  # idempotent
        assert gate.held == 0 and pipeline.fleet.load.inflight(decided.route.placement.primary) == 0
    finally:
        await pipeline.aclose()
        await gate.close()


async def test_outcomes_for_other_paths_bad_bodies_and_oversized_requests() -> None:
    runtime = compile_runtime(parse_config(doc()))
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(1))
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)
    try:
        other = await pipeline.decide(headers("a", "/v1/models"), None, 0.0)
        assert isinstance(other, Passthrough)
        empty = await pipeline.decide(headers("a"), None, 0.0)
        assert isinstance(empty, BadRequest) and empty.status == 400
        broken = await pipeline.decide(headers("a"), b"{not json", 0.0)
        assert isinstance(broken, BadRequest) and broken.status == 400
        # 300 tokens of budget in flight at most: a larger request can never be admitted.
        huge = await pipeline.decide(headers("a"), body("x" * 2000), 0.0)
        assert isinstance(huge, Rejected) and huge.reject.status == 413
        assert isinstance(await pipeline.preview(headers("a"), body("x" * 2000), 0.0), Rejected)
        assert gate.held == 0
        assert sample(registry, "fleet_passthrough_requests_total") == 1
    finally:
        await pipeline.aclose()
        await gate.close()

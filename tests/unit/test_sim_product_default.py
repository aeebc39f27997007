"""The simulator's ``product-default`` policy is the processor's default placement: pure hashing
plus bounded-load placement of new sessions (extproc.core.affinity.place_bounded), fed with the
pipeline's own session memory and decayed placement counts. Checked against the real pipeline
request by request, and on a shared-opening layout where pure hashing is over the bound."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import DEFAULT_BALANCE_FACTOR, Runtime, with_sketch
from extproc.core.chains import ChainParams, ChainSketch
from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.harness.layouts import LayoutConfig, generate_layout
from extproc.harness.workload import ReplayRequest
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.sim.engine import run_policy
from extproc.sim.model import FleetShape
from extproc.sim.policies import FleetView, ProductDefault
from extproc.sim.scenario import SimOptions, build, simulate
from extproc.sim.vector import ranking

CLUSTERS = 16
BODY = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def default_runtime(clusters: int) -> Runtime:
    """fleet.yaml with clusters only: every placement setting at its default."""
    data: dict[str, Any] = {
        "version": 1,
        "clusters": [
            {"name": f"c{i}", "endpoints": [f"127.0.0.1:{9000 + i}"]} for i in range(clusters)
        ],
    }
    return compile_runtime(parse_config(data, "test.yaml"))


def headers(session: str) -> dict[str, str]:
    return {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
        "x-session-id": session,
    }


def requests(sessions: int, seed: int) -> list[tuple[float, int]]:
    """(arrival s, session): 1-4 turns per session, sessions starting in a burst and
    interleaving, as conversations do."""
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    for s in range(sessions):
        start = rng.uniform(0.0, 30.0)
        for turn in range(rng.randint(1, 4)):
            out.append((start + turn * rng.uniform(5.0, 40.0), s))
    return sorted(out)


def arrival(request: ReplayRequest) -> float:
    return request.arrival_s


def pipeline_primaries(runtime: Runtime, sequence: list[tuple[float, int]]) -> list[str]:
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(CollectorRegistry()))

    async def run() -> list[str]:
        out = []
        for now, s in sequence:
            outcome = await pipeline.decide(headers(f"session-{s}"), BODY, now)
            assert isinstance(outcome, Routed)
            out.append(outcome.route.placement.primary)
        return out

    return asyncio.run(run())


def fleet_view(names: tuple[str, ...], points: list[int], alive: list[bool]) -> FleetView:
    """The engine's view of a fleet of equal clusters, all members, with its hash tables."""
    array = np.array(points, dtype=np.uint64)
    table = ranking(array, names, [1.0] * len(names), len(names)).astype(np.int32)
    return FleetView(
        states=[],
        alive=alive,
        alive_ix=[i for i, up in enumerate(alive) if up],
        table=table,
        primary=table[:, 0].tolist(),
        secondary=table[:, 1].tolist(),
        rng=random.Random(0),
        member=[True] * len(names),
        names=names,
        points=array,
        weights=(1.0,) * len(names),
    )


def simulator_primaries(
    runtime: Runtime, sequence: list[tuple[float, int]], sessions: int
) -> tuple[list[str], ProductDefault]:
    """The same requests through the simulator's policy, on the simulator's hash tables built
    from the processor's placement points of the same session ids."""
    points = []
    for s in range(sessions):
        facts = parse_request(
            "/v1/chat/completions",
            headers(f"session-{s}"),
            BODY,
            runtime.key_rules,
            ParseLimits(),
        )
        assert isinstance(facts, RequestFacts)
        points.append(facts.session.point)
    names = tuple(c.name for c in runtime.clusters)
    view = fleet_view(names, points, [True] * len(names))
    policy = ProductDefault()
    policy.refresh(view)
    seen: set[int] = set()
    out = []
    for now, s in sequence:
        candidates = policy.route(view, s, s not in seen, now)
        seen.add(s)
        out.append(names[candidates[0][0]])
    return out, policy


def test_the_runtime_default_is_the_bound_the_policy_models() -> None:
    runtime = default_runtime(CLUSTERS)
    assert not runtime.affinity.enabled
    assert runtime.affinity.balance_factor == DEFAULT_BALANCE_FACTOR > 0
    assert ProductDefault().params == runtime.affinity


@pytest.mark.parametrize("seed", [1, 2])
def test_placements_equal_the_pipelines_request_by_request(seed: int) -> None:
    runtime = default_runtime(CLUSTERS)
    sessions = 120
    sequence = requests(sessions, seed)
    expected = pipeline_primaries(runtime, sequence)
    got, policy = simulator_primaries(runtime, sequence, sessions)
    assert got == expected
    # Not vacuous: the bound moved sessions, and their later turns followed.
    assert policy.spilled > 0
    assert policy.kinds.get("override", 0) > 0


def test_a_spilled_session_keeps_its_cluster_for_its_later_turns() -> None:
    runtime = default_runtime(CLUSTERS)
    sequence = requests(120, 3)
    got, _policy = simulator_primaries(runtime, sequence, 120)
    first: dict[int, str] = {}
    for (_now, s), cluster in zip(sequence, got, strict=True):
        assert first.setdefault(s, cluster) == cluster


def test_a_shared_opening_layout_is_bounded_where_pure_hashing_is_not() -> None:
    """first-user (the opening in the first user message), keyed by the chain key, one
    processor: requests per cluster max/mean over 8 and 16 clusters."""
    for clusters in (8, 16):
        summary, _runs, _prepared = simulate(
            SimOptions(
                layout="first-user",
                key="chain",
                layout_conversations=400,
                sessions=400,
                shape=FleetShape(clusters, spares=0),
                events=(),
                policies=("hash-2", "product-default"),
            )
        )
        hashed = summary["policies"]["hash-2"]
        bounded = summary["policies"]["product-default"]
        assert hashed["requests_max_over_mean"] > 1.2
        assert bounded["requests_max_over_mean"] <= 1.2
        assert bounded["spilled_sessions"] > 0
        # Bounding costs no cache hits worth the name (turns follow their session).
        assert bounded["hit_ratio"] >= hashed["hit_ratio"] - 0.02


def test_a_dead_cluster_is_not_known_to_the_processor_and_envoy_fails_over() -> None:
    """With load-aware affinity off the processor reads no response, so it never learns that
    a cluster is down: it decides as before, Envoy serves the request on the decision's
    secondary, and the budget is charged to the decided cluster."""
    names = tuple(c.name for c in default_runtime(CLUSTERS).clusters)
    hashed = fleet_view(names, [0], [True] * len(names))
    primary, secondary = hashed.primary[0], hashed.secondary[0]
    alive = [True] * len(names)
    alive[primary] = False
    policy = ProductDefault()
    assert policy.route(fleet_view(names, [0], alive), 0, True, 0.0) == [(secondary, primary)]
    assert policy.kinds == {"primary": 1}


@pytest.mark.parametrize("layout", ["first-user", "anthropic", "completions-8k"])
def test_a_layout_run_serves_every_request_where_the_pipeline_places_it(layout: str) -> None:
    """The whole issue-15 comparison path: the layout keyed by the simulator
    (``processor_sessions``: the chain key, one sketch in arrival order), run by the engine
    with ``product-default``, against the real pipeline keying the same bodies through its own
    chain sketch (as ``serve`` gives it one) at the same instants, default config."""
    options = SimOptions(
        layout=layout,
        key="chain",
        layout_conversations=200,
        sessions=200,
        shape=FleetShape(16, spares=0),
        events=(),
        policies=("product-default",),
    )
    prepared = build(options)
    scenario = prepared.scenario
    run = run_policy(scenario, prepared.config, "product-default")
    simulated = [scenario.names[c] for c in run.served_on.tolist()]
    assert run.spilled_sessions > 0
    data: dict[str, Any] = {
        "version": 1,
        "clusters": [
            {"name": name, "endpoints": [f"127.0.0.1:{9000 + i}"]}
            for i, name in enumerate(scenario.names)
        ],
    }
    runtime = with_sketch(
        compile_runtime(parse_config(data, "test.yaml")), ChainSketch(ChainParams())
    )
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(CollectorRegistry()))
    requests = sorted(generate_layout(LayoutConfig(layout=layout, conversations=200)), key=arrival)
    # The same instants (the copy offset arithmetic may move the last bit).
    assert [r.arrival_s for r in requests] == pytest.approx(list(scenario.traffic.times))

    async def place() -> list[str]:
        out = []
        for request in requests:
            outcome = await pipeline.decide(
                {":method": "POST", ":path": request.path, "content-type": "application/json"},
                orjson.dumps(request.materialize()),
                request.arrival_s,
            )
            assert isinstance(outcome, Routed)
            out.append(outcome.route.placement.primary)
        return out

    assert simulated == asyncio.run(place())

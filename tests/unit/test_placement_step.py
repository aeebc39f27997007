"""The bounded placement step (extproc/pipeline/placement_step.py) has two drivers: the
pipeline's (``Pipeline._follow_override``) and the simulator's ``product-default``. The same
requests, GPU verdicts and KV reports through both give the same (primary, secondary) and the
same kind of decision, request by request: the bound's spills, the overrides later turns follow,
hot clusters skipped for new sessions and as secondaries, and relief's migrations."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.core.affinity import AffinityParams, Decision, SessionView
from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.core.load import FleetSnapshot, LoadReport
from extproc.core.placement import Placement
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.pipeline.placement_step import (
    BoundedInputs,
    LookUpSession,
    NotePlacement,
    PlacementNeed,
    bounded_step,
)
from extproc.pipeline.step import drive
from extproc.sim.policies import ProductDefault
from tests.unit.test_sim_product_default import fleet_view, headers

CLUSTERS = 8
BODY = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
GPU_HOT = "c2"
KV_HOT = "c5"


def hot_runtime() -> Runtime:
    """Affinity off with its default bound; every cluster's GPUs watched, and its engine's KV
    use scraped (KV relief); relief rounds every 10 s, half of a hot cluster's sessions each."""
    doc: dict[str, Any] = {
        "version": 1,
        "clusters": [
            {
                "name": f"c{i}",
                "endpoints": [f"127.0.0.1:{9100 + i}"],
                "engine": "vllm",
                "gpus": [{"endpoint": f"127.0.0.1:{9100 + i}", "exporter": "127.0.0.1:9400"}],
            }
            for i in range(CLUSTERS)
        ],
        "engine_metrics": {"enabled": True},
        "gpu_health": {"enabled": True, "move_after_ms": 10000, "move_fraction": 0.5},
    }
    return compile_runtime(parse_config(doc, "test.yaml"))


@dataclass(frozen=True, slots=True)
class Request:
    at: float
    session: int


@dataclass(frozen=True, slots=True)
class GpuVerdict:
    at: float
    cluster: str
    until: float


@dataclass(frozen=True, slots=True)
class KvReport:
    at: float
    cluster: str
    kv: float


Event = Request | GpuVerdict | KvReport


def scrape(kv: float) -> LoadReport:
    return LoadReport(kv=kv, queue=None, inflight=None, cpu=None, source="scrape")


def events(sessions: int, seed: int) -> list[Event]:
    """Sessions of 1-6 turns starting over the first minute; c2's GPUs hot from 25 s to 80 s;
    c5's KV use at 0.99 in reports every second from 30 s to 55 s (stale after)."""
    rng = random.Random(seed)
    out: list[Event] = []
    for s in range(sessions):
        at = rng.uniform(0.0, 60.0)
        for _turn in range(rng.randint(1, 6)):
            out.append(Request(at, s))
            at += rng.uniform(2.0, 15.0)
    out.append(GpuVerdict(25.0, GPU_HOT, 80.0))
    out.extend(KvReport(float(t), KV_HOT, 0.99) for t in range(30, 56))
    return sorted(out, key=lambda e: (e.at, isinstance(e, Request)))


def points(runtime: Runtime, sessions: int) -> list[int]:
    """The processor's placement point of each session id."""
    out = []
    for s in range(sessions):
        facts = parse_request(
            "/v1/chat/completions", headers(f"session-{s}"), BODY, runtime.key_rules, ParseLimits()
        )
        assert isinstance(facts, RequestFacts)
        out.append(facts.session.point)
    return out


Choice = tuple[str, str | None, str]


def through_the_pipeline(runtime: Runtime, sequence: list[Event]) -> list[Choice]:
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(CollectorRegistry()))

    async def run() -> list[Choice]:
        out: list[Choice] = []
        for event in sequence:
            if isinstance(event, GpuVerdict):
                pipeline.fleet.gpu_checked(event.cluster, "gpu_memory", event.at, event.until)
            elif isinstance(event, KvReport):
                report = LoadReport(
                    kv=event.kv, queue=None, inflight=None, cpu=None, source="scrape"
                )
                pipeline.fleet.scraped(event.cluster, report, event.at)
            else:
                routed = await pipeline.decide(headers(f"session-{event.session}"), BODY, event.at)
                assert isinstance(routed, Routed)
                placement = routed.route.placement
                out.append((placement.primary, placement.secondary, routed.kind))
                await pipeline.release(routed.hold)
        return out

    return asyncio.run(run())


def through_the_simulator(
    runtime: Runtime, sequence: list[Event], sessions: int
) -> tuple[list[Choice], list[Placement]]:
    """The simulator's policy on its own hash tables, built from the same sessions' points;
    also pure hashing's placement of each request."""
    names = tuple(c.name for c in runtime.clusters)
    view = fleet_view(names, points(runtime, sessions), [True] * len(names))
    policy = ProductDefault.of_runtime(runtime)
    out: list[Choice] = []
    hashed: list[Placement] = []
    for event in sequence:
        if isinstance(event, GpuVerdict):
            policy.load.record_gpu(event.cluster, "gpu_memory", event.at, event.until)
        elif isinstance(event, KvReport):
            policy.load.record(event.cluster, scrape(event.kv), event.at)
        else:
            outcome = policy.decide(view, event.session, event.at)
            placement = outcome.placement
            out.append((placement.primary, placement.secondary, outcome.decision.kind))
            p, s = view.primary[event.session], view.secondary[event.session]
            hashed.append(Placement(names[p], names[s]))
    return out, hashed


@pytest.mark.parametrize("seed", [1, 6])
def test_the_pipeline_and_the_simulator_place_every_request_alike(seed: int) -> None:
    runtime = hot_runtime()
    assert not runtime.affinity.enabled and runtime.affinity.balance_factor > 0
    assert runtime.relief is not None and runtime.kv_relief_at is not None
    sessions = 160
    sequence = events(sessions, seed)
    live = through_the_pipeline(runtime, sequence)
    simulated, hashed = through_the_simulator(runtime, sequence, sessions)
    assert simulated == live
    # Not vacuous: every rule of the step decided some requests ...
    kinds = {kind for _p, _s, kind in live}
    assert {"primary", "spilled", "override", "migrated"} <= kinds
    # ... hot clusters took no new session while hot, and were replaced as secondaries.
    at = [e.at for e in sequence if isinstance(e, Request)]
    spilled_off_hot = [
        h.primary
        for (_p, _s, kind), h, t in zip(live, hashed, at, strict=True)
        if kind == "spilled" and (h.primary, 25.0 <= t < 80.0) == (GPU_HOT, True)
    ]
    assert spilled_off_hot
    assert any(
        s != h.secondary and h.secondary in (GPU_HOT, KV_HOT)
        for (p, s, _k), h in zip(live, hashed, strict=True)
        if p == h.primary
    )


class Counting:
    """The step's lazy inputs over a fixed ranking and an idle fleet, counting each ask."""

    def __init__(self, ranked: list[str]) -> None:
        self.order = ranked
        self.ranked_asks = 0
        self.loads_asks = 0

    def ranked(self) -> list[str]:
        self.ranked_asks += 1
        return self.order

    def loads(self, ranked: Sequence[str]) -> FleetSnapshot:
        self.loads_asks += 1
        assert list(ranked) == self.order
        return FleetSnapshot({})


def run_step(
    inputs: BoundedInputs, session: SessionView, params: AffinityParams
) -> tuple[list[PlacementNeed], Placement, Decision]:
    needs: list[PlacementNeed] = []

    def perform(need: PlacementNeed) -> SessionView | None:
        needs.append(need)
        return session if isinstance(need, LookUpSession) else None

    outcome = drive(bounded_step(inputs, inputs.hashed, 0.0, params), perform)
    return needs, outcome.placement, outcome.decision


def test_a_later_turn_neither_ranks_nor_reads_loads() -> None:
    fleet = Counting(["c0", "c1", "c2"])
    inputs = BoundedInputs(Placement("c0", "c1"), {"c0", "c1", "c2"}, fleet.ranked, fleet.loads)
    needs, placement, decision = run_step(
        inputs, SessionView(seen=True), AffinityParams(balance_factor=1.1)
    )
    assert placement == Placement("c0", "c1") and decision.kind == "primary"
    assert needs == [LookUpSession("c0"), NotePlacement(decision, "c0")]
    assert (fleet.ranked_asks, fleet.loads_asks) == (0, 0)


def test_a_new_session_on_a_hot_primary_ranks_and_reads_loads_once() -> None:
    fleet = Counting(["c0", "c1", "c2"])
    inputs = BoundedInputs(
        Placement("c0", "c1"), {"c0", "c1", "c2"}, fleet.ranked, fleet.loads, hot={"c0", "c2"}
    )
    needs, placement, decision = run_step(
        inputs, SessionView(seen=False), AffinityParams(balance_factor=1.1)
    )
    assert decision.kind == "spilled" and placement.primary == "c1"
    assert needs[-1] == NotePlacement(decision, "c1")
    assert (fleet.ranked_asks, fleet.loads_asks) == (1, 1)

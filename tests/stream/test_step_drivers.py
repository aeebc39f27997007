"""The admission step (extproc/pipeline/step.py) driven by the processor and by the simulator
decides the same: one seeded request sequence through the live pipeline (real gate, in-memory
ledger) and through the simulator's driver (extproc/sim/admission.py) over its own in-memory
ledger, on one clock. Every request gets the same class, placement, admission, queueing and,
for a refusal, the same status and retry hint (both draw the hint's jitter from one seed in
the same order)."""

from __future__ import annotations

import random
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.core.admission import Admitted, Reject, Ticket
from extproc.core.decide import Route
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.flow import WaitPolicy, placement_candidates, secondary_for
from extproc.core.placement import Placement
from extproc.ledger.gate import build_gate
from extproc.ledger.memory import MemoryLedger
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Hold, Rejected, Routed, Waiting
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.pipeline.step import Placed, admission_step
from extproc.sim.admission import QUEUED, SimAdmission

CHAT = "/v1/chat/completions"
SEED = 7

DOC: dict[str, Any] = {
    "version": 1,
    "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"]} for i in range(1, 5)],
    "classes": [
        {
            "name": "short",
            "max_input_tokens": 40,
            "budget": {"max_concurrent": 1},
            "wait": {"max_wait_s": 0},
        },
        {
            "name": "long",
            "budget": {"max_concurrent": 2, "max_inflight_tokens": 400},
            "wait": {"max_wait_s": 20, "max_queue": 2},
        },
    ],
    "flow": {"place_new_sessions": True},
    # Admission's placement alone (bounded-load placement of new sessions is the placement
    # step's, not admission's).
    "affinity": {"balance_factor": 0},
}


def request(sid: str, words: int) -> tuple[dict[str, str], bytes]:
    headers = {
        ":method": "POST",
        ":path": CHAT,
        "content-type": "application/json",
        "x-session-id": sid,
    }
    text = " ".join(f"w{k}" for k in range(words))
    return headers, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def sequence(n: int) -> list[tuple[str, int, bool]]:
    """(session, words, release the oldest held request first)."""
    rng = random.Random(SEED)
    return [
        (f"s{rng.randrange(12)}", rng.choice((5, 10, 60, 150, 300)), rng.random() < 0.45)
        for _ in range(n)
    ]


class SimSide:
    """The simulator's driver fed as the pipeline feeds the live one: the hash route, or the
    placement a new session was given; later hash candidates for a new session."""

    def __init__(self, runtime: Any, clock: list[float]) -> None:
        self.runtime = runtime
        self.ledger = MemoryLedger(lambda: clock[0])
        self.queued: list[tuple[tuple[str, str], int]] = []
        self.driver = SimAdmission(
            self.ledger, random.Random(SEED), self._on_queued, self.ledger.release_now
        )
        self.seen: set[str] = set()
        self.placed: dict[str, str] = {}

    def _on_queued(self, _i: int, key: tuple[str, str], qid: int, _wait: WaitPolicy) -> None:
        self.queued.append((key, qid))

    def leave_queues(self, keep: int) -> None:
        """Every queued request but the last ``keep`` leaves its queue."""
        leaving = self.queued[: len(self.queued) - keep]
        for key, qid in leaving:
            assert self.driver.queues[key].remove(qid)
        del self.queued[: len(leaving)]

    def decide(self, i: int, sid: str, facts: RequestFacts) -> tuple[tuple[Any, ...], Any]:
        runtime = self.runtime
        route = runtime.policy.route(facts)
        ranked = runtime.policy.placer(route).ranked(facts.session.point)
        seen, override = sid in self.seen, self.placed.get(sid)
        self.seen.add(sid)
        kind = "primary"
        if override is not None:
            route = Route(Placement(override, secondary_for(ranked, override)), route.request_class)
            kind = "override"
        cls = route.request_class

        def elsewhere() -> list[Route]:
            order = placement_candidates(
                ranked, route.placement.primary, seen, override is not None
            )
            return [Route(Placement(c, secondary_for(ranked, c)), cls) for c in order]

        step = admission_step(facts.input_tokens, route, elsewhere, cls.wait)
        outcome = self.driver.admit(step, i)
        if outcome is QUEUED:
            return ("queued", cls.name, route.placement.primary), None
        if isinstance(outcome, Reject):
            return ("rejected", cls.name, outcome.status, outcome.retry_after_s), None
        if isinstance(outcome, Placed):
            self.placed[sid] = outcome.route.placement.primary
            route, kind, ticket = outcome.route, "placed", outcome.admitted.ticket
        else:
            assert isinstance(outcome, Admitted)
            ticket = outcome.ticket
        return ("routed", cls.name, kind, route.placement.primary), ticket


def live_view(outcome: Any) -> tuple[Any, ...]:
    if isinstance(outcome, Waiting):
        return ("queued", outcome.route.request_class.name, outcome.route.placement.primary)
    if isinstance(outcome, Rejected):
        reject = outcome.reject
        return ("rejected", outcome.route.request_class.name, reject.status, reject.retry_after_s)
    assert isinstance(outcome, Routed)
    cls = outcome.route.request_class.name
    return ("routed", cls, outcome.kind, outcome.route.placement.primary)


async def test_the_live_driver_and_the_simulators_driver_decide_the_same() -> None:
    runtime = compile_runtime(parse_config(DOC))
    clock = [0.0]
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, lambda: clock[0], random.Random(SEED))
    await gate.start()
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)
    sim = SimSide(runtime, clock)
    live_held: list[Hold] = []
    sim_held: list[Ticket] = []
    waiting: list[Waiting] = []
    seen_kinds: set[str] = set()
    try:
        for i, (sid, words, release) in enumerate(sequence(300)):
            clock[0] += 0.25
            if release and live_held:
                await pipeline.release(live_held.pop(0))
                sim.ledger.release_now(sim_held.pop(0))
            headers, body = request(sid, words)
            live = await pipeline.decide(headers, body, clock[0], wait=False)
            facts = parse_request(CHAT, headers, body, runtime.key_rules, runtime.parse_limits)
            assert isinstance(facts, RequestFacts)
            expected, ticket = sim.decide(i, sid, facts)
            assert live_view(live) == expected, (i, sid, words)
            seen_kinds.add(expected[0] if expected[0] != "routed" else expected[2])
            if isinstance(live, Routed):
                assert live.hold.ticket is not None and ticket is not None
                assert live.hold.ticket.cluster == ticket.cluster
                live_held.append(live.hold)
                sim_held.append(ticket)
            # A queued request leaves its queue after the next one (its client gave up):
            # that next request met the queue (it joins behind it rather than take a release).
            for w in waiting:
                w.cancel()
            waiting = [live] if isinstance(live, Waiting) else []
            sim.leave_queues(keep=len(waiting))
        # The sequence went through every path: routed on the primary, placed elsewhere,
        # following a placement, queued, refused.
        assert seen_kinds >= {"primary", "placed", "override", "queued", "rejected"}, seen_kinds
    finally:
        for w in waiting:
            w.cancel()
        for hold in live_held:
            await pipeline.release(hold)
        await gate.close()

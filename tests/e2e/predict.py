"""What the processor should decide, computed by the same core the processor runs.

Stacks run the product's default prefix key, the chain key, which learns from the traffic a
processor has seen which chunk chains are common (extproc.core.chains). ``runtime`` from
``load_runtime`` has no sketch: it keys a request by its first chunk, which is what the
processor does too as long as fewer than ``prefix.common_after`` (4) distinct conversations
without a session header or body field share that chunk. A test that sends more of them
predicts with :func:`learning`: a runtime with its own sketch, fed the same requests in the
same order as the stack's one processor replica sees them.

Pure hashing predicts an existing session's turns, not always a new session's first one:
bounded-load placement of new sessions (``affinity.balance_factor``, on by default, with or
without load-aware affinity) may start it on a later hash candidate once the processor's recent
placements are uneven. A test about placement asks the live processor (:func:`live_primary`,
its admin ``/explain``, which shows that decision on the live state); a test about something
else (failover, budgets, P/D ...) pins :data:`PURE_HASH` in its stack's config.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.config import Runtime
from extproc.config.runtime import with_sketch
from extproc.core.chains import ChainSketch
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.placement import Placement
from extproc.explain import explain_remote
from extproc.harness.launch import FleetStack

# fleet.yaml's affinity section for a stack whose first turns are predicted by pure hashing.
PURE_HASH: dict[str, object] = {"balance_factor": 0}


def learning(runtime: Runtime) -> Runtime:
    """``runtime`` keyed through a fresh chain sketch that learns from every prediction: call
    it for each request the test sends, in order, and for nothing else."""
    return with_sketch(runtime, ChainSketch())


def facts_for(
    runtime: Runtime, path: str, body: bytes, headers: Mapping[str, str] | None = None
) -> RequestFacts:
    hdrs = {"content-type": "application/json", **(headers or {})}
    facts = parse_request(path, hdrs, body, runtime.key_rules, runtime.parse_limits)
    assert isinstance(facts, RequestFacts), facts
    return facts


def placement_for(
    runtime: Runtime, path: str, body: bytes, headers: Mapping[str, str] | None = None
) -> Placement:
    return runtime.policy.route(facts_for(runtime, path, body, headers)).placement


def ranked_for(
    runtime: Runtime, path: str, body: bytes, headers: Mapping[str, str] | None = None
) -> list[str]:
    """The request's candidates in hash order: a session started on any of them (its hash
    primary, or a later one a bounded spill chose) fails over to the first other one."""
    facts = facts_for(runtime, path, body, headers)
    return runtime.policy.placer(runtime.policy.route(facts)).ranked(facts.session.point)


def explain_live(
    stack: FleetStack,
    path: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    replica: int = 0,
) -> dict[str, object]:
    """What the stack's live processor (``replica``) would decide for this request now, bounded
    placement included (its admin ``/explain``): ask right before sending it, with nothing else
    in flight."""
    admin = f"http://127.0.0.1:{stack.metrics_ports[replica]}"
    explained = explain_remote(admin, path, dict(headers or {}), body)
    assert explained["outcome"] == "route", explained
    return explained


def live_primary(
    stack: FleetStack,
    path: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    replica: int = 0,
) -> str:
    return str(explain_live(stack, path, body, headers, replica)["primary"])

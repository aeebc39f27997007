"""What the processor should decide, computed by the same core the processor runs.

Stacks run the product's default prefix key, the chain key, which learns from the traffic a
processor has seen which chunk chains are common (extproc.core.chains). ``runtime`` from
``load_runtime`` has no sketch: it keys a request by its first chunk, which is what the
processor does too as long as fewer than ``prefix.common_after`` (4) distinct conversations
without a session header or body field share that chunk. A test that sends more of them
predicts with :func:`learning`: a runtime with its own sketch, fed the same requests in the
same order as the stack's one processor replica sees them.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.config import Runtime
from extproc.config.runtime import with_sketch
from extproc.core.chains import ChainSketch
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.placement import Placement


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

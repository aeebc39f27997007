"""What the processor should decide, computed by the same core the processor runs."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.config import Runtime
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.placement import Placement


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

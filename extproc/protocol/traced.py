"""The stream loop's tracing hooks: a decision's attributes, and its context on the answer.

Used only when tracing is on (``FleetProcessor(tracer=...)``). Attributes follow the
OpenTelemetry GenAI conventions where one exists (``gen_ai.*``) and name the fleet's own facts
under ``fleet.*``. The session appears only as its keyed label; no prompt text, no session id,
no request id.
"""

from __future__ import annotations

from collections.abc import Mapping

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.core.api import Api, BadRequest
from extproc.names import TRACEPARENT_HEADER
from extproc.pipeline.exchange import Outcome, Rejected, Routed, Unavailable
from extproc.protocol.responses import _set
from extproc.tracing import AttributeValue, DecisionTrace

OPERATION = {
    Api.OPENAI_CHAT: "chat",
    Api.OPENAI_COMPLETIONS: "text_completion",
    Api.OPENAI_RESPONSES: "chat",
    Api.ANTHROPIC_MESSAGES: "chat",
}
# The route kinds (extproc.core.affinity.Kind) as the decision a reader of a trace looks for.
DECISION = {
    "primary": "kept",
    "override": "kept",
    "spilled": "spilled",
    "hot_spread": "spilled",
    "placed": "spilled",
    "migrated": "migrated",
}


def record_outcome(trace: DecisionTrace, outcome: Outcome) -> bool:
    """The outcome's attributes on ``trace``; False for what is not an inference decision
    (a pass-through, the model list): no span for those."""
    attrs = trace.attributes
    if isinstance(outcome, BadRequest):
        attrs.update({"fleet.decision": "bad_request", "http.response.status_code": 400})
        trace.status = "bad_request"
        return True
    if isinstance(outcome, Unavailable):
        attrs.update(
            {
                "fleet.decision": "model_unavailable",
                "http.response.status_code": 503,
                "gen_ai.request.model": outcome.miss.model,
            }
        )
        trace.status = "model_unavailable"
        return True
    if not isinstance(outcome, (Routed, Rejected)):
        return False
    facts, route = outcome.facts, outcome.route
    found: dict[str, AttributeValue] = {
        "gen_ai.operation.name": OPERATION[facts.api],
        "fleet.api": facts.api.value,
        "fleet.class": route.request_class.name,
        "fleet.primary": route.placement.primary,
        "fleet.route_kind": outcome.kind,
        "fleet.session": facts.session.label,
        "fleet.session_source": facts.session.source.value,
        "fleet.input_tokens_estimate": facts.input_tokens,
        "fleet.stream": facts.stream,
    }
    if facts.model:
        found["gen_ai.request.model"] = facts.model
    if route.placement.secondary is not None:
        found["fleet.secondary"] = route.placement.secondary
    if isinstance(outcome, Rejected):
        reject = outcome.reject
        found["fleet.decision"] = "rejected"
        found["fleet.reject.reason"] = str(reject.reason)
        found["http.response.status_code"] = reject.status
        if reject.retry_after_s is not None:
            found["fleet.retry_after_s"] = reject.retry_after_s
        trace.status = str(reject.reason)
    else:
        found["fleet.decision"] = DECISION.get(outcome.kind, outcome.kind)
        engine = (outcome.endpoints or outcome.engines or (None,))[0]
        if engine is not None:
            found["fleet.engine"] = engine
        prefill = outcome.prefill
        if prefill is not None:
            found["fleet.prefill.relation"] = prefill.relation
            if prefill.address is not None:
                found["fleet.prefill.endpoint"] = prefill.address
    attrs.update(found)
    return True


def served(trace: DecisionTrace, served_by: str | None) -> None:
    """The response named the cluster that served: another than the primary is a failover."""
    if served_by is None:
        return
    attrs = trace.attributes
    attrs["fleet.served_by"] = served_by
    if attrs.get("fleet.primary") not in (None, served_by):
        attrs["fleet.decision"] = "failed_over"


def with_headers(
    answer: ep.ProcessingResponse, headers: Mapping[str, str]
) -> ep.ProcessingResponse:
    """A copy of a routing answer that also sets ``headers`` on the upstream request (answers
    may be shared between streams: never changed in place)."""
    phase = answer.WhichOneof("response")
    if phase not in ("request_headers", "request_body") or not headers:
        return answer
    out = ep.ProcessingResponse()
    out.CopyFrom(answer)
    sets = getattr(out, phase).response.header_mutation.set_headers
    sets.extend(_set(key, value) for key, value in headers.items())
    if "traceparent" in headers:
        # A tracing Envoy's router overwrites traceparent; its upstream filter restores this.
        sets.append(_set(TRACEPARENT_HEADER, headers["traceparent"]))
    return out

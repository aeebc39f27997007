"""A pipeline outcome as the JSON `extproc explain` prints (CLI and the admin endpoint)."""

from __future__ import annotations

from extproc.config.runtime import Runtime
from extproc.core.api import BadRequest
from extproc.names import EVERY_ENDPOINT_CLUSTER
from extproc.pipeline.fleet_state import LoadTable
from extproc.pipeline.outcomes import (
    ModelList,
    Outcome,
    Passthrough,
    Rejected,
    Routed,
    Unavailable,
)
from extproc.render.grove import describe_end, packed_together


def explain_outcome(runtime: Runtime, outcome: Outcome) -> dict[str, object]:
    """A pipeline outcome as the JSON ``explain`` prints."""
    base: dict[str, object] = {"config_version": runtime.version}
    if isinstance(outcome, Passthrough):
        return {**base, "outcome": "passthrough"}
    if isinstance(outcome, ModelList):
        return {**base, "outcome": "model_list"}
    if isinstance(outcome, BadRequest):
        return {
            **base,
            "outcome": "bad_request",
            "status": outcome.status,
            "message": outcome.message,
        }
    if isinstance(outcome, Unavailable):
        return {
            **base,
            "outcome": "model_unavailable",
            "status": 503,
            "model": outcome.miss.model,
            "class": outcome.miss.class_name,
            "retry_after_s": outcome.miss.retry_after_s,
            "message": outcome.miss.message,
        }
    facts, route = outcome.facts, outcome.route
    cls = route.request_class
    budget = cls.budget
    result: dict[str, object] = {
        **base,
        "outcome": "route" if isinstance(outcome, Routed) else "reject",
        "facts": {
            "api": facts.api.value,
            "model": facts.model,
            "session": facts.session.label,
            "session_source": facts.session.source.value,
            "input_tokens_estimate": facts.input_tokens,
            "max_output_tokens": facts.max_output_tokens,
            "tier": facts.tier,
            "stream": facts.stream,
            "body_bytes": facts.body_bytes,
        },
        "class": cls.name,
        "kind": outcome.kind,
        "primary": route.placement.primary,
        "secondary": route.placement.secondary,
        "x-fleet-route": route.placement.route,
        "model": route.model or None,
        "preference_order": runtime.policy.placer(route).ranked(facts.session.point),
        "budget_per_cluster": {
            "max_inflight_tokens": budget.max_inflight_tokens,
            "max_concurrent": budget.max_concurrent,
            "tokens_per_second": budget.tokens_per_second,
            "burst_tokens": budget.burst_tokens,
            "enforced": budget.enforced,
        },
        # Flow control (extproc/core/flow.py): how long an over-budget request may wait.
        "wait_per_cluster": {
            "max_wait_s": cls.wait.max_wait_s,
            "max_queue": cls.wait.max_queue,
            "enabled": cls.wait.enabled,
        },
    }
    if isinstance(outcome, Routed):
        if outcome.endpoints is not None:
            result["endpoints"] = list(outcome.endpoints)
        prefill = outcome.prefill
        if prefill is not None and runtime.pd is not None:
            # P/D: the prefiller named in x-prefiller-host-port (None: colocated prefill), and
            # what moving this prompt's KV to the decode target costs over that link.
            kv_bytes = outcome.facts.input_tokens * runtime.pd.kv_bytes_per_token
            result["prefill"] = {
                "endpoint": prefill.address,
                "cluster": prefill.endpoint.cluster if prefill.endpoint is not None else None,
                "relation": prefill.relation,
                "reason": prefill.reason,
                "kv_transfer_ms": round(
                    runtime.pd.topology.transfer_s(kv_bytes, prefill.tier) * 1000, 1
                )
                if prefill.endpoint is not None
                else None,
                # Both ends: their topology domains and where the Grove rendering runs them.
                "ends": {
                    "decode": describe_end(runtime.config, outcome.route.placement.primary),
                    "prefill": describe_end(runtime.config, prefill.endpoint.cluster)
                    if prefill.endpoint is not None
                    else None,
                },
                # The narrowest domain the Grove rendering requires both ends to share.
                "packed_together": packed_together(
                    runtime.config, outcome.route.placement.primary, prefill.endpoint.cluster
                )
                if prefill.endpoint is not None
                else None,
            }
        result["engine"] = explain_engine(runtime, outcome)
    else:
        assert isinstance(outcome, Rejected)
        reject = outcome.reject
        result["status"] = reject.status
        result["reason"] = str(reject.reason)
        result["message"] = reject.message
    return result


def explain_engine(runtime: Runtime, outcome: Routed) -> dict[str, object]:
    """Which engine of the primary serves the request, or how Envoy will choose it."""
    primary = outcome.route.placement.primary
    engines = list(runtime.endpoints.get(primary, ()))
    if outcome.endpoints is not None:  # endpoint-picker mode: the processor chose
        chosen = outcome.endpoints[0] if outcome.endpoints else None
        by = "processor rendezvous" if runtime.engines.sticky else "processor, drawn per request"
        out: dict[str, object] = {"chosen_by": by, "engine": chosen, "cluster_engines": engines}
        if outcome.pool is not None:
            out["pool"] = outcome.pool  # the model's own Envoy pool (x-fleet-route)
        return out
    if outcome.engines:  # route mode, a LoRA adapter's request: its loaded engines named
        return {
            "chosen_by": "processor rendezvous over the adapter's loaded engines",
            "engine": outcome.engines[0],
            "named_engines": list(outcome.engines),
            "x-fleet-route": EVERY_ENDPOINT_CLUSTER,  # override_host there tries them in order
            "cluster_engines": engines,
        }
    if outcome.engine_key is not None:
        return {
            "chosen_by": f"envoy {runtime.config.engines.envoy_policy}",
            "x-fleet-engine-key": outcome.engine_key,
            "cluster_engines": engines,
        }
    return {"chosen_by": "envoy round robin", "cluster_engines": engines}


def hot_candidates(load: LoadTable, order: list[str], now: float) -> dict[str, str]:
    """The candidates that take no new sessions at ``now``, with why: a GPU verdict
    (gpu_health) or ``kv_cache`` (KV use at affinity.kv_migrate_threshold, affinity off)."""
    return {c: reason for c in order if (reason := load.hot_reason(c, now)) is not None}


def request_headers(path: str, headers: dict[str, str]) -> dict[str, str]:
    """Headers as the pipeline sees them from Envoy: lower-case names, pseudo-headers set."""
    return {
        "content-type": "application/json",
        **{k.lower(): v for k, v in headers.items()},
        ":method": "POST",
        ":path": path,
    }

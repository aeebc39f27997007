"""The decision pipeline: one request's path from headers and body to an outcome.

The ext_proc servicer, ``extproc explain`` and the benchmarks call this, and the fleet simulator
drives its admission step (extproc/pipeline/step.py) with a driver of its own, so what each of
them shows is what the processor does. It sits between the protocol shell
(which knows Envoy) and the pure core (which knows no I/O and no clock): it owns the state the
core is fed — the fleet's load and session memory, the admission gate, endpoint health — and
takes time as an argument. See ARCHITECTURE.md, "The path of one request".

    pipeline = Pipeline(RuntimeHolder(runtime), metrics, gate)
    outcome = await pipeline.decide(headers, body, now)  # Routed | Rejected | BadRequest | ...
    ...                                                    # response phases:
    pipeline.observe_response(hold, response_headers, now)
    await pipeline.observe_response_body(hold, chunk, end_of_stream, now)
    await pipeline.release(hold)                           # when the exchange ends, always

The protocol shell does not call these: it opens one :class:`Exchange` per stream
(:meth:`Pipeline.exchange`, extproc/pipeline/exchange.py), which keeps the request's hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from random import Random
from typing import Any, Literal, overload
from urllib.parse import unquote

import orjson
from prometheus_client import Counter

from extproc.config.runtime import Runtime
from extproc.core.admission import Admitted, Reject, TenantClaim, request_tokens
from extproc.core.affinity import (
    Decision,
    Kind,
    Override,
    RecentShare,
    SessionView,
    Shortcut,
    place,
)
from extproc.core.api import Api, BadRequest, ErrorStyle, canonical_path
from extproc.core.decide import Placer, Route, base_class_name
from extproc.core.endpoints import adapter_engines, engine_key, pick_endpoints
from extproc.core.facts import RequestFacts, header_facts, parse_request
from extproc.core.failover import around_unready, endpoint_owners
from extproc.core.flow import TenantLimit, WaitPolicy, placement_candidates
from extproc.core.keys import KeySource
from extproc.core.load import ORCA_HEADER, ClusterLoad, FleetSnapshot, parse_load_headers
from extproc.core.models import (
    MODELS_PATH,
    Candidates,
    ModelMiss,
    ModelUnavailable,
    UnknownModel,
    model_list,
    model_object,
)
from extproc.core.pd import PrefillChoice, bootstrap_batch, bootstrap_fields
from extproc.core.placement import HEAD_MIN_CLUSTERS, Placement, Rendezvous, mix64
from extproc.core.relief import cool_first, cool_secondary
from extproc.core.tenant_limits import refusal as tenant_refusal
from extproc.core.tenant_limits import share as tenant_share
from extproc.core.tenants import Tenant, resolve_tenant
from extproc.core.usage import SseUsageScanner, Usage, response_id_from_body, usage_from_body
from extproc.ledger.gate import AdmissionGate
from extproc.ledger.tenant_limits import TenantLimits, TenantSlot
from extproc.ledger.waiters import Queued
from extproc.names import prefill_mirror_cluster
from extproc.pipeline import step as steps
from extproc.pipeline.endpoint_health import EndpointHealth
from extproc.pipeline.exchange import Exchange, Modes, inference_api
from extproc.pipeline.fleet_state import FleetState
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import (
    PASSTHROUGH,
    Hold,
    ModelList,
    Outcome,
    Rejected,
    Routed,
    Unavailable,
    Waiting,
)
from extproc.pipeline.placement_step import (
    BoundedInputs,
    BoundedPlacement,
    LookUpSession,
    balance_half_life,
    bounded_step,
)
from extproc.pipeline.relief import relief_view
from extproc.pipeline.step import (
    JoinQueue,
    Placed,
    QueueDepth,
    RememberPlacement,
    Reserve,
    Step,
)
from extproc.pipeline.tenant_metrics import TenantMetrics
from extproc.tracing import annotate as trace_annotate
from extproc.tracing import phase as trace_phase

log = logging.getLogger("extproc.server")

# explain's preview admits as far as admission is pure: it never waits.
NO_WAIT = WaitPolicy()

STATUS = ":status"
# The status llm-d's routing sidecar answered when the prefiller could not be reached (Go's
# reverse proxy), before it fell back to decode-only (llm-d-inference-scheduler PR #652) ...
PREFILL_FAILED_STATUS = "502"
# ... and the status of an SGLang decode server whose prefill half is gone (it cannot join
# the bootstrap room, so it aborts the request before generating; 500 in the simulated
# engine, not verified against SGLang). Such a request cannot be retried on another
# prefiller: the bootstrap fields are in the body Envoy resends unchanged on a retry, and the
# mirror to the prefiller is decided once per request. So the first such answer marks the
# prefiller down, and the requests decided after it are paired elsewhere ...
SGLANG_PREFILL_FAILED_STATUS = "500"
# ... and how long such a prefiller is skipped: longer than a prober round (1 s) plus its
# timeout, so the prober's view takes over before the mark expires.
PREFILL_DOWN_S = 5.0


def _prefill_failed(runtime: Runtime, status: str | None) -> bool:
    """Whether a decode answer with ``status`` says its prefill half could not be reached."""
    if status == PREFILL_FAILED_STATUS:
        return True
    pd = runtime.pd
    return pd is not None and pd.protocol == "sglang" and status == SGLANG_PREFILL_FAILED_STATUS


class _Both:
    """Two counters incremented together (requests by outcome, routes by kind)."""

    __slots__ = ("requests", "routes")

    def __init__(self, requests: Counter, routes: Counter) -> None:
        self.requests = requests
        self.routes = routes

    def inc(self) -> None:
        self.requests.inc()
        self.routes.inc()


async def _settled(outcome: Outcome | Waiting) -> Outcome:
    """The outcome, a request queued for budget waited for (and left if the wait is cut)."""
    if isinstance(outcome, Waiting):
        try:
            return await outcome.resume()
        finally:
            outcome.cancel()
    return outcome


class RuntimeHolder:
    """The runtime being served; reload swaps it whole (one reference assignment)."""

    def __init__(self, runtime: Runtime) -> None:
        self.current = runtime


def _loaded_tier(placer: object) -> int | None:
    """How many of a LoRA adapter's ranked candidates have it loaded (they rank first,
    extproc.core.models.Candidates), or None: no adapter, or loaded nowhere."""
    if isinstance(placer, Candidates) and placer.preferred is not None:
        return len(placer.preferred.names)
    return None


def _bound_tier(placer: object, within: int | None) -> Rendezvous | None:
    """The rendezvous over the clusters a new session's bound is taken among, in the
    placer's own hash order: a LoRA adapter's loaded tier (the first ``within`` of its
    ranking), or every candidate; None when they are not one rendezvous."""
    if isinstance(placer, Rendezvous):
        return placer
    if isinstance(placer, Candidates):
        if within:
            return placer.preferred
        if placer.preferred is None:
            return placer.rest
    return None


class Pipeline:
    def __init__(
        self,
        runtime: RuntimeHolder,
        metrics: Metrics,
        gate: AdmissionGate | None = None,
        *,
        endpoint_health: EndpointHealth | None = None,
        fleet: FleetState | None = None,
        rooms: Callable[[], int] = lambda: secrets.randbits(63),
        share_totals: bool = True,
        tenant_limits: TenantLimits | None = None,
        rng: Random | None = None,
    ) -> None:
        self._runtime = runtime
        # Per-tenant limits (flow.tenant_limit / flow.tenants), counted by this replica.
        self.tenant_limits = (
            tenant_limits if tenant_limits is not None else TenantLimits(time.monotonic)
        )
        self._tenant_metrics = TenantMetrics(metrics.registry)
        self._tenant_metrics.configure(runtime.current.flow.tenant_metrics_top)
        # The jitter of the retry hints the pipeline itself computes (tenant limits).
        self._rng = rng or Random()
        # False: a new session's bound is judged from the full ranking and snapshot only (the
        # benchmark's baseline; same decisions, see _follow_override).
        self._share_totals = share_totals
        self._ready_cache: tuple[object, object, frozenset[str]] | None = None
        # SGLang's P/D protocol: bootstrap rooms, random as its router draws them (two
        # processor replicas must not pair different requests in one room).
        self._rooms = rooms
        self._metrics = metrics
        self._gate = gate
        self._endpoint_health = endpoint_health
        self.fleet = fleet or FleetState(metrics, runtime.current.max_sessions)
        self.fleet.relieve_kv(runtime.current)
        # The counters every routed request increments, by (api, class, kind): labels() costs
        # more than the increment, and the set is bounded by the config (cleared past 4096).
        self._routed_series: dict[tuple[Api, str, str], _Both] = {}
        # Per-request salt for the policy's hot-key tie-break: a mixed counter, reproducible
        # (no unseeded randomness) and, unlike the bare counter, free of aliasing with periodic
        # traffic (a hot request after every other request would see only even salts).
        self._decisions = 0
        self._owners: tuple[Runtime | None, Mapping[str, str]] = (None, {})
        self._modes: tuple[Runtime | None, Modes | None] = (None, None)
        # Prefills in flight per prefill endpoint (disaggregated classes): the load half of the
        # prefill choice (extproc.core.pd).
        self._prefill_inflight: dict[str, int] = {}
        # Prefill endpoints a response showed unreachable, and when (see observe_response).
        self._prefill_down: dict[str, float] = {}
        # Endpoint-picker mode: requests this replica has in flight per engine (endpoint), what
        # the bounded-load engine choice reads (extproc.core.endpoints).
        self._engine_inflight: dict[str, int] = {}
        self._engine_draws = 0

    @property
    def metrics(self) -> Metrics:
        return self._metrics

    @property
    def runtime(self) -> Runtime:
        return self._runtime.current

    @property
    def gate(self) -> AdmissionGate | None:
        return self._gate

    def use(self, runtime: Runtime) -> None:
        """Serve ``runtime`` from the next request on (a reload): one reference assignment;
        requests already decided keep what they hold."""
        self._runtime.current = runtime
        self._tenant_metrics.configure(runtime.flow.tenant_metrics_top)
        # The session memory trims to a lower bound on its next writes.
        self.fleet.memory.max_sessions = runtime.max_sessions
        self.fleet.relief.max_sessions = runtime.max_sessions
        self.fleet.relieve_kv(runtime)

    def use_endpoint_health(self, endpoint_health: EndpointHealth | None) -> None:
        """The endpoint prober a reload started (or stopped): probing follows the config
        without a restart."""
        self._endpoint_health = endpoint_health

    # -- the decision -----------------------------------------------------------------------
    async def preview(self, headers: Mapping[str, str], body: bytes | None, now: float) -> Outcome:
        """The decision :meth:`decide` would take now, on the same state, changing nothing:
        no session is marked, no override written, no budget reserved, nothing counted.

        Admission is previewed only as far as it is pure (a request no budget state could
        admit is Rejected with 413); whether the ledger has room right now is a question of
        the next instant, which ``explain`` answers with the compartment's usage instead.
        """
        return await self.decide(headers, body, now, record=False)

    def refuse_partial_body(self, api: Api) -> BadRequest:
        """The answer when the body arrived in pieces (the filter is not in BUFFERED mode, or
        the body outgrew Envoy's buffer): deciding on a prefix would hash truncated JSON."""
        bad = BadRequest(
            413,
            "request body was not delivered whole (raise the gateway's buffer limit)",
            "request_too_large",
            api.error_style,
        )
        self._count_bad(bad, api)
        return bad

    @overload
    async def decide(
        self,
        headers: Mapping[str, str],
        body: bytes | None,
        now: float,
        *,
        record: bool = ...,
        wait: Literal[True] = ...,
    ) -> Outcome: ...

    @overload
    async def decide(
        self,
        headers: Mapping[str, str],
        body: bytes | None,
        now: float,
        *,
        record: bool = ...,
        wait: Literal[False],
    ) -> Outcome | Waiting: ...

    async def decide(
        self,
        headers: Mapping[str, str],
        body: bytes | None,
        now: float,
        *,
        record: bool = True,
        wait: bool = True,
    ) -> Outcome | Waiting:
        """Decide one request and take what it holds (budget, an in-flight count).

        ``headers`` have lower-case names and Envoy's pseudo-headers (``:path``, ``:method``);
        ``body`` is the whole body, or None when the request ended with its headers. A Routed
        outcome's hold must be given back with :meth:`release` when the exchange ends.
        ``record=False`` is :meth:`preview` (one body for both, so they cannot drift).
        A request queued for budget is waited for here; ``wait=False`` returns it as
        :class:`Waiting` at once instead (what an :class:`Exchange` does: the protocol shell
        first extends Envoy's message timer, then awaits ``resume()``, and calls ``cancel()``
        if the stream ends first).
        """
        outcome = await self._decide_body(headers, body, now, record)
        return await _settled(outcome) if wait else outcome

    def exchange(self) -> Exchange:
        """The seam for one HTTP exchange (extproc/pipeline/exchange.py): opened by the
        protocol shell when a stream starts."""
        return Exchange(self)

    @property
    def modes(self) -> Modes:
        """What a stream asks Envoy for under the runtime served now (one value per runtime)."""
        runtime = self._runtime.current
        cached, modes = self._modes
        if cached is runtime and modes is not None:
            return modes
        modes = Modes(
            runtime.response_phases,
            runtime.inspect_usage,
            self.asks_load_reports,
            runtime.envoy_graceful_close,
        )
        self._modes = (runtime, modes)
        return modes

    async def _decide_body(
        self, headers: Mapping[str, str], body: bytes | None, now: float, record: bool
    ) -> Outcome | Waiting:
        api = inference_api(headers)
        if api is None:
            listing = self._model_listing(headers)
            if listing is not None:
                return listing
            if record:
                self._metrics.passthrough.inc()
            return PASSTHROUGH
        if body is None:
            # No body will follow: this is the only chance to answer.
            empty = BadRequest(
                400,
                "request body is empty; expected a JSON object",
                "invalid_request_error",
                api.error_style,
            )
            if record:
                self._count_bad(empty, api)
            return empty
        runtime = self._runtime.current
        # A preview reads the chain key's learnt chains without counting the request.
        rules = runtime.key_rules if record else dataclasses.replace(runtime.key_rules, learn=False)
        with trace_phase("body_parse"):
            facts = parse_request(
                headers.get(":path", ""), headers, body, rules, runtime.parse_limits
            )
        return await self._decide_facts(runtime, api, facts, headers, now, record)

    @overload
    async def decide_headers(
        self,
        headers: Mapping[str, str],
        now: float,
        *,
        record: bool = ...,
        wait: Literal[True] = ...,
    ) -> Outcome | None: ...

    @overload
    async def decide_headers(
        self,
        headers: Mapping[str, str],
        now: float,
        *,
        record: bool = ...,
        wait: Literal[False],
    ) -> Outcome | Waiting | None: ...

    async def decide_headers(
        self, headers: Mapping[str, str], now: float, *, record: bool = True, wait: bool = True
    ) -> Outcome | Waiting | None:
        """The header path: decide an inference request at its headers when its body adds
        nothing to the decision (extproc.core.facts.header_facts), else None (the body is
        needed: call :meth:`decide` with it). The outcome is the one :meth:`decide` would
        take on the same request with its body, for placement, class and admission; the body
        itself is not checked (ARCHITECTURE.md, "The header path"). ``wait`` as in
        :meth:`decide`.
        """
        outcome = await self._decide_head(headers, now, record)
        if outcome is None or not wait:
            return outcome
        return await _settled(outcome)

    async def _decide_head(
        self, headers: Mapping[str, str], now: float, record: bool
    ) -> Outcome | Waiting | None:
        runtime = self._runtime.current
        if not runtime.decide_at_headers or runtime.policy.models.enabled:
            # A model-aware fleet places by the body's "model": the body is needed.
            return None
        api = inference_api(headers)
        if api is None:
            return None
        facts = header_facts(
            headers.get(":path", ""), headers, runtime.key_rules, runtime.parse_limits
        )
        if facts is None:
            return None
        if record:
            self._metrics.header_decisions.inc()
        return await self._decide_facts(runtime, api, facts, headers, now, record)

    async def _decide_facts(
        self,
        runtime: Runtime,
        api: Api,
        facts: RequestFacts | BadRequest,
        headers: Mapping[str, str],
        now: float,
        record: bool,
    ) -> Outcome | Waiting:
        if isinstance(facts, BadRequest):
            if record:
                self._count_bad(facts, api)
            return facts
        if (
            facts.previous_response_id is not None
            and runtime.response_link_ttl_s is not None
            and facts.session.source is KeySource.PREFIX
        ):
            facts = await self._follow(runtime, facts, now, record)
        placed = runtime.policy.place(facts)
        if not isinstance(placed, Route):
            return self._model_miss(facts, placed, record)
        route = placed
        if route.model and not self._any_ready(runtime, route):
            return self._model_miss(
                facts,
                ModelUnavailable(
                    route.model,
                    route.request_class.name,
                    runtime.policy.unavailable_retry_after_s,
                ),
                record,
            )
        route, kind, view = await self._placement(runtime, facts, route, now, record)
        prefill = self._choose_prefill(runtime, facts, route, now)
        if not record:
            return self._previewed(runtime, api, facts, route, kind, prefill)
        return await self._admitted(runtime, api, facts, headers, route, kind, view, prefill, now)

    async def _placement(
        self, runtime: Runtime, facts: RequestFacts, route: Route, now: float, record: bool
    ) -> tuple[Route, Kind, SessionView | None]:
        """Where the request goes (the class's hash placement as ``route``): affinity's
        decision, or around an unready primary and, with bounded load or admission's
        placement, the session memory's."""
        kind: Kind = "primary"
        view: SessionView | None = None
        if runtime.affinity.enabled:
            decision, view = await self._place(runtime, facts, route, now, record)
            route = Route(decision.placement, route.request_class, route.model)
            kind = decision.kind
        else:
            if self._endpoint_health is not None and not runtime.endpoint_picker:
                # Probed clusters (processor.probe_clusters, or a P/D fleet): a primary with no
                # ready endpoint is not placed on, so the request is admitted against the budget
                # of the cluster that will serve it (affinity does the same through its load
                # snapshot), and a P/D prefiller is chosen in that cluster's island.
                route = self._around_unready(runtime, facts, route, record)
            if (
                runtime.affinity.balance_factor > 0
                or runtime.relief is not None
                or (runtime.flow.place_new_sessions and route.request_class.budget.enforced)
            ):
                # Bounded-load placement of new sessions, GPU health (new sessions avoid a hot
                # cluster, its least active sessions leave), and admission's placement (which
                # needs to know new sessions from existing ones) all need later turns to
                # follow a placement: the session memory, without affinity.
                route, kind, view = await self._follow_override(runtime, facts, route, now, record)
        return route, kind, view

    def _previewed(
        self,
        runtime: Runtime,
        api: Api,
        facts: RequestFacts,
        route: Route,
        kind: Kind,
        prefill: PrefillChoice | None,
    ) -> Routed | Rejected:
        """explain's preview of admission (the step, every reservation assumed to have room,
        nothing written) and of the engine choice; nothing is held."""
        previewed = steps.preview(steps.admission_step(request_tokens(facts), route, None, NO_WAIT))
        if isinstance(previewed, Reject):
            return Rejected(facts, route, kind, previewed)
        return Routed(
            facts,
            route,
            kind,
            Hold(api),
            self._endpoints(runtime, facts, route),
            prefill,
            self._engine_key(runtime, facts),
            engines=self._adapter_engines(runtime, facts, route),
        )

    async def _admitted(
        self,
        runtime: Runtime,
        api: Api,
        facts: RequestFacts,
        headers: Mapping[str, str],
        route: Route,
        kind: Kind,
        view: SessionView | None,
        prefill: PrefillChoice | None,
        now: float,
    ) -> Outcome | Waiting:
        """The placed request's tenant limits, then its admission (which may place it on a
        later candidate, queue it, or refuse it), then what a routed request holds."""
        hold = Hold(api, headers.get("x-request-id", ""))
        tenant = self._tenant(runtime, headers, facts)
        if self._tenant_metrics.enabled:
            hold.tenant_label = tenant.label
        if runtime.flow.limits_tenants and not self._tenants_in_ledger:
            over = self._take_tenant(runtime, tenant, facts, route, hold)
            if over is not None:
                if self._gate is not None:
                    # Counted as an admission refusal, as the ledger counts it with Redis.
                    self._gate.count_reject(over)
                self._count_reject(facts, over, headers)
                return Rejected(facts, route, kind, over)
        if self._gate is not None:
            with trace_phase("budget_reservation"):
                admission = await self._admit(self._gate, runtime, facts, route, view, now, tenant)
            if isinstance(admission, Reject):
                self._refund_tenant(runtime, hold)
                self._count_reject(facts, admission, headers)
                return Rejected(facts, route, kind, admission)
            if isinstance(admission, Placed):
                route, kind = admission.route, "placed"
                admission = admission.admitted
                # The decode target moved: its prefiller is chosen for the new one.
                prefill = self._choose_prefill(runtime, facts, route, now)
            if isinstance(admission, Queued):
                return self._waiting(admission, runtime, facts, route, kind, hold, headers, prefill)
            if isinstance(admission, Admitted):
                hold.ticket = admission.ticket
        return await self._routed(runtime, facts, route, kind, hold, headers, prefill)

    def _waiting(
        self,
        queued: Queued,
        runtime: Runtime,
        facts: RequestFacts,
        route: Route,
        kind: Kind,
        hold: Hold,
        headers: Mapping[str, str],
        prefill: PrefillChoice | None,
    ) -> Waiting:
        # Set once resume() has answered: the answer settled the tenant's charge (a refusal
        # gave it back, a routed request keeps it until its release).
        answered = False

        async def resume() -> Outcome:
            nonlocal answered
            admission = await queued.wait()
            if isinstance(admission, Reject):
                self._refund_tenant(runtime, hold)
                self._count_reject(facts, admission, headers)
                answered = True
                return Rejected(facts, route, kind, admission)
            hold.ticket = admission.ticket
            # Served through a contended queue: its output is charged to its tenant too.
            hold.fair = queued.fair
            outcome = await self._routed(runtime, facts, route, kind, hold, headers, prefill)
            answered = True
            return outcome

        def cancel() -> None:
            # Called when the wait ends, however it ended: the client left before an answer,
            # so the request is not served and its tenant gets its charge back.
            if not answered:
                self._refund_tenant(runtime, hold)
            queued.cancel()

        return Waiting(facts, route, kind, queued.max_wait_s, resume, cancel)

    async def _routed(
        self,
        runtime: Runtime,
        facts: RequestFacts,
        route: Route,
        kind: Kind,
        hold: Hold,
        headers: Mapping[str, str],
        prefill: PrefillChoice | None,
    ) -> Routed | Rejected:
        """The decode budget is held (or none is needed): the prefill pool's budget, then the
        bookkeeping of a routed request."""
        if self._gate is not None:
            refused = await self._admit_prefill(runtime, facts, route, prefill, hold, headers)
            if refused is not None:
                self._count_reject(facts, refused, headers)
                self._refund_tenant(runtime, hold)
                return Rejected(facts, route, kind, refused)
        if prefill is not None:
            self._metrics.prefill_choices.labels(prefill.relation, prefill.reason).inc()
            address = prefill.address
            if address is not None:
                hold.prefill_endpoint = address
                self._prefill_inflight[address] = self._prefill_inflight.get(address, 0) + 1
        self._routed_counter(facts.api, route.request_class.name, kind).inc()
        primary = route.placement.primary
        if runtime.affinity.enabled:
            hold.routed_to = primary
            self.fleet.routed(primary)
        if runtime.inspect_usage:
            hold.usage_cluster = primary
            hold.usage_model = route.model
            if runtime.response_link_ttl_s is not None and facts.api is Api.OPENAI_RESPONSES:
                hold.link_session = facts.session
        with trace_phase("engine_pick"):
            endpoints = self._endpoints(runtime, facts, route) if runtime.endpoint_picker else None
            named = self._adapter_engines(runtime, facts, route)
        if endpoints == ():
            self._metrics.routes.labels("no_endpoint").inc()
        elif endpoints or named:
            engine = hold.engine = (endpoints or named)[0]
            self._engine_inflight[engine] = self._engine_inflight.get(engine, 0) + 1
            self._metrics.engine_requests.labels(engine).inc()
        if log.isEnabledFor(logging.DEBUG):  # per-request lines only when asked for
            log.debug(
                "routed",
                extra={
                    "request_id": headers.get("x-request-id", ""),
                    "session": facts.session.label,  # a hash, never the raw key
                    "session_source": facts.session.source.value,
                    "request_class": route.request_class.name,
                    "primary": primary,
                    "secondary": route.placement.secondary,
                    "kind": kind,
                    "input_tokens": facts.input_tokens,
                    # Which ledger admitted it (redis, memory: the local fallback, or none) and
                    # under which config: what `extproc chaos` explains a peak with.
                    "ledger": hold.ticket.store if hold.ticket is not None else None,
                    "config_version": runtime.version,
                },
            )
        if hold.tenant_label is not None:
            self._tenant_metrics.served(hold.tenant_label, facts.input_tokens, 1)
        return Routed(
            facts,
            route,
            kind,
            hold,
            endpoints,
            prefill,
            self._engine_key(runtime, facts),
            self._model_pool(runtime, route, endpoints),
            named,
        )

    def _model_pool(
        self, runtime: Runtime, route: Route, endpoints: tuple[str, ...] | None
    ) -> str | None:
        """The pool data path, model-aware fleets: the model's own pool when it holds every
        endpoint to try (a cluster only discovery added to the model is in no rendered pool:
        then the pool of every endpoint, where override_host finds them all)."""
        if not endpoints or not route.model:
            return None
        pool = runtime.model_pools.get(route.model)
        if pool is None:
            return None
        owners = self.endpoint_owners()
        if all(owners.get(e) in pool.clusters for e in endpoints):
            return pool.name
        return None

    def _adapter_engines(
        self, runtime: Runtime, facts: RequestFacts, route: Route
    ) -> tuple[str, ...]:
        """Route mode with sticky engines, a LoRA adapter's request: the engines to name, its
        loaded engine in the primary first (core.endpoints.adapter_engines); the request then
        goes to the pool of every endpoint, whose override_host tries them in order."""
        if runtime.endpoint_picker or not runtime.engines.sticky or not route.model:
            return ()
        loaded = runtime.adapter_engines.get(route.model)
        if not loaded:
            return ()
        health = self._endpoint_health
        engines = runtime.engines
        return adapter_engines(
            facts.session.point,
            route.placement.primary,
            route.placement.secondary,
            runtime.endpoints,
            loaded,
            health.ready if health is not None else runtime.listing_endpoints,
            self._engine_inflight,
            engines.balance,
            engines.min_inflight,
        )

    @staticmethod
    def _engine_key(runtime: Runtime, facts: RequestFacts) -> str | None:
        """Route mode with sticky engines: the value Envoy's consistent hash keeps the session
        on (extproc.core.endpoints.engine_key)."""
        if runtime.endpoint_picker or not runtime.engines.sticky:
            return None
        return engine_key(facts.session.digest, runtime.engines.key_secret)

    def _choose_prefill(
        self, runtime: Runtime, facts: RequestFacts, route: Route, now: float
    ) -> PrefillChoice | None:
        """Disaggregated classes: the prefill endpoint for the decided decode target (the
        primary; the secondary, when Envoy fails over to it, gets the same prefiller)."""
        pd = runtime.pd
        if pd is None:
            return None
        ready = self._endpoint_health.ready if self._endpoint_health is not None else None
        down = self._prefill_down
        if down:
            for address, since in list(down.items()):
                if now - since > PREFILL_DOWN_S:
                    del down[address]
        return pd.choose(
            base_class_name(route.request_class),
            route.placement.primary,
            facts.session.point,
            self._prefill_inflight,
            ready,
            frozenset(down),
        )

    async def _admit_prefill(
        self,
        runtime: Runtime,
        facts: RequestFacts,
        route: Route,
        prefill: PrefillChoice | None,
        hold: Hold,
        headers: Mapping[str, str],
    ) -> Reject | None:
        """Reserve the prefill pool's budget (prefill tokens, per prefill cluster) apart from
        the decode pool's (extproc/pipeline/step.py, ``prefill_step``); a refusal gives the
        decode reservation back."""
        gate = self._gate
        if prefill is None or prefill.endpoint is None or runtime.pd is None or not gate:
            return None
        cls = runtime.pd.prefill_classes[base_class_name(route.request_class)]
        prefill_route = Route(Placement(prefill.endpoint.cluster, None), cls)
        step = steps.prefill_step(request_tokens(facts), prefill_route, hold.ticket)
        outcome = await self._drive(step, gate, runtime, facts, 0.0, None, hold)
        if isinstance(outcome, Reject):
            gate.count_reject(outcome)
            return outcome
        if outcome is None:
            gate.count_unbudgeted(cls.name)
        else:
            hold.prefill_ticket = outcome
        return None

    async def _follow(
        self, runtime: Runtime, facts: RequestFacts, now: float, record: bool
    ) -> RequestFacts:
        """A Responses turn chained by previous_response_id takes the session of the response
        it names, when that response's link is known (extproc.core.response_links)."""
        assert facts.previous_response_id is not None
        found = await self.fleet.follow(
            facts.previous_response_id, runtime.key_rules.label_secret, now
        )
        if record:
            self._metrics.response_links.labels("followed" if found else "unknown").inc()
        return facts if found is None else dataclasses.replace(facts, session=found)

    def _routed_counter(self, api: Api, class_name: str, kind: str) -> _Both:
        key = (api, class_name, kind)
        both = self._routed_series.get(key)
        if both is None:
            if len(self._routed_series) >= 4096:
                self._routed_series.clear()
            m = self._metrics
            both = self._routed_series[key] = _Both(
                m.requests.labels(api.value, class_name, "routed"), m.routes.labels(kind)
            )
        return both

    def _model_listing(self, headers: Mapping[str, str]) -> ModelList | BadRequest | None:
        """GET /v1/models[/{id}] in a model-aware fleet: the fleet's union (None: not that)."""
        catalog = self._runtime.current.policy.models
        if not catalog.enabled or headers.get(":method") != "GET":
            return None
        raw = headers.get(":path", "").split("?", 1)[0]
        path = canonical_path(raw)
        if path != MODELS_PATH and not path.startswith(MODELS_PATH + "/"):
            return None
        # Anthropic's SDK sends anthropic-version on every request; OpenAI's never does.
        anthropic = "anthropic-version" in headers
        if path == MODELS_PATH:
            return ModelList(orjson.dumps(model_list(catalog, anthropic)))
        # The id keeps its case and may hold slashes ("meta-llama/Llama-3.1-8B").
        name = unquote(raw).split(MODELS_PATH + "/", 1)[-1]
        found = model_object(catalog, name, anthropic)
        if found is None:
            style = ErrorStyle.ANTHROPIC if anthropic else ErrorStyle.OPENAI
            return BadRequest(404, UnknownModel(name).message, "model_not_found", style, "model")
        return ModelList(orjson.dumps(found))

    def _model_miss(
        self, facts: RequestFacts, miss: ModelMiss, record: bool
    ) -> BadRequest | Unavailable:
        """An unknown model: 404 in the API's format (400 when the model is missing); a known
        one with nowhere to go: 503 with a retry hint."""
        if isinstance(miss, ModelUnavailable):
            if record:
                self._metrics.requests.labels(
                    facts.api.value, miss.class_name, "model_unavailable"
                ).inc()
            return Unavailable(facts, miss)
        style = facts.api.error_style
        if miss.requested:
            bad = BadRequest(404, miss.message, "model_not_found", style, "model")
        else:
            bad = BadRequest(400, miss.message, "invalid_request_error", style, "model")
        if record:
            self._metrics.requests.labels(facts.api.value, "", "model_not_found").inc()
        return bad

    def _any_ready(self, runtime: Runtime, route: Route) -> bool:
        """Whether any cluster the route's model may go to has a ready endpoint, as the prober
        sees it (endpoint-picker mode, processor.probe_clusters); without a prober, yes."""
        ready = self._ready_clusters(runtime)
        return ready is None or any(c in ready for c in runtime.policy.placer(route).names)

    def _count_bad(self, bad: BadRequest, api: Api) -> None:
        outcome = "too_large" if bad.status == 413 else "bad_request"
        self._metrics.requests.labels(api.value, "", outcome).inc()

    def _count_reject(
        self, facts: RequestFacts, reject: Reject, headers: Mapping[str, str]
    ) -> None:
        self._metrics.requests.labels(facts.api.value, reject.class_name, reject.reason).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "rejected",
                extra={
                    "request_id": headers.get("x-request-id", ""),
                    "session": facts.session.label,
                    "request_class": reject.class_name,
                    "cluster": reject.cluster,
                    "status": reject.status,
                    "reason": str(reject.reason),
                    "retry_after_s": reject.retry_after_s,
                },
            )

    def _ready_clusters(self, runtime: Runtime) -> frozenset[str] | None:
        if self._endpoint_health is None:
            return None
        ready = self._endpoint_health.ready
        cached = self._ready_cache
        if cached is not None and cached[0] is ready and cached[1] is runtime.endpoints:
            return cached[2]
        clusters = frozenset(
            c for c, eps in runtime.endpoints.items() if any(e in ready for e in eps)
        )
        if self._share_totals:
            # Both are replaced, never changed in place (a probe round, a reload).
            self._ready_cache = (ready, runtime.endpoints, clusters)
        return clusters

    def _around_unready(
        self, runtime: Runtime, facts: RequestFacts, route: Route, record: bool
    ) -> Route:
        ready = self._ready_clusters(runtime)
        if ready is None or route.placement.primary in ready:
            return route
        ranked = runtime.policy.placer(route).ranked(facts.session.point)
        placement = around_unready(route.placement, ranked, ready)
        if placement == route.placement:
            return route
        if record:
            self._metrics.placed_around_unready.labels(route.placement.primary).inc()
        return Route(placement, route.request_class, route.model)

    async def _admit(
        self,
        gate: AdmissionGate,
        runtime: Runtime,
        facts: RequestFacts,
        route: Route,
        view: SessionView | None,
        now: float,
        tenant: Tenant,
    ) -> Admitted | Reject | Placed | Queued | None:
        """Admission with flow control (extproc/pipeline/step.py): the chosen primary; else,
        for a new session, its next hash candidate with room; else a bounded wait; else a
        429. Every refusal it answers is counted once, here."""
        elsewhere = None
        if runtime.flow.place_new_sessions and view is not None:

            def elsewhere() -> Iterator[Route]:
                return self._elsewhere(runtime, facts, route, view, now)

        wait = route.request_class.wait
        claim = self._tenant_claim(runtime, tenant)
        step = steps.admission_step(
            request_tokens(facts), route, elsewhere, wait, claim, tenant.key
        )
        outcome = await self._drive(step, gate, runtime, facts, now, tenant)
        if outcome is None:
            gate.count_unbudgeted(route.request_class.name)
        elif isinstance(outcome, Reject):
            gate.count_reject(outcome)
        return outcome  # type: ignore[no-any-return]

    def tenant_key(self, headers: Mapping[str, str], facts: RequestFacts) -> str:
        """The key (keyed label) of the request's tenant, as its fair queue knows it."""
        return self._tenant(self._runtime.current, headers, facts).key

    async def tenant_view(
        self, headers: Mapping[str, str], facts: RequestFacts, cluster: str, class_name: str
    ) -> dict[str, object]:
        """The request's tenant as fair admission sees it (for explain): its label, never its
        name; its weight, its standing in the queue on (cluster, class), its own limits and
        its use of them where they are counted (read only: nothing is taken)."""
        runtime = self._runtime.current
        flow = runtime.flow
        tenant = self._tenant(runtime, headers, facts)
        claim = flow.claim(tenant.key, facts.tier, request_tokens(facts))
        out: dict[str, object] = {
            "label": tenant.label,
            "source": tenant.source,
            "fairness": flow.fairness.value,
            "weight": claim.weight,
            "service": claim.service,
        }
        if self._gate is not None:
            out["queue"] = self._gate.waiters.fair_view((cluster, class_name), claim)
        limit = flow.limit_for(tenant.key)
        if not limit.enabled:
            return out
        if self._gate is not None and self._tenants_in_ledger:
            # Fleet-wide in Redis (its live leases and bucket), or this replica's share while
            # Redis is unreachable.
            where, own, use = await self._gate.tenant_use(TenantClaim(tenant.key, limit))
            limit = own.limit
        else:
            where, limit = "memory", tenant_share(limit, runtime.redis.replicas)
            use = self.tenant_limits.use(tenant.key, limit)
        out["limits"] = {
            "max_concurrent": limit.max_concurrent,
            "tokens_per_minute": limit.tokens_per_minute,
            "counted_in": where,
            "inflight": use.inflight,
            "bucket_tokens": round(use.bucket_tokens, 1) if limit.tokens_per_minute else None,
        }
        return out

    @staticmethod
    def _tenant(runtime: Runtime, headers: Mapping[str, str], facts: RequestFacts) -> Tenant:
        flow = runtime.flow
        return resolve_tenant(
            headers,
            facts.tier,
            flow.tenant_header,
            flow.tenant_fallback,
            runtime.key_rules.label_secret,
        )

    @property
    def _tenants_in_ledger(self) -> bool:
        """With Redis the tenant's own limits are counted fleet-wide by the reservation itself
        (reserve.lua, one round trip); without it, by this replica (:meth:`_take_tenant`)."""
        return self._gate is not None and self._gate.counts_tenants

    def _tenant_claim(self, runtime: Runtime, tenant: Tenant) -> TenantClaim | None:
        if not runtime.flow.limits_tenants or not self._tenants_in_ledger:
            return None
        limit = runtime.flow.limit_for(tenant.key)
        return TenantClaim(tenant.key, limit) if limit.enabled else None

    def _take_tenant(
        self,
        runtime: Runtime,
        tenant: Tenant,
        facts: RequestFacts,
        route: Route,
        hold: Hold,
    ) -> Reject | None:
        """Hold a slot of the tenant's own limits, or the 429 that names them."""
        limit = runtime.flow.limit_for(tenant.key)
        if not limit.enabled:
            return None
        tokens = request_tokens(facts)
        own = self._own_limit(runtime, tenant.key)
        taken = self.tenant_limits.take(tenant.key, tokens, own)
        if isinstance(taken, TenantSlot):
            hold.tenant_slot = taken
            return None
        cls, cluster = route.request_class.name, route.placement.primary
        return tenant_refusal(own, taken, tokens, cls, cluster, self._rng)

    @staticmethod
    def _own_limit(runtime: Runtime, tenant_key: str) -> TenantLimit:
        """The tenant's limits as this replica enforces them (its share, without Redis)."""
        return tenant_share(runtime.flow.limit_for(tenant_key), runtime.redis.replicas)

    def _give_tenant(self, hold: Hold) -> None:
        """The request was served: its slot of the tenant's limits goes back, its tokens
        stay drawn from the tenant's bucket."""
        slot, hold.tenant_slot = hold.tenant_slot, None
        if slot is not None:
            self.tenant_limits.give(slot)

    def _refund_tenant(self, runtime: Runtime, hold: Hold) -> None:
        """The request is not served (refused, timed out in the queue, or its client left
        while it waited): its slot and its tokens go back to the tenant, as if never taken.
        ``runtime`` is the one the slot was taken under (its limits cap the refund)."""
        slot, hold.tenant_slot = hold.tenant_slot, None
        if slot is not None:
            self.tenant_limits.refund(slot, self._own_limit(runtime, slot.tenant))

    async def _drive(
        self,
        step: Step,
        gate: AdmissionGate,
        runtime: Runtime,
        facts: RequestFacts,
        now: float,
        tenant: Tenant | None,
        hold: Hold | None = None,
    ) -> Any:
        """The live driver of an admission step: its needs against the gate (Redis or
        memory, with its timeouts and outage policy) and the session memory. A ticket given
        back leaves ``hold`` first, so the exchange's release cannot give it twice."""
        answer: Any = None
        while True:
            try:
                need = step.send(answer)
            except StopIteration as done:
                return done.value
            if isinstance(need, Reserve):
                answer = await gate.attempt(need.demand, reserve=not need.look)
            elif isinstance(need, QueueDepth):
                answer = gate.waiters.depth(need.cluster, need.class_name)
            elif isinstance(need, JoinQueue):
                assert tenant is not None  # only an admission step queues
                claim = runtime.flow.claim(tenant.key, facts.tier, request_tokens(facts))
                answer = await gate.queue(
                    need.demand, need.attempt, need.wait, claim, runtime.flow_redis_poll_s
                )
            elif isinstance(need, RememberPlacement):
                placement = need.route.placement
                override = Override(placement.primary, now + runtime.affinity.override_ttl_s)
                await self.fleet.remember(
                    facts, Decision(placement, "placed", override_to_write=override), now
                )
                gate.metrics.placements.labels(need.route.request_class.name).inc()
                answer = None
            else:
                if hold is not None and hold.ticket is need.ticket:
                    hold.ticket = None
                await asyncio.shield(gate.release(need.ticket))
                answer = None

    def _elsewhere(
        self,
        runtime: Runtime,
        facts: RequestFacts,
        route: Route,
        view: SessionView,
        now: float,
    ) -> Iterator[Route]:
        """Where a new session may start when its primary's budget is full: its later hash
        candidates (none for a session seen or placed before), skipping unhealthy ones."""
        ranked = runtime.policy.placer(route).ranked(facts.session.point)
        ready = self._ready_clusters(runtime)
        order = placement_candidates(
            ranked, route.placement.primary, view.seen, view.override is not None
        )
        load = self.fleet.load
        hot = load.hot(now)
        healthy: Iterator[str] = (c for c in order if load.cluster(c, now, ready).healthy)
        if hot:
            # A hot cluster takes no new sessions while a cooler one is healthy.
            healthy = iter(cool_first(list(healthy), hot))
        for cluster in healthy:
            placement = Placement(cluster, cool_secondary(ranked, cluster, hot))
            yield Route(placement, route.request_class, route.model)

    async def _follow_override(
        self, runtime: Runtime, facts: RequestFacts, route: Route, now: float, record: bool
    ) -> tuple[Route, Kind, SessionView]:
        """Without load-aware affinity: the live driver of the bounded placement step
        (extproc/pipeline/placement_step.py). The session is marked seen, an earlier
        placement's override is followed (the session's cache is there), and with
        ``affinity.balance_factor`` a new session starts within the bound. The session lookup
        is the one round trip admission's placement makes anyway; a spill adds one write (a SET
        with Redis). ``record=False`` (explain's preview): nothing is marked, counted or
        written."""
        fleet = self.fleet
        params = runtime.affinity
        placer = runtime.policy.placer(route)
        point = facts.session.point
        step = bounded_step(
            self._bounded_inputs(runtime, placer, point, now), route.placement, now, params
        )
        # The needs are answered here rather than in helpers: this runs on every request.
        answer: Any = None
        while True:
            try:
                need = step.send(answer)
            except StopIteration as done:
                outcome: BoundedPlacement = done.value
                break
            answer = None
            if isinstance(need, LookUpSession):
                primary = need.hash_primary
                with trace_phase("session_lookup"):
                    view = await fleet.view(facts, primary, now, params, record=record, hot=False)
                answer = (
                    view
                    if runtime.relief is None
                    else self._relief_view(runtime, facts, view, primary, now, record)
                )
            elif record:
                balance = balance_half_life(params)
                if balance is not None:
                    fleet.load.placed(need.cluster, now, balance)
                self._moved(runtime, facts, need.decision, need.cluster, now)
                await fleet.remember(facts, need.decision, now)
        if outcome.placement != route.placement:
            route = Route(outcome.placement, route.request_class, route.model)
        return route, outcome.decision.kind, outcome.session

    def _bounded_inputs(
        self, runtime: Runtime, placer: Placer, point: int, now: float
    ) -> BoundedInputs:
        """What the bounded placement step reads of this replica's fleet state."""
        fleet = self.fleet
        balance = balance_half_life(runtime.affinity)
        hot: frozenset[str] = frozenset()
        if runtime.relief is not None:
            hot = fleet.load.hot(now)

        def loads(ranked: Sequence[str]) -> FleetSnapshot:
            return fleet.load.snapshot(ranked, now, self._ready_clusters(runtime), balance)

        # A LoRA adapter's new session is bounded among the clusters that have it loaded: a
        # spill onto one that must load it first would cost more than the evenness gains.
        within = _loaded_tier(placer)
        shortcut = None
        if balance is not None and self._share_totals:
            half_life = balance

            def shortcut() -> Shortcut:
                return self._shortcut(runtime, placer, point, now, half_life, within)

        return BoundedInputs(
            placer.top2(point),
            placer.names,
            lambda: placer.ranked(point),
            loads,
            hot,
            within,
            shortcut,
        )

    def _shortcut(
        self,
        runtime: Runtime,
        placer: Placer,
        point: int,
        now: float,
        half_life_s: float,
        within: int | None,
    ) -> Shortcut:
        """place_bounded's cheaper inputs: the load table's kept totals, the ranking's head."""
        load = self.fleet.load
        # The candidates the mean is taken over, as one stable tuple (the load table keeps
        # their total by it): the adapter's loaded tier, or every candidate.
        searcher = _bound_tier(placer, within)
        members = searcher.names if searcher is not None else placer.names
        ready = self._ready_clusters(runtime)
        heads: dict[int, list[str]] = {}

        def share(cluster: str) -> RecentShare | None:
            return load.share(members, cluster, now, ready, half_life_s)

        def head(k: int) -> list[str]:
            found = heads.get(k)
            if found is None:
                found = heads[k] = placer.ranked_head(point, k)
            return found

        def cluster(name: str) -> ClusterLoad:
            return load.cluster(name, now, ready, half_life_s)

        def recent(name: str) -> float:
            return load.recent(name, now, half_life_s)

        first_within = None
        if searcher is not None and len(searcher.names) >= HEAD_MIN_CLUSTERS:
            tier = searcher

            def first_within(low: float, high: float) -> tuple[str | None, bool]:
                return load.first_within(tier, point, now, half_life_s, low, high)

        return Shortcut(share, head, cluster, len(placer.names), recent, first_within)

    async def _place(
        self, runtime: Runtime, facts: RequestFacts, route: Route, now: float, record: bool
    ) -> tuple[Decision, SessionView]:
        """Feed the pure affinity policy: candidates, load snapshot, session memory, now."""
        fleet = self.fleet
        params = runtime.affinity
        placer = runtime.policy.placer(route)
        ranked = placer.ranked(facts.session.point)
        salt = mix64(self._decisions)
        if record:
            self._decisions += 1
        with trace_phase("session_lookup"):
            view = await fleet.view(facts, ranked[0], now, params, salt, record=record)
        if runtime.relief is not None:
            view = self._relief_view(runtime, facts, view, ranked[0], now, record)
        balance = params.balance_half_life_s if params.balance_factor > 0 else None
        snapshot = fleet.load.snapshot(ranked, now, self._ready_clusters(runtime), balance)
        # A LoRA adapter's spills, hot-key spreading and moves stay among the clusters that
        # have it loaded while one of them is healthy (as place_bounded's new sessions).
        within = _loaded_tier(placer)
        decision = place(facts.session.source, ranked, snapshot, view, now, params, within)
        if record:
            if balance is not None:
                fleet.load.placed(decision.placement.primary, now, balance)
            self._moved(runtime, facts, decision, decision.placement.primary, now)
            await fleet.remember(facts, decision, now)
        return decision, view

    def _relief_view(
        self,
        runtime: Runtime,
        facts: RequestFacts,
        view: SessionView,
        hash_primary: str,
        now: float,
        record: bool,
    ) -> SessionView:
        """The session view with relief's verdict (extproc.pipeline.relief.relief_view), when
        GPU health or KV relief is on."""
        relief = runtime.relief
        if relief is None:
            return view
        ttl = runtime.affinity.new_session_ttl_s
        return relief_view(
            self.fleet.relief,
            self.fleet.load,
            relief,
            facts.session.digest,
            view,
            hash_primary,
            now,
            ttl,
            record,
        )

    def _moved(
        self, runtime: Runtime, facts: RequestFacts, decision: Decision, cluster: str, now: float
    ) -> None:
        """Count a migration, and (GPU health) the session on the cluster it was routed to."""
        if decision.migration_reason is not None:
            # The session leaves the cluster holding its cache: one re-prefill on the new one.
            self._metrics.migrations.labels(decision.migration_reason).inc()
        relief = runtime.relief
        if relief is not None:
            ttl = runtime.affinity.new_session_ttl_s
            self.fleet.relief.seen(cluster, facts.session.digest, now, ttl, relief)

    def _endpoints(
        self, runtime: Runtime, facts: RequestFacts, route: Route
    ) -> tuple[str, ...] | None:
        """Endpoint-picker mode: the endpoints to try, in order (None in route mode)."""
        if not runtime.endpoint_picker:
            return None
        # The decided (primary, secondary) first — pure hashing's own top two unless affinity
        # moved the session — then the rest in hash order for when neither has a ready endpoint.
        head = [route.placement.primary]
        if route.placement.secondary is not None:
            head.append(route.placement.secondary)
        ready = (
            self._endpoint_health.ready
            if self._endpoint_health
            else frozenset(e for eps in runtime.endpoints.values() for e in eps)
        )
        engines = runtime.engines
        point = facts.session.point
        if not engines.sticky:
            # round_robin: a per-request point (a counter, mixed) spreads the session.
            self._engine_draws += 1
            point = mix64(point ^ self._engine_draws)

        # A LoRA adapter: the engines that list it loaded first (core.endpoints.pick_engine).
        loaded = runtime.adapter_engines.get(route.model, ()) if route.model else ()

        def pick(clusters: list[str]) -> list[str]:
            return pick_endpoints(
                point,
                clusters,
                runtime.endpoints,
                ready,
                2,
                self._engine_inflight,
                engines.balance,
                engines.min_inflight,
                loaded,
            )

        picked = pick(head)
        if len(picked) == 2:
            # Both have a ready endpoint: the rest of the order cannot change the answer, and
            # ranking every cluster costs O(N) per request.
            return tuple(picked)
        hashed = runtime.policy.placer(route).ranked(facts.session.point)
        return tuple(pick(head + [c for c in hashed if c not in head]))

    @property
    def asks_load_reports(self) -> bool:
        """Whether upstream requests ask for ORCA load reports (endpoint-load-metrics-format):
        only when affinity reads them from response headers."""
        runtime = self._runtime.current
        return runtime.affinity.enabled and ORCA_HEADER in runtime.response_headers

    # -- the response -------------------------------------------------------------------------
    def response_headers_wanted(self, hold: Hold | None) -> tuple[str, ...]:
        """The response headers :meth:`observe_response` reads for this exchange (none: the
        phase can be answered at once). Only these are decoded: a response may carry dozens."""
        if hold is None:
            return ()
        runtime = self._runtime.current
        # P/D: the status tells whether the decode-side sidecar reached the prefiller.
        status = (STATUS,) if hold.prefill_endpoint is not None else ()
        inspect = runtime.inspect_usage and hold.usage_cluster is not None
        if (hold.routed_to is None or hold.reported) and not inspect and hold.ticket is None:
            return status
        return (*runtime.response_headers, *status)

    def endpoint_owners(self) -> Mapping[str, str]:
        """address -> cluster of the configured endpoints (for Envoy's upstream.address)."""
        runtime = self._runtime.current
        if self._owners[0] is not runtime:
            self._owners = (runtime, endpoint_owners(runtime.endpoints))
        return self._owners[1]

    def observe_response(
        self,
        hold: Hold,
        found: Mapping[str, str],
        now: float,
        envoy_served: str | None = None,
        envoy_address: str | None = None,
    ) -> bool:
        """The response headers of a routed exchange arrived (``found``: the wanted ones;
        ``envoy_served``: the serving cluster Envoy named in its response attributes, see
        extproc/protocol/attributes.py).

        Feeds the load report and any failover to the fleet state; returns True when the
        response body should stream through usage inspection (an SSE response).
        """
        runtime = self._runtime.current
        if hold.prefill_endpoint is not None and _prefill_failed(runtime, found.get(STATUS)):
            # llm-d's sidecar answered 502 when it could not reach the prefiller (newer ones
            # fall back to decode-only and answer normally), an SGLang decode server 500: skip
            # the prefiller until the prober has had a round to confirm (a prober round alone
            # leaves a second of failures).
            self._prefill_down[hold.prefill_endpoint] = now
        served_header = runtime.served_by_header
        served_by = envoy_served
        if served_by is None and served_header:
            # Envoy's word first (it knows the host it used); the engine's header otherwise.
            served_by = found.get(served_header)
        if served_by not in runtime.cluster_names:
            served_by = None  # not one of ours (or absent): credit the cluster we chose
        hold.served_by = served_by
        # The engine: Envoy's serving host (route mode: its Maglev chose it), else the picker's.
        engine = envoy_address or hold.engine
        if engine is not None and hold.usage_engine is None:
            hold.usage_engine = engine
            self._metrics.engine_served.labels(engine).inc()
        chosen = hold.routed_to
        if chosen is not None and not hold.reported:
            hold.reported = True
            report = parse_load_headers(found)
            self.fleet.reported(chosen, served_by, report, now, runtime.affinity)
        inspect = runtime.inspect_usage and hold.usage_cluster is not None
        if not inspect:
            return False
        if served_by is not None:
            hold.usage_cluster = served_by
        if found.get("content-type", "").startswith("text/event-stream"):
            hold.usage_scanner = SseUsageScanner(hold.api)
            return True
        return False

    async def observe_response_body(
        self, hold: Hold, chunk: bytes, end_of_stream: bool, now: float
    ) -> None:
        """A piece of the response body (the whole body unless it streams as SSE)."""
        cluster = hold.usage_cluster
        if cluster is None:
            return
        scanner = hold.usage_scanner
        if scanner is not None:
            scanner.feed(chunk)
            if end_of_stream:
                self._account_usage(cluster, hold, scanner.finish())
            response_id = scanner.response_id
        else:
            if end_of_stream:
                self._account_usage(cluster, hold, usage_from_body(hold.api, chunk))
            response_id = response_id_from_body(chunk) if hold.link_session else None
        if response_id is not None and hold.link_session is not None:
            session, hold.link_session = hold.link_session, None
            runtime = self._runtime.current
            ttl = runtime.response_link_ttl_s
            if ttl is not None:
                # Before the answer to this body phase: the body (or the event naming the
                # id) reaches the client only after the link is stored, so the next turn,
                # on whichever replica, finds it.
                await self.fleet.learn(
                    response_id, session, runtime.key_rules.label_secret, now, ttl
                )
                self._metrics.response_links.labels("learnt").inc()

    def _account_usage(self, cluster: str, hold: Hold, usage: Usage | None) -> None:
        hold.usage_cluster = None
        model, engine = hold.usage_model, hold.usage_engine
        if usage is None:
            self._metrics.usage_missing.inc()
            return
        if hold.tenant_label is not None:
            self._tenant_metrics.served(hold.tenant_label, usage.output_tokens)
        fair, hold.fair = hold.fair, None
        if fair is not None and self._gate is not None:
            self._gate.charge(fair, self._runtime.current.flow.output_service(usage.output_tokens))
        trace_annotate(
            gen_ai__usage__input_tokens=usage.prompt_tokens,
            gen_ai__usage__output_tokens=usage.output_tokens,
            gen_ai__usage__cache_read__input_tokens=usage.cached_tokens,
        )
        m = self._metrics
        m.upstream_input_tokens.labels(cluster, "hit").inc(usage.cached_tokens)
        m.upstream_input_tokens.labels(cluster, "miss").inc(
            max(0, usage.prompt_tokens - usage.cached_tokens)
        )
        m.upstream_output_tokens.labels(cluster).inc(usage.output_tokens)
        runtime = self._runtime.current
        prices = runtime.model_prices.get(model, runtime.prices)
        label = runtime.model_label(model)
        m.cost_dollars.labels(cluster, label).inc(prices.cost(usage))
        m.cache_savings_dollars.labels(cluster, label).inc(prices.saved(usage))
        if engine is not None:
            m.engine_input_tokens.labels(engine, "hit").inc(usage.cached_tokens)
            m.engine_input_tokens.labels(engine, "miss").inc(
                max(0, usage.prompt_tokens - usage.cached_tokens)
            )
            m.engine_output_tokens.labels(engine).inc(usage.output_tokens)
            m.engine_cost_dollars.labels(engine, label).inc(prices.cost(usage))

    async def charge_served(self, hold: Hold) -> None:
        """Move the budget charge to the cluster that serves the request, when Envoy failed it
        over (the aggregate's secondary, or another host of the fallback route): the budget
        charged is the one of the cluster doing the work, so a secondary's per-class budgets
        hold while it takes a dead primary's traffic. Call after :meth:`observe_response`."""
        ticket, served = hold.ticket, hold.served_by
        if ticket is None or served is None or served == ticket.cluster or self._gate is None:
            return
        runtime = self._runtime.current
        # A model's own class ("<class>@<model>") is found too.
        cls = runtime.policy.class_named(ticket.class_name)
        if cls is None:
            return  # the class is gone after a reload: keep the charge where it is
        hold.ticket = await self._gate.move(ticket, served, cls.budget)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "charge moved",
                extra={"request_id": hold.request_id, "from": ticket.cluster, "to": served},
            )

    # -- the end ------------------------------------------------------------------------------
    def wants_request_body(self) -> bool:
        """Whether the protocol shell keeps the request body until the answer: SGLang's P/D
        protocol rewrites it (:meth:`bootstrap_body`)."""
        pd = self._runtime.current.pd
        return pd is not None and pd.protocol == "sglang"

    def bootstrap_body(self, outcome: Routed, body: bytes) -> tuple[str, bytes] | None:
        """SGLang's P/D protocol: the Envoy cluster to mirror the request to (the chosen
        prefill endpoint alone) and the body for both halves, with the bootstrap fields
        SGLang's router adds (extproc.core.pd.bootstrap_fields). None when the request has no
        prefiller (or the protocol is llm-d's): it goes on unchanged, and the decode target
        prefills it itself."""
        pd = self._runtime.current.pd
        prefill = outcome.prefill
        if pd is None or pd.protocol != "sglang" or prefill is None or prefill.endpoint is None:
            return None
        try:
            request = orjson.loads(body)
            batch = bootstrap_batch(request) if isinstance(request, dict) else None
        except ValueError:  # orjson.JSONDecodeError, or an empty batch (the router's 400)
            return None
        if not isinstance(request, dict):
            return None
        endpoint = prefill.endpoint
        rooms = [self._rooms() for _ in range(batch or 1)]
        request.update(bootstrap_fields(endpoint.address, endpoint.bootstrap_port, rooms, batch))
        return prefill_mirror_cluster(endpoint.address), orjson.dumps(request)

    async def release(self, hold: Hold) -> None:
        """Give back what the exchange holds; idempotent, never raises for the ledger."""
        self._give_tenant(hold)
        routed, hold.routed_to = hold.routed_to, None
        if routed is not None:
            self.fleet.finished(routed)
        prefiller, hold.prefill_endpoint = hold.prefill_endpoint, None
        if prefiller is not None:
            left = self._prefill_inflight.get(prefiller, 0) - 1
            if left > 0:
                self._prefill_inflight[prefiller] = left
            else:
                self._prefill_inflight.pop(prefiller, None)
        prefill_ticket, hold.prefill_ticket = hold.prefill_ticket, None
        if prefill_ticket is not None and self._gate is not None:
            await asyncio.shield(self._gate.release(prefill_ticket))
        engine, hold.engine = hold.engine, None
        if engine is not None:
            left = self._engine_inflight.get(engine, 0) - 1
            if left > 0:
                self._engine_inflight[engine] = left
            else:
                self._engine_inflight.pop(engine, None)  # a reload may have removed it
        ticket, hold.ticket = hold.ticket, None
        if ticket is not None and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "released",
                extra={
                    "request_id": hold.request_id,
                    "cluster": ticket.cluster,
                    "request_class": ticket.class_name,
                    "ledger": ticket.store,
                },
            )
        # In memory: given back at once, no task per request (a shield costs one). Redis:
        # shielded, as the stream may be ending by cancellation (client or upstream abort)
        # and a second cancel must not abandon the release half-way (a round trip).
        gate = self._gate
        if ticket is not None and gate is not None and not gate.release_if_local(ticket):
            await asyncio.shield(gate.release(ticket))

    async def aclose(self) -> None:
        """Close the shared affinity store's connections."""
        await self.fleet.close()

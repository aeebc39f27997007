"""The ext_proc servicer: a thin stream loop with one handler per phase.

Envoy keeps the ext_proc stream open for the whole HTTP exchange (normal end, SSE end, client
abort, upstream abort): the stream ends either as a normal close or as a cancellation, so
everything held for the request is released in ``finally``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from extproc.config.runtime import Runtime
from extproc.core.admission import Admitted, Reject
from extproc.core.affinity import Decision, place
from extproc.core.api import Api, BadRequest, api_for_path
from extproc.core.decide import Route
from extproc.core.endpoints import pick_endpoints
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.load import LOAD_HEADERS, parse_load_headers
from extproc.core.placement import mix64
from extproc.core.usage import Prices, SseUsageScanner, Usage, usage_from_body
from extproc.ledger.gate import AdmissionGate
from extproc.metrics import Metrics
from extproc.pipeline.endpoint_health import EndpointHealth
from extproc.pipeline.fleet_state import FleetState, RedisSessions
from extproc.protocol import responses
from extproc.protocol.state import StreamState

log = logging.getLogger("extproc.server")

Handler = Callable[[StreamState, Any], Awaitable[ep.ProcessingResponse]]


class RuntimeHolder:
    """The runtime being served; reload swaps it whole (one reference assignment)."""

    def __init__(self, runtime: Runtime) -> None:
        self.current = runtime


def _header_map(headers: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in headers.headers:
        # Envoy sends raw_value (bytes); older versions used value.
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


class FleetProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        runtime: RuntimeHolder,
        metrics: Metrics,
        gate: AdmissionGate | None = None,
        clock: Callable[[], float] = time.perf_counter,
        endpoint_health: EndpointHealth | None = None,
        fleet_state: FleetState | None = None,
        redis_url: str | None = None,
    ) -> None:
        self._endpoint_health = endpoint_health
        # --redis-url / FLEET_REDIS_URL win over the config's redis.url, as for the ledger.
        self._redis_url = redis_url
        self._runtime = runtime
        self._metrics = metrics
        self._gate = gate
        self._active = 0
        self._answers = responses.RouteAnswers()
        self._clock = clock
        # Load-aware affinity state (used only while runtime.affinity.enabled). Its Redis store
        # is attached on first use, so a reload that turns affinity on needs no restart.
        self._fleet = fleet_state or FleetState(
            metrics, runtime.current.config.affinity.max_sessions
        )
        self._shared_checked = fleet_state is not None
        # Per-request salt for the policy's hot-key tie-break: a mixed counter, reproducible
        # (no unseeded randomness) and, unlike the bare counter, free of aliasing with periodic
        # traffic (a hot request after every other request would see only even salts).
        self._salt = itertools.count()
        # The whole phase contract, in one table. Phases we never ask Envoy for (see the
        # processing_mode we render) still get a pass-through answer so a mis-configured
        # filter degrades to "no decision" rather than a broken stream.
        self._handlers: dict[str, Handler] = {
            "request_headers": self._on_request_headers,
            "request_body": self._on_request_body,
            "request_trailers": self._pass(responses.CONTINUE_TRAILERS),
            # Asked for only when affinity is on: the clusters' load reports ride on them.
            "response_headers": self._on_response_headers,
            # Asked for only when usage inspection is on (cost metrics).
            "response_body": self._on_response_body,
            "response_trailers": self._pass(responses.CONTINUE_RESPONSE_TRAILERS),
        }

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        state = StreamState()
        self._active += 1
        self._metrics.streams_active.inc()
        try:
            async for request in request_iterator:
                phase = request.WhichOneof("request")
                handler = self._handlers.get(phase or "")
                if handler is None:
                    self._metrics.stream_errors.labels("unknown_phase").inc()
                    continue
                yield await handler(state, request)
        except asyncio.CancelledError:
            # Envoy cancels the stream when the client or upstream aborts: an ordinary end.
            raise
        except Exception:
            self._metrics.stream_errors.labels("handler_exception").inc()
            log.exception("ext_proc stream failed", extra={"request_id": state.request_id})
            raise
        finally:
            self._active -= 1
            self._metrics.streams_active.dec()
            await self._release(state)

    @property
    def active(self) -> int:
        """ext_proc streams open right now."""
        return self._active

    @property
    def fleet_state(self) -> FleetState:
        return self._fleet

    async def aclose(self) -> None:
        """Close the shared affinity store's connections (the serve loop calls this on exit)."""
        await self._fleet.close()

    async def _release(self, state: StreamState) -> None:
        routed, state.routed_to = state.routed_to, None
        if routed is not None:
            self._fleet.finished(routed)
        ticket, state.ticket = state.ticket, None
        if ticket is not None and self._gate is not None:
            # Shielded: the stream may be ending by cancellation (client or upstream abort), and
            # a second cancel must not abandon the release half-way (a Redis round trip).
            await asyncio.shield(self._gate.release(ticket))

    @staticmethod
    def _pass(answer: ep.ProcessingResponse) -> Handler:
        async def handler(_state: StreamState, _request: Any) -> ep.ProcessingResponse:
            return answer

        return handler

    async def _on_request_headers(self, state: StreamState, request: Any) -> ep.ProcessingResponse:
        msg = request.request_headers
        state.headers = _header_map(msg.headers)
        state.path = state.headers.get(":path", "")
        state.method = state.headers.get(":method", "")
        state.request_id = state.headers.get("x-request-id", "")
        api = api_for_path(state.path)
        if api is None or state.method != "POST":
            self._metrics.passthrough.inc()
            return responses.CONTINUE_HEADERS
        state.api = api
        if msg.end_of_stream:
            # No body will follow, so this is the only chance to answer.
            state.decided = True
            empty = BadRequest(
                400,
                "request body is empty; expected a JSON object",
                "invalid_request_error",
                api.error_style,
            )
            return self._answer_bad(empty, api.value)
        return responses.CONTINUE_HEADERS

    async def _on_request_body(self, state: StreamState, request: Any) -> ep.ProcessingResponse:
        api = state.api
        if api is None or state.decided:
            return responses.CONTINUE_BODY
        msg = request.request_body
        started = self._clock()
        runtime = self._runtime.current
        state.decided = True
        body: bytes = msg.body
        self._metrics.body_bytes.observe(len(body))
        if not msg.end_of_stream:
            # BUFFERED mode delivers the whole body in one message; anything else means the
            # filter is configured for streaming/partial bodies, which would hash truncated JSON.
            bad = BadRequest(
                413,
                "request body was not delivered whole (raise the gateway's buffer limit)",
                "request_too_large",
                api.error_style,
            )
            return self._answer_bad(bad, api.value)
        facts = parse_request(
            state.path, state.headers, body, runtime.key_rules, runtime.parse_limits
        )
        if isinstance(facts, BadRequest):
            return self._answer_bad(facts, api.value)
        route = runtime.policy.route(facts)
        kind = "primary"
        if runtime.affinity.enabled:
            decision = await self._place(runtime, facts, route, started)
            route = Route(decision.placement, route.request_class)
            kind = decision.kind
        if self._gate is not None:
            outcome = await self._gate.admit(facts, route)
            if isinstance(outcome, Reject):
                self._metrics.requests.labels(
                    facts.api.value, outcome.class_name, outcome.reason
                ).inc()
                self._metrics.decision_seconds.observe(self._clock() - started)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug(
                        "rejected",
                        extra={
                            "request_id": state.request_id,
                            "session": facts.session.label,
                            "request_class": outcome.class_name,
                            "cluster": outcome.cluster,
                            "status": outcome.status,
                            "reason": str(outcome.reason),
                            "retry_after_s": outcome.retry_after_s,
                        },
                    )
                return responses.reject_response(outcome, api.error_style)
            if isinstance(outcome, Admitted):
                state.ticket = outcome.ticket
        self._metrics.requests.labels(facts.api.value, route.request_class.name, "routed").inc()
        self._metrics.routes.labels(kind).inc()
        if runtime.affinity.enabled:
            state.routed_to = route.placement.primary
            self._fleet.routed(state.routed_to)
        if runtime.config.processor.inspect_usage:
            state.usage_cluster = route.placement.primary
        if runtime.config.processor.mode == "endpoint_picker":
            answer = self._pick(runtime, route, facts, api)
        else:
            answer = self._answers.route(route, facts)
        self._metrics.decision_seconds.observe(self._clock() - started)
        if log.isEnabledFor(logging.DEBUG):  # per-request lines only when asked for
            log.debug(
                "routed",
                extra={
                    "request_id": state.request_id,
                    "session": facts.session.label,  # a hash, never the raw key
                    "session_source": facts.session.source.value,
                    "request_class": route.request_class.name,
                    "primary": route.placement.primary,
                    "secondary": route.placement.secondary,
                    "kind": kind,
                    "input_tokens": facts.input_tokens,
                },
            )
        return answer

    def _ready_clusters(self, runtime: Runtime) -> frozenset[str] | None:
        if self._endpoint_health is None:
            return None
        ready = self._endpoint_health.ready
        return frozenset(c for c, eps in runtime.endpoints.items() if any(e in ready for e in eps))

    def _attach_shared_store(self, runtime: Runtime) -> None:
        self._shared_checked = True
        redis = runtime.config.redis
        url = self._redis_url or redis.url
        if url:
            self._fleet.shared = RedisSessions.from_url(
                url, redis.key_prefix, redis.timeout_ms / 1000
            )

    async def _place(
        self, runtime: Runtime, facts: RequestFacts, route: Route, now: float
    ) -> Decision:
        """Feed the pure affinity policy: candidates, load snapshot, session memory, now."""
        if not self._shared_checked:
            self._attach_shared_store(runtime)
        # A reload may change the bound; the memory trims to it on its next writes.
        self._fleet.memory.max_sessions = runtime.config.affinity.max_sessions
        params = runtime.affinity
        ranked = runtime.policy.placers[route.request_class.name].ranked(facts.session.point)
        view = await self._fleet.view(facts, ranked[0], now, params, mix64(next(self._salt)))
        snapshot = self._fleet.load.snapshot(ranked, now, self._ready_clusters(runtime))
        decision = place(facts, ranked, snapshot, view, now, params)
        if decision.migration_reason is not None:
            # The session leaves the cluster holding its cache: one re-prefill on the new one.
            self._metrics.migrations.labels(decision.migration_reason).inc()
        await self._fleet.remember(facts, decision, now)
        return decision

    async def _on_response_headers(self, state: StreamState, request: Any) -> ep.ProcessingResponse:
        runtime = self._runtime.current
        inspect = runtime.config.processor.inspect_usage and state.usage_cluster is not None
        if (state.routed_to is None or state.reported) and not inspect:
            return responses.CONTINUE_RESPONSE_HEADERS
        served_header = runtime.config.affinity.served_by_header
        wanted = (
            (*LOAD_HEADERS, served_header, "content-type")
            if served_header
            else (
                *LOAD_HEADERS,
                "content-type",
            )
        )
        found: dict[str, str] = {}
        # Only the few headers we read are decoded; a response may carry dozens.
        for h in request.response_headers.headers.headers:
            if h.key in wanted:
                found[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        served_by = found.get(served_header) if served_header else None
        if served_by not in runtime.cluster_names:
            served_by = None  # not one of ours (or absent): credit the cluster we chose
        chosen = state.routed_to
        if chosen is not None and not state.reported:
            state.reported = True
            report = parse_load_headers(found)
            self._fleet.reported(chosen, served_by, report, self._clock(), runtime.affinity)
        if not inspect or state.api is None:
            return responses.CONTINUE_RESPONSE_HEADERS
        if served_by is not None:
            state.usage_cluster = served_by
        if found.get("content-type", "").startswith("text/event-stream"):
            state.usage_stream = SseUsageScanner(state.api)
            return responses.STREAM_RESPONSE_HEADERS
        return responses.CONTINUE_RESPONSE_HEADERS

    async def _on_response_body(self, state: StreamState, request: Any) -> ep.ProcessingResponse:
        api, cluster = state.api, state.usage_cluster
        if api is None or cluster is None:
            return responses.CONTINUE_RESPONSE_BODY
        msg = request.response_body
        scanner = state.usage_stream
        if isinstance(scanner, SseUsageScanner):
            scanner.feed(msg.body)
            if msg.end_of_stream:
                self._account_usage(cluster, scanner.finish())
                state.usage_cluster = None
        elif msg.end_of_stream:
            self._account_usage(cluster, usage_from_body(api, msg.body))
            state.usage_cluster = None
        return responses.CONTINUE_RESPONSE_BODY

    def _account_usage(self, cluster: str, usage: Usage | None) -> None:
        if usage is None:
            self._metrics.usage_missing.inc()
            return
        m = self._metrics
        m.upstream_input_tokens.labels(cluster, "hit").inc(usage.cached_tokens)
        m.upstream_input_tokens.labels(cluster, "miss").inc(
            max(0, usage.prompt_tokens - usage.cached_tokens)
        )
        m.upstream_output_tokens.labels(cluster).inc(usage.output_tokens)
        p = self._runtime.current.config.prices
        prices = Prices(p.cached_input, p.uncached_input, p.output)
        m.cost_dollars.labels(cluster).inc(prices.cost(usage))
        m.cache_savings_dollars.labels(cluster).inc(prices.saved(usage))

    def _pick(
        self, runtime: Runtime, route: Route, facts: RequestFacts, api: Api
    ) -> ep.ProcessingResponse:
        hashed = runtime.policy.placers[route.request_class.name].ranked(facts.session.point)
        # The decided (primary, secondary) first — pure hashing's own top two unless affinity
        # moved the session — then the rest in hash order for when neither has a ready endpoint.
        head = [route.placement.primary]
        if route.placement.secondary is not None:
            head.append(route.placement.secondary)
        ranked = head + [c for c in hashed if c not in head]
        ready = (
            self._endpoint_health.ready
            if self._endpoint_health
            else frozenset(e for eps in runtime.endpoints.values() for e in eps)
        )
        picked = pick_endpoints(facts.session.point, ranked, runtime.endpoints, ready)
        if not picked:
            self._metrics.routes.labels("no_endpoint").inc()
            return responses.error_response(
                api.error_style, 503, "no inference endpoint is ready", "no_ready_endpoint"
            )
        return responses.endpoint_response(route, facts, picked)

    def _answer_bad(self, bad: BadRequest, api: str) -> ep.ProcessingResponse:
        outcome = "too_large" if bad.status == 413 else "bad_request"
        self._metrics.requests.labels(api, "", outcome).inc()
        return responses.bad_request_response(bad)

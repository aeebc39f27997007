"""A simulated inference cluster: an aiohttp server around ``kvmodel.ClusterModel``.

It speaks just enough of three APIs for Envoy, the processor and the replayer to treat it as a
real OpenAI-compatible / Anthropic-compatible backend:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI), ``POST /v1/messages``
  (Anthropic), streaming (SSE) and not, each in its own wire format, with usage in the body
  (in streams: the last event before the terminator, like ``stream_options.include_usage``);
- ``POST /v1/responses`` (OpenAI Responses API, ``sim_responses``): response objects, typed
  stream events, and stored responses per cluster for ``previous_response_id`` (vLLM's 404
  for an id this cluster does not hold);
- ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /v1/models``;
- ``POST /admin/fault`` to inject failures: ``none`` | ``refuse`` | ``error`` | ``slow`` |
  ``hang`` | ``reset`` (``GET`` shows the current one). ``error`` answers ``status`` (e.g. 429
  or 503, an engine's backpressure) before any generation; ``reset`` starts the generation,
  then drops the connection before a response byte (an engine crash mid-prefill);
- ``GET /admin/concurrency``: requests in flight, peak and total per request class (the
  processor's ``x-fleet-class``), how tests prove budgets at the upstream; ``DELETE`` restarts
  the peaks; ``GET /admin/requests?since=<unix time>``: the last 50,000 finished requests as
  [``x-request-id``, class, start, end] (wall clock), for `extproc chaos`'s diagnosis of a peak;
- ``GET /admin/executions``: generations started, per ``x-request-id`` (Envoy keeps the id
  across retries, so a count above 1 is a generation that ran twice);
- ``POST /admin/reset``: an empty prefix cache and no queue, as a new process would have
  (409 while a request is in flight); counters keep counting.

Every response names the cluster in ``x-served-by`` (how e2e tests and the replayer see where
Envoy routed a request) and every inference response carries a load report twice: the ORCA
``endpoint-load-metrics`` header in its TEXT format, which Envoy parses natively, and the
simpler ``x-fleet-load`` header. ``x-sim-ttft-ms`` and ``x-sim-cached-tokens`` expose the
model's plan to tests.

A client that disconnects ends its request at once, as in vLLM and SGLang, which abort a
request whose client went away (the handler is cancelled; ``sim_client_disconnects`` counts it),
so the per-class in-flight figures at the upstream drop with it. The KV model keeps the
abandoned request's planned slot (it plans each request once, on arrival): load figures after
an abort overstate the engine's load until that plan ends.

Anthropic usage follows the real API: ``input_tokens`` counts only the uncached part;
``input_tokens + cache_read_input_tokens`` is the prompt.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from extproc.harness import llamacpp_format
from extproc.harness.class_concurrency import CLASS_HEADER, ClassConcurrency
from extproc.harness.engine_formats import (
    MODEL_NAME,
    ORCA_FORMAT_HEADER,
    SIM_ENGINES,
    EngineMetrics,
    SimEngine,
    vllm_orca_header,
)
from extproc.harness.kvmodel import ClusterModel, ClusterParams, LoadSnapshot, ModelRequest, Plan
from extproc.harness.llamacpp_format import LlamaCppMetrics, timings
from extproc.harness.prompts import (
    ApiKind,
    PromptError,
    block_hashes,
    canonical_prompt,
    count_tokens,
    responses_prompt,
)
from extproc.harness.sim_responses import (
    PreviousResponseMissing,
    ResponsesEvents,
    ResponseStore,
    new_response_id,
    not_found_body,
    response_object,
)
from extproc.harness.sim_responses import usage as responses_usage
from extproc.harness.vllm_families import FinishedRequest

log = logging.getLogger(__name__)

FaultMode = Literal["none", "refuse", "error", "slow", "hang", "reset"]
FAULT_MODES: tuple[str, ...] = get_args(FaultMode)

SERVED_BY = "x-served-by"
# The traceparent the request arrived with, echoed on a non-streamed answer.
SIM_TRACEPARENT_HEADER = "x-sim-traceparent"
# Which engine of the cluster answered (a cluster simulated as several engine processes, each
# with its own KV cache): how tests and benches see engine stickiness. Only when set.
SERVED_BY_ENGINE = "x-served-by-engine"
ORCA_HEADER = "endpoint-load-metrics"
FLEET_LOAD_HEADER = "x-fleet-load"
SIM_TTFT_HEADER = "x-sim-ttft-ms"
SIM_CACHED_HEADER = "x-sim-cached-tokens"

# A 1M-token prompt is ~4 MB of text; aiohttp's default body limit is 1 MiB.
MAX_BODY_BYTES = 64 * 1024 * 1024
# Streams group tokens so that one write covers at least this much wall time; thousands of
# concurrent streams writing every 0.2 ms would measure the event loop, not the model.
MIN_CHUNK_INTERVAL_S = 0.005
# Four-character "tokens" (three letters and a space) keep output length == tokens * 4.
_OUTPUT_WORDS = ("the", "sim", "kv ", "ok ", "and", "one", "two", "via", "new", "run")


class FaultError(ValueError):
    """An /admin/fault payload that does not describe a fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    mode: FaultMode = "none"
    status: int = 503
    factor: float = 5.0

    @classmethod
    def from_json(cls, payload: object) -> Fault:
        if not isinstance(payload, Mapping):
            raise FaultError("body must be a JSON object")
        unknown = set(payload) - {"mode", "status", "factor"}
        if unknown:
            raise FaultError(f"unknown fields: {sorted(unknown)}")
        mode = payload.get("mode", "none")
        if mode not in FAULT_MODES:
            raise FaultError(f"mode must be one of {list(FAULT_MODES)}, got {mode!r}")
        status = payload.get("status", 503)
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise FaultError(f"status must be an integer in 400..599, got {status!r}")
        factor = payload.get("factor", 5.0)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise FaultError(f"factor must be a number > 0, got {factor!r}")
        return cls(mode=mode, status=status, factor=float(factor))

    def to_json(self) -> dict[str, object]:
        return {"mode": self.mode, "status": self.status, "factor": self.factor}


@dataclass(frozen=True, slots=True)
class SimClusterConfig:
    name: str = "sim"
    params: ClusterParams = field(default_factory=ClusterParams)
    max_output: int = 64
    # "sim": the simulator's own load headers and metrics; "vllm" / "sglang" / "llamacpp": the
    # real engine's /metrics families and response headers, exactly (extproc.harness.
    # engine_formats, llamacpp_format), and llama.cpp's usage timings, model list and errors.
    engine: SimEngine = "sim"
    # This process is one engine of cluster ``name`` (echoed in x-served-by-engine); empty:
    # the process is the whole cluster.
    engine_id: str = ""
    # The models this cluster serves (vLLM's --served-model-name plus its LoRA adapters);
    # others get vLLM's 404. Empty: any model name is served (the simulator's old behaviour).
    # llama.cpp serves one model and answers any name with it (its alias: the first here).
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        if self.engine not in SIM_ENGINES:
            raise ValueError(f"engine must be one of {list(SIM_ENGINES)}, got {self.engine!r}")
        if self.max_output < 1:
            raise ValueError("max_output must be >= 1")


def _reader(
    load: Callable[[], LoadSnapshot], pick: Callable[[LoadSnapshot], float]
) -> Callable[[], float]:
    # Evaluated at scrape time, so gauges always show the model's state at that instant.
    return lambda: float(pick(load()))


class SimMetrics:
    """Prometheus metrics of one simulated cluster, on an injected registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        load: Callable[[], LoadSnapshot],
        engine_names: bool = True,
    ) -> None:
        self.requests = Counter(
            "sim_requests",
            "Inference requests by API and status",
            ["api", "code"],
            registry=registry,
        )
        self.prefix_hits = Counter(
            "sim_prefix_cache_hits", "Requests with at least one cached block", registry=registry
        )
        self.prompt_tokens = Counter("sim_prompt_tokens", "Prompt tokens", registry=registry)
        self.cached_tokens = Counter(
            "sim_cached_tokens", "Prompt tokens served from the prefix cache", registry=registry
        )
        self.uncached_tokens = Counter(
            "sim_uncached_tokens", "Prompt tokens prefilled", registry=registry
        )
        self.generation_tokens = Counter(
            "sim_generation_tokens", "Output tokens", registry=registry
        )
        self.evictions = Counter(
            "sim_prefix_cache_evictions", "Blocks evicted from the prefix cache", registry=registry
        )
        self.disconnects = Counter(
            "sim_client_disconnects", "Requests the client closed early", registry=registry
        )
        self.fault = Gauge(
            "sim_fault_mode", "1 for the active fault mode", ["mode"], registry=registry
        )
        gauges: list[tuple[str, str, Callable[[LoadSnapshot], float]]] = [
            ("sim_queue_depth", "Requests waiting for prefill", lambda s: s.queued),
            ("sim_inflight_requests", "Requests queued or running", lambda s: s.inflight),
            ("sim_kv_usage_ratio", "KV held by running requests / capacity", lambda s: s.kv_usage),
            ("sim_prefix_cache_fill_ratio", "Prefix cache fill", lambda s: s.cache_fill),
            # vLLM's names, so a scraper written for vLLM (e.g. the Gateway API Inference
            # Extension's endpoint picker) reads the simulator unchanged.
            ("vllm:num_requests_waiting", "Requests waiting (vLLM name)", lambda s: s.queued),
            (
                "vllm:num_requests_running",
                "Requests running (vLLM name)",
                lambda s: s.inflight - s.queued,
            ),
            ("vllm:kv_cache_usage_perc", "KV usage 0..1 (vLLM name)", lambda s: s.kv_usage),
        ]
        if not engine_names:
            # Playing a real engine: its own labelled families replace these (engine_formats).
            gauges = [g for g in gauges if not g[0].startswith("vllm:")]
        for name, help_text, pick in gauges:
            gauge = Gauge(name, help_text, registry=registry)
            gauge.set_function(_reader(load, pick))

    def set_fault(self, mode: str) -> None:
        for candidate in FAULT_MODES:
            self.fault.labels(mode=candidate).set(1.0 if candidate == mode else 0.0)


@dataclass(frozen=True, slots=True)
class _Parsed:
    api: ApiKind
    model: str
    stream: bool
    prompt_tokens: int
    hashes: tuple[int, ...]
    output_tokens: int
    requested_tokens: int
    # Responses API: the request (echoed in the response object), its id and its prompt text
    # (stored with the output for a later previous_response_id).
    body: Mapping[str, Any] | None = None
    response_id: str = ""
    text: str = ""


def _error_body(api: ApiKind, status: int, message: str) -> dict[str, object]:
    if api == "anthropic-messages":
        kind = {
            400: "invalid_request_error",
            413: "request_too_large",
            429: "rate_limit_error",
            503: "overloaded_error",
            529: "overloaded_error",
        }.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _model_not_found(api: ApiKind, model: str) -> dict[str, object]:
    """vLLM's answer to a model it does not serve (its _check_model): a 404 NotFoundError in
    the OpenAI error shape; on the Anthropic API, Anthropic's not_found_error shape."""
    message = f"The model `{model}` does not exist."
    if api == "anthropic-messages":
        return {"type": "error", "error": {"type": "not_found_error", "message": message}}
    return {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}


def _requested_tokens(api: ApiKind, body: Mapping[str, Any]) -> int | None:
    names: tuple[str, ...] = ("max_tokens",)
    if api == "openai-chat":
        names = ("max_completion_tokens", "max_tokens")
    elif api == "openai-responses":
        names = ("max_output_tokens",)
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PromptError(f"{name} must be a positive integer")
        return value
    return None


def _output_text(start: int, count: int) -> str:
    return "".join(_OUTPUT_WORDS[i % len(_OUTPUT_WORDS)] + " " for i in range(start, start + count))


def _finish_reason(parsed: _Parsed) -> str:
    truncated = parsed.output_tokens >= parsed.requested_tokens
    if parsed.api == "anthropic-messages":
        return "max_tokens" if truncated else "end_turn"
    return "length" if truncated else "stop"


def _responses_truncated(parsed: _Parsed) -> bool:
    """Responses API: "incomplete" only when the request's own max_output_tokens cut it."""
    limit = parsed.body.get("max_output_tokens") if parsed.body is not None else None
    return isinstance(limit, int) and parsed.output_tokens >= limit


def _openai_usage(parsed: _Parsed, plan: Plan) -> dict[str, object]:
    return {
        "prompt_tokens": parsed.prompt_tokens,
        "completion_tokens": parsed.output_tokens,
        "total_tokens": parsed.prompt_tokens + parsed.output_tokens,
        "prompt_tokens_details": {"cached_tokens": plan.cached_tokens},
    }


def _phase_seconds(plan: Plan) -> tuple[float, float]:
    """Simulated seconds of the prompt's prefill and of the generation."""
    return (
        (plan.first_token_at - plan.prefill_start) / plan.time_scale,
        (plan.done_at - plan.first_token_at) / plan.time_scale,
    )


def _llamacpp_timings(parsed: _Parsed, plan: Plan) -> dict[str, float | int]:
    prompt_s, predicted_s = _phase_seconds(plan)
    return timings(
        plan.cached_tokens, plan.uncached_tokens, parsed.output_tokens, prompt_s, predicted_s
    )


def _vllm_model_entry(name: str, created: int) -> dict[str, object]:
    """One entry of vLLM's /v1/models (its ModelCard: the served name, its root, the context
    length and one permission record)."""
    permission = {
        "id": f"modelperm-sim-{name}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": name,
        "parent": None,
        "max_model_len": 4096,
        "permission": [permission],
    }


def _anthropic_usage(plan: Plan, output_tokens: int) -> dict[str, object]:
    return {
        "input_tokens": plan.uncached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": plan.cached_tokens,
        "output_tokens": output_tokens,
    }


def _sse(data: Mapping[str, object], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


class SimCluster:
    """The HTTP shell: parses requests, asks the model for a plan, sleeps until it plays out."""

    def __init__(
        self,
        config: SimClusterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.model = ClusterModel(config.params)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._wall_clock = wall_clock
        self.metrics = SimMetrics(
            self.registry,
            lambda: self.model.load(self._clock()),
            engine_names=config.engine == "sim",
        )
        self.engine_metrics = EngineMetrics(
            config.engine,
            self.registry,
            lambda: self.model.load(self._clock()),
            config.params.kv_capacity_tokens,
            model_name=config.models[0] if config.models else MODEL_NAME,
            block_tokens=config.params.block_tokens,
        )
        self.llamacpp = (
            LlamaCppMetrics(lambda: self.model.load(self._clock()))
            if config.engine == "llamacpp"
            else None
        )
        self.metrics.set_fault("none")
        self._fault = Fault()
        self._ids = itertools.count(1)
        # Set whenever the cluster is not hanging; hanging requests wait on it.
        self._unhang = asyncio.Event()
        self._unhang.set()
        self._closing = False
        self.concurrency = ClassConcurrency()
        # Generations started per x-request-id.
        self.executions: collections.Counter[str] = collections.Counter()
        # Responses API: stored responses (sim_responses), per cluster as per engine process.
        self.responses = ResponseStore()

    @property
    def fault(self) -> Fault:
        return self._fault

    def set_fault(self, fault: Fault) -> None:
        self._fault = fault
        self.model.set_slowdown(fault.factor if fault.mode == "slow" else 1.0)
        self.metrics.set_fault(fault.mode)
        if fault.mode == "hang":
            self._unhang.clear()
        else:
            self._unhang.set()
        log.info("cluster %s: fault %s", self.config.name, fault.to_json())

    def release(self) -> None:
        """Let hanging requests finish (with a 503) so a server can shut down promptly."""
        self._closing = True
        self._unhang.set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._name_errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/responses", self._responses_api)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/admin/fault", self._set_fault)
        app.router.add_get("/admin/fault", self._get_fault)
        app.router.add_get("/admin/concurrency", self._get_concurrency)
        app.router.add_delete("/admin/concurrency", self._reset_concurrency)
        app.router.add_get("/admin/requests", self._get_requests)
        app.router.add_get("/admin/executions", self._get_executions)
        app.router.add_post("/admin/reset", self._reset)
        return app

    # -- small endpoints -------------------------------------------------------------------

    @web.middleware
    async def _name_errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp's own answers (404 for an unknown path, 405) name the server too: every
        answer of this cluster carries x-served-by, which is how tests tell an upstream's
        answer from the gateway's."""
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPException as exc:
            exc.headers.update(self._base_headers())
            raise
        return response

    def _base_headers(self) -> dict[str, str]:
        if self.config.engine_id:
            return {SERVED_BY: self.config.name, SERVED_BY_ENGINE: self.config.engine_id}
        return {SERVED_BY: self.config.name}

    async def _reset(self, request: web.Request) -> web.Response:
        """A fresh engine without a new process: empty prefix cache, no stored responses, no
        executions counted (a benchmark's fresh fleet for each set-up). Counters keep counting:
        readers take differences. Refused (409) while a request is in flight."""
        if self.model.load(self._clock()).inflight:
            return web.json_response({"status": "busy"}, status=409, headers=self._base_headers())
        self.model = ClusterModel(self.config.params)
        self.executions.clear()
        self.responses = ResponseStore()
        return web.json_response({"status": "reset"}, headers=self._base_headers())

    async def _health(self, request: web.Request) -> web.Response:
        if self._fault.mode == "refuse":
            return web.json_response(
                {"status": "refusing", "cluster": self.config.name},
                status=503,
                headers=self._base_headers(),
            )
        return web.json_response(
            {"status": "ok", "cluster": self.config.name}, headers=self._base_headers()
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        page = generate_latest(self.registry)
        if self.llamacpp is not None:
            page += self.llamacpp.page().encode()
        response = web.Response(body=page, headers=self._base_headers())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _models(self, request: web.Request) -> web.Response:
        names = self.config.models or ("sim",)
        if self.llamacpp is not None:
            body = llamacpp_format.models_body(names[0], int(self._wall_clock()))
            return web.json_response(body, headers=self._base_headers())
        if self.config.engine == "vllm":
            data = [_vllm_model_entry(n, int(self._wall_clock())) for n in names]
        else:
            data = [{"id": n, "object": "model", "owned_by": "sim"} for n in names]
        return web.json_response({"object": "list", "data": data}, headers=self._base_headers())

    async def _get_fault(self, request: web.Request) -> web.Response:
        return web.json_response(self._fault.to_json(), headers=self._base_headers())

    async def _get_executions(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"executions": dict(self.executions)}, headers=self._base_headers()
        )

    async def _set_fault(self, request: web.Request) -> web.Response:
        try:
            fault = Fault.from_json(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, FaultError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.set_fault(fault)
        return web.json_response(fault.to_json(), headers=self._base_headers())

    async def _get_concurrency(self, request: web.Request) -> web.Response:
        return web.json_response(self.concurrency.snapshot(), headers=self._base_headers())

    async def _get_requests(self, request: web.Request) -> web.Response:
        since = float(request.query.get("since", "0") or 0)
        kept = self.concurrency.requests_since(since)
        return web.json_response(
            {"requests": [list(r) for r in kept]}, headers=self._base_headers()
        )

    async def _reset_concurrency(self, request: web.Request) -> web.Response:
        self.concurrency.reset_peaks()
        return web.json_response(self.concurrency.snapshot(), headers=self._base_headers())

    # -- inference ---------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "openai-chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "openai-completions")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "anthropic-messages")

    async def _responses_api(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "openai-responses")

    def _error(self, api: ApiKind, status: int, message: str) -> web.Response:
        self.metrics.requests.labels(api=api, code=str(status)).inc()
        body = (
            llamacpp_format.error_body(status, message)
            if self.llamacpp is not None and api != "anthropic-messages"
            else _error_body(api, status, message)
        )
        return web.json_response(body, status=status, headers=self._base_headers())

    def _parse(self, api: ApiKind, raw: bytes) -> _Parsed:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise PromptError(f"body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise PromptError("body must be a JSON object")
        response_id = ""
        if api == "openai-responses":
            earlier = ""
            previous = body.get("previous_response_id")
            if previous is not None:
                if not isinstance(previous, str):
                    raise PromptError("previous_response_id must be a string")
                found = self.responses.get(previous)
                if found is None:
                    raise PreviousResponseMissing(previous)
                earlier = found
            text = responses_prompt(body, earlier)
            response_id = new_response_id()
        else:
            text = canonical_prompt(api, body)
        requested = _requested_tokens(api, body)
        max_output = self.config.max_output
        output = max_output if requested is None else min(requested, max_output)
        model = body.get("model")
        return _Parsed(
            api=api,
            model=model if isinstance(model, str) else "sim",
            stream=body.get("stream") is True,
            prompt_tokens=count_tokens(text),
            hashes=block_hashes(text),
            output_tokens=output,
            requested_tokens=output if requested is None else requested,
            body=body if api == "openai-responses" else None,
            response_id=response_id,
            text=text if api == "openai-responses" else "",
        )

    async def _inference(self, request: web.Request, api: ApiKind) -> web.StreamResponse:
        request_id = request.headers.get("x-request-id", "")
        with self.concurrency.track(request.headers.get(CLASS_HEADER, ""), request_id):
            try:
                response = await self._serve(request, api)
                parent = request.headers.get("traceparent")
                if parent is not None and not response.prepared:
                    # What an engine that traces would take as its span's parent.
                    response.headers[SIM_TRACEPARENT_HEADER] = parent
                return response
            except asyncio.CancelledError:
                # The server cancels the handler when the client disconnects
                # (handler_cancellation): the engine aborts the request.
                self.metrics.disconnects.inc()
                self.metrics.requests.labels(api=api, code="client_closed").inc()
                raise

    async def _serve(self, request: web.Request, api: ApiKind) -> web.StreamResponse:
        while self._fault.mode == "hang" and not self._closing:
            await self._unhang.wait()
        if self._closing:
            return self._error(api, 503, "cluster shutting down")
        fault = self._fault
        if fault.mode == "refuse":
            # Drop the connection without a status line: Envoy sees a connect/reset failure,
            # which is what a dead backend looks like, not an HTTP error it could pass on.
            if request.transport is not None:
                request.transport.abort()
            self.metrics.requests.labels(api=api, code="refused").inc()
            return web.Response(status=503)
        if fault.mode == "error":
            return self._error(api, fault.status, f"injected fault: {fault.status}")
        try:
            parsed = self._parse(api, await request.read())
        except PromptError as exc:
            return self._error(api, 400, str(exc))
        except PreviousResponseMissing as exc:
            self.metrics.requests.labels(api=api, code="404").inc()
            return web.json_response(
                not_found_body(exc.response_id), status=404, headers=self._base_headers()
            )
        if self.llamacpp is not None:
            parsed = dataclasses.replace(parsed, model=(self.config.models or ("sim",))[0])
        elif self.config.models and parsed.model not in self.config.models:
            self.metrics.requests.labels(api=api, code="404").inc()
            return web.json_response(
                _model_not_found(api, parsed.model), status=404, headers=self._base_headers()
            )
        self.executions[request.headers.get("x-request-id", "")] += 1
        if self._fault.mode == "reset":
            if request.transport is not None:
                request.transport.abort()
            self.metrics.requests.labels(api=api, code="reset").inc()
            return web.Response(status=503)

        evictions_before = self.model.cache.evictions
        plan = self.model.admit(
            ModelRequest(parsed.hashes, parsed.prompt_tokens, parsed.output_tokens), self._clock()
        )
        self._record(parsed, plan, self.model.cache.evictions - evictions_before)
        request_id = next(self._ids)
        if parsed.stream:
            return await self._stream(request, parsed, plan, request_id)
        await self._sleep_until(plan.done_at)
        self._finished(parsed, plan, _finish_reason(parsed))
        body = self._full_body(parsed, plan, request_id)
        if self.llamacpp is not None and parsed.api in ("openai-chat", "openai-completions"):
            body["system_fingerprint"] = llamacpp_format.SYSTEM_FINGERPRINT
            body["timings"] = _llamacpp_timings(parsed, plan)
        self._store(parsed, _output_text(0, parsed.output_tokens))
        self.metrics.requests.labels(api=api, code="200").inc()
        headers = self._response_headers(plan, request.headers.get(ORCA_FORMAT_HEADER))
        return web.json_response(body, headers=headers, dumps=_dumps)

    def _record(self, parsed: _Parsed, plan: Plan, evicted: int) -> None:
        metrics = self.metrics
        metrics.prompt_tokens.inc(parsed.prompt_tokens)
        metrics.cached_tokens.inc(plan.cached_tokens)
        metrics.uncached_tokens.inc(plan.uncached_tokens)
        metrics.generation_tokens.inc(parsed.output_tokens)
        if plan.cached_tokens > 0:
            metrics.prefix_hits.inc()
        if evicted:
            metrics.evictions.inc(evicted)
        self.engine_metrics.record(parsed.prompt_tokens, plan.cached_tokens)
        if self.llamacpp is not None:
            prompt_s, predicted_s = _phase_seconds(plan)
            self.llamacpp.record(
                plan.uncached_tokens,
                plan.cached_tokens,
                parsed.output_tokens,
                prompt_s,
                predicted_s,
            )

    def _finished(self, parsed: _Parsed, plan: Plan, reason: str) -> None:
        """A request that ran to its end. A client's disconnect is not one: vLLM drops the
        aborted request's state without counting it in request_success_total."""
        scale = plan.time_scale
        self.engine_metrics.finished(
            FinishedRequest(
                reason=reason,
                prompt_tokens=parsed.prompt_tokens,
                cached_tokens=plan.cached_tokens,
                output_tokens=parsed.output_tokens,
                max_tokens=parsed.requested_tokens,
                queue_s=(plan.prefill_start - plan.arrival) / scale,
                prefill_s=(plan.first_token_at - plan.prefill_start) / scale,
                decode_s=(plan.done_at - plan.first_token_at) / scale,
            )
        )

    async def _sleep_until(self, instant: float) -> None:
        delay = instant - self._clock()
        if delay > 0:
            await asyncio.sleep(delay)

    def _response_headers(self, plan: Plan, orca_format: str | None = None) -> dict[str, str]:
        """``orca_format``: the request's endpoint-load-metrics-format (None on streams: vLLM
        reports only on non-streaming responses)."""
        load = self.model.load(self._clock())
        headers = self._base_headers()
        headers[SIM_TTFT_HEADER] = f"{plan.sim_ttft_s * 1000.0:.3f}"
        headers[SIM_CACHED_HEADER] = str(plan.cached_tokens)
        if self.config.engine == "vllm":
            orca = vllm_orca_header(orca_format, load)
            if orca is not None:
                headers[ORCA_HEADER] = orca
            return headers
        if self.config.engine in ("sglang", "llamacpp"):
            return headers
        cpu = min(1.0, load.inflight / self.config.params.max_concurrency)
        # ORCA native-HTTP ("TEXT") format as Envoy's parser reads it: comma-separated
        # key=value pairs, standard fields by name and custom ones under "named_metrics.";
        # values must be finite and non-negative, and no key may repeat.
        headers[ORCA_HEADER] = (
            f"TEXT cpu_utilization={cpu:.4f}, mem_utilization={load.kv_usage:.4f}, "
            f"named_metrics.kv_cache={load.kv_usage:.4f}, named_metrics.queue={load.queued}, "
            f"named_metrics.inflight={load.inflight}"
        )
        headers[FLEET_LOAD_HEADER] = (
            f"kv={load.kv_usage:.4f},queue={load.queued},inflight={load.inflight}"
        )
        return headers

    def _store(self, parsed: _Parsed, output: str) -> None:
        """Responses API: keep the conversation so far for a later previous_response_id."""
        if parsed.body is not None and parsed.body.get("store", True) is not False:
            self.responses.put(parsed.response_id, parsed.text + f"<|assistant|>{output}\n")

    def _full_body(self, parsed: _Parsed, plan: Plan, request_id: int) -> dict[str, object]:
        text = _output_text(0, parsed.output_tokens)
        finish = _finish_reason(parsed)
        created = int(self._wall_clock())
        if parsed.body is not None:
            return response_object(
                parsed.response_id,
                parsed.body,
                created,
                text=text,
                truncated=_responses_truncated(parsed),
                usage_doc=responses_usage(
                    parsed.prompt_tokens, plan.cached_tokens, parsed.output_tokens
                ),
                model=parsed.model,
            )
        if parsed.api == "anthropic-messages":
            return {
                "id": f"msg_sim{request_id}",
                "type": "message",
                "role": "assistant",
                "model": parsed.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": finish,
                "stop_sequence": None,
                "usage": _anthropic_usage(plan, parsed.output_tokens),
            }
        if parsed.api == "openai-completions":
            return {
                "id": f"cmpl-sim{request_id}",
                "object": "text_completion",
                "created": created,
                "model": parsed.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": _openai_usage(parsed, plan),
            }
        return {
            "id": f"chatcmpl-sim{request_id}",
            "object": "chat.completion",
            "created": created,
            "model": parsed.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            ],
            "usage": _openai_usage(parsed, plan),
        }

    async def _stream(
        self,
        request: web.Request,
        parsed: _Parsed,
        plan: Plan,
        request_id: int,
        extra_headers: Mapping[str, str] | None = None,
    ) -> web.StreamResponse:
        # Headers go out with the first token: until then a real engine has nothing to send,
        # and a long prefill shows up as a slow response start (what Envoy's timeouts see).
        await self._sleep_until(plan.first_token_at)
        headers = self._response_headers(plan)
        headers.update(extra_headers or {})
        response = web.StreamResponse(status=200, headers=headers)
        response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        events: _StreamEvents | _ResponsesStream = _StreamEvents(
            parsed, plan, request_id, int(self._wall_clock()), self.llamacpp is not None
        )
        if parsed.body is not None:
            events = _ResponsesStream(
                parsed,
                plan,
                ResponsesEvents(
                    parsed.response_id, parsed.body, int(self._wall_clock()), parsed.model
                ),
            )
        total = parsed.output_tokens
        per_token = (plan.done_at - plan.first_token_at) / max(1, total - 1)
        step = 1 if per_token <= 0 else max(1, math.ceil(MIN_CHUNK_INTERVAL_S / per_token))
        try:
            await response.prepare(request)
            await response.write(events.opening())
            sent = 1
            while sent < total:
                count = min(step, total - sent)
                await self._sleep_until(plan.first_token_at + (sent + count - 1) * per_token)
                await response.write(events.delta(sent, count))
                sent += count
            await response.write(events.closing())
            await response.write_eof()
            self._store(parsed, _output_text(0, total))
        except ConnectionResetError:
            self.metrics.disconnects.inc()
            self.metrics.requests.labels(api=parsed.api, code="client_closed").inc()
            return response
        self._finished(parsed, plan, _finish_reason(parsed))
        self.metrics.requests.labels(api=parsed.api, code="200").inc()
        return response


@dataclass(frozen=True, slots=True)
class _StreamEvents:
    """The SSE events of one streamed response, in the request's API format."""

    parsed: _Parsed
    plan: Plan
    request_id: int
    created: int
    # llama.cpp puts its timings beside the usage of the final chunk.
    llamacpp: bool = False

    def _openai_chunk(self, choice: dict[str, object] | None) -> dict[str, object]:
        chat = self.parsed.api == "openai-chat"
        chunk: dict[str, object] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-sim{self.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": self.parsed.model,
            "choices": [] if choice is None else [choice],
        }
        if self.llamacpp:
            chunk["system_fingerprint"] = llamacpp_format.SYSTEM_FINGERPRINT
        return chunk

    def _openai_choice(self, text: str, finish: str | None, first: bool) -> dict[str, object]:
        if self.parsed.api == "openai-completions":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        delta: dict[str, object] = {"content": text}
        if first:
            delta = {"role": "assistant", "content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish}

    def opening(self) -> bytes:
        first = _output_text(0, 1)
        if self.parsed.api != "anthropic-messages":
            return _sse(self._openai_chunk(self._openai_choice(first, None, first=True)))
        message: dict[str, object] = {
            "id": f"msg_sim{self.request_id}",
            "type": "message",
            "role": "assistant",
            "model": self.parsed.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _anthropic_usage(self.plan, 1),
        }
        return (
            _sse({"type": "message_start", "message": message}, "message_start")
            + _sse(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
                "content_block_start",
            )
            + self._anthropic_delta(first)
        )

    def _anthropic_delta(self, text: str) -> bytes:
        return _sse(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": text},
            },
            "content_block_delta",
        )

    def delta(self, start: int, count: int) -> bytes:
        text = _output_text(start, count)
        if self.parsed.api == "anthropic-messages":
            return self._anthropic_delta(text)
        return _sse(self._openai_chunk(self._openai_choice(text, None, first=False)))

    def closing(self) -> bytes:
        finish = _finish_reason(self.parsed)
        if self.parsed.api == "anthropic-messages":
            usage = _anthropic_usage(self.plan, self.parsed.output_tokens)
            return (
                _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                + _sse(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": finish, "stop_sequence": None},
                        "usage": usage,
                    },
                    "message_delta",
                )
                + _sse({"type": "message_stop"}, "message_stop")
            )
        finish_chunk = self._openai_chunk(self._openai_choice("", finish, first=False))
        usage_chunk = self._openai_chunk(None)
        usage_chunk["usage"] = _openai_usage(self.parsed, self.plan)
        if self.llamacpp:
            usage_chunk["timings"] = _llamacpp_timings(self.parsed, self.plan)
        return _sse(finish_chunk) + _sse(usage_chunk) + b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class _ResponsesStream:
    """The Responses API's events behind the same three calls as :class:`_StreamEvents`."""

    parsed: _Parsed
    plan: Plan
    events: ResponsesEvents

    def opening(self) -> bytes:
        return self.events.opening(_output_text(0, 1))

    def delta(self, start: int, count: int) -> bytes:
        return self.events.delta(_output_text(start, count))

    def closing(self) -> bytes:
        usage = responses_usage(
            self.parsed.prompt_tokens, self.plan.cached_tokens, self.parsed.output_tokens
        )
        return self.events.closing(_responses_truncated(self.parsed), usage)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


@dataclass(slots=True)
class RunningSimCluster:
    """A sim cluster listening on a socket; ``close()`` stops it."""

    cluster: SimCluster
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return self.cluster.config.name

    async def close(self) -> None:
        self.cluster.release()
        await self.runner.cleanup()


async def start_sim_cluster(
    config: SimClusterConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    clock: Callable[[], float] = time.monotonic,
    registry: CollectorRegistry | None = None,
    shutdown_timeout: float = 1.0,
    access_log: bool = False,
    cluster: SimCluster | None = None,
) -> RunningSimCluster:
    """Start a sim cluster on ``host:port`` (port 0 picks a free port) in the running loop;
    ``cluster`` serves instead of a plain one built from ``config`` (the P/D roles,
    extproc.harness.sim_pd)."""
    if cluster is None:
        cluster = SimCluster(config, clock=clock, registry=registry)
    runner = web.AppRunner(
        cluster.app(),
        shutdown_timeout=shutdown_timeout,
        access_log=log if access_log else None,
        # Header lines up to Envoy's own limit (60 KiB by default): aiohttp's 8 KiB default
        # answered oversized ones itself, in text/plain and before the handler could name the
        # cluster. Envoy refuses what is larger before it reaches any engine.
        max_line_size=64 << 10,
        max_field_size=64 << 10,
        # Real engines abort a request whose client disconnected (vLLM's API server cancels
        # the handler; SGLang checks for the disconnect while it waits): without this, aiohttp
        # would keep "generating" for nobody and count it in flight.
        handler_cancellation=True,
        # Real engines' HTTP servers (uvicorn, for vLLM and SGLang) do not decode a request's
        # content-encoding: a gzip or br body reaches the JSON parser as it is, and the engine
        # answers its own JSON 400. aiohttp would decode it, and answer a body it cannot
        # decode in its own text/plain, before the handler could name the cluster.
        auto_decompress=False,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = int(runner.addresses[0][1])
    return RunningSimCluster(cluster, runner, host, bound_port)

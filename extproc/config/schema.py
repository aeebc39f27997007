"""The fleet.yaml schema, version 1. Defaults live here and nowhere else."""

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


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenerConfig(Strict):
    """Envoy's public listener and its admin interface (admin is always bound to 127.0.0.1).

    Timers are in seconds, 0 = off. An LLM request can prefill for minutes before its first byte
    and then stream for many more, so by default no timer bounds the response side: only
    receiving the request is bounded (RELIABILITY.md lists every timer)."""

    address: str = "127.0.0.1"
    port: Port = 10000
    admin_port: Port = 9901
    # The whole request, retries included, until the last byte of the (streamed) response
    # (Envoy's route timeout; its own default of 15 s is always overridden).
    route_timeout_s: float = Field(default=0.0, ge=0)
    # Each upstream attempt until its response begins (route per_try_timeout); once a byte of
    # the response has reached the client it no longer applies.
    per_try_timeout_s: float = Field(default=0.0, ge=0)
    # No byte in either direction for this long (HCM stream_idle_timeout; Envoy's default is
    # 5 min, which a long prefill or a non-streamed generation can exceed).
    stream_idle_timeout_s: float = Field(default=0.0, ge=0)
    # Receiving the whole request, headers and body (HCM request_timeout). Envoy disarms it once
    # the request has gone upstream or the response began, so it never ends a generation. The
    # default admits a maximum-size body at about 280 KB/s and bounds slow uploads.
    request_receive_timeout_s: float = Field(default=120.0, ge=0)
    # Receiving the request headers (HCM request_headers_timeout): bounds slow-header clients.
    request_headers_timeout_s: float = Field(default=10.0, ge=0)
    # Downstream connections over all Envoy workers (overload manager); beyond it new
    # connections are closed at accept. Worst-case buffered memory is this many times
    # processor.max_body_bytes + 1 MiB.
    max_connections: int = Field(default=10_000, ge=1)
    # Concurrent HTTP/2 streams per client connection (Envoy's default is 2^31 - 1): each may
    # buffer a maximum-size body, so without it the connection limit bounds nothing for HTTP/2
    # clients. Raise it for a trusted proxy in front that multiplexes many requests.
    max_streams_per_connection: int = Field(default=100, ge=1)


class ProcessorConfig(Strict):
    address: str = "127.0.0.1"
    port: Port = 50051
    metrics_port: Port = 9464
    # open: Envoy forwards on the fallback route when the processor is down or slow.
    # closed: Envoy answers 500 (Envoy's own status_on_error default).
    failure_mode: Literal["open", "closed"] = "open"
    # Envoy's default 200 ms is too short to ship a multi-MB body to the processor and back.
    message_timeout_ms: int = Field(default=2000, gt=0)
    max_body_bytes: int = Field(default=32 << 20, gt=0)
    workers: int = Field(default=1, ge=1, le=64)
    # route: set x-fleet-route for Envoy's aggregate clusters (the default).
    # endpoint_picker: act as a Gateway API Inference Extension Endpoint Picker — name the
    # primary's endpoint then the secondary's in x-gateway-destination-endpoint and in the
    # envoy.lb dynamic metadata; 503 when no endpoint is ready.
    # auto: route up to pool_above_clusters clusters, endpoint_picker above. The pair design's
    # Envoy config grows as N·(N-1) aggregate clusters (1.6 s to ready and 285 MB RSS at 64
    # clusters, minutes and GBs at 256); the pool's grows linearly (BENCHMARKS.md, Scale).
    mode: Literal["route", "endpoint_picker", "auto"] = "auto"
    pool_above_clusters: int = Field(default=32, ge=1)
    # Read the upstream's token usage (cached vs uncached input, output) from responses for the
    # cost metrics. Costs one more ext_proc exchange per response (two or more for streams):
    # off by default, measured by `extproc bench overhead --inspect-usage`.
    inspect_usage: bool = False
    # Probe every endpoint's health_path each second (as endpoint_picker mode always does) and
    # place a request whose hash primary has no ready endpoint on the next ready cluster
    # directly, charging that cluster's budget from the start. None (the default): on when any
    # class has a budget, the case where the charge matters. Without probing, a request Envoy
    # fails over is still charged to the cluster that served it once its response begins, and
    # the secondary's budget is exceeded meanwhile by up to the dead primary's class budget.
    # The prober follows Envoy's own health check: out at a refused connection or at the second
    # failed probe in a row, back at the first success (pipeline/endpoint_health.py). It only
    # steers new requests; nothing running is ended or moved.
    probe_clusters: bool | None = None
    # when_needed: a request whose decision needs nothing from its body (it carries the trusted
    # session header and a content-length) is decided at its headers, and Envoy is told not to
    # send the body (one ext_proc exchange, no body copy). Its body is then not checked: bad
    # JSON reaches the upstream, which answers its own 400. always: every inference body is
    # read and validated by the processor (two exchanges). ARCHITECTURE.md, "The header path".
    read_body: Literal["when_needed", "always"] = "when_needed"
    # SIGTERM (a deploy): the replica reports NOT_SERVING and keeps taking new ext_proc streams
    # for drain_delay_s (what Envoy's health checks, 1 s apart, or a Kubernetes endpoint update
    # need to send new streams elsewhere), then refuses new ones and keeps serving the streams
    # of requests in flight until they end, at most drain_timeout_s more. None: the longest
    # request the config allows (extproc.config.drain), unbounded when no timer bounds one.
    drain_delay_s: float = Field(default=5.0, ge=0)
    drain_timeout_s: float | None = Field(default=None, ge=0)
    # true: the Envoy this processor serves ends each ext_proc stream gracefully (the runtime
    # flag envoy.reloadable_features.ext_proc_graceful_grpc_close, which `extproc envoy`,
    # the harness and `extproc gateway`'s EnvoyProxy render when this is true): a half-close,
    # then it waits for the processor's status. The processor answers it at once with OK.
    # false: an Envoy without the flag half-closes and resets at once; the processor then
    # waits up to 50 ms for that reset instead of answering (grpc/grpc#43360 leaks memory when
    # a status meets a reset), at ~300 us of CPU per request. ARCHITECTURE.md, "End of a stream".
    envoy_graceful_close: bool = True


class ServedModelConfig(Strict):
    """A model one cluster serves (vLLM's --served-model-name): a request naming it or one of
    its aliases may be placed there. ``adapters`` are LoRA adapters of this base model loaded on
    the cluster: any cluster of the base may serve them, these are preferred."""

    name: ModelName
    aliases: list[ModelName] = []
    adapters: list[ModelName] = []


class ClusterConfig(Strict):
    name: ClusterName
    endpoints: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-\[\]:]+:[0-9]{1,5}$")]] = Field(
        min_length=1
    )
    weight: float = Field(default=1.0, gt=0)
    health_path: str = Field(default="/health", pattern=r"^/")
    # The inference engine behind the endpoints: which /metrics names engine_metrics scrapes
    # (extproc.core.engine_metrics). vLLM is the default, as in the Inference Extension.
    engine: Literal["vllm", "sglang"] = "vllm"
    metrics_path: str = Field(default="/metrics", pattern=r"^/")
    # Disaggregated prefill/decode (extproc.core.pd; DisaggregationConfig below).
    role: Literal["both", "prefill", "decode"] = "both"
    topology: dict[TopologyKey, TopologyLabel] = {}
    # disaggregation.protocol "sglang", prefill clusters: the port of the SGLang prefill
    # servers' bootstrap server (--disaggregation-bootstrap-port; None: sent as null, the
    # server's default 8998), as SGLang's router takes it with ``--prefill URL PORT``.
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    # The models this cluster serves (ServedModelConfig; a bare name is a model without aliases
    # or adapters). Empty on every cluster: the fleet is model-agnostic, as before models
    # existed (every request is placed whatever its "model" says).
    models: list[ModelName | ServedModelConfig] = []


class SessionConfig(Strict):
    # A trusted header: the edge/auth layer sets it; clients' own values must be overwritten there.
    header: HeaderName | None = "x-session-id"
    body_fields: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")]] = [
        "prompt_cache_key",
        # Responses API: a stored conversation (a string id or {"id": ...}). Turns chained by
        # previous_response_id carry only the new input, so the prefix key cannot follow them.
        "conversation",
        "conversation.id",
        "user",
        "metadata.user_id",
        "metadata.session_id",
    ]
    # Trusted tenant-tier header, set by the auth layer; selects tier-specific classes.
    tier_header: HeaderName | None = None
    # The fleet secret that keys session labels (extproc.config.label_secret): read from this
    # file if set, else from this environment variable, else drawn at random per process.
    label_secret_file: str | None = None
    label_secret_env: str | None = "FLEET_SESSION_SECRET"
    # Responses API turns chained by previous_response_id (and no conversation) follow the
    # session of the response they name (extproc.core.response_links). The links are learnt
    # from responses, so this acts only with processor.inspect_usage on; a link lives
    # response_link_ttl_s (in Redis too, when configured).
    follow_previous_response: bool = True
    response_link_ttl_s: float = Field(default=86400.0, gt=0)


class PrefixConfig(Strict):
    # "chain": the chain key (extproc.core.chains, default); "opening": the older key, system
    # text + the first first_message_chars of the first message (kept for comparison).
    key: Literal["chain", "opening"] = "chain"
    system_chars: int = Field(default=65536, ge=0)
    first_message_chars: int = Field(default=1024, ge=1)
    prompt_chars: int = Field(default=4096, ge=1)
    bytes_per_token: float = Field(default=4.0, gt=0)
    # Chain key: at most this many bytes of the canonical prompt are hashed (CPU bound).
    scan_bytes: int = Field(default=128 * 1024, ge=1024)
    # Distinct conversations after which a shared opening becomes common (spread), if they
    # are also more of the new conversations than chance gives a chain at nested_share of one
    # cluster's fair share (a document read by a few requests at a time stays together) ...
    common_after: int = Field(default=4, ge=2)
    # ... and after which a chain below a common one (a shared document) may, if it also
    # carries more than nested_share of one cluster's fair share of new conversations.
    nested_common_after: int = Field(default=16, ge=2)
    nested_share: float = Field(default=0.4, gt=0)
    # With Redis: how often replicas exchange the common chains they learnt.
    sync_interval_s: float = Field(default=1.0, gt=0)


class BudgetConfig(Strict):
    """Per cluster, per class. 0 = no cap."""

    max_inflight_tokens: int = Field(default=0, ge=0)
    max_concurrent: int = Field(default=0, ge=0)
    tokens_per_second: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    burst_tokens: int = Field(default=0, ge=0)


class WaitConfig(Strict):
    """How an over-budget request of the class waits for budget (extproc/core/flow.py).

    Unset, the class's size decides (extproc.core.flow.default_max_wait_s): a class bounded at
    8,192 input tokens or less barely waits (0.5 s), larger ones and the catch-all (long and
    agentic requests) wait up to 30 s. 0 s = never wait: the 429 is immediate. A request whose
    estimated wait exceeds the maximum is refused at once either way."""

    max_wait_s: float | None = Field(default=None, ge=0, le=3600, allow_inf_nan=False)
    # Waiters per (cluster, class): fleet-wide with Redis (one queue for every replica), on
    # one processor replica without it; more get an immediate 429.
    max_queue: int = Field(default=64, ge=1)


class ClassConfig(Strict):
    name: ClassName
    # Exclusive upper bound on estimated input tokens; omit on the catch-all last class.
    max_input_tokens: int | None = Field(default=None, gt=0)
    tiers: list[str] = []
    eligible: list[str] = []
    budget: BudgetConfig = BudgetConfig()
    # P/D: prefill on a prefill-role cluster, decode on this class's (decode) clusters.
    disaggregated: bool = False
    prefill_eligible: list[str] = []  # empty: every prefill-role cluster
    # The prefill pool's budget, per prefill cluster, in prefill (input) tokens; ``budget``
    # stays the decode pool's.
    prefill_budget: BudgetConfig = BudgetConfig()
    wait: WaitConfig = WaitConfig()

    @property
    def max_wait_s(self) -> float:
        """``wait.max_wait_s``, or the shipped default for the class's size when unset."""
        if self.wait.max_wait_s is None:
            return default_max_wait_s(self.max_input_tokens)
        return self.wait.max_wait_s


class FlowConfig(Strict):
    """Flow control before a 429 (ARCHITECTURE.md, "Flow control")."""

    # A new session (no seen mark, no override) whose primary's class budget is full runs on
    # its next hash candidate with room, remembered like a spill (affinity.override_ttl_s).
    # Off, it waits or gets its 429 on its primary like an existing session.
    place_new_sessions: bool = True
    # Trusted header naming the tenant for fair queueing; unset: the tier is the tenant.
    tenant_header: HeaderName | None = None
    # A tenant's share of a contended queue, by tier (default 1).
    tier_weights: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = {}
    # With Redis: how often the head waiter re-checks the shared ledger if no release
    # notice (pub/sub) arrived, covering lost notices and lapsed leases.
    redis_poll_ms: int = Field(default=500, ge=10)
    # With Redis: wake waiters by the release notices release.lua publishes (pub/sub); off,
    # they re-check every redis_poll_ms only (`extproc bench wake` compares the two).
    redis_notices: bool = True


class RedisConfig(Strict):
    url: str | None = None
    # When Redis cannot be reached: "local" admits against this replica's share of each budget
    # (budget / replicas); "closed" rejects with 503.
    on_unavailable: Literal["local", "closed"] = "local"
    replicas: int = Field(default=1, ge=1)
    timeout_ms: int = Field(default=50, gt=0)
    lease_ttl_s: float = Field(default=30.0, gt=0)
    key_prefix: str = "fleet"


class PricesConfig(Strict):
    """$ per million tokens, for the cost-saved metric and reports."""

    cached_input: float = 0.30
    uncached_input: float = 3.00
    output: float = 15.00


class ModelConfig(Strict):
    """Fleet-wide settings of one model or adapter, by its canonical name (optional).

    A model listed here that no cluster serves is known but unavailable (503 with a retry hint,
    not 404): what a fleet says while the last cluster of a model is being replaced."""

    name: ModelName
    # An adapter served by every cluster of its base (none has it loaded yet).
    base: ModelName | None = None
    # $ per million tokens for this model's cost metrics; unset: the fleet's `prices`.
    prices: PricesConfig | None = None
    # A class budget for this model, per class name, replacing the class's own budget (a 70B
    # model's KV per token is not an 8B model's). Its compartment is (class, model, cluster).
    budgets: dict[ClassName, BudgetConfig] = {}


class ModelRoutingConfig(Strict):
    # Retry-After of the 503 for a known model with no cluster to serve it.
    unavailable_retry_after_s: int = Field(default=5, ge=1, le=60)
    # Also read every endpoint's GET /v1/models on this interval and add what it lists to its
    # cluster's models (extproc.pipeline.model_discovery). clusters[].models stays the floor:
    # discovery only adds, and a name the config gives a meaning (alias, adapter) keeps it.
    discovery: bool = False
    discovery_interval_s: float = Field(default=30.0, gt=0)
    discovery_timeout_s: float = Field(default=2.0, gt=0)


class AffinityConfig(Strict):
    """Load- and pressure-aware affinity (extproc.core.affinity). Off by default: consistent
    hashing then stays the policy, with only bounded-load placement of new sessions
    (balance_factor, extproc.core.affinity.place_bounded: no extra exchange). On, Envoy also
    sends the response headers to the processor (the clusters' load reports ride on them):
    one more gRPC exchange per request."""

    enabled: bool = False
    # A cluster is saturated when its requests in flight exceed this factor x the mean over
    # the session's candidates, and at least min_inflight (an idle fleet has no "load").
    saturation_factor: float = Field(default=1.25, gt=1)
    min_inflight: int = Field(default=4, ge=1)
    # KV use at which a cluster takes no new sessions (its existing ones stay) ...
    kv_pressure_threshold: float = Field(default=0.85, gt=0, le=1)
    # ... and at which its existing sessions migrate away (accepting one re-prefill each).
    kv_migrate_threshold: float = Field(default=0.97, gt=0, le=1)
    # A session not seen for this long is new (it may be placed off its hash primary).
    new_session_ttl_s: float = Field(default=600.0, gt=0)
    # How long a spilled / migrated session is remembered after its last refresh.
    override_ttl_s: float = Field(default=1800.0, gt=0)
    # Load reports older than this are ignored (a cluster that went quiet).
    signal_max_age_s: float = Field(default=10.0, gt=0)
    # A prefix key carrying more than this share of its hash primary's load is spread over
    # its top hot_key_spread candidates (fewer when its class has fewer clusters), once it
    # has hot_key_min_requests recent requests.
    hot_key_share: float = Field(default=0.5, gt=0, le=1)
    hot_key_spread: int = Field(default=3, ge=2)
    hot_key_min_requests: float = Field(default=20.0, ge=1)
    hot_key_half_life_s: float = Field(default=10.0, gt=0)
    # Bounded-load placement of new sessions: a new session starts on the first candidate in
    # hash order whose recent requests (decayed, half-life balance_half_life_s) stay within
    # balance_factor x the mean; its later turns follow (remembered like a spill). 0: off.
    # Unset: DEFAULT_BALANCE_FACTOR (1.1) wherever a later turn finds the spill (one replica,
    # redis.replicas 1, or the replicas share overrides through redis.url), else off: with
    # several replicas and memory only, a later turn on another replica would go back to the
    # hash primary, away from its cache (extproc.config.runtime.balance_factor).
    # Applies with `enabled` false too (extproc.core.affinity.place_bounded): its counts are the
    # processor's own placements, so it needs no response phase; the session lookup it reads
    # is the one flow control's placement makes anyway, and a spill costs one store write.
    # Sessions named by a trusted header or body field are bounded too when new: a new
    # conversation has no cache anywhere yet, so where it starts is free; once seen it never
    # moves for balance (hot-key spreading, affinity-only, never applies to them).
    balance_factor: float | None = Field(default=None, ge=0)
    balance_half_life_s: float = Field(default=60.0, gt=0)
    # Response header naming the cluster that served (the simulated cluster sends it). With
    # it, a load report is credited to the right cluster and a failover is seen; without it
    # reports are credited to the cluster the processor chose.
    served_by_header: HeaderName | None = "x-served-by"
    # Read load reports (ORCA endpoint-load-metrics, x-fleet-load) from response headers. Off,
    # with engine_metrics scraping on, load comes from the engines' /metrics alone.
    load_from_response_headers: bool = True
    # Sessions remembered in memory per replica (seen marks and overrides); the oldest go first.
    max_sessions: int = Field(default=1_000_000, ge=1)


class EngineMetricsConfig(Strict):
    """Scrape every endpoint's Prometheus /metrics for its load (extproc.pipeline.
    engine_scraper): load-aware affinity then needs no load header in responses, so it works
    with streams and with engines that send none. The Inference Extension scrapes every 50 ms
    and ignores metrics older than 2 s."""

    enabled: bool = False
    interval_ms: int = Field(default=100, gt=0)
    # A cluster whose newest scrape is older than this has no scraped load (not a stale one).
    max_age_ms: int = Field(default=2000, gt=0)
    timeout_ms: int = Field(default=1000, gt=0)


class EnginesConfig(Strict):
    """How a session's requests spread over its cluster's endpoints: each endpoint is an engine
    with its own KV cache, so spraying a session over them re-prefills it on each (issue 22).

    sticky: one engine per session, turn after turn. Route mode: every cluster balances with
    Envoy's Maglev (or ring hash) on ``x-fleet-engine-key`` (set by the processor);
    endpoint-picker mode: the processor's rendezvous choice (extproc.core.endpoints).
    round_robin: Envoy's round
    robin over the cluster's endpoints (the behaviour before engine stickiness), and in
    endpoint-picker mode an engine drawn per request.
    """

    affinity: Literal["sticky", "round_robin"] = "sticky"
    # Route mode: Envoy's consistent hash inside each cluster. Maglev: measured on Envoy 1.40,
    # an engine removed or added moved 0-1 % of the other engines' sessions; ring hash moved
    # 10-13 % of them (its ring is re-divided among the engines; render.envoy._engine_lb).
    envoy_policy: Literal["maglev", "ring_hash"] = "maglev"
    # Bounded load: an engine holding more than balance_factor x its cluster's mean in-flight
    # requests passes a new request to the session's next engine in the same cluster (Envoy's
    # hash_balance_factor, in percent; the processor's own bound in endpoint-picker mode).
    # None: no bound (a hot session can pile onto one engine).
    balance_factor: float | None = Field(default=1.25, ge=1.0, le=100.0)
    # Endpoint-picker mode: the bound applies only to an engine holding at least this many
    # requests (Envoy's hash_balance_factor has no such floor).
    min_inflight: int = Field(default=4, ge=1)


def _default_classes() -> list[ClassConfig]:
    return [
        ClassConfig(name="short", max_input_tokens=2048),
        ClassConfig(name="medium", max_input_tokens=100_000),
        ClassConfig(name="long"),
    ]


class TopologyLevel(Strict):
    # A label key clusters carry under ``topology`` (e.g. nvlink, island).
    name: TopologyKey
    # KV-transfer bandwidth between two hosts whose narrowest shared label is this one.
    gbytes_per_s: float = Field(gt=0, allow_inf_nan=False)


class TopologyConfig(Strict):
    """The fabric, narrowest level first (e.g. an NVLink domain, then an InfiniBand island)."""

    levels: list[TopologyLevel] = []
    # Between hosts sharing no level (the spine / data-centre network).
    cross_gbytes_per_s: float = Field(default=12.5, gt=0, allow_inf_nan=False)


class DisaggregationConfig(Strict):
    """How the prefill endpoint is chosen (extproc.core.pd) and the KV size the simulator,
    benchmarks and ``explain`` use to cost the transfer. The pair is signalled with llm-d's
    ``x-prefiller-host-port`` request header, read by the decode-side routing sidecar."""

    # A hashed prefill endpoint with at least min_inflight prefills in flight, and more than
    # this factor x the mean over the prefill endpoints of the decode target's island, yields
    # to the least loaded of them (prefill is compute-bound: one in flight is a queue).
    saturation_factor: float = Field(default=1.25, gt=1)
    min_inflight: int = Field(default=1, ge=1)
    # Off: no ready prefiller in any level shared with the decode target -> colocated prefill.
    cross_island: bool = True
    # The topology level whose narrower levels are pooled with it into one candidate group
    # (extproc.core.pd); None: the widest level (the island). The narrowest level keeps every
    # level apart.
    group_level: TopologyKey | None = None
    # Off: the prefill endpoint is chosen by prefix affinity and load over the whole pool,
    # ignoring topology (the topology-blind baseline of `extproc bench pd`).
    topology_aware: bool = True
    # KV bytes per prompt token: 80 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes for a
    # 70B GQA model in fp16 (1.34 GB at 4,096 tokens).
    kv_bytes_per_token: int = Field(default=327_680, gt=0)
    # How the pair reaches the data path. "llm-d": the x-prefiller-host-port request header,
    # for llm-d's routing sidecar in the decode pod (which runs the prefill round trip).
    # "sglang": SGLang's router protocol: bootstrap_host / bootstrap_port / bootstrap_room in
    # the JSON body, and the same body sent to the prefill server too (an Envoy request mirror
    # to the chosen prefill endpoint; the decode response is the answer).
    protocol: Literal["llm-d", "sglang"] = "llm-d"


class FleetConfig(Strict):
    version: Literal[1]
    listener: ListenerConfig = ListenerConfig()
    processor: ProcessorConfig = ProcessorConfig()
    clusters: list[ClusterConfig] = Field(min_length=1)
    session: SessionConfig = SessionConfig()
    prefix: PrefixConfig = PrefixConfig()
    classes: list[ClassConfig] = Field(default_factory=_default_classes, min_length=1)
    redis: RedisConfig = RedisConfig()
    prices: PricesConfig = PricesConfig()
    affinity: AffinityConfig = AffinityConfig()
    engine_metrics: EngineMetricsConfig = EngineMetricsConfig()
    topology: TopologyConfig = TopologyConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    flow: FlowConfig = FlowConfig()
    engines: EnginesConfig = EnginesConfig()
    models: list[ModelConfig] = []
    model_routing: ModelRoutingConfig = ModelRoutingConfig()

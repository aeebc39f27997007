"""The compiled, immutable runtime object the processor serves from; swapped whole on reload.

Everything the serving path reads per request is compiled here once: placement, classes and
budgets, key rules, affinity parameters, prices, the Redis settings with the command line's
override applied (:class:`Overrides`), and the response headers the pipeline reads. The pydantic
model stays attached (``config``) for the renderers and for process set-up, not for requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from extproc.config.label_secret import resolve_label_secret
from extproc.config.schema import (
    AffinityConfig,
    FleetConfig,
    FlowConfig,
    PricesConfig,
    ProcessorConfig,
    TenantLimitConfig,
)
from extproc.core.affinity import AffinityParams
from extproc.core.chains import ChainParams, ChainSketch
from extproc.core.decide import Policy
from extproc.core.endpoints import EngineChoice
from extproc.core.facts import ParseLimits
from extproc.core.fleet import Budget, Cluster, RequestClass
from extproc.core.flow import Fairness, FlowParams, TenantFallback, TenantLimit, WaitPolicy
from extproc.core.keys import KeyRules
from extproc.core.load import LOAD_HEADERS
from extproc.core.models import (
    Candidates,
    Catalog,
    ModelPool,
    ServedModel,
    build_catalog,
    candidates,
    loaded_engines,
    model_pools,
    with_discovered,
)
from extproc.core.pd import (
    PdPlan,
    PrefillEndpoint,
    PrefillParams,
    Topology,
    prefill_class_name,
)
from extproc.core.placement import Rendezvous
from extproc.core.relief import ReliefParams
from extproc.core.tenants import tenant_key
from extproc.core.usage import Prices


@dataclass(frozen=True, slots=True)
class Overrides:
    """Settings the command line or the environment override, resolved in one place
    (``extproc serve``: ``--redis-url``, else ``$FLEET_REDIS_URL``, else ``redis.url``)."""

    redis_url: str | None = None


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """fleet.yaml's ``redis:`` with the override applied; ``url`` None = in-memory only."""

    url: str | None = None
    key_prefix: str = "fleet"
    timeout_s: float = 0.05
    lease_ttl_s: float = 30.0
    on_unavailable: Literal["local", "closed"] = "local"
    replicas: int = 1


@dataclass(frozen=True, slots=True)
class Runtime:
    config: FleetConfig
    version: str
    clusters: tuple[Cluster, ...]
    policy: Policy
    key_rules: KeyRules
    parse_limits: ParseLimits
    endpoints: Mapping[str, tuple[str, ...]]
    affinity: AffinityParams = field(default_factory=AffinityParams)
    label_secret_source: str = "process"  # file | env | process (extproc.config.label_secret)
    redis: RedisSettings = field(default_factory=RedisSettings)
    prices: Prices = field(default_factory=Prices)
    # Per canonical model where fleet.yaml's models[] sets prices; others use ``prices``.
    model_prices: Mapping[str, Prices] = field(default_factory=lambda: MappingProxyType({}))
    # The canonical models fleet.yaml names (not discovery's additions): the values the cost
    # metrics' model label may take (model_label).
    configured_models: frozenset[str] = frozenset()
    # The pool data path, model-aware fleets: canonical model -> its base model's pool (an
    # Envoy cluster of the model's endpoints), from fleet.yaml's lists only: discovery never
    # changes what Envoy has (core.models.model_pools).
    model_pools: Mapping[str, ModelPool] = field(default_factory=lambda: MappingProxyType({}))
    # LoRA adapter -> the endpoints listing it at /v1/models (model discovery): the engines it
    # is loaded on, preferred where the processor names the engine (core.endpoints).
    adapter_engines: Mapping[str, frozenset[str]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # The endpoints that answered model discovery's last poll with a list: live as far as the
    # processor knows without its prober (route mode names adapter engines among them).
    listing_endpoints: frozenset[str] = frozenset()
    endpoint_picker: bool = False  # processor.mode, auto resolved (picks_endpoints)
    # Engine choice inside a cluster (fleet.yaml engines; extproc.core.endpoints).
    engines: EngineChoice = field(default_factory=EngineChoice)
    inspect_usage: bool = False
    # processor.envoy_graceful_close: Envoy half-closes and waits for the status, so a stream
    # ends at the half-close without waiting for a reset (protocol/server.py).
    envoy_graceful_close: bool = True
    # How long a learnt response link lives; None: previous_response_id is not followed
    # (session.follow_previous_response off, or no response inspection to learn links from).
    response_link_ttl_s: float | None = None
    # Decide at the request headers when the body adds nothing (processor.read_body and a
    # session header configured; extproc.core.facts.header_facts says per request). A policy
    # that reads the body (e.g. placement by model) must turn this off.
    decide_at_headers: bool = False
    # Bound of the per-replica session memory (affinity.max_sessions).
    max_sessions: int = 1_000_000
    # Relief (extproc.core.relief): when a hot cluster's least active sessions move. Set when
    # gpu_health watches a GPU, or for KV pressure (kv_relief_at). None: nothing is watched.
    relief: ReliefParams | None = None
    # With affinity off and engine_metrics on: the scraped KV use (affinity.kv_migrate_threshold)
    # at which a cluster is hot (no new sessions, relieved as for a GPU). None: not watched.
    kv_relief_at: float | None = None
    served_by_header: str | None = "x-served-by"
    # The response headers the pipeline reads when it reads any: load reports, the serving
    # cluster's name, the content type (SSE or not, for usage inspection).
    response_headers: tuple[str, ...] = (*LOAD_HEADERS, "x-served-by", "content-type")
    # Disaggregated prefill/decode (extproc.core.pd); None when no class is disaggregated.
    pd: PdPlan | None = None
    flow: FlowParams = field(default_factory=FlowParams)
    # With Redis: the head waiter's re-check period when no release notice arrives.
    flow_redis_poll_s: float = 0.5
    flow_redis_notices: bool = True

    @property
    def cluster_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.clusters)

    def model_label(self, model: str) -> str:
        """The cost metrics' model label: the canonical model when fleet.yaml names it,
        "other" for a model only discovery found (endpoints may list anything), "" in a
        model-agnostic fleet. Bounded by the config."""
        if not model or model in self.configured_models:
            return model
        return "other"

    @property
    def response_phases(self) -> bool:
        """Whether the processor reads inference responses (their headers, at least): for load
        reports (affinity), usage, a budget charge that must follow a failover, or P/D's
        sidecar status. The rendered filter skips response phases by default and the
        processor asks for them per inference request (a mode override), so that nothing
        else, above all Envoy's own answer to a malformed request, waits on the processor."""
        budgets = any(c.budget.enforced for c in self.policy.all_classes())
        return self.affinity.enabled or self.inspect_usage or budgets or self.pd is not None

    @property
    def probes_clusters(self) -> bool:
        """Whether the processor probes every endpoint to place around a dead primary
        (processor.probe_clusters; by default when a class has a budget, so a secondary's
        budget holds while it carries a dead primary's sessions)."""
        setting = self.config.processor.probe_clusters
        if setting is None:
            return any(c.budget.enforced for c in self.policy.all_classes())
        return setting


def compile_runtime(
    cfg: FleetConfig, raw: bytes | None = None, overrides: Overrides | None = None
) -> Runtime:
    overrides = overrides or Overrides()
    clusters = tuple(
        Cluster(c.name, tuple(c.endpoints), c.weight, c.health_path) for c in cfg.clusters
    )
    weights = {c.name: c.weight for c in clusters}
    classes = tuple(
        RequestClass(
            name=c.name,
            max_input_tokens=c.max_input_tokens,
            tiers=frozenset(c.tiers),
            eligible=tuple(c.eligible),
            budget=Budget(
                c.budget.max_inflight_tokens,
                c.budget.max_concurrent,
                c.budget.tokens_per_second,
                c.budget.burst_tokens,
            ),
            wait=WaitPolicy(c.max_wait_s, c.wait.max_queue),
        )
        for c in cfg.classes
    )
    # Prefill-only clusters never take a request (or a session) themselves: the decode-side
    # sidecar sends them the prefill half (extproc.core.pd).
    roles = {c.name: c.role for c in cfg.clusters}
    everyone = Rendezvous.of([(c.name, c.weight) for c in clusters if roles[c.name] != "prefill"])
    placers = {
        cls.name: Rendezvous.of([(n, weights[n]) for n in cls.eligible])
        if cls.eligible
        else everyone
        for cls in classes
    }
    catalog = compile_catalog(cfg)
    model_placers, model_classes = compile_model_policy(cfg, catalog, classes, weights)
    material = raw if raw is not None else cfg.model_dump_json().encode()
    served = cfg.affinity.served_by_header
    label_secret = resolve_label_secret(cfg.session)
    return Runtime(
        config=cfg,
        version=hashlib.sha256(material).hexdigest()[:12],
        clusters=clusters,
        policy=Policy(
            classes,
            MappingProxyType(placers),
            catalog,
            model_placers,
            model_classes,
            cfg.model_routing.unavailable_retry_after_s,
        ),
        key_rules=KeyRules(
            header=cfg.session.header,
            body_fields=tuple(tuple(f.split(".")) for f in cfg.session.body_fields),
            tier_header=cfg.session.tier_header,
            system_chars=cfg.prefix.system_chars,
            first_message_chars=cfg.prefix.first_message_chars,
            prompt_chars=cfg.prefix.prompt_chars,
            label_secret=label_secret.value,
            prefix_key=cfg.prefix.key,
            chain=ChainParams(
                scan_bytes=cfg.prefix.scan_bytes,
                common_after=cfg.prefix.common_after,
                nested_common_after=cfg.prefix.nested_common_after,
                nested_share=cfg.prefix.nested_share,
                clusters=len(clusters),
            ),
        ),
        parse_limits=ParseLimits(cfg.processor.max_body_bytes, cfg.prefix.bytes_per_token),
        endpoints=MappingProxyType({c.name: c.endpoints for c in clusters}),
        affinity=affinity_params(cfg.affinity, balance_factor(cfg, overrides.redis_url)),
        label_secret_source=label_secret.source,
        redis=RedisSettings(
            url=overrides.redis_url or cfg.redis.url,
            key_prefix=cfg.redis.key_prefix,
            timeout_s=cfg.redis.timeout_ms / 1000,
            lease_ttl_s=cfg.redis.lease_ttl_s,
            on_unavailable=cfg.redis.on_unavailable,
            replicas=cfg.redis.replicas,
        ),
        prices=_prices(cfg.prices),
        model_prices=MappingProxyType(
            {m.name: _prices(m.prices) for m in cfg.models if m.prices is not None}
        ),
        configured_models=frozenset(catalog.models),
        model_pools=model_pools(catalog),
        endpoint_picker=picks_endpoints(cfg.processor, len(clusters)),
        engines=EngineChoice(
            sticky=cfg.engines.affinity == "sticky",
            balance=cfg.engines.balance_factor,
            min_inflight=cfg.engines.min_inflight,
            # Only a secret the replicas share keeps the key equal across them (engine_key).
            key_secret=label_secret.value if label_secret.source != "process" else b"",
        ),
        inspect_usage=cfg.processor.inspect_usage,
        envoy_graceful_close=cfg.processor.envoy_graceful_close,
        response_link_ttl_s=(
            cfg.session.response_link_ttl_s
            if cfg.session.follow_previous_response and cfg.processor.inspect_usage
            else None
        ),
        decide_at_headers=(
            cfg.processor.read_body == "when_needed"
            and cfg.session.header is not None
            # SGLang's P/D fields are written into the body: it must reach the processor.
            and not (
                cfg.disaggregation.protocol == "sglang"
                and any(c.disaggregated for c in cfg.classes)
            )
        ),
        max_sessions=cfg.affinity.max_sessions,
        relief=relief_params(cfg),
        kv_relief_at=kv_relief_at(cfg),
        served_by_header=served,
        pd=pd_plan(cfg, classes),
        response_headers=(
            *(LOAD_HEADERS if cfg.affinity.load_from_response_headers else ()),
            *([served] if served else []),
            "content-type",
        ),
        flow=flow_params(cfg.flow),
        flow_redis_poll_s=cfg.flow.redis_poll_ms / 1000,
        flow_redis_notices=cfg.flow.redis_notices,
    )


def _limit(own: TenantLimitConfig, default: TenantLimit) -> TenantLimit:
    return TenantLimit(
        own.max_concurrent if own.max_concurrent is not None else default.max_concurrent,
        own.tokens_per_minute if own.tokens_per_minute is not None else default.tokens_per_minute,
    )


def flow_params(flow: FlowConfig) -> FlowParams:
    """fleet.yaml's ``flow:`` compiled; named tenants are keyed as the pipeline keys them."""
    default = TenantLimit(flow.tenant_limit.max_concurrent, flow.tenant_limit.tokens_per_minute)
    return FlowParams(
        place_new_sessions=flow.place_new_sessions,
        tenant_header=flow.tenant_header,
        tier_weights=MappingProxyType(dict(flow.tier_weights)),
        fairness=Fairness(flow.fairness),
        output_weight=flow.output_weight,
        tenant_fallback=TenantFallback(flow.tenant_fallback),
        tenant_weights=MappingProxyType(
            {tenant_key(n): t.weight for n, t in flow.tenants.items() if t.weight is not None}
        ),
        tenant_limit=default,
        tenant_limits=MappingProxyType(
            {tenant_key(n): _limit(t, default) for n, t in flow.tenants.items()}
        ),
        tenant_metrics_top=flow.tenant_metrics_top,
    )


def picks_endpoints(processor: ProcessorConfig, n_clusters: int) -> bool:
    """The data path a mode means for a fleet of ``n_clusters``: the pool (endpoint picking)
    or the (primary, secondary) aggregate clusters. auto takes the pool above the crossover."""
    if processor.mode == "auto":
        return n_clusters > processor.pool_above_clusters
    return processor.mode == "endpoint_picker"


def _prices(cfg: PricesConfig) -> Prices:
    return Prices(cfg.cached_input, cfg.uncached_input, cfg.output)


def _served(cfg: FleetConfig) -> list[tuple[str, list[ServedModel]]]:
    return [
        (
            c.name,
            [
                ServedModel(m)
                if isinstance(m, str)
                else ServedModel(m.name, tuple(m.aliases), tuple(m.adapters))
                for m in c.models
            ],
        )
        for c in cfg.clusters
    ]


def compile_catalog(cfg: FleetConfig) -> Catalog:
    """fleet.yaml's models: each cluster's served models and the fleet-wide declared ones."""
    return build_catalog(_served(cfg), [(m.name, m.base) for m in cfg.models])


Discovered = Mapping[str, frozenset[tuple[str, str | None]]]


def with_discovered_models(
    runtime: Runtime, discovered: Discovered, by_endpoint: Discovered | None = None
) -> Runtime:
    """The runtime with what the endpoints' /v1/models list added to its clusters' models
    (fleet.yaml's list is the floor; extproc.core.models.with_discovered). Recomputed from the
    config each time, so it may be applied to a runtime that already had discoveries.
    ``by_endpoint``: the same lists per endpoint, for the engines each adapter is loaded on."""
    cfg = runtime.config
    if not cfg.model_routing.discovery:
        return runtime
    configured = compile_catalog(cfg)
    if not configured.enabled:
        return runtime
    served = with_discovered(_served(cfg), configured, discovered)
    catalog = build_catalog(served, [(m.name, m.base) for m in cfg.models])
    policy = runtime.policy
    weights = {c.name: c.weight for c in runtime.clusters}
    placers, classes = compile_model_policy(cfg, catalog, policy.classes, weights)
    return dataclasses.replace(
        runtime,
        policy=dataclasses.replace(
            policy, models=catalog, model_placers=placers, model_classes=classes
        ),
        adapter_engines=loaded_engines(catalog, by_endpoint or {}),
        listing_endpoints=frozenset(e for e, listed in (by_endpoint or {}).items() if listed),
    )


def compile_model_policy(
    cfg: FleetConfig,
    catalog: Catalog,
    classes: tuple[RequestClass, ...],
    weights: Mapping[str, float],
) -> tuple[Mapping[tuple[str, str], Candidates], Mapping[tuple[str, str], RequestClass]]:
    """One placer per (class, model) with somewhere to go, and the classes that a model's own
    budget replaces (named "<class>@<model>": their own ledger compartments)."""
    placers: dict[tuple[str, str], Candidates] = {}
    # Prefill-only clusters never take a request themselves (extproc.core.pd).
    roles = {c.name: c.role for c in cfg.clusters}
    weights = {n: w for n, w in weights.items() if roles.get(n) != "prefill"}
    for model in catalog.models.values():
        for cls in classes:
            found = candidates(model, cls.eligible, weights)
            if found is not None:
                placers[(cls.name, model.name)] = found
    budgets = {m.name: m.budgets for m in cfg.models}
    per_model: dict[tuple[str, str], RequestClass] = {}
    for name, by_class in budgets.items():
        for cls in classes:
            b = by_class.get(cls.name)
            if b is not None and name in catalog.models:
                per_model[(cls.name, name)] = dataclasses.replace(
                    cls,
                    name=f"{cls.name}@{name}",
                    budget=Budget(
                        b.max_inflight_tokens, b.max_concurrent, b.tokens_per_second, b.burst_tokens
                    ),
                )
    return MappingProxyType(placers), MappingProxyType(per_model)


def with_sketch(runtime: Runtime, sketch: ChainSketch) -> Runtime:
    """The runtime keyed through ``sketch`` (the process's learnt common chains, which outlive
    config reloads); the sketch takes the runtime's chain parameters."""
    sketch.params = runtime.key_rules.chain
    rules = dataclasses.replace(runtime.key_rules, sketch=sketch)
    return dataclasses.replace(runtime, key_rules=rules)


# Measured through Envoy in every layout of `extproc bench layouts` (BENCHMARKS.md): max/mean
# 1.07-1.12 over 8 clusters where the hash alone gives
# 1.21-1.32, hit ratio unchanged, every later turn on its first cluster.
DEFAULT_BALANCE_FACTOR = 1.1


def balance_factor(cfg: FleetConfig, redis_url: str | None = None) -> float:
    """``affinity.balance_factor``, or its default when unset: on wherever a spilled session's
    later turns find the spill, which every replica must be able to read. One replica
    (``redis.replicas``: 1) remembers it itself; several share it only through Redis. With
    several replicas on memory alone a spill would cost its session the cache on every turn
    another replica decides, so bounded placement stays off there unless asked for."""
    if cfg.affinity.balance_factor is not None:
        return cfg.affinity.balance_factor
    shared = (redis_url or cfg.redis.url) is not None
    return DEFAULT_BALANCE_FACTOR if shared or cfg.redis.replicas == 1 else 0.0


def kv_relief_at(cfg: FleetConfig) -> float | None:
    """The scraped KV use at which, with load-aware affinity off, a cluster is relieved as a hot
    GPU's (affinity on has its own rule there); None when no engine's KV use is scraped."""
    if cfg.affinity.enabled or not cfg.engine_metrics.enabled:
        return None
    if not any(c.engine != "openai" for c in cfg.clusters):
        return None
    return cfg.affinity.kv_migrate_threshold


def relief_params(cfg: FleetConfig) -> ReliefParams | None:
    """When a hot cluster's least active sessions move (gpu_health's pace, also for KV
    pressure), or None when neither a GPU nor, with affinity off, KV use is watched."""
    gh = cfg.gpu_health
    gpus = gh.enabled and any(c.gpus for c in cfg.clusters)
    if not gpus and kv_relief_at(cfg) is None:
        return None
    return ReliefParams(gh.move_after_ms / 1000, gh.move_fraction)


def affinity_params(cfg: AffinityConfig, balance: float) -> AffinityParams:
    """The policy's parameters, by name from the validated config: one list of fields (the
    core's dataclass), so a parameter added there cannot be forgotten here. The config's other
    affinity fields (served_by_header, max_sessions) belong to the shell and are compiled apart;
    ``balance`` is the compiled ``balance_factor`` (:func:`balance_factor`).
    """
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(AffinityParams)}
    return AffinityParams(**{**fields, "balance_factor": balance})


def pd_plan(cfg: FleetConfig, classes: tuple[RequestClass, ...]) -> PdPlan | None:
    """The compiled P/D settings, or None when no class is disaggregated."""
    if not any(c.disaggregated for c in cfg.classes):
        return None
    topology = pd_topology(cfg)
    labels = {c.name: topology.labels(c.topology) for c in cfg.clusters}
    prefill = [c for c in cfg.clusters if c.role == "prefill"]
    pools: dict[str, tuple[PrefillEndpoint, ...]] = {}
    budgets: dict[str, RequestClass] = {}
    for spec, cls in zip(cfg.classes, classes, strict=True):
        if not spec.disaggregated:
            continue
        members = [
            c for c in prefill if not spec.prefill_eligible or c.name in spec.prefill_eligible
        ]
        pools[cls.name] = tuple(
            PrefillEndpoint(e, c.name, labels[c.name], c.bootstrap_port)
            for c in members
            for e in c.endpoints
        )
        b = spec.prefill_budget
        budgets[cls.name] = RequestClass(
            name=prefill_class_name(cls.name),
            max_input_tokens=cls.max_input_tokens,
            budget=Budget(
                b.max_inflight_tokens, b.max_concurrent, b.tokens_per_second, b.burst_tokens
            ),
        )
    d = cfg.disaggregation
    return PdPlan(
        topology=topology,
        params=PrefillParams(
            d.saturation_factor,
            d.min_inflight,
            d.cross_island,
            d.topology_aware,
            topology.levels.index(d.group_level)
            if d.group_level in topology.levels
            else max(0, len(topology.levels) - 1),
        ),
        cluster_labels=MappingProxyType(labels),
        pools=MappingProxyType(pools),
        prefill_classes=MappingProxyType(budgets),
        kv_bytes_per_token=d.kv_bytes_per_token,
        protocol=d.protocol,
    )


def pd_topology(cfg: FleetConfig) -> Topology:
    """fleet.yaml's topology levels and bandwidths (GB/s there, bytes/s here)."""
    topo = cfg.topology
    return Topology(
        tuple(lvl.name for lvl in topo.levels),
        tuple(lvl.gbytes_per_s * 1e9 for lvl in topo.levels),
        topo.cross_gbytes_per_s * 1e9,
    )

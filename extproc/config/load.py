"""Staged loading: YAML decode → typed model with defaults → cross-checks → compiled runtime.

Every error names the path of the bad field, e.g. ``clusters[2].weight: must be > 0``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from extproc.config.label_secret import LabelSecretError
from extproc.config.runtime import Overrides, Runtime, compile_runtime
from extproc.config.schema import (
    RESERVED_CLUSTER_NAMES,
    BudgetConfig,
    ClassConfig,
    FleetConfig,
)
from extproc.core.fleet import Budget, effective_burst
from extproc.names import FLEET_HEADER_PREFIX


class ConfigError(ValueError):
    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__(f"{source}: invalid fleet config:\n  " + "\n  ".join(self.problems))


def format_path(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(root)"


_PYDANTIC_WORDING = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than_equal": "must be <= {le}",
    "missing": "is required",
    "extra_forbidden": "unknown field",
    "too_short": "must have at least {min_length} item(s)",
}


def _bound(value: object) -> object:
    # A float field's bound arrives as 0.0; the documented message is "must be > 0".
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _describe(err: dict[str, object]) -> str:
    kind = str(err.get("type", ""))
    ctx = err.get("ctx")
    template = _PYDANTIC_WORDING.get(kind)
    if template and isinstance(ctx, dict):
        try:
            return template.format(**{k: _bound(v) for k, v in ctx.items()})
        except KeyError:
            pass  # fall through to pydantic's own message when ctx lacks the field
    elif template and "{" not in template:
        return template
    return str(err.get("msg", "invalid"))


def _shadows(earlier: ClassConfig, later: ClassConfig) -> bool:
    """Every request ``later`` would admit is already taken by ``earlier`` (first match wins)."""
    tiers_covered = not earlier.tiers or (
        bool(later.tiers) and set(later.tiers) <= set(earlier.tiers)
    )
    tokens_covered = earlier.max_input_tokens is None or (
        later.max_input_tokens is not None and later.max_input_tokens <= earlier.max_input_tokens
    )
    return tiers_covered and tokens_covered


def cross_check(cfg: FleetConfig) -> list[str]:
    """Checks that span fields: references, uniqueness, coverage."""
    problems: list[str] = []
    names: dict[str, int] = {}
    for i, cluster in enumerate(cfg.clusters):
        if cluster.name in names:
            problems.append(f"clusters[{i}].name: duplicate of clusters[{names[cluster.name]}]")
        if cluster.name in RESERVED_CLUSTER_NAMES:
            problems.append(
                f"clusters[{i}].name: {cluster.name!r} is reserved for the rendered Envoy config"
            )
        names.setdefault(cluster.name, i)
        for j, endpoint in enumerate(cluster.endpoints):
            # The schema's pattern admits 1-5 digits; Envoy rejects ports outside 1..65535 only
            # when it loads the rendered bootstrap, far from the line that is wrong.
            port = int(endpoint.rpartition(":")[2])
            if not 0 < port <= 65535:
                problems.append(f"clusters[{i}].endpoints[{j}]: port {port} is not in 1..65535")
        watched: set[str] = set()
        for j, watch in enumerate(cluster.gpus):
            if watch.endpoint not in cluster.endpoints:
                problems.append(f"clusters[{i}].gpus[{j}].endpoint: not one of its endpoints")
            elif watch.endpoint in watched:
                problems.append(f"clusters[{i}].gpus[{j}].endpoint: listed twice")
            watched.add(watch.endpoint)
    seen_classes: dict[str, int] = {}
    for i, cls in enumerate(cfg.classes):
        if cls.name in seen_classes:
            problems.append(f"classes[{i}].name: duplicate of classes[{seen_classes[cls.name]}]")
        seen_classes.setdefault(cls.name, i)
        seen_refs: dict[str, int] = {}
        for j, ref in enumerate(cls.eligible):
            if ref not in names:
                problems.append(f"classes[{i}].eligible[{j}]: no cluster named {ref!r}")
            elif ref in seen_refs:
                # A repeated name would let rendezvous pick the same cluster as primary and
                # secondary: a route "c1__c1" that no aggregate cluster exists for.
                problems.append(
                    f"classes[{i}].eligible[{j}]: duplicate of eligible[{seen_refs[ref]}]"
                )
            seen_refs.setdefault(ref, j)
        problems.extend(_budget_fits(f"classes[{i}].budget", cls.budget, cls.max_input_tokens))
        for j, earlier in enumerate(cfg.classes[:i]):
            if _shadows(earlier, cls):
                problems.append(
                    f"classes[{i}]: unreachable: every request it admits matches "
                    f"classes[{j}] ({earlier.name!r}) first"
                )
                break
    last = len(cfg.classes) - 1
    tail = cfg.classes[last]
    if tail.max_input_tokens is not None or tail.tiers:
        problems.append(
            f"classes[{last}]: the last class must be a catch-all (no max_input_tokens, no tiers)"
        )
    if any(c.tiers for c in cfg.classes) and not cfg.session.tier_header:
        problems.append("session.tier_header: required when a class lists tiers")
    for field in ("header", "tier_header"):
        value = getattr(cfg.session, field)
        if value and value.startswith(FLEET_HEADER_PREFIX):
            # Envoy strips the processor's own headers from client requests
            # (internal_only_headers): a trusted header in that namespace never arrives.
            problems.append(
                f"session.{field}: {FLEET_HEADER_PREFIX}* headers are reserved for the processor"
            )
    problems.extend(_affinity_problems(cfg))
    problems.extend(_flow_problems(cfg))
    problems.extend(_pd_problems(cfg))
    problems.extend(_model_problems(cfg))
    ports = {
        "listener.port": cfg.listener.port,
        "listener.admin_port": cfg.listener.admin_port,
        "processor.port": cfg.processor.port,
        "processor.metrics_port": cfg.processor.metrics_port,
    }
    seen_ports: dict[int, str] = {}
    for path, port in ports.items():
        if port and port in seen_ports:
            problems.append(f"{path}: port {port} is also {seen_ports[port]}")
        seen_ports.setdefault(port, path)
    return problems


def _pd_problems(cfg: FleetConfig) -> list[str]:
    """Roles, topology labels and disaggregated classes (extproc.core.pd)."""
    problems: list[str] = []
    roles = {c.name: c.role for c in cfg.clusters}
    levels = [lvl.name for lvl in cfg.topology.levels]
    for i, lvl in enumerate(levels):
        if lvl in levels[:i]:
            problems.append(f"topology.levels[{i}].name: duplicate of levels[{levels.index(lvl)}]")
    for i, cluster in enumerate(cfg.clusters):
        for key in cluster.topology:
            if key not in levels:
                problems.append(
                    f"clusters[{i}].topology.{key}: not a topology level (topology.levels: "
                    f"{levels or 'none'})"
                )
    group = cfg.disaggregation.group_level
    if group is not None and group not in levels:
        problems.append(f"disaggregation.group_level: {group!r} is not a topology level")
    if all(role == "prefill" for role in roles.values()):
        problems.append("clusters: every cluster is prefill-only; at least one must decode")
    prefill = [n for n, r in roles.items() if r == "prefill"]
    for i, cls in enumerate(cfg.classes):
        for j, ref in enumerate(cls.eligible):
            if roles.get(ref) == "prefill":
                # eligible clusters are where the request (and its session's KV) runs.
                problems.append(
                    f"classes[{i}].eligible[{j}]: {ref!r} is a prefill-only cluster; list it "
                    "in prefill_eligible"
                )
        for j, ref in enumerate(cls.prefill_eligible):
            if ref not in roles:
                problems.append(f"classes[{i}].prefill_eligible[{j}]: no cluster named {ref!r}")
            elif roles[ref] != "prefill":
                problems.append(
                    f"classes[{i}].prefill_eligible[{j}]: {ref!r} has role {roles[ref]!r}, "
                    "not 'prefill'"
                )
        if not cls.disaggregated:
            if cls.prefill_eligible or cls.prefill_budget != BudgetConfig():
                problems.append(
                    f"classes[{i}]: prefill_eligible / prefill_budget need disaggregated: true"
                )
            continue
        if not prefill:
            problems.append(f"classes[{i}].disaggregated: no cluster has role 'prefill'")
        b, limit = cls.prefill_budget, cls.max_input_tokens
        if b.max_inflight_tokens and limit and b.max_inflight_tokens < limit - 1:
            problems.append(
                f"classes[{i}].prefill_budget.max_inflight_tokens: must be >= max_input_tokens "
                f"- 1 ({limit - 1}) or the largest requests of the class never fit"
            )
        burst = effective_burst(Budget(0, 0, b.tokens_per_second, b.burst_tokens))
        if b.tokens_per_second and limit and burst < limit - 1:
            problems.append(
                f"classes[{i}].prefill_budget.burst_tokens: must be >= max_input_tokens - 1 "
                f"({limit - 1}) or the largest requests of the class never fit"
            )
    return problems


def _budget_fits(path: str, b: BudgetConfig, limit: int | None) -> list[str]:
    """A bounded class must be able to admit its own largest request; otherwise those requests
    could only ever get 413. (The catch-all class has no bound to check.)"""
    problems: list[str] = []
    # The bucket's capacity exactly as admission computes it (0 = one second of refill).
    burst = effective_burst(Budget(0, 0, b.tokens_per_second, b.burst_tokens))
    if b.tokens_per_second and limit and burst < limit - 1:
        problems.append(
            f"{path}.burst_tokens: must be >= max_input_tokens - 1 "
            f"({limit - 1}) or the largest requests of the class never fit"
        )
    if b.max_inflight_tokens and limit and b.max_inflight_tokens < limit - 1:
        problems.append(
            f"{path}.max_inflight_tokens: must be >= max_input_tokens - 1 "
            f"({limit - 1}) or the largest requests of the class never fit"
        )
    return problems


def _model_problems(cfg: FleetConfig) -> list[str]:
    """Every requestable model name must resolve to one model (extproc.core.models)."""
    problems: list[str] = []
    listing = [i for i, c in enumerate(cfg.clusters) if c.models]
    if not listing:
        if cfg.models:
            problems.append(
                "models: needs clusters that list the models they serve (clusters[].models)"
            )
        if cfg.model_routing.discovery:
            # Discovery adds to a floor; without one, a flapping endpoint would switch the
            # whole fleet between model-aware and model-agnostic placement.
            problems.append(
                "model_routing.discovery: needs clusters[].models (the floor discovery adds to)"
            )
        return problems
    for i, c in enumerate(cfg.clusters):
        if not c.models:
            # Mixed fleets are ambiguous: would such a cluster serve every model, or none?
            problems.append(
                f"clusters[{i}].models: required when any cluster lists models "
                f"(clusters[{listing[0]}] does)"
            )
    # name -> (what it is, the model it resolves to, where it was first declared)
    seen: dict[str, tuple[str, str, str]] = {}

    def claim(name: str, kind: str, target: str, where: str) -> None:
        prior = seen.get(name)
        if prior is None:
            seen[name] = (kind, target, where)
        elif (prior[0], prior[1]) != (kind, target):
            problems.append(
                f"{where}: {name!r} is already the {prior[0]} of {prior[1]!r} at {prior[2]}"
            )

    for i, c in enumerate(cfg.clusters):
        for j, served in enumerate(c.models):
            where = f"clusters[{i}].models[{j}]"
            if isinstance(served, str):
                claim(served, "model", served, where)
                continue
            claim(served.name, "model", served.name, f"{where}.name")
            for k, alias in enumerate(served.aliases):
                claim(alias, "alias", served.name, f"{where}.aliases[{k}]")
            for k, adapter in enumerate(served.adapters):
                claim(adapter, "adapter", served.name, f"{where}.adapters[{k}]")
    class_names = {c.name: c for c in cfg.classes}
    declared: dict[str, int] = {}
    for i, m in enumerate(cfg.models):
        if m.name in declared:
            problems.append(f"models[{i}].name: duplicate of models[{declared[m.name]}]")
        declared.setdefault(m.name, i)
        if m.base is not None:
            base = seen.get(m.base)
            if base is not None and base[0] != "model":
                problems.append(f"models[{i}].base: {m.base!r} is an {base[0]}, not a base model")
            claim(m.name, "adapter", m.base, f"models[{i}]")
        else:
            prior = seen.get(m.name)
            if prior is not None and prior[0] == "alias":
                problems.append(
                    f"models[{i}].name: {m.name!r} is an alias of {prior[1]!r}; use that name"
                )
            elif prior is None:
                seen[m.name] = ("model", m.name, f"models[{i}]")
        for cls, budget in m.budgets.items():
            if cls not in class_names:
                problems.append(f"models[{i}].budgets.{cls}: no class named {cls!r}")
            else:
                limit = class_names[cls].max_input_tokens
                problems.extend(_budget_fits(f"models[{i}].budgets.{cls}", budget, limit))
    return problems


def _flow_problems(cfg: FleetConfig) -> list[str]:
    if cfg.flow.tenants and not cfg.flow.tenant_header:
        # Named tenants are matched by the tenant header's value: without it none ever is.
        return ["flow.tenants: needs flow.tenant_header (tenants are named by its value)"]
    return []


def _affinity_problems(cfg: FleetConfig) -> list[str]:
    aff = cfg.affinity
    problems: list[str] = []
    if aff.kv_migrate_threshold < aff.kv_pressure_threshold:
        # Sessions would leave a cluster that still accepts new ones: migrations for nothing.
        problems.append(
            f"affinity.kv_migrate_threshold: must be >= kv_pressure_threshold "
            f"({aff.kv_pressure_threshold:g})"
        )
    if aff.override_ttl_s < aff.new_session_ttl_s:
        # A session could outlive its override while still counting as existing: its next turn
        # would go back to the hash primary, away from the cache the override pointed at.
        problems.append(
            f"affinity.override_ttl_s: must be >= new_session_ttl_s ({aff.new_session_ttl_s:g})"
        )
    if aff.balance_factor is not None and 0 < aff.balance_factor <= 1:
        # No cluster can stay at or below the mean while another is above it: every new
        # session would fall back to its hash primary, so the setting would do nothing.
        problems.append("affinity.balance_factor: must be 0 (off) or > 1")
    return problems


def parse_config(data: object, source: str = "<config>") -> FleetConfig:
    if not isinstance(data, dict):
        raise ConfigError(source, ["(root): must be a mapping"])
    try:
        cfg = FleetConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            source, [f"{format_path(e['loc'])}: {_describe(dict(e))}" for e in exc.errors()]
        ) from None
    problems = cross_check(cfg)
    if problems:
        raise ConfigError(source, problems)
    return cfg


def parse_yaml(raw: bytes, source: str) -> FleetConfig:
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"(yaml): {exc}"]) from None
    return parse_config(data, source)


def load_config(path: str | Path) -> tuple[FleetConfig, bytes]:
    p = Path(path)
    raw = p.read_bytes()
    return parse_yaml(raw, str(p)), raw


def _compile(
    cfg: FleetConfig, raw: bytes, source: str, overrides: Overrides | None = None
) -> Runtime:
    try:
        return compile_runtime(cfg, raw, overrides)
    except LabelSecretError as exc:
        raise ConfigError(source, [str(exc)]) from None


def runtime_from_bytes(raw: bytes, source: str, overrides: Overrides | None = None) -> Runtime:
    return _compile(parse_yaml(raw, source), raw, source, overrides)


def load_runtime(path: str | Path, overrides: Overrides | None = None) -> Runtime:
    cfg, raw = load_config(path)
    return _compile(cfg, raw, str(path), overrides)

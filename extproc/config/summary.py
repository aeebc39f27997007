"""What a fleet.yaml compiles to, as a few lines a person reads (``extproc config check``)."""

from __future__ import annotations

from extproc.config.runtime import Runtime
from extproc.core.fleet import Budget, RequestClass


def _budget(b: Budget) -> str:
    parts = [
        f"{label} {value:g}" if isinstance(value, float) else f"{label} {value}"
        for label, value in (
            ("inflight_tokens", b.max_inflight_tokens),
            ("concurrent", b.max_concurrent),
            ("tokens/s", b.tokens_per_second),
        )
        if value
    ]
    return ", ".join(parts) if parts else "no budget"


def _class_line(cls: RequestClass, clusters: tuple[str, ...]) -> str:
    size = f"< {cls.max_input_tokens} tokens" if cls.max_input_tokens else "catch-all"
    tiers = f" tiers {','.join(sorted(cls.tiers))}" if cls.tiers else ""
    where = ",".join(cls.eligible) if cls.eligible else f"all {len(clusters)}"
    wait = f"; waits up to {cls.wait.max_wait_s:g} s" if cls.budget.enforced else ""
    budget = _budget(cls.budget)
    return f"  {cls.name}: {size}{tiers}; clusters {where}; per cluster: {budget}{wait}"


def summary_lines(source: str, rt: Runtime) -> list[str]:
    cfg = rt.config
    names = rt.cluster_names
    mode = "endpoint_picker (pool data path)" if rt.endpoint_picker else "route (aggregate pairs)"
    lines = [
        f"{source}: valid, version {rt.version}",
        f"data path: {mode}, processor.mode {cfg.processor.mode}",
        f"clusters ({len(names)}):",
    ]
    for c in cfg.clusters:
        models = [m if isinstance(m, str) else m.name for m in c.models]
        extra = f", models {','.join(models)}" if models else ""
        role = f", role {c.role}" if c.role != "both" else ""
        lines.append(
            f"  {c.name}: {len(c.endpoints)} endpoint(s), weight {c.weight:g}{role}{extra}"
        )
    lines.append("classes (first match wins):")
    lines += [_class_line(cls, names) for cls in rt.policy.classes]
    for cls in rt.policy.model_classes.values():
        lines.append(f"  {cls.name}: per cluster: {_budget(cls.budget)}")
    session = cfg.session
    key_order = [f"header {session.header}"] if session.header else []
    key_order += [f"body {', '.join(session.body_fields)}"] if session.body_fields else []
    key_order.append(f"prefix key {cfg.prefix.key}")
    lines.append("session key: " + "; then ".join(key_order))
    lines.append(f"label secret: {rt.label_secret_source}")
    redis = rt.redis
    state = (
        f"Redis {redis.url} (on_unavailable {redis.on_unavailable})"
        if redis.url
        else f"in memory, {redis.replicas} replica(s)"
    )
    lines.append(f"shared state: {state}")
    balance = rt.affinity.balance_factor
    lines.append(
        f"placement: load-aware affinity {'on' if rt.affinity.enabled else 'off'}; "
        f"bounded-load new sessions {f'factor {balance:g}' if balance else 'off'}"
    )
    engines = rt.engines
    bound = f"bound {engines.balance:g}" if engines.balance else "unbounded"
    choice = f"sticky ({cfg.engines.envoy_policy}, {bound})" if engines.sticky else "round robin"
    lines.append(f"engines inside a cluster: {choice}")
    lines.append(
        "request phases: "
        + (
            "decided at headers when a session header and content-length are present"
            if rt.decide_at_headers
            else "every inference body read"
        )
        + f"; responses read: {'yes' if rt.response_phases else 'no'}"
        + f"; endpoint probing: {'on' if rt.probes_clusters else 'off'}"
    )
    if rt.pd is not None:
        lines.append(f"disaggregated classes: {', '.join(sorted(rt.pd.pools))}")
    return lines

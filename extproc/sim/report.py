"""Figures from the raw runs: a JSON-able summary, a text table, and PNG plots.

Definitions (the same for every policy):

- hit ratio: cached / prompt tokens over served requests (token-weighted, like
  ``extproc.harness.trace.ideal_hit_ratio``, which is reported alongside as the ceiling);
- TTFT: first token minus the request's *first* arrival, so 429 retry waits count;
  percentiles over served requests; SLO attainment over all requests (not served = missed);
- 429 rate: 429 answers / attempts; "gave up": requests still refused after the last retry;
- re-prefill: tokens a request had to prefill although one infinite fleet-wide cache would have
  held them (ideal cached - cached). A failure's re-prefill is that of the sessions whose
  cache was on the failed cluster, during the outage, by the cluster that absorbed it; its
  spread is max/mean over the survivors (divided by weight when weights differ), next to the
  same statistic for a perfectly uniform random assignment of the same sessions;
- cost: input at $0.30/M cached and $3.00/M uncached, output at $15/M, served requests.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from extproc.sim.engine import GAVE_UP_429, SERVED, FailureRecord, PolicyRun, Scenario
from extproc.sim.events import Kind
from extproc.sim.pd import TIER_NAMES
from extproc.sim.policies import POLICIES
from extproc.sim.traffic import Traffic

USD_PER_M_CACHED = 0.30
USD_PER_M_UNCACHED = 3.00
USD_PER_M_OUTPUT = 15.00
# Trials of the uniform-random baseline for the failure spread.
RANDOM_TRIALS = 200
TIMELINE_BUCKETS = 60


def _pct(values: npt.NDArray[np.float64], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)


class _Arrays:
    """Per-request columns of the traffic as numpy arrays (built once per report)."""

    def __init__(self, traffic: Traffic) -> None:
        tmpl = np.asarray(traffic.templates, dtype=np.int64)
        self.times = np.asarray(traffic.times, dtype=np.float64)
        self.input = np.asarray(traffic.t_input, dtype=np.int64)[tmpl]
        self.output = np.asarray(traffic.t_output, dtype=np.int64)[tmpl]
        self.klass = np.asarray(traffic.t_class, dtype=np.int64)[tmpl]
        self.ideal = np.asarray(traffic.ideal_cached, dtype=np.int64)
        self.burst = tmpl >= len(traffic.base)


def _failure(record: FailureRecord, scenario: Scenario, seed: int) -> dict[str, Any]:
    clusters = scenario.clusters
    survivors = record.survivors
    weights = np.array([clusters[c].weight for c in survivors], dtype=np.float64)
    tokens = np.array([record.spread.get(c, 0) for c in survivors], dtype=np.float64)
    per_w = tokens / weights
    mean = float(per_w.mean()) if len(per_w) else 0.0
    spread = float(per_w.max() / mean) if mean > 0 else None
    # The same displaced sessions, each thrown on a survivor at random (by weight): what
    # perfect hashing could at best do with this few sessions.
    sizes = np.array(list(record.by_session.values()), dtype=np.float64)
    baseline: dict[str, float | None] = {"median": None, "p95": None}
    if len(sizes) and sizes.sum() > 0 and len(survivors) > 1:
        rng = np.random.default_rng([seed, record.cluster, 0xFA11])
        prob = weights / weights.sum()
        ratios = []
        for _ in range(RANDOM_TRIALS):
            pick = rng.choice(len(survivors), size=len(sizes), p=prob)
            load = np.bincount(pick, weights=sizes, minlength=len(survivors)) / weights
            ratios.append(load.max() / load.mean())
        baseline = {"median": float(np.median(ratios)), "p95": float(np.percentile(ratios, 95))}
    reprefilling = int((sizes > 0).sum())
    return {
        "cluster": clusters[record.cluster].name,
        "failed_at_s": _round(record.failed_at, 1),
        "recovered_at_s": _round(record.recovered_at, 1),
        "survivors": len(survivors),
        "displaced_sessions": len(record.by_session),
        "reprefilling_sessions": reprefilling,
        "reprefill_tokens": int(tokens.sum()),
        "survivors_reached": int((tokens > 0).sum()),
        "spread_max_over_mean": _round(spread),
        "random_assignment_max_over_mean": {k: _round(v) for k, v in baseline.items()},
        "failback_reprefill_tokens": record.failback_tokens,
        "lost_inflight_requests": record.lost_inflight,
    }


def failover_plan(scenario: Scenario) -> list[dict[str, Any]]:
    """Per scripted failure, where the hash sends *all* the failed cluster's sessions.

    Every trace session whose primary is the failed cluster (in the epoch in force), weighted
    by its largest prompt (what it would re-prefill if it came back), goes to its secondary.
    This is the re-prefill the placement plans for, independent of which sessions happen to
    return during the outage; max/mean over survivors (divided by weight).
    """
    traffic = scenario.traffic
    names = scenario.names
    weights_all = np.array([c.weight for c in scenario.clusters], dtype=np.float64)
    tmpl = np.asarray(traffic.templates, dtype=np.int64)
    sess = np.asarray(traffic.sessions, dtype=np.int64)
    context = np.zeros(traffic.n_sessions, dtype=np.float64)
    np.maximum.at(context, sess, np.asarray(traffic.t_input, dtype=np.float64)[tmpl])
    out: list[dict[str, Any]] = []
    for ev, epoch in zip(scenario.events, scenario.epoch_after, strict=True):
        if ev.kind is not Kind.FAIL:
            continue
        failed = names.index(ev.cluster)
        table = scenario.tables.tables[epoch][: traffic.n_trace_sessions]
        members = scenario.tables.members[epoch].copy()
        members[failed] = False
        survivors = np.flatnonzero(members)
        mine = table[:, 0] == failed
        second = table[mine, 1].astype(np.int64)
        n_clusters = len(names)
        tokens = (
            np.bincount(
                second, weights=context[: traffic.n_trace_sessions][mine], minlength=n_clusters
            )[survivors]
            / weights_all[survivors]
        )
        counts = np.bincount(second, minlength=n_clusters)[survivors] / weights_all[survivors]
        out.append(
            {
                "event": str(ev),
                "sessions": int(mine.sum()),
                "survivors": len(survivors),
                "sessions_per_survivor": _round(float(mine.sum()) / len(survivors), 2),
                "tokens_max_over_mean": _round(float(tokens.max() / tokens.mean()), 4)
                if tokens.mean() > 0
                else None,
                "sessions_max_over_mean": _round(float(counts.max() / counts.mean()), 4)
                if counts.mean() > 0
                else None,
            }
        )
    return out


def _class_stats(
    run: PolicyRun, arr: _Arrays, mask: npt.NDArray[np.bool_], slo: float | None
) -> dict[str, Any]:
    n = int(mask.sum())
    served = mask & (run.status == SERVED)
    ttft = run.ttft[served]
    attempts = int(mask.sum() + run.rejections[mask].sum())
    out: dict[str, Any] = {
        "requests": n,
        "served": int(served.sum()),
        "ttft_p50_s": _round(_pct(ttft, 50), 3),
        "ttft_p99_s": _round(_pct(ttft, 99), 3),
        "rate_429": _round(float(run.rejections[mask].sum()) / attempts if attempts else 0.0, 5),
        "gave_up": int((mask & (run.status == GAVE_UP_429)).sum()),
        "not_served": int(n - served.sum()),
    }
    if slo is not None:
        out["slo_s"] = slo
        out["slo_attainment"] = _round(float((ttft <= slo).sum()) / n if n else None, 4)
    return out


def _throughput(run: PolicyRun, arr: _Arrays, output: npt.NDArray[np.int64]) -> float | None:
    """Served output tokens per second, from the first arrival to the last decode's end."""
    if run.done_at is None or not len(arr.times):
        return None
    done = run.done_at[run.status == SERVED]
    if not len(done):
        return None
    span = float(done.max() - arr.times.min())
    return _round(float(output.sum()) / span, 1) if span > 0 else None


def _pd_stats(
    run: PolicyRun, transfer: npt.NDArray[np.float64], tier: npt.NDArray[np.int8]
) -> dict[str, Any]:
    """P/D runs: how the disaggregated requests' pairs related, and their KV transfers
    (seconds, uncached-at-decode tokens x KV bytes / the pair's link)."""
    served = run.status == SERVED
    moved = served & (tier >= 0)
    t = transfer[moved]
    values, counts = np.unique(tier[moved], return_counts=True)
    relations = {
        TIER_NAMES[min(int(k), len(TIER_NAMES) - 1)]: int(v)
        for k, v in zip(values, counts, strict=True)
    }
    return {
        "disaggregated": int(moved.sum()),
        "colocated_fallback": int((served & (tier == -1)).sum()),
        "by_tier": relations,
        "transfer_p50_s": _round(_pct(t, 50), 4),
        "transfer_p99_s": _round(_pct(t, 99), 4),
    }


def _timeline(
    run: PolicyRun, arr: _Arrays, klass: int, edges: npt.NDArray[np.float64]
) -> list[float | None]:
    ok = (run.status == SERVED) & (arr.klass == klass)
    which = np.searchsorted(edges, arr.times[ok], side="right") - 1
    ttft = run.ttft[ok]
    out: list[float | None] = []
    for b in range(len(edges) - 1):
        values = ttft[which == b]
        out.append(_round(_pct(values, 99), 3) if len(values) >= 20 else None)
    return out


def summarize(
    scenario: Scenario,
    runs: Mapping[str, PolicyRun],
    slo_s: Mapping[str, float],
    windows: Sequence[tuple[float, float]] = (),
    seed: int = 0,
) -> dict[str, Any]:
    traffic = scenario.traffic
    arr = _Arrays(traffic)
    in_window = np.zeros(len(arr.times), dtype=bool)
    for lo, hi in windows:
        in_window |= (arr.times >= lo) & (arr.times < hi)
    end = float(arr.times.max()) if len(arr.times) else 0.0
    edges = np.linspace(0.0, end + 1e-9, TIMELINE_BUCKETS + 1)
    policies = {
        name: _policy_summary(
            name, run, scenario, arr, slo_s, in_window if windows else None, edges, seed
        )
        for name, run in runs.items()
    }
    return {
        "workload": _workload_summary(traffic, arr),
        "fleet": _fleet_summary(scenario),
        "events": [str(e) for e in scenario.events],
        "bursts": [
            {
                "start_s": b.start_s,
                "duration_s": b.duration_s,
                "rate_per_s": b.rate_per_s,
                "input_tokens": b.input_tokens,
            }
            for b in traffic.bursts
        ],
        "windows": [[_round(lo, 3), _round(hi, 3)] for lo, hi in windows],
        "remapped": scenario.remapped(),
        "failover_plan": failover_plan(scenario),
        "timeline_edges_s": [_round(float(e), 2) for e in edges],
        "policies": policies,
    }


def _policy_summary(
    name: str,
    run: PolicyRun,
    scenario: Scenario,
    arr: _Arrays,
    slo_s: Mapping[str, float],
    in_window: npt.NDArray[np.bool_] | None,
    edges: npt.NDArray[np.float64],
    seed: int,
) -> dict[str, Any]:
    """One policy's figures: hits, cost, per-class latency, balance, failures."""
    classes = scenario.traffic.classes
    trace_mask = ~arr.burst
    ok = run.status == SERVED
    cached = np.where(ok, run.cached, 0)
    prompt = np.where(ok, arr.input, 0)
    uncached = prompt - cached
    output = np.where(ok, arr.output, 0)
    per_class = {
        c.name: _class_stats(run, arr, arr.klass == k, slo_s.get(c.name))
        for k, c in enumerate(classes)
    }
    window = (
        {
            c.name: _class_stats(run, arr, in_window & (arr.klass == k), slo_s.get(c.name))
            for k, c in enumerate(classes)
        }
        if in_window is not None
        else None
    )
    busy, per_cluster = _per_cluster(run, scenario, ok, uncached)
    out: dict[str, Any] = {
        "description": POLICIES[name].description if name in POLICIES else "",
        "hit_ratio": _round(float(cached.sum() / max(1, prompt.sum())), 4),
        "trace_hit_ratio": _round(
            float(cached[trace_mask].sum() / max(1, prompt[trace_mask].sum())), 4
        ),
        "served": int(ok.sum()),
        "not_served": int((~ok).sum()),
        "classes": per_class,
        "window": window,
        "cost_usd": _cost(cached, uncached, output),
        "prefill_busy_max_over_mean": _round(float(busy.max() / busy.mean()), 3)
        if busy.mean() > 0
        else None,
        "requests_max_over_mean": _round(float(per_cluster.max() / per_cluster.mean()), 3)
        if per_cluster.mean() > 0
        else None,
        "failures": [_failure(f, scenario, seed) for f in run.failures],
        "spilled_sessions": run.spilled_sessions,
        "affinity_decisions": dict(sorted(run.decisions.items())),
        "leaked_tickets": run.leaked_tickets,
        "timeline_short_p99_s": _timeline(run, arr, 0, edges),
        "output_tokens_per_s": _throughput(run, arr, output),
    }
    if run.transfer_s is not None and run.prefill_tier is not None:
        out["pd"] = _pd_stats(run, run.transfer_s, run.prefill_tier)
    return out


def _per_cluster(
    run: PolicyRun, scenario: Scenario, ok: npt.NDArray[np.bool_], uncached: npt.NDArray[Any]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Per base cluster: prefill busy time over the run (how evenly work landed), and served
    requests (the load figure, max/mean <= 1.2)."""
    busy = np.bincount(
        run.served_on[ok].astype(np.int64),
        weights=uncached[ok].astype(np.float64),
        minlength=len(scenario.clusters),
    )[: scenario.n_base] / np.array([c.prefill_tps for c in scenario.clusters[: scenario.n_base]])
    per_cluster = np.bincount(run.served_on[ok].astype(np.int64), minlength=len(scenario.clusters))[
        : scenario.n_base
    ]
    return busy, per_cluster


def _cost(
    cached: npt.NDArray[Any], uncached: npt.NDArray[Any], output: npt.NDArray[Any]
) -> dict[str, float | None]:
    usd_cached = float(cached.sum()) * USD_PER_M_CACHED / 1e6
    usd_uncached = float(uncached.sum()) * USD_PER_M_UNCACHED / 1e6
    usd_output = float(output.sum()) * USD_PER_M_OUTPUT / 1e6
    return {
        "input_cached": _round(usd_cached, 2),
        "input_uncached": _round(usd_uncached, 2),
        "input": _round(usd_cached + usd_uncached, 2),
        "output": _round(usd_output, 2),
        "total": _round(usd_cached + usd_uncached + usd_output, 2),
    }


def _workload_summary(traffic: Traffic, arr: _Arrays) -> dict[str, Any]:
    base = traffic.base
    trace_mask = ~arr.burst
    ideal = float(arr.ideal[trace_mask].sum() / max(1, arr.input[trace_mask].sum()))
    ideal_input_usd = (
        float(arr.ideal.sum()) * USD_PER_M_CACHED
        + float((arr.input - arr.ideal).sum()) * USD_PER_M_UNCACHED
    ) / 1e6
    return {
        "source": base.source,
        "base_requests": len(base),
        "base_sessions": base.n_sessions,
        "copies": traffic.copies,
        "requests": len(traffic),
        "sessions": traffic.n_sessions,
        "trace_sessions": traffic.n_trace_sessions,
        "burst_requests": int(arr.burst.sum()),
        "period_s": _round(base.period, 3),
        "ideal_hit_ratio": _round(ideal, 4),
        "ideal_input_usd": _round(ideal_input_usd, 2),
        "classes": {
            c.name: {
                "max_input_tokens": c.max_input_tokens,
                "requests": int((arr.klass == k).sum()),
                "budget": {
                    "max_concurrent": c.budget.max_concurrent,
                    "max_inflight_tokens": c.budget.max_inflight_tokens,
                    "tokens_per_second": c.budget.tokens_per_second,
                },
            }
            for k, c in enumerate(traffic.classes)
        },
    }


def _fleet_summary(scenario: Scenario) -> dict[str, Any]:
    fleet = scenario.clusters
    return {
        "clusters": scenario.n_base,
        "spares": len(fleet) - scenario.n_base,
        "profiles": {
            p: sum(1 for c in fleet[: scenario.n_base] if c.profile == p)
            for p in sorted({c.profile for c in fleet})
        },
        "prefill_tps": [
            _round(min(c.prefill_tps for c in fleet), 1),
            _round(max(c.prefill_tps for c in fleet), 1),
        ],
        "kv_capacity_tokens": [
            min(c.kv_capacity_tokens for c in fleet),
            max(c.kv_capacity_tokens for c in fleet),
        ],
        "decode_tps": [
            _round(min(c.decode_tps for c in fleet), 2),
            _round(max(c.decode_tps for c in fleet), 2),
        ],
        "lanes": fleet[0].lanes,
        "weights": sorted({c.weight for c in fleet}),
    }


def write_json(summary: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def format_table(summary: Mapping[str, Any]) -> str:
    wl = summary["workload"]
    classes = list(wl["classes"])
    lines = [
        f"workload: {wl['requests']:,} requests, {wl['sessions']:,} sessions "
        f"({wl['copies']} copies of {wl['source']}, {wl['burst_requests']:,} burst), "
        f"ideal hit ratio {wl['ideal_hit_ratio']:.3f}",
        f"fleet: {summary['fleet']['clusters']} clusters {summary['fleet']['profiles']}, "
        f"{summary['fleet']['lanes']} prefill lanes each; events: "
        + (", ".join(summary["events"]) or "none"),
        "",
    ]
    lines += _policy_rows(summary["policies"], classes)
    lines.append("")
    lines += [_policy_notes(name, p) for name, p in summary["policies"].items()]
    if summary.get("windows"):
        lines.append("")
        lines += _window_rows(summary, classes)
    lines += _fleet_event_rows(summary)
    return "\n".join(lines)


def _policy_rows(policies: Mapping[str, Any], classes: list[str]) -> list[str]:
    """The table: per policy, hits, per-class latency, SLO and 429s, cost, failure spread."""
    head = f"{'policy':<27}{'hit':>6}"
    for c in classes:
        head += f"{c + ' p50/p99 s':>20}{'SLO':>6}{'429%':>7}"
    head += f"{'input $':>10}{'total $':>10}{'refill max/mean':>17}"
    lines = [head]
    for name, p in policies.items():
        row = f"{name:<27}{_fmt(p['hit_ratio'], 100, 1):>6}"
        for c in classes:
            st = p["classes"][c]
            pp = f"{_fmt(st['ttft_p50_s'])}/{_fmt(st['ttft_p99_s'])}"
            row += f"{pp:>20}{_fmt(st.get('slo_attainment'), 100, 1):>6}"
            row += f"{_fmt(st['rate_429'], 100, 2):>7}"
        spreads = [f["spread_max_over_mean"] for f in p["failures"]]
        spread = "/".join(_fmt(s) for s in spreads) or "-"
        row += f"{p['cost_usd']['input']:>10.2f}{p['cost_usd']['total']:>10.2f}{spread:>17}"
        lines.append(row)
    rr = policies.get("round-robin")
    if rr and rr["cost_usd"]["input"]:
        ratios = ", ".join(
            f"{name} {p['cost_usd']['input'] / rr['cost_usd']['input']:.2f}x"
            for name, p in policies.items()
            if name != "round-robin"
        )
        lines.append("")
        lines.append(f"input cost relative to round-robin: {ratios}")
    return lines


def _policy_notes(name: str, p: Mapping[str, Any]) -> str:
    """One policy's throughput, balance, spills and P/D figures, on one line."""
    row = f"{name}: output {_fmt(p.get('output_tokens_per_s'), 1, 0)} tokens/s"
    row += (
        f"; per cluster max/mean: requests {_fmt(p.get('requests_max_over_mean'))}, "
        f"prefill busy {_fmt(p.get('prefill_busy_max_over_mean'))}"
    )
    if p.get("spilled_sessions"):
        row += f"; {p['spilled_sessions']:,} sessions spilled"
    pd = p.get("pd")
    if pd:
        row += (
            f"; P/D: {pd['disaggregated']:,} disaggregated {pd['by_tier']}, "
            f"{pd['colocated_fallback']:,} prefilled colocated, KV transfer p50/p99 "
            f"{_fmt(pd['transfer_p50_s'], 1000, 1)}/{_fmt(pd['transfer_p99_s'], 1000, 1)} ms"
        )
    return row


def _window_rows(summary: Mapping[str, Any], classes: list[str]) -> list[str]:
    lines = ["inside the window(s) " + ", ".join(f"[{a}, {b})" for a, b in summary["windows"])]
    for name, p in summary["policies"].items():
        parts = [
            f"{c} p99 {_fmt(p['window'][c]['ttft_p99_s'])}s"
            f" (n={p['window'][c]['requests']}, 429 {_fmt(p['window'][c]['rate_429'], 100)}%)"
            for c in classes
        ]
        lines.append(f"  {name:<27}" + "; ".join(parts))
    return lines


def _fleet_event_rows(summary: Mapping[str, Any]) -> list[str]:
    """Remapping on membership changes, the failover plan, and each failure's re-prefill."""
    lines: list[str] = []
    if summary["remapped"]:
        lines.append("")
        for r in summary["remapped"]:
            lines.append(
                f"{r['event']}: {r['moved_share'] * 100:.3f}% of sessions remapped "
                f"(1/N = {r['one_over_n'] * 100:.3f}%, weight share "
                f"{r['expected_share'] * 100:.3f}%)"
            )
    for plan in summary.get("failover_plan", []):
        lines.append(
            f"{plan['event']}: its {plan['sessions']:,} sessions' secondaries "
            f"({plan['sessions_per_survivor']} per survivor): context tokens max/mean "
            f"{_fmt(plan['tokens_max_over_mean'])}, sessions max/mean "
            f"{_fmt(plan['sessions_max_over_mean'])}"
        )
    failures = [(n, f) for n, p in summary["policies"].items() for f in p["failures"]]
    if failures:
        lines.append("")
        for name, f in failures:
            base = f["random_assignment_max_over_mean"]
            lines.append(
                f"{name}: {f['cluster']} down {f['failed_at_s']}-{f['recovered_at_s']} s: "
                f"{f['reprefilling_sessions']} sessions re-prefilled "
                f"{f['reprefill_tokens']:,} tokens on {f['survivors_reached']}/"
                f"{f['survivors']} survivors, max/mean {_fmt(f['spread_max_over_mean'])} "
                f"(uniform random: median {_fmt(base['median'])}); failback "
                f"{f['failback_reprefill_tokens']:,} tokens"
            )
    return lines


def _figure(rows: int, cols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    # Figure + Agg canvas directly, not pyplot: no global figure registry, no backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(rows, cols, squeeze=False)


def plot(summary: Mapping[str, Any], path: str | Path) -> None:
    """One PNG: hit ratio and cost, TTFT p99 by class, failure spread, short TTFT over time."""
    policies = summary["policies"]
    names = list(policies)
    classes = list(summary["workload"]["classes"])
    figure, axes = _figure(2, 2, (15, 10))

    ax = axes[0][0]
    xs = np.arange(len(names))
    ax.bar(xs - 0.2, [policies[n]["hit_ratio"] or 0 for n in names], 0.4, label="hit ratio")
    ax.axhline(summary["workload"]["ideal_hit_ratio"], color="k", ls="--", lw=1, label="ideal")
    ax.set(ylim=(0, 1), ylabel="cached / prompt tokens", title="prefix-cache hit ratio and cost")
    twin = ax.twinx()
    twin.bar(
        xs + 0.2,
        [policies[n]["cost_usd"]["total"] for n in names],
        0.4,
        color="tab:orange",
        label="total $",
    )
    twin.set(ylabel="USD (input + output)")
    ax.set_xticks(xs, names, rotation=20, ha="right")
    handles = ax.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    ax.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper center", fontsize=8)

    ax = axes[0][1]
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        p99 = [policies[n]["classes"][c]["ttft_p99_s"] or 0.0 for c in classes]
        ax.bar(np.arange(len(classes)) + i * width, p99, width, label=n)
    ax.set_xticks(np.arange(len(classes)) + width * (len(names) - 1) / 2, classes)
    ax.set(ylabel="TTFT p99 (s)", title="TTFT p99 by class", yscale="log")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    for n in names:
        for f in policies[n]["failures"]:
            ax.bar(n, f["spread_max_over_mean"] or 0.0)
            base = f["random_assignment_max_over_mean"]["median"]
            if base is not None:
                ax.plot([n], [base], "k_", ms=30)
    ax.axhline(1.2, color="r", ls="--", lw=1, label="1.2")
    ax.set(ylabel="max / mean over survivors", title="failure re-prefill spread (— = random)")
    ax.tick_params(axis="x", rotation=20)
    ax.legend()

    ax = axes[1][1]
    edges = summary["timeline_edges_s"]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    for n in names:
        series = policies[n]["timeline_short_p99_s"]
        ax.plot(mids, [np.nan if v is None else v for v in series], label=n)
    for e in summary["events"]:
        ax.axvline(float(e.rsplit("@", 1)[1]), color="grey", lw=0.8, ls=":")
    for lo, hi in summary.get("windows", []):
        ax.axvspan(lo, hi, color="red", alpha=0.08)
    ax.set(
        xlabel="arrival time (s)",
        ylabel=f"{classes[0]} TTFT p99 (s)",
        yscale="log",
        title=f"{classes[0]}-class TTFT p99 over time (dotted: events, red: window)",
    )
    ax.legend(fontsize=8)
    figure.savefig(str(path), dpi=100)

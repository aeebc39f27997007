"""Tables of `extproc bench peers`: figures per run, then one markdown table per question."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extproc.bench.peer_procs import sum_counters
from extproc.bench.peer_runs import ENGINE_DOWN_S, RunResult
from extproc.harness.replay import percentile

LABELS: Mapping[str, str] = {
    "extproc": "Envoy + extproc, defaults",
    "extproc-tuned": "Envoy + extproc, tuned",
    "vllm-router:cache_aware": "vllm-router cache_aware",
    "vllm-router:consistent_hash": "vllm-router consistent_hash",
    "vllm-router:round_robin": "vllm-router round_robin",
    "smg:cache_aware": "smg cache_aware",
    "smg:round_robin": "smg round_robin",
    "direct": "client → engines, round robin",
}
# After a fault, the hit ratio is read over this long a window.
WINDOW_S = 20.0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def figures(run: RunResult, ideal: float) -> dict[str, Any]:
    """One run's figures, as the tables and the JSON summary show them."""
    replay = run.replay
    total = sum_counters(list(run.engines.values()))
    hit = total.cached_tokens / total.queried_tokens if total.queried_tokens else None
    per_engine = [c.requests for c in run.engines.values()]
    mean = sum(per_engine) / len(per_engine) if per_engine else 0.0
    ok = [o for o in replay.outcomes if o.outcome == "2xx"]
    e2e = [o.latency_s for o in ok if o.latency_s is not None]
    short, long = replay.ttfts("short"), replay.ttfts("long")
    sent = len(replay.outcomes)
    return {
        "setup": run.spec.setup,
        "label": LABELS.get(run.spec.setup, run.spec.setup),
        "placement": run.spec.placement,
        "replicas": run.spec.replicas,
        "requests": sent,
        "failed": sent - len(ok),
        "hit_ratio": hit,
        "hit_vs_ideal": None if hit is None or not ideal else hit / ideal,
        "client_hit_ratio": replay.hit_ratio,
        "short_n": len(short),
        "short_ttft_p50_s": percentile(short, 50),
        "short_ttft_p99_s": percentile(short, 99),
        "long_n": len(long),
        "long_ttft_p50_s": percentile(long, 50),
        "long_ttft_p99_s": percentile(long, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "engine_requests": {name: c.requests for name, c in run.engines.items()},
        "max_over_mean": max(per_engine) / mean if mean else None,
        "router_cpu_ms_per_request": (
            None if run.router_cpu_s is None or not sent else run.router_cpu_s / sent * 1000
        ),
        "router_rss_mb": run.router_rss_bytes / 2**20 if run.router_rss_bytes else None,
        "probe_p50_s": percentile(run.probe, 50),
        "probe_p90_s": percentile(run.probe, 90),
        "events": dict(run.events),
        "wall_s": replay.wall_s,
        "start_s": run.start_s,
        "errors": sorted(
            {f"{o.outcome}:{o.status or o.error}" for o in replay.outcomes if o.outcome != "2xx"}
        ),
    }


def main_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        "| set-up | hit ratio (engines) | ÷ ideal | short TTFT p50 / p99 ms (n) "
        "| long TTFT p50 / p99 ms (n) | e2e p50 / p99 ms | requests max/mean | failed "
        "| router CPU ms/request | router RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = r["router_cpu_ms_per_request"]
        rss = r["router_rss_mb"]
        lines.append(
            f"| {r['label']} | {_num(r['hit_ratio'])} | {_num(r['hit_vs_ideal'], 2)} "
            f"| {_ms(r['short_ttft_p50_s'])} / {_ms(r['short_ttft_p99_s'])} ({r['short_n']}) "
            f"| {_ms(r['long_ttft_p50_s'])} / {_ms(r['long_ttft_p99_s'])} ({r['long_n']}) "
            f"| {_ms(r['e2e_p50_s'])} / {_ms(r['e2e_p99_s'])} | {_num(r['max_over_mean'], 2)} "
            f"| {r['failed']} | {'-' if cpu is None else f'{cpu:.2f}'} "
            f"| {'-' if rss is None else f'{rss:.0f}'} |"
        )
    return lines


def latency_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    floor = next((r["probe_p50_s"] for r in rows if r["setup"] == "direct"), None)
    smg = next((r for r in rows if r["setup"] == "smg:cache_aware"), None)
    smg_added = None if smg is None or floor is None else smg["probe_p50_s"] - floor
    lines = [
        "| set-up | one connection p50 / p90 ms | added p50 vs direct ms | ÷ smg cache_aware's |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if r["probe_p50_s"] is None:
            continue
        added = None if floor is None else r["probe_p50_s"] - floor
        ratio = None if added is None or not smg_added or smg_added <= 0 else added / smg_added
        lines.append(
            f"| {r['label']} | {r['probe_p50_s'] * 1000:.2f} / {r['probe_p90_s'] * 1000:.2f} "
            f"| {'-' if added is None else f'{added * 1000:.2f}'} | {_num(ratio, 2)} |"
        )
    return lines


def _window_hit(run: RunResult, start: float, end: float) -> tuple[float | None, int]:
    chosen = [o for o in run.replay.outcomes if o.outcome == "2xx" and start <= o.sent_s < end]
    prompt = sum(o.prompt_tokens or 0 for o in chosen)
    cached = sum(o.cached_tokens or 0 for o in chosen)
    return (cached / prompt if prompt else None), len(chosen)


def _failed(run: RunResult, start: float, end: float) -> int:
    return sum(1 for o in run.replay.outcomes if o.outcome != "2xx" and start <= o.sent_s < end)


def fault_row(run: RunResult) -> dict[str, Any]:
    ev = run.events
    killed, back = ev.get("engine_killed", 0.0), ev.get("engine_back", 0.0)
    stopped, restarted = ev.get("router_stopped", 0.0), ev.get("router_back", 0.0)
    # A request sent just before the kill can still fail on it: the window opens 2 s earlier.
    return {
        "setup": run.spec.setup,
        "label": LABELS.get(run.spec.setup, run.spec.setup),
        "events": dict(ev),
        "failed_engine_down": _failed(run, killed - 2.0, back),
        "failed_router_restart": _failed(run, stopped - 2.0, restarted + 1.0),
        "failed_other": len([o for o in run.replay.outcomes if o.outcome != "2xx"])
        - _failed(run, killed - 2.0, back)
        - _failed(run, stopped - 2.0, restarted + 1.0),
        "hit_before_kill": _window_hit(run, 0.0, killed)[0],
        "hit_after_engine_back": _window_hit(run, back, back + WINDOW_S)[0],
        "hit_before_restart": _window_hit(run, stopped - WINDOW_S, stopped)[0],
        "hit_after_restart": _window_hit(run, restarted, restarted + WINDOW_S)[0],
        "restart_s": restarted - stopped,
    }


def fault_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        f"| set-up | failed, engine down {ENGINE_DOWN_S:g} s | hit before the kill "
        f"| hit {WINDOW_S:g} s after it is back | failed, router restart (s down) "
        f"| hit {WINDOW_S:g} s before the restart | hit {WINDOW_S:g} s after | other failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['failed_engine_down']} | {_num(r['hit_before_kill'])} "
            f"| {_num(r['hit_after_engine_back'])} "
            f"| {r['failed_router_restart']} ({r['restart_s']:.1f}) "
            f"| {_num(r['hit_before_restart'])} | {_num(r['hit_after_restart'])} "
            f"| {r['failed_other']} |"
        )
    return lines


def replicas_table(one: Sequence[Mapping[str, Any]], two: Sequence[Mapping[str, Any]]) -> list[str]:
    single = {r["setup"]: r for r in one}
    lines = [
        "| set-up | hit ratio, 1 replica | hit ratio, 2 replicas | difference (points) "
        "| short TTFT p99 ms, 1 / 2 |",
        "|---|---|---|---|---|",
    ]
    for r in two:
        s = single.get(r["setup"])
        if s is None:
            continue
        diff = None
        if s["hit_ratio"] is not None and r["hit_ratio"] is not None:
            diff = (r["hit_ratio"] - s["hit_ratio"]) * 100
        lines.append(
            f"| {r['label']} | {_num(s['hit_ratio'])} | {_num(r['hit_ratio'])} "
            f"| {'-' if diff is None else f'{diff:+.1f}'} "
            f"| {_ms(s['short_ttft_p99_s'])} / {_ms(r['short_ttft_p99_s'])} |"
        )
    return lines


def ramp_row(
    run: RunResult, steps: Sequence[float], step_s: float, bound_s: float
) -> dict[str, Any]:
    cells = []
    sustained = None
    holding = True  # the highest rate of the steps before the first one that fails
    for start in steps:
        sent = [o for o in run.replay.outcomes if start <= o.scheduled_s < start + step_s]
        short = [
            o.ttft_s
            for o in sent
            if o.outcome == "2xx" and o.klass == "short" and o.ttft_s is not None
        ]
        p99 = percentile(short, 99)
        failed = sum(1 for o in sent if o.outcome != "2xx")
        rate = len(sent) / step_s
        ok = p99 is not None and p99 <= bound_s and failed == 0
        holding = holding and ok
        if holding:
            sustained = rate
        cells.append({"rate": rate, "short_p99_s": p99, "failed": failed, "ok": ok})
    return {
        "setup": run.spec.setup,
        "label": LABELS.get(run.spec.setup, run.spec.setup),
        "steps": cells,
        "sustained_rate": sustained,
    }


def ramp_table(rows: Sequence[Mapping[str, Any]], bound_s: float) -> list[str]:
    if not rows:
        return []
    n = len(rows[0]["steps"])
    head = " | ".join(f"step {i + 1}" for i in range(n))
    lines = [
        f"| set-up | {head} | highest rate with short TTFT p99 ≤ {bound_s * 1000:.0f} ms, "
        "no failure (requests/s) |",
        "|---|" + "---|" * n + "---|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{c['rate']:.0f}/s: {_ms(c['short_p99_s'])} ms"
            + ("" if c["failed"] == 0 else f", {c['failed']} failed")
            for c in r["steps"]
        )
        rate = r["sustained_rate"]
        lines.append(f"| {r['label']} | {cells} | {'-' if rate is None else f'{rate:.0f}'} |")
    return lines

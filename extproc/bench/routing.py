"""`extproc bench routing`: one workload through three front doors, side by side in one run.

The same requests, replayed open-loop at the same instants, go through:

1. ``round_robin`` — Envoy alone, round robin over every cluster (what a plain L7 balancer does);
2. ``ring_hash`` — Envoy alone, consistent hashing on the session header: Envoy-native
   stickiness, no body inspection, no budgets (requests without the header land anywhere);
3. ``extproc`` — Envoy + this processor: session / prefix affinity from the body, class budgets
   and per-class cluster pools configured as an operator would (``operator_classes``).

Each set-up gets a fresh fleet (new simulated clusters: empty caches, idle queues), so no set-up
inherits another's warm cache. Reported per set-up: the token-weighted prefix-cache hit ratio
(beside the workload's ideal: one infinite cache serving everything in order), TTFT p50/p95/p99
per class, short-class TTFT p99 inside vs outside the long-context burst windows, 429s (and
whether each carried retry-after), errors, and an account of every request.

Time: the simulated clusters run ``1/speedup`` times real time (``--time-scale``), exactly as
fast as the replay compresses arrivals, so each cluster sees the load it would see at real
speed. Latencies are wall-clock milliseconds as the client saw them; multiply by the speedup for
simulated time (the proxies' own cost, ~1-2 ms, is not compressed).

``--workload tenant-flood`` is another comparison: one tenant's flood beside 20 steady tenants
in the long class, Envoy + the processor once per ``flow.fairness``
(extproc/bench/routing_tenants.py).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import orjson

from extproc.harness.kvmodel import ClusterParams
from extproc.harness.launch import FleetStack
from extproc.harness.layouts import LAYOUTS, add_layout_arguments, layout_from_args
from extproc.harness.prompts import BLOCK_TOKENS, block_hashes, canonical_prompt, count_tokens
from extproc.harness.replay import (
    CLASSES,
    ClassBounds,
    ReplayOptions,
    ReplayResult,
    percentile,
    plot_comparison,
    run_replay,
    write_json,
)
from extproc.harness.trace import (
    TraceRequest,
    ideal_hit_ratio,
    read_trace,
    trace_to_requests,
    working_set_tokens,
)
from extproc.harness.workload import BurstSpec, ReplayRequest, WorkloadConfig, generate_workload

if TYPE_CHECKING:
    from extproc.core.chains import Chain
from extproc.render.envoy import Mode

# The Envoy modes, plus the processor with engines.affinity: round_robin (clusters of several
# engines: session affinity to the cluster only, no engine stickiness).
Setup = Literal["round_robin", "ring_hash", "extproc", "extproc_engine_rr"]
SETUPS: tuple[Setup, ...] = ("round_robin", "ring_hash", "extproc", "extproc_engine_rr")
# Without several engines per cluster the fourth set-up is the third one.
SINGLE_ENGINE_SETUPS: tuple[Setup, ...] = SETUPS[:3]
LABELS: Mapping[Setup, str] = {
    "extproc_engine_rr": "Envoy + extproc, round robin over each cluster's engines",
    "round_robin": "Envoy round robin",
    "ring_hash": "Envoy ring hash (session header)",
    "extproc": "Envoy + extproc",
}
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "third_party/mooncake/mooncake_synthetic_trace.jsonl"
)
# One long-context burst in the middle of the synthetic workload: 0.5 requests/s of 150K-token
# prompts for 30 s, i.e. ~15 requests that each need 7.5 s of prefill on a 20K tokens/s cluster.
DEFAULT_BURST = "40,30,0.5,150000"
# Speedups that keep each run to about a minute of wall time on a 2-core machine.
DEFAULT_SPEEDUP = {"trace": 20.0, "synthetic": 4.0, "layout": 4.0, "tenant-flood": 4.0}
# The simulator's own default KV capacity; auto-sizing never goes below it.
SIM_DEFAULT_KV = ClusterParams().kv_capacity_tokens
# Targets for set-up 3 (from the issue).
TARGET_HIT_VS_IDEAL = 0.9
TARGET_HIT_VS_RR = 2.0
TARGET_BURST_RATIO = 1.5


# -- the fleet ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimProfile:
    """What every simulated cluster is: the same hardware in every set-up."""

    clusters: int
    kv_capacity_tokens: int
    prefill_tps: float
    decode_tps: float
    max_concurrency: int
    time_scale: float
    max_output: int
    # Engines per cluster, each its own simulated process with its own KV cache of
    # kv_capacity_tokens (FleetStack.engines).
    engines: int = 1

    def sim_args(self) -> tuple[str, ...]:
        return (
            "--kv-capacity-tokens",
            str(self.kv_capacity_tokens),
            "--prefill-tps",
            f"{self.prefill_tps:g}",
            "--decode-tps",
            f"{self.decode_tps:g}",
            "--max-concurrency",
            str(self.max_concurrency),
            "--time-scale",
            f"{self.time_scale:g}",
            "--max-output",
            str(self.max_output),
        )


def cluster_names(count: int) -> list[str]:
    # FleetStack names its clusters c1..cN in this order.
    return [f"c{i}" for i in range(1, count + 1)]


def refused_at_once(classes: list[dict[str, Any]]) -> dict[str, Any]:
    """fleet.yaml overrides for the 429 contract without flow control: no class
    waits for budget and no new session is placed off its full primary, so an over-budget
    request gets its 429 at once (``--no-wait``, to compare with the default)."""
    return {
        "classes": [{**c, "wait": {"max_wait_s": 0}} for c in classes],
        "flow": {"place_new_sessions": False},
    }


def operator_classes(
    profile: SimProfile, bounds: ClassBounds, long_clusters: int, long_slots: int
) -> list[dict[str, Any]]:
    """The classes an operator would configure for this fleet (set-up 3), sized from the
    clusters' own capacity.

    - Two pools: the last ``long_clusters`` clusters take long-context requests, the others
      take short and medium ones. A cluster prefills one request at a time (FIFO), so a
      150K-token prompt holds every later prompt on its cluster back by 7.5 s at 20K tokens/s:
      no budget on a shared cluster can keep short TTFT flat while one long prefill is running
      there. Only keeping long prefills off the interactive clusters can. Short and medium share
      one pool so that a chat session growing past the short bound keeps its cluster (rendezvous
      over the same set, same key => same primary) and its cache.
    - short: ``max_concurrent`` = the cluster's concurrency slots. Beyond them a request would
      only queue inside the engine; a 429 with a hint is the better answer.
    - medium: ``max_inflight_tokens`` = half the KV capacity (input + output cap of admitted,
      unfinished requests), so medium traffic alone can never fill a cluster's KV and starve
      short requests of memory or evict every cached prefix.
    - long: ``max_concurrent`` = ``long_slots`` per long-context cluster: one prefilling and
      the rest queued behind it, which bounds an admitted long request's queueing to
      ``long_slots - 1`` prefills; the excess gets 429 with a retry-after computed from the
      class's observed completion rate instead of waiting minutes in a queue.
    """
    names = cluster_names(profile.clusters)
    # long_clusters == 0: no pools, every class on every cluster (eligible [] = all), budgets
    # only — the configuration that shows what budgets alone can and cannot do.
    long_pool = names[-long_clusters:] if long_clusters else []
    interactive = names[:-long_clusters] if long_clusters else []
    return [
        {
            "name": "short",
            "max_input_tokens": bounds.short_below,
            "eligible": interactive,
            "budget": {"max_concurrent": profile.max_concurrency},
        },
        {
            "name": "medium",
            "max_input_tokens": bounds.long_from,
            "eligible": interactive,
            "budget": {"max_inflight_tokens": profile.kv_capacity_tokens // 2},
        },
        {"name": "long", "eligible": long_pool, "budget": {"max_concurrent": long_slots}},
    ]


# -- workloads ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    name: str  # "trace" | "synthetic" | "layout"
    description: str
    requests: tuple[ReplayRequest, ...]
    burst_windows: tuple[tuple[float, float], ...]
    ideal_source: str
    unique_tokens: int  # distinct prefix blocks x block size: the working set of the workload
    # How to compute the ideal for any subset (by index) of the requests: a trace keeps its
    # block ids (trace.ideal_hit_ratio), the synthetic mix its prompts' block hashes.
    trace_requests: tuple[TraceRequest, ...] = ()
    prompt_blocks: tuple[tuple[tuple[int, ...], int], ...] = ()

    @property
    def ideal_hit_ratio(self) -> float:
        return self.ideal(range(len(self.requests)))

    def ideal(self, indexes: Iterable[int]) -> float:
        """Hit ratio of one infinite cache serving just these requests, in arrival order.

        A set-up that answers some requests with 429 is compared with the ideal of the requests
        it served: a rejected request neither counts nor warms any cache.
        """
        chosen = sorted(indexes)
        if self.trace_requests:
            return ideal_hit_ratio([self.trace_requests[i] for i in chosen])
        return blocks_ideal([self.prompt_blocks[i] for i in chosen])


def trace_workload(path: Path, max_requests: int | None, seed: int, share: float) -> Workload:
    trace = read_trace(path)
    for issue in trace.issues[:10]:
        print(f"{path}:{issue.line}: skipped: {issue.reason}", file=sys.stderr)
    selected = list(trace.requests)
    if max_requests is not None:
        selected = selected[:max_requests]
    requests = trace_to_requests(selected, session_header_share=share, seed=seed)
    span = selected[-1].arrival_s - selected[0].arrival_s if selected else 0.0
    return Workload(
        name="trace",
        description=(
            f"{path.name}: {len(selected)} of {len(trace.requests)} requests over {span:.0f} s "
            f"({len(trace.issues)} malformed lines skipped)"
        ),
        requests=tuple(requests),
        burst_windows=(),
        ideal_source="trace.ideal_hit_ratio: block ids, one infinite cache",
        unique_tokens=working_set_tokens(selected),
        trace_requests=tuple(selected),
    )


def prompt_blocks(requests: Sequence[ReplayRequest]) -> list[tuple[tuple[int, ...], int]]:
    """(block hashes, prompt tokens) per request, exactly as the simulated cluster computes
    them from the request body."""
    out: list[tuple[tuple[int, ...], int]] = []
    for request in requests:
        text = canonical_prompt(request.api, request.materialize())
        out.append((block_hashes(text), count_tokens(text)))
    return out


def blocks_ideal(requests: Sequence[tuple[tuple[int, ...], int]]) -> float:
    """Token-weighted hit ratio of one infinite prefix cache (chained block hashes)."""
    seen: set[int] = set()
    cached = prompt = 0
    for hashes, tokens in requests:
        matched = 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            matched += 1
        cached += min(matched * BLOCK_TOKENS, tokens)
        prompt += tokens
        seen.update(hashes)
    return cached / prompt if prompt else 0.0


def synthetic_workload(args: argparse.Namespace) -> Workload:
    bursts = tuple(BurstSpec.parse(text) for text in (args.burst or [DEFAULT_BURST]))
    config = WorkloadConfig(
        seed=args.seed,
        duration_s=args.workload_duration,
        chat_sessions_per_s=args.chat_rate,
        rag_per_s=args.rag_rate,
        agent_sessions_per_s=args.agent_rate,
        session_header_share=args.session_share,
        bursts=bursts,
    )
    requests = generate_workload(config)
    if args.max_requests is not None:
        requests = requests[: args.max_requests]
    kinds = Counter(r.kind for r in requests)
    return _prompt_workload(
        "synthetic",
        f"synthetic, {config.duration_s:g} s, seed {config.seed}: "
        + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
        + "; bursts "
        + "; ".join(
            f"{b.rate_per_s:g}/s x {b.input_tokens} tokens in [{b.start_s:g}, "
            f"{b.start_s + b.duration_s:g}) s"
            for b in bursts
        ),
        requests,
        config.burst_windows,
    )


def layout_workload(args: argparse.Namespace) -> Workload:
    """A shared opening in one position (extproc.harness.layouts), no session headers."""
    requests = layout_from_args(args)
    if args.max_requests is not None:
        requests = requests[: args.max_requests]
    docs = sum(1 for r in requests if r.kind != "chat")
    return _prompt_workload(
        "layout",
        f"layout {args.layout}: {args.layout_conversations} conversations x "
        f"{args.layout_turns} turns, seed {args.seed} ({docs} requests carry a shared document)",
        requests,
        (),
    )


def _prompt_workload(
    name: str,
    description: str,
    requests: Sequence[ReplayRequest],
    windows: tuple[tuple[float, float], ...],
) -> Workload:
    blocks = prompt_blocks(requests)
    return Workload(
        name=name,
        description=description,
        requests=tuple(requests),
        burst_windows=windows,
        ideal_source="the simulator's block hashes of each prompt, one infinite cache",
        unique_tokens=len({h for hashes, _tokens in blocks for h in hashes}) * BLOCK_TOKENS,
        prompt_blocks=tuple(blocks),
    )


# -- one set-up ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetupRun:
    mode: Setup
    result: ReplayResult
    envoy_requests: int  # downstream requests Envoy counted: every attempt the client made
    setup_s: float
    # Requests Envoy sent on without the processor's answer (failure_mode_allow: routed by its
    # default route, not by the decision) and its ext_proc message timeouts; 0 without extproc.
    fail_open: int = 0
    message_timeouts: int = 0


def _run(main: Coroutine[Any, Any, ReplayResult]) -> ReplayResult:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def envoy_mode(setup: Setup) -> Mode:
    return "extproc" if setup == "extproc_engine_rr" else setup


def run_setup(
    mode: Setup,
    workload: Workload,
    profile: SimProfile,
    options: ReplayOptions,
    classes: list[dict[str, Any]],
    workdir: Path,
    prefix_key: str = "chain",
    message_timeout_ms: int | None = None,
    waiting: bool = True,
) -> SetupRun:
    started = time.monotonic()

    def make_stack() -> FleetStack:
        # The class list is the same in every set-up, but only the processor reads it: the
        # Envoy-only modes have neither classes nor budgets. The product's default prefix key,
        # named: FleetStack's own default is the stateless opening key (tests predict
        # placements without the learnt chains).
        overrides: dict[str, Any] = {"classes": classes, "prefix": {"key": prefix_key}}
        if mode == "extproc_engine_rr":
            overrides["engines"] = {"affinity": "round_robin"}
        if message_timeout_ms is not None:
            overrides["processor"] = {"message_timeout_ms": message_timeout_ms}
        if not waiting:
            overrides.update(refused_at_once(classes))
        return FleetStack(
            workdir,
            clusters=profile.clusters,
            engines=profile.engines,
            # Many engine processes start at once: slower on a loaded 2-core machine (at load
            # ~30, 20 s per engine was not enough for 8 clusters to come up).
            sim_start_timeout_s=90.0 * max(1, profile.engines),
            mode=envoy_mode(mode),
            sim_args=profile.sim_args(),
            fleet_overrides=overrides,
            processor_args=("--log-level", "warning", "--seed", "0"),
            access_log=False,
        )

    stack = make_stack()
    stack.start()  # FleetStack retries once with fresh ports on a start failure
    try:
        ready = time.monotonic()
        result = _run(run_replay(workload.requests, stack.url, options))
        envoy_requests = stack.envoy_stat("http.ingress.downstream_rq_total")
        fail_open = timeouts = 0
        if envoy_mode(mode) == "extproc":
            fail_open = stack.envoy_stat("http.ingress.ext_proc.failure_mode_allowed")
            timeouts = stack.envoy_stat("http.ingress.ext_proc.message_timeouts")
    finally:
        stack.stop()
    return SetupRun(mode, result, envoy_requests, ready - started, fail_open, timeouts)


# -- the comparison -----------------------------------------------------------------------------


def _sticky(result: ReplayResult) -> tuple[int, int]:
    """(sessions with >= 2 served requests, of which served by exactly one cluster)."""
    where: dict[str, set[str]] = defaultdict(set)
    counts: Counter[str] = Counter()
    for o in result.outcomes:
        if o.outcome == "2xx" and o.session_id and o.served_by:
            where[o.session_id].add(o.served_by)
            counts[o.session_id] += 1
    multi = [s for s, n in counts.items() if n >= 2]
    return len(multi), sum(1 for s in multi if len(where[s]) == 1)


def _before_burst(
    result: ReplayResult,
    requests: Sequence[ReplayRequest],
    windows: Sequence[tuple[float, float]],
) -> list[float]:
    """Short-class TTFTs of requests sent before the first burst starts (a clean baseline:
    outside-window requests just after a burst can still queue behind its backlog)."""
    if not windows:
        return []
    first = min(start for start, _end in windows)
    # Outcome indexes are positions in the arrival-ordered input, which requests already are.
    return [
        o.ttft_s
        for o in result.outcomes
        if o.outcome == "2xx"
        and o.klass == "short"
        and o.ttft_s is not None
        and requests[o.index].arrival_s < first
    ]


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def setup_report(run: SetupRun, workload: Workload) -> dict[str, Any]:
    result = run.result
    summary = result.summary()
    outcomes = summary["all"]["outcomes"]
    rejected = [o for o in result.outcomes if o.outcome == "429"]
    with_hint = sum(1 for o in rejected if o.retry_after)
    errors = Counter(
        f"{o.outcome}:{o.status if o.status is not None else o.error}"
        for o in result.outcomes
        if o.outcome not in ("2xx", "429")
    )
    # Lost = the client got no HTTP answer at all, or a 429 without a hint it could act on.
    lost = outcomes["transport"] + outcomes["timeout"] + (len(rejected) - with_hint)
    attempts = len(result.outcomes) + summary["retries"]
    multi, sticky = _sticky(result)
    served = [o.index for o in result.outcomes if o.outcome == "2xx"]
    ideal_served = workload.ideal(served) if served else None
    short_in = result.ttfts("short", in_burst=True)
    short_out = result.ttfts("short", in_burst=False)
    before = _before_burst(result, workload.requests, workload.burst_windows)
    p99_in, p99_out, p99_before = (percentile(v, 99) for v in (short_in, short_out, before))
    return {
        "label": LABELS[run.mode],
        "requests": len(workload.requests),
        "outcomes_recorded": len(result.outcomes),
        "skipped": result.skipped,
        "outcomes": outcomes,
        "429_with_retry_after": with_hint,
        "errors": dict(sorted(errors.items())),
        "lost": lost,
        "attempts": attempts,
        "envoy_downstream_requests": run.envoy_requests,
        "ext_proc_fail_open": run.fail_open,
        "ext_proc_message_timeouts": run.message_timeouts,
        "hit_ratio": result.hit_ratio,
        "ideal_of_served": ideal_served,
        "hit_vs_ideal": _div(result.hit_ratio, ideal_served),
        "sessions_multi": multi,
        "sessions_on_one_cluster": sticky,
        "clusters": result.clusters,
        "classes": {
            k: {
                "n_2xx": summary["classes"][k]["outcomes"]["2xx"],
                "n": summary["classes"][k]["count"],
                "429": summary["classes"][k]["outcomes"]["429"],
                "ttft_p50_s": summary["classes"][k]["ttft_p50_s"],
                "ttft_p95_s": summary["classes"][k]["ttft_p95_s"],
                "ttft_p99_s": summary["classes"][k]["ttft_p99_s"],
                "hit_ratio": summary["classes"][k]["hit_ratio"],
            }
            for k in CLASSES
        },
        "burst": {
            "short_in_n": len(short_in),
            "short_out_n": len(short_out),
            "short_before_n": len(before),
            "short_p99_in_s": p99_in,
            "short_p99_out_s": p99_out,
            "short_p99_before_s": p99_before,
            "ratio_in_out": _div(p99_in, p99_out),
            "ratio_in_before": _div(p99_in, p99_before),
        },
        "wall_s": result.wall_s,
        "max_send_lag_s": summary["max_send_lag_s"],
        "delayed": summary["delayed"],
        "start_s": run.setup_s,
    }


def _hit_ratio_of(result: ReplayResult, indexes: set[int]) -> float | None:
    chosen = [o for o in result.outcomes if o.index in indexes]
    prompt = sum(o.prompt_tokens or 0 for o in chosen)
    return sum(o.cached_tokens or 0 for o in chosen) / prompt if prompt else None


def add_common(
    reports: Mapping[Setup, dict[str, Any]], runs: Mapping[Setup, SetupRun], workload: Workload
) -> dict[str, Any]:
    """Hit ratios over the requests every set-up served (like for like when budgets reject)."""
    served = [{o.index for o in r.result.outcomes if o.outcome == "2xx"} for r in runs.values()]
    common = set.intersection(*served) if served else set()
    for mode, run in runs.items():
        reports[mode]["hit_ratio_common"] = _hit_ratio_of(run.result, common)
    return {
        "requests": len(common),
        "ideal": workload.ideal(common) if common else None,
    }


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: str
    met: bool | None  # None: not measurable in this run


def targets(reports: Mapping[Setup, dict[str, Any]], workload: Workload) -> list[Target]:
    out: list[Target] = []
    ext = reports.get("extproc")
    rr = reports.get("round_robin")
    if ext is not None and ext["hit_ratio"] is not None:
        ratio = ext["hit_vs_ideal"]
        out.append(
            Target(
                f"extproc hit ratio >= {TARGET_HIT_VS_IDEAL:g} x ideal (of the requests it served)",
                f"{ext['hit_ratio']:.3f} / {_num(ext['ideal_of_served'])} = {_num(ratio, 2)} x",
                None if ratio is None else ratio >= TARGET_HIT_VS_IDEAL,
            )
        )
        if rr is not None and rr["hit_ratio"]:
            vs_rr = ext["hit_ratio"] / rr["hit_ratio"]
            common = _div(ext.get("hit_ratio_common"), rr.get("hit_ratio_common"))
            out.append(
                Target(
                    f"extproc hit ratio >= {TARGET_HIT_VS_RR:g} x round robin",
                    f"{ext['hit_ratio']:.3f} / {rr['hit_ratio']:.3f} = {vs_rr:.2f} x "
                    f"(over the requests both served: {_num(common, 2)} x)",
                    vs_rr >= TARGET_HIT_VS_RR,
                )
            )
    spray = reports.get("extproc_engine_rr")
    if ext is not None and spray is not None and ext["hit_ratio"] and spray["hit_ratio"]:
        out.append(
            Target(
                "engine stickiness vs round robin over each cluster's engines (hit ratio x ideal)",
                f"{_num(ext['hit_vs_ideal'], 2)} x vs {_num(spray['hit_vs_ideal'], 2)} x",
                ext["hit_ratio"] > spray["hit_ratio"],
            )
        )
    if ext is not None and workload.burst_windows:
        # Two baselines: outside the windows (the replayer's split) and before the first burst.
        # A burst's backlog outlives its window on a FIFO cluster, so "outside" can be inflated
        # by the burst itself and flatter a set-up; "before" is untouched by it.
        def pair(mode: Setup) -> str:
            b = reports[mode]["burst"]
            return f"{_num(b['ratio_in_out'], 2)} / {_num(b['ratio_in_before'], 2)}"

        ratios = (ext["burst"]["ratio_in_out"], ext["burst"]["ratio_in_before"])
        beside = ", ".join(
            f"{LABELS[m]} {pair(m)}" for m in SETUPS if m in reports and m != "extproc"
        )
        out.append(
            Target(
                f"extproc short TTFT p99 in burst <= {TARGET_BURST_RATIO:g} x without "
                "(in/outside the windows / in/before the first burst)",
                pair("extproc") + (f" (beside: {beside})" if beside else ""),
                None
                if None in ratios
                else all(r is not None and r <= TARGET_BURST_RATIO for r in ratios),
            )
        )
    lost = {m: r["lost"] for m, r in reports.items()}
    unaccounted = {
        m: r["requests"] - r["outcomes_recorded"] - r["skipped"] for m, r in reports.items()
    }
    out.append(
        Target(
            "no request lost (every request has one outcome; no transport error, timeout or "
            "429 without retry-after)",
            ", ".join(f"{m}: lost {lost[m]}, unaccounted {unaccounted[m]}" for m in reports),
            all(v == 0 for v in lost.values()) and all(v == 0 for v in unaccounted.values()),
        )
    )
    return out


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_report(
    reports: Mapping[Setup, dict[str, Any]],
    common: Mapping[str, Any],
    workload: Workload,
    profile: SimProfile,
    classes: Sequence[Mapping[str, Any]],
) -> str:
    speedup = 1.0 / profile.time_scale
    lines = [
        f"workload: {workload.description}",
        f"ideal hit ratio ({workload.ideal_source}): {workload.ideal_hit_ratio:.3f}; "
        f"working set {workload.unique_tokens / 1e6:.2f}M tokens",
        f"fleet: {profile.clusters} simulated clusters of {profile.engines} engine(s), KV "
        f"{profile.kv_capacity_tokens / 1e6:.2f}M tokens per engine, prefill "
        f"{profile.prefill_tps:g} tok/s, decode {profile.decode_tps:g} "
        f"tok/s/request, {profile.max_concurrency} slots; simulated time runs {speedup:g}x real",
        f"extproc classes: {describe_classes(classes)}",
        "",
        "| set-up | requests | 2xx | 429 (with retry-after) | 413 | other 4xx | 5xx | transport"
        " | timeout | lost | Envoy saw |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports.values():
        o = r["outcomes"]
        lines.append(
            f"| {r['label']} | {r['requests']} | {o['2xx']} | {o['429']} "
            f"({r['429_with_retry_after']}) | {o['413']} | {o['4xx']} | {o['5xx']} "
            f"| {o['transport']} | {o['timeout']} | {r['lost']} "
            f"| {r['envoy_downstream_requests']} |"
        )
    lines += [
        "",
        "| set-up | hit ratio (2xx) | ideal, same requests | hit / ideal "
        f"| hit ratio, the {common['requests']} requests all served (ideal "
        f"{_num(common['ideal'])}) | sessions on one cluster |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports.values():
        lines.append(
            f"| {r['label']} | {_num(r['hit_ratio'])} | {_num(r['ideal_of_served'])} "
            f"| {_num(r['hit_vs_ideal'], 2)} | {_num(r['hit_ratio_common'])} "
            f"| {r['sessions_on_one_cluster']}/{r['sessions_multi']} |"
        )
    lines += [
        "",
        f"TTFT per class, wall ms (x{speedup:g} for simulated ms): p50 / p95 / p99 (2xx of sent)",
        "",
        "| set-up | " + " | ".join(CLASSES) + " |",
        "|---|" + "---|" * len(CLASSES),
    ]
    for r in reports.values():
        cells = []
        for k in CLASSES:
            c = r["classes"][k]
            cells.append(
                f"{_ms(c['ttft_p50_s'])} / {_ms(c['ttft_p95_s'])} / {_ms(c['ttft_p99_s'])} "
                f"({c['n_2xx']} of {c['n']})"
            )
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    if workload.burst_windows:
        lines += [
            "",
            "short-class TTFT p99, wall ms: inside the burst windows vs outside them (and vs"
            " before the first burst)",
            "",
            "| set-up | in burst (n) | outside (n) | in / outside | before burst (n)"
            " | in / before |",
            "|---|---|---|---|---|---|",
        ]
        for r in reports.values():
            b = r["burst"]
            lines.append(
                f"| {r['label']} | {_ms(b['short_p99_in_s'])} ({b['short_in_n']}) "
                f"| {_ms(b['short_p99_out_s'])} ({b['short_out_n']}) "
                f"| {_num(b['ratio_in_out'], 2)} "
                f"| {_ms(b['short_p99_before_s'])} ({b['short_before_n']}) "
                f"| {_num(b['ratio_in_before'], 2)} |"
            )
    lines += ["", "requests per cluster (2xx):"]
    for r in reports.values():
        spread = ", ".join(f"{name}={n}" for name, n in r["clusters"].items())
        lines.append(f"- {r['label']}: {spread}")
    errors = {r["label"]: r["errors"] for r in reports.values() if r["errors"]}
    if errors:
        lines += ["", "non-2xx, non-429 outcomes (kind:status or error):"]
        lines += [f"- {label}: {found}" for label, found in errors.items()]
    lines += [
        "",
        "replay: "
        + "; ".join(
            f"{r['label']} wall {r['wall_s']:.0f} s, max send lag {r['max_send_lag_s'] * 1000:.0f}"
            f" ms, held by the concurrency cap {r['delayed']}"
            for r in reports.values()
        ),
    ]
    return "\n".join(lines)


def describe_classes(classes: Sequence[Mapping[str, Any]]) -> str:
    """One line per class: bound, clusters, budget (for the report and BENCHMARKS.md)."""
    parts = []
    for cls in classes:
        bound = cls.get("max_input_tokens")
        where = ",".join(cls["eligible"]) if cls["eligible"] else "all clusters"
        budget = ", ".join(f"{k} {v}" for k, v in cls["budget"].items()) or "no budget"
        below = f"< {bound} tokens" if bound else "the rest"
        parts.append(f"{cls['name']} ({below}) on {where}: {budget} per cluster")
    return "; ".join(parts)


def format_targets(found: Sequence[Target]) -> str:
    mark = {True: "met", False: "NOT met", None: "n/a"}
    return "\n".join(f"- {t.name}: {t.value} — {mark[t.met]}" for t in found)


# -- offline: which sessions a prefix key splits ---------------------------------------------------


def key_split(
    requests: Sequence[ReplayRequest],
    prefix_key: Literal["chain", "opening"],
    common_after: int,
    causes: bool = False,
) -> str:
    """Sessions (>= 2 requests) whose requests the processor's own ``parse_request`` gives more
    than one key, as one replica sees the requests in arrival order: each split session lands
    on more than one cluster whatever the placement. No Envoy, no clusters: not load-dependent.

    ``causes``: also say, for each split session, why its first request keyed differently from
    the session's first (whether it extends an earlier request of the session, which
    grandfathering should have kept), and how many chains the sketch promoted."""
    from extproc.core.chains import ChainParams, ChainSketch
    from extproc.core.facts import ParseLimits, RequestFacts, parse_request
    from extproc.core.keys import KeyRules, request_chain

    params = ChainParams(common_after=common_after)
    sketch = ChainSketch(params)
    rules = KeyRules(prefix_key=prefix_key, chain=params, sketch=sketch)
    keys: defaultdict[str, set[int]] = defaultdict(set)
    counts: Counter[str] = Counter()
    headed: dict[str, bool] = {}
    chains: defaultdict[str, list[Chain]] = defaultdict(list)
    first_key: dict[str, int] = {}
    why: dict[str, str] = {}
    promotions = 0
    ordered = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    for n in ordered:
        request = requests[n]
        sid = request.session_id or f"anon-{n}"
        headers = {"content-type": "application/json"}
        if request.send_session_header and request.session_id:
            headers["x-session-id"] = request.session_id
        body = orjson.dumps(request.materialize())
        facts = parse_request(request.path, headers, body, rules, ParseLimits())
        if isinstance(facts, RequestFacts):
            point = facts.session.point
            keys[sid].add(point)
            counts[sid] += 1
            headed[sid] = "x-session-id" in headers
            if causes and prefix_key == "chain" and not headed[sid]:
                promotions += len(sketch.drain_promotions())
                chain = request_chain(facts.api, orjson.loads(body), params)
                if point != first_key.setdefault(sid, point) and sid not in why:
                    why[sid] = _split_cause(chains[sid], chain)
                chains[sid].append(chain)
    multi = [sid for sid, n in counts.items() if n >= 2]
    split = [sid for sid in multi if len(keys[sid]) > 1]
    bare = sum(1 for sid in multi if not headed[sid])
    summary = (
        f"{prefix_key} key (common_after {common_after}): {len(split)} of {len(multi)} sessions "
        f"with >= 2 requests get more than one key ({sum(1 for s in split if not headed[s])} "
        f"of the {bare} without a session header)"
    )
    if not causes or prefix_key != "chain":
        return summary
    lines = [summary, f"  chains promoted (made common): {promotions}"]
    lines += [f"  {cause}: {n}" for cause, n in sorted(Counter(why.values()).items())]
    return "\n".join(lines)


def _split_cause(earlier: Sequence[Chain], chain: Chain) -> str:
    extends = any(
        0 < c.stable <= len(chain.hashes) and chain.hashes[: c.stable] == c.hashes[: c.stable]
        for c in earlier
    )
    if extends:
        return "extends an earlier request of its session, keyed differently (leaf lost)"
    return "extends no earlier request of its session (a new reader of a prefix made common)"


# -- CLI ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"Mooncake-format JSONL trace (default when no --workload: {DEFAULT_TRACE})",
    )
    source.add_argument(
        "--workload",
        choices=["synthetic", "tenant-flood"],
        help="the built-in synthetic mix, or one tenant's flood beside 20 steady tenants in the "
        "long class, one arm per flow.fairness (extproc/bench/routing_tenants.py)",
    )
    source.add_argument(
        "--layout",
        choices=LAYOUTS,
        help="conversations sharing one opening placed in this position (extproc.harness.layouts)",
    )
    parser.add_argument("--max-requests", type=int, default=None, help="replay only the first N")
    parser.add_argument(
        "--speedup",
        type=float,
        default=None,
        help="divide arrival times by this; the clusters run as much faster "
        f"(default {DEFAULT_SPEEDUP['trace']:g} for a trace, "
        f"{DEFAULT_SPEEDUP['synthetic']:g} for the synthetic workload)",
    )
    parser.add_argument(
        "--setups",
        default=None,
        help="comma-separated subset of "
        + ",".join(SETUPS)
        + " (default: all; without --engines-per-cluster > 1 the last is left out)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--session-share", type=float, default=0.5, help="share of sessions sending x-session-id"
    )
    parser.add_argument("--concurrency", type=int, default=1024, help="replayer in-flight cap")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    parser.add_argument(
        "--retry-429",
        action="store_true",
        help="clients honour retry-after (default: a 429 is the request's final outcome)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("out/bench/routing"))
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    fleet = parser.add_argument_group("simulated fleet")
    fleet.add_argument("--clusters", type=int, default=8)
    fleet.add_argument(
        "--engines-per-cluster",
        type=int,
        default=1,
        help="engines per cluster, each with its own KV cache (the fleet's KV is divided among "
        "all engines)",
    )
    fleet.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=None,
        help="per engine; default: the workload's working set / engines (the whole fleet can "
        f"hold every distinct prefix once), never below the simulator's {SIM_DEFAULT_KV}",
    )
    fleet.add_argument("--prefill-tps", type=float, default=20_000.0)
    fleet.add_argument("--decode-tps", type=float, default=50.0)
    fleet.add_argument("--max-concurrency", type=int, default=64)
    fleet.add_argument("--max-output", type=int, default=64, help="cap on output tokens")
    fleet.add_argument(
        "--long-clusters",
        type=int,
        default=None,
        help="clusters reserved for the long class in set-up 3 (default: a quarter, at least 1;"
        " 0: no pools, every class on every cluster, budgets only)",
    )
    fleet.add_argument(
        "--long-slots", type=int, default=2, help="long requests in flight per long cluster"
    )
    fleet.add_argument("--class-bounds", default="2048,100000", help="SHORT,LONG input tokens")

    parser.add_argument(
        "--key-split",
        action="store_true",
        help="offline, no Envoy: per prefix key, the sessions whose requests get more than one "
        "key (parse_request in arrival order)",
    )
    parser.add_argument(
        "--common-after",
        type=int,
        default=4,
        help="--key-split: the chain key's prefix.common_after",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="extproc answers every over-budget request with a 429 at once: no class waits for "
        "budget and no new session is placed off its full primary (flow control's defaults off)",
    )
    parser.add_argument(
        "--message-timeout-ms",
        type=int,
        default=None,
        help="the processor's ext_proc message timeout (default: the stack's 5000 ms); a "
        "loaded machine needs more, or Envoy fails open and routes without the processor",
    )
    parser.add_argument(
        "--prefix-key",
        choices=["chain", "opening"],
        default="chain",
        help="the extproc set-up's prefix key (chain: the default; opening: the old key)",
    )
    add_layout_arguments(parser)
    from extproc.bench import routing_tenants

    routing_tenants.add_arguments(parser)
    synthetic = parser.add_argument_group("synthetic workload")
    synthetic.add_argument("--workload-duration", type=float, default=120.0)
    synthetic.add_argument("--chat-rate", type=float, default=1.5, help="chat sessions per s")
    synthetic.add_argument("--rag-rate", type=float, default=0.5, help="RAG requests per s")
    synthetic.add_argument("--agent-rate", type=float, default=0.02, help="agent sessions per s")
    synthetic.add_argument(
        "--burst",
        action="append",
        default=None,
        metavar="START,DURATION,RATE,TOKENS",
        help=f"long-context burst, repeatable (default {DEFAULT_BURST})",
    )


def _profile(args: argparse.Namespace, workload: Workload, speedup: float) -> SimProfile:
    kv = args.kv_capacity_tokens
    engines = args.clusters * args.engines_per_cluster
    if kv is None:
        kv = max(SIM_DEFAULT_KV, math.ceil(workload.unique_tokens / engines))
    profile = SimProfile(
        clusters=args.clusters,
        kv_capacity_tokens=kv,
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        max_concurrency=args.max_concurrency,
        time_scale=1.0 / speedup,
        max_output=args.max_output,
        engines=args.engines_per_cluster,
    )
    # Fail here, with the model's own message, rather than in eight sim processes.
    ClusterParams(kv, args.prefill_tps, args.decode_tps, args.max_concurrency, 1.0 / speedup)
    return profile


def _parse_setups(text: str) -> list[Setup]:
    chosen: list[Setup] = []
    for item in (part.strip() for part in text.split(",")):
        match = [m for m in SETUPS if m == item]
        if not match:
            raise ValueError(f"unknown set-up {item!r}; choose from {', '.join(SETUPS)}")
        chosen.append(match[0])
    return chosen


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.workload == "tenant-flood":
        from extproc.bench import routing_tenants

        return routing_tenants.run(args, DEFAULT_SPEEDUP["tenant-flood"])
    try:
        if args.engines_per_cluster < 1:
            raise ValueError("--engines-per-cluster must be >= 1")
        default = SETUPS if args.engines_per_cluster > 1 else SINGLE_ENGINE_SETUPS
        setups = _parse_setups(args.setups) if args.setups else list(default)
        bounds = ClassBounds.parse(args.class_bounds)
        if args.workload == "synthetic":
            workload = synthetic_workload(args)
        elif args.layout is not None:
            if args.burst:
                raise ValueError("--burst applies to --workload synthetic")
            workload = layout_workload(args)
        else:
            if args.burst:
                raise ValueError("--burst applies to --workload synthetic")
            workload = trace_workload(
                args.trace or DEFAULT_TRACE, args.max_requests, args.seed, args.session_share
            )
        if not workload.requests:
            raise ValueError("the workload has no requests")
        speedup = args.speedup or DEFAULT_SPEEDUP[workload.name]
        profile = _profile(args, workload, speedup)
        long_clusters = (
            args.long_clusters if args.long_clusters is not None else max(1, args.clusters // 4)
        )
        if not 0 <= long_clusters < args.clusters:
            raise ValueError("--long-clusters must leave at least one cluster for the rest")
        if args.long_slots < 1:
            raise ValueError("--long-slots must be >= 1")
        classes = operator_classes(profile, bounds, long_clusters, args.long_slots)
        options = ReplayOptions(
            speedup=speedup,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            retry_429=args.retry_429,
            class_bounds=bounds,
            burst_windows=workload.burst_windows,
            progress=None if args.quiet else _progress,
            progress_interval_s=10.0,
        )
    except (OSError, ValueError) as exc:
        print(f"extproc bench routing: {exc}", file=sys.stderr)
        return 2

    if args.key_split:
        print(f"workload: {workload.description}")
        keys: tuple[Literal["chain", "opening"], ...] = ("opening", "chain")
        for key in keys:
            print(key_split(workload.requests, key, args.common_after, causes=True))
        return 0
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"workload: {workload.description}", file=sys.stderr)
    runs: dict[Setup, SetupRun] = {}
    for mode in setups:
        print(f"== {LABELS[mode]} ==", file=sys.stderr, flush=True)
        workdir = out_dir / "logs" / f"{workload.name}-{mode}"
        for old in workdir.glob("*.log"):
            old.unlink()  # Proc appends to its log: start each run with a clean one
        runs[mode] = run_setup(
            mode,
            workload,
            profile,
            options,
            classes,
            workdir,
            args.prefix_key,
            args.message_timeout_ms,
            waiting=not args.no_wait,
        )
        write_json(runs[mode].result, out_dir / f"{workload.name}-{mode}.json")
        if envoy_mode(mode) == "extproc":
            # Nonzero: part of the traffic was routed without the processor's decision (a
            # starved processor on a loaded machine); the hit and stickiness rows then measure
            # the machine, not the routing.
            run = runs[mode]
            print(
                f"ext_proc fail-open {run.fail_open} (message timeouts {run.message_timeouts})",
                file=sys.stderr,
                flush=True,
            )

    reports = {mode: setup_report(r, workload) for mode, r in runs.items()}
    common = add_common(reports, runs, workload)
    found = targets(reports, workload)
    text = format_report(reports, common, workload, profile, classes)
    print(text)
    print("\ntargets (set-up 3):\n" + format_targets(found))

    summary_path = out_dir / f"{workload.name}.json"
    png_path = out_dir / f"{workload.name}.png"
    summary_path.write_bytes(
        orjson.dumps(
            {
                "command": shlex.join(["extproc", *sys.argv[1:]]),
                "workload": {
                    "name": workload.name,
                    "description": workload.description,
                    "requests": len(workload.requests),
                    "ideal_hit_ratio": workload.ideal_hit_ratio,
                    "ideal_source": workload.ideal_source,
                    "working_set_tokens": workload.unique_tokens,
                    "burst_windows": [list(w) for w in workload.burst_windows],
                },
                "profile": asdict(profile),
                "extproc_classes": classes,
                "served_by_every_setup": common,
                "setups": reports,
                "targets": [asdict(t) for t in found],
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    plot_comparison({LABELS[m]: r.result for m, r in runs.items()}, png_path)
    print(f"\nwritten: {summary_path}, {png_path}, per-request results in {out_dir}/")
    unaccounted = any(
        r["outcomes_recorded"] + r["skipped"] != r["requests"] for r in reports.values()
    )
    return 1 if unaccounted else 0

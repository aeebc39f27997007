"""From options to a prepared run: traffic, fleet, classes and budgets, events, report windows.

``SimOptions`` holds every knob (the CLI fills it; tests build it directly), ``build`` does the
preparation shared by all policies and ``simulate`` runs it to a summary.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.core.endpoints import DEFAULT_BALANCE, DEFAULT_MIN_INFLIGHT
from extproc.core.fleet import Budget, RequestClass
from extproc.harness.layouts import LayoutConfig, generate_layout
from extproc.harness.trace import read_trace
from extproc.harness.workload import WorkloadConfig, generate_workload
from extproc.sim.engine import PolicyRun, Scenario, SimConfig, prepare, run_all
from extproc.sim.engines import EngineSpill
from extproc.sim.events import Event, default_events, parse_event
from extproc.sim.model import FleetShape, build_fleet
from extproc.sim.pd import compile_pd, parse_layout
from extproc.sim.policies import POLICIES
from extproc.sim.report import summarize
from extproc.sim.traffic import (
    BaseTraffic,
    BurstSpec,
    base_from_requests,
    base_from_trace,
    copies_for,
    expand,
)


@dataclass(frozen=True, slots=True)
class SimOptions:
    trace: str | None = None  # a Mooncake-format file; None = the synthetic workload
    # A workload layout (extproc.harness.layouts) instead: conversations behind one shared
    # opening, keyed by the processor's own key function (key: opening | chain) or by session.
    layout: str | None = None
    layout_conversations: int = 400
    key: str = "session"
    synthetic_duration_s: float = 120.0
    sessions: int | None = None  # trace sessions wanted; None = the base once
    shape: FleetShape = field(default_factory=lambda: FleetShape(16, spares=1))
    # Events as text (see events.parse_event); None = events.default_events.
    events: tuple[str, ...] | None = None
    # Bursts as START,DURATION,RATE,TOKENS; START/DURATION may end in T (trace periods),
    # RATE in /c (per base cluster).
    bursts: tuple[str, ...] = ()
    windows: tuple[str, ...] = ()  # extra report windows, A,B (T allowed)
    short_below: int = 2000
    long_from: int = 100_000
    medium_budget: Budget = field(default_factory=Budget)
    long_budget: Budget = field(default_factory=lambda: Budget(max_concurrent=1))
    slo_s: Mapping[str, float] = field(
        default_factory=lambda: {"short": 2.0, "medium": 15.0, "long": 120.0}
    )
    policies: tuple[str, ...] = tuple(POLICIES)
    spill_wait_s: float = 2.0
    max_retries: int = 3
    seed: int = 0
    # Clusters of several engines (shape.engines > 1): sessions stick to one engine, or not.
    sticky_engines: bool = True
    engine_spill: EngineSpill = "within"
    engine_balance: float = DEFAULT_BALANCE
    engine_min_inflight: int = DEFAULT_MIN_INFLIGHT
    # Refuse up front when the estimated peak memory exceeds this (None: half of this
    # machine's physical memory); jobs = worker processes that each run policies.
    memory_limit_bytes: int | None = None
    jobs: int = 1
    # What the fleet is sized from (its prefill capacity and its KV): "ideal", the work and
    # distinct blocks of one cache serving everything; "spread", those of a fleet that spreads
    # conversations evenly, where a block shared by s conversations is held, and prefilled
    # once, on min(s, clusters) clusters (BaseTraffic.spread_keys). None: "spread" for a layout
    # (one opening shared by hundreds of conversations), "ideal" otherwise.
    sizing: str | None = None
    # Disaggregated prefill/decode (extproc.sim.pd): "P:D" prefill:decode base clusters split
    # evenly over pd_islands islands, pd_classes served disaggregated; None: colocated.
    pd: str | None = None
    pd_islands: int = 8
    pd_classes: tuple[str, ...] = ("medium", "long")
    pd_prefill_budget: Budget = field(default_factory=Budget)
    # fleet.yaml disaggregation.min_inflight / saturation_factor (None: shipped defaults).
    pd_min_inflight: int | None = None
    pd_saturation: float | None = None


# Peak memory per simulated request with one policy, measured with `extproc simulate` on
# mooncake-like bases (2k-174k requests, RSS slope 1.08 KB/request), rounded up. Forked
# workers share the prepared scenario but each grows its own per-request state, so the
# estimate counts one such share per worker.
BYTES_PER_REQUEST = 1200


def physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_size(options: SimOptions, base_requests: int, copies: int) -> int:
    """The number of requests to simulate; ValueError (with the numbers) when it would not
    fit in memory. Estimated before anything is allocated, so no argument can exhaust it."""
    requests = base_requests * copies
    limit = options.memory_limit_bytes
    if limit is None:
        physical = physical_memory_bytes()
        limit = physical // 2 if physical else 8 << 30
    estimate = requests * BYTES_PER_REQUEST * max(1, options.jobs)
    if estimate > limit:
        fits = max(1, limit // (BYTES_PER_REQUEST * max(1, options.jobs) * max(1, base_requests)))
        raise ValueError(
            f"--sessions {options.sessions} needs {copies:,} copies of the base trace "
            f"({base_requests:,} requests each): {requests:,} requests, about "
            f"{estimate / 2**30:.1f} GiB at {BYTES_PER_REQUEST} bytes per request and "
            f"{max(1, options.jobs)} job(s), over the {limit / 2**30:.1f} GiB limit. "
            f"At most {fits:,} copies fit: lower --sessions, use fewer --jobs, or raise "
            f"--memory-limit-gb"
        )
    return requests


@dataclass(frozen=True, slots=True)
class Prepared:
    scenario: Scenario
    config: SimConfig
    windows: tuple[tuple[float, float], ...]


def _time(text: str, period: float) -> float:
    text = text.strip()
    return float(text[:-1]) * period if text.endswith("T") else float(text)


def parse_burst(text: str, period: float, clusters: int, capacity_tps: float) -> BurstSpec:
    """START,DURATION,RATE,TOKENS. RATE is requests/s; with ``/c`` per base cluster; with
    ``x`` a multiple of the base fleet's prefill capacity (0.6x: the burst's prompts alone
    would keep 60% of all prefill busy), so one spec is the same shock at any fleet size."""
    parts = text.split(",")
    if len(parts) != 4:
        raise ValueError(f"burst must be START,DURATION,RATE,TOKENS, got {text!r}")
    start, duration, rate, tokens = (p.strip() for p in parts)
    try:
        n_tokens = int(tokens)
        if rate.endswith("x"):
            rate_v = float(rate[:-1]) * capacity_tps / max(1, n_tokens)
        elif rate.endswith("/c"):
            rate_v = float(rate[:-2]) * clusters
        else:
            rate_v = float(rate)
        return BurstSpec(_time(start, period), _time(duration, period), rate_v, n_tokens)
    except ValueError as exc:
        raise ValueError(f"burst {text!r}: {exc}") from None


def parse_window(text: str, period: float) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"window must be START,END, got {text!r}")
    lo, hi = (_time(p, period) for p in parts)
    if not hi > lo:
        raise ValueError(f"window {text!r}: END must be after START")
    return lo, hi


def classes_of(options: SimOptions) -> tuple[RequestClass, ...]:
    if not 0 < options.short_below < options.long_from:
        raise ValueError("need 0 < short_below < long_from")
    return (
        RequestClass("short", options.short_below),
        RequestClass("medium", options.long_from, budget=options.medium_budget),
        RequestClass("long", None, budget=options.long_budget),
    )


def load_base(options: SimOptions) -> BaseTraffic:
    if options.layout is not None:
        layout = LayoutConfig(
            layout=options.layout, conversations=options.layout_conversations, seed=options.seed
        )
        return base_from_requests(
            generate_layout(layout),
            f"layout {options.layout} ({options.key} key)",
            options.key,
            options.shape.clusters,
        )
    if options.trace is not None:
        trace = read_trace(options.trace)
        if not trace.requests:
            raise ValueError(f"{options.trace}: no usable requests")
        return base_from_trace(trace)
    config = WorkloadConfig(seed=options.seed, duration_s=options.synthetic_duration_s)
    return base_from_requests(
        generate_workload(config),
        f"synthetic(seed={options.seed})",
        clusters=options.shape.clusters,
    )


SIZINGS = ("ideal", "spread")


def sizing_of(options: SimOptions) -> str:
    if options.sizing is None:
        return "spread" if options.layout is not None else "ideal"
    if options.sizing not in SIZINGS:
        raise ValueError(f"sizing must be one of {', '.join(SIZINGS)}, got {options.sizing!r}")
    return options.sizing


def build(options: SimOptions, base: BaseTraffic | None = None) -> Prepared:
    for name in options.policies:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    base = base if base is not None else load_base(options)
    period = base.period
    shape = options.shape
    classes = classes_of(options)
    copies = copies_for(base, options.sessions) if options.sessions else 1
    if options.layout is not None and options.sessions:
        # A layout's sessions are its conversations, however the key groups them (the old
        # key makes them all one session): copy the layout to reach that many conversations.
        copies = max(1, -(-options.sessions // options.layout_conversations))
    check_size(options, len(base), copies)
    # Offered prefill work if every cluster cached perfectly, per second of the trace period
    # (bursts excluded: they are overload by design). Copies of a base whose sessions share
    # no prefix each offer exactly the base's work; otherwise this is the base's ideal, an
    # estimate that is good enough for sizing.
    uncached = sum(base.input_tokens) - sum(base.ideal_cached)
    held_keys = base.n_keys
    if sizing_of(options) == "spread" and base.spread_keys is not None:
        # Each block also lives on (and is prefilled once by) the other clusters its
        # conversations spread to. Sized from one cache instead, a layout whose 8k-token
        # preamble is shared by every conversation of a tenant gets less KV per cluster than
        # the tenants' preambles take, and any placement that spreads them thrashes
        # (SIMULATION.md).
        held_keys = base.spread_keys
        uncached += (base.spread_keys - base.n_keys) * base.block_tokens
    prefill_per_s = copies * uncached / period
    distinct_tokens = copies * held_keys * base.block_tokens
    clusters = build_fleet(shape, prefill_per_s, distinct_tokens)
    capacity = sum(c.prefill_tps for c in clusters[: shape.clusters])
    bursts = [parse_burst(b, period, shape.clusters, capacity) for b in options.bursts]
    traffic = expand(base, copies, classes, bursts, options.seed)

    if options.events is None:
        if shape.spares < 1:
            raise ValueError("the default events add a cluster: give at least one spare")
        events: tuple[Event, ...] = default_events(shape.clusters, period)
    else:
        events = tuple(parse_event(e, period) for e in options.events)
    pd = None
    if options.pd is not None:
        if events:
            raise ValueError("--pd runs take no fleet events (give --no-events)")
        layout = parse_layout(
            options.pd,
            shape.clusters,
            options.pd_islands,
            options.pd_classes,
            options.pd_prefill_budget,
        )
        layout = dataclasses.replace(
            layout, min_inflight=options.pd_min_inflight, saturation_factor=options.pd_saturation
        )
        pd = compile_pd(
            layout, [c.name for c in clusters], shape.clusters, classes, endpoints=shape.lanes
        )
    scenario = prepare(
        traffic, clusters, shape.clusters, events, placeable=pd.placeable if pd else None
    )
    config = SimConfig(
        classes,
        options.max_retries,
        options.spill_wait_s,
        options.seed,
        options.sticky_engines,
        options.engine_spill,
        options.engine_balance,
        options.engine_min_inflight,
        pd=pd,
    )
    # Bursts are windows of their own; an explicit window equal to one is reported once
    # (0.2T + 0.1T and 0.3T differ in the last bits, hence the rounding).
    spans = [b.window for b in bursts] + [parse_window(w, period) for w in options.windows]
    unique = {(round(lo, 6), round(hi, 6)): (lo, hi) for lo, hi in reversed(spans)}
    windows = tuple(sorted(unique.values()))
    return Prepared(scenario, config, windows)


def simulate(
    options: SimOptions,
    jobs: int = 1,
    progress: Callable[[Mapping[str, int]], None] | None = None,
    base: BaseTraffic | None = None,
) -> tuple[dict[str, Any], dict[str, PolicyRun], Prepared]:
    prepared = build(options, base)
    runs = run_all(prepared.scenario, prepared.config, options.policies, jobs, progress)
    summary = summarize(prepared.scenario, runs, options.slo_s, prepared.windows, options.seed)
    return summary, runs, prepared

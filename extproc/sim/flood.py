"""``extproc simulate --workload tenant-flood``: one tenant's flood inside a class, on a fleet.

The question ``extproc bench fairness`` asks of one cluster on a virtual clock (docs/fairness.md,
"How fair it is"), asked of the fleet simulator: the clusters' prefill lanes, KV cache and
decode (extproc/sim/model.py), the processor's placement and admission steps, and its flow
control (``hash-2+bulkheads+flow``: a new session whose primary's class budget is full starts
on its next hash candidate with room, else it waits in its primary's queue, else a 429 the
client retries after its hint). Each (cluster, class) queue is the processor's
:class:`extproc.core.flow.FairQueue`, each request's tenant the key the processor makes of its
tenant header (extproc/sim/tenants.py), its cost the processor's ``FlowParams.claim`` under each
:class:`extproc.core.flow.Fairness`, and a request that waited is charged its output when it ends.

Traffic, one-shot requests (each its own session, so hashing spreads every tenant over the
fleet; no prefix is shared, so no cache hit changes a request's cost):

- the long class (a budget of in-flight tokens on every cluster): 20 steady tenants (Poisson,
  20,000-token prompts) and, in the flood runs, one flooding tenant (Poisson at
  ``flood_factor`` times the rate of its 200,000-token prompts the class's budgets hold);
- the short class: 500-token prompts, Poisson, no budget; it shares the clusters' lanes.

Two loads of the steady tenants, as the bench: ``light`` (together 30 % of the class) and
``heavy`` (each twice its 1/21 share). Per load, four runs on the same fleet: without the flood
(tokens fairness), then with it under FIFO, unit costs (``requests``) and ``tokens``. Each
tenant's arrivals have their own seeded stream, so the runs with and without the flood see the
same steady and short requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

from extproc.bench.fairness_stats import jain, pct
from extproc.core.fleet import Budget, RequestClass
from extproc.core.flow import Fairness, FlowParams
from extproc.harness.prompts import BLOCK_TOKENS
from extproc.sim.engine import GAVE_UP_429, SERVED, PolicyRun, SimConfig, prepare, run_policy
from extproc.sim.model import ClusterSpec, FleetShape, build_fleet
from extproc.sim.traffic import BaseTraffic, Traffic, expand

STEADY = 20
FLOOD = "flood"
SHORT = "interactive"
TENANT_HEADER = "x-tenant"
POLICY = "hash-2+bulkheads+flow"
LOADS = ("light", "heavy")
ORDERS = (Fairness.FIFO, Fairness.REQUESTS, Fairness.TOKENS)
LANE_PREFILL_TPS = 50_000.0
# A short request's first token later than its prefill by more than this waited for a lane.
LANE_WAIT_S = 1e-3


@dataclass(frozen=True, slots=True)
class FloodShape:
    """The workload and the fleet (the command's flags fill a few)."""

    seconds: float = 600.0  # measured: requests arriving in [warmup_s, seconds)
    warmup_s: float = 60.0
    tail_s: float = 60.0  # arrivals go on this long after the window, so it ends loaded
    clusters: int = 8
    lanes: int = 8
    lane_prefill_tps: float = LANE_PREFILL_TPS
    decode_tps: float = 50.0
    long_budget_tokens: int = 1_000_000  # per cluster
    long_budget_concurrent: int = 0  # per cluster; 0: no cap (the loads are set by the tokens)
    flood_tokens: int = 200_000
    flood_factor: float = 3.0
    steady_tokens: int = 20_000
    short_tokens: int = 500
    short_rate: float = 4.0  # per cluster
    output_tokens: int = 200
    kv_tokens: int = 4_000_000

    def hold_s(self, tokens: int) -> float:
        """Seconds a request of ``tokens`` holds its budget when its prefill waits for no lane."""
        return tokens / self.lane_prefill_tps + (self.output_tokens - 1) / self.decode_tps

    def class_rate(self, tokens: int) -> float:
        """Requests/s of ``tokens`` the long class's budgets hold, fleet-wide."""
        return self.clusters * self.long_budget_tokens / (tokens * self.hold_s(tokens))

    def steady_rate(self, load: str) -> float:
        """Requests/s per steady tenant: together 30 % of the class (light), or each twice
        its 1/21 share (heavy)."""
        capacity = self.class_rate(self.steady_tokens)
        return 0.3 * capacity / STEADY if load == "light" else 2.0 * capacity / (STEADY + 1)

    def flood_rate(self) -> float:
        return self.flood_factor * self.class_rate(self.flood_tokens)


@dataclass(frozen=True, slots=True)
class Arrival:
    time: float
    tenant: str
    tokens: int
    label: str  # its session: the same request has the same placement in every run


def _poisson(rng: Random, rate: float, until: float) -> Iterator[float]:
    t = rng.expovariate(rate)
    while t < until:
        yield t
        t += rng.expovariate(rate)


def arrivals(shape: FloodShape, load: str, flood: bool, seed: int) -> list[Arrival]:
    """Every request of one run in arrival order, each tenant from its own seeded stream."""
    streams = [(f"steady{i}", shape.steady_rate(load), shape.steady_tokens) for i in range(STEADY)]
    streams.append((SHORT, shape.short_rate * shape.clusters, shape.short_tokens))
    if flood:
        streams.append((FLOOD, shape.flood_rate(), shape.flood_tokens))
    until = shape.seconds + shape.tail_s
    out: list[Arrival] = []
    for name, rate, tokens in streams:
        rng = Random(f"tenant-flood:{seed}:{load}:{name}")
        out += (
            Arrival(t, name, tokens, f"{name}/{n}")
            for n, t in enumerate(_poisson(rng, rate, until))
        )
    out.sort(key=lambda a: (a.time, a.label))
    return out


def base_of(requests: list[Arrival], shape: FloodShape, source: str) -> BaseTraffic:
    """The requests as the simulator's traffic: one session and one unshared block each."""
    n = len(requests)
    return BaseTraffic(
        times=tuple(r.time for r in requests),
        sessions=tuple(range(n)),
        input_tokens=tuple(r.tokens for r in requests),
        output_tokens=(shape.output_tokens,) * n,
        keys=tuple((i + 1,) for i in range(n)),
        ideal_cached=(0,) * n,
        session_labels=tuple(r.label for r in requests),
        n_keys=n,
        sessions_disjoint=True,
        block_tokens=BLOCK_TOKENS,
        source=source,
        tenants=tuple(r.tenant for r in requests),
    )


def classes_of(shape: FloodShape) -> tuple[RequestClass, ...]:
    """Short below 2,000 tokens; the steady tenants' and the flood's prompts are long."""
    long_from = min(shape.steady_tokens, shape.flood_tokens)
    return (
        RequestClass("short", 2000),
        RequestClass("medium", max(2001, long_from)),
        RequestClass(
            "long",
            None,
            budget=Budget(
                max_inflight_tokens=shape.long_budget_tokens,
                max_concurrent=shape.long_budget_concurrent,
            ),
        ),
    )


def fleet_of(shape: FloodShape) -> tuple[ClusterSpec, ...]:
    """Clusters of one hardware shape, sized by the shape's figures, not by the traffic."""
    fleet = FleetShape(
        clusters=shape.clusters,
        heterogeneous=False,
        kv_tokens=shape.kv_tokens,
        prefill_tps=shape.lane_prefill_tps * shape.lanes,
        decode_tps=shape.decode_tps,
        lanes=shape.lanes,
    )
    return build_fleet(fleet, 0.0, 0)


@dataclass(slots=True)
class Figures:
    """What one run served, over the requests arriving in the measured window."""

    served: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    asked: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    gave_up: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # Served short requests whose first token came later than their own prefill: they found
    # every prefill lane of their cluster taken.
    short_waited: int = 0
    leaked_tickets: int = 0


def figures(traffic: Traffic, run: PolicyRun, shape: FloodShape) -> Figures:
    """Served input tokens, 429s given up on and TTFTs, by tenant (``long:steady``,
    ``long:flood``, ``short``)."""
    out = Figures(leaked_tickets=run.leaked_tickets)
    assert traffic.t_tenant is not None
    status, ttft = run.status.tolist(), run.ttft.tolist()
    for i, t in enumerate(traffic.times):
        if not shape.warmup_s <= t < shape.seconds:
            continue
        tp = traffic.templates[i]
        name = traffic.t_tenant[tp]
        group = "short" if name == SHORT else "long:flood" if name == FLOOD else "long:steady"
        out.asked[name] += 1
        if status[i] == SERVED:
            out.served[name] += traffic.t_input[tp]
            out.ttft[group].append(ttft[i])
            prefill_s = traffic.t_input[tp] / shape.lane_prefill_tps
            if group == "short" and ttft[i] > prefill_s + LANE_WAIT_S:
                out.short_waited += 1
        elif status[i] == GAVE_UP_429:
            out.gave_up[name] += 1
    return out


def run_one(shape: FloodShape, load: str, flood: bool, fairness: Fairness, seed: int) -> Figures:
    """One run of the processor's flow control over one load, with or without the flood."""
    source = f"tenant-flood({load}, {'flood' if flood else 'no flood'}, seed={seed})"
    classes = classes_of(shape)
    traffic = expand(base_of(arrivals(shape, load, flood, seed), shape, source), 1, classes)
    scenario = prepare(traffic, fleet_of(shape), shape.clusters, ())
    flow = FlowParams(tenant_header=TENANT_HEADER, fairness=fairness)
    config = SimConfig(classes, seed=seed, flow=flow)
    return figures(traffic, run_policy(scenario, config, POLICY), shape)


def row(shape: FloodShape, out: Figures, base: Figures) -> dict[str, Any]:
    """One table row's figures (``base``: the same load without the flood)."""
    steady_names = [f"steady{i}" for i in range(STEADY)]
    steady = [out.served.get(n, 0.0) for n in steady_names]
    everyone = [*steady, out.served.get(FLOOD, 0.0)] if out.asked.get(FLOOD) else steady
    long_total = sum(everyone)
    asked = sum(out.asked.get(n, 0) for n in steady_names)
    gave_up = sum(out.gave_up.get(n, 0) for n in steady_names)
    p99 = pct(out.ttft["long:steady"], 99)
    base_p99 = pct(base.ttft["long:steady"], 99)
    short_p99 = pct(out.ttft["short"], 99)
    base_short = pct(base.ttft["short"], 99)
    short_served = len(out.ttft["short"])
    long_tokens_per_s = long_total / (shape.seconds - shape.warmup_s)
    lanes_tps = shape.clusters * shape.lanes * shape.lane_prefill_tps
    return {
        "jain_steady": jain(steady),
        "jain_all": jain(everyone),
        "flood_share": out.served.get(FLOOD, 0.0) / long_total if long_total else None,
        "long_tokens_per_s": long_tokens_per_s,
        "long_lane_share": long_tokens_per_s / lanes_tps,
        "steady_gave_up": gave_up / asked if asked else None,
        "steady_ttft_p50_s": pct(out.ttft["long:steady"], 50),
        "steady_ttft_p99_s": p99,
        "steady_p99_over_no_flood": p99 / base_p99 if base_p99 > 0 else None,
        "short_ttft_p99_s": short_p99,
        "short_p99_over_no_flood": short_p99 / base_short if base_short > 0 else None,
        "short_waited": out.short_waited / short_served if short_served else None,
        "leaked_tickets": out.leaked_tickets,
    }


def rows(shape: FloodShape, seed: int) -> Iterator[dict[str, Any]]:
    """Per load: no flood, then the flood under each order."""
    for load in LOADS:
        base = run_one(shape, load, False, Fairness.TOKENS, seed)
        yield {"load": load, "order": "no flood", **row(shape, base, base)}
        for order in ORDERS:
            out = run_one(shape, load, True, order, seed)
            yield {"load": load, "order": order.value, **row(shape, out, base)}


# (header, key, format) of the printed table.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("steady load", "load", "{}"),
    ("order", "order", "{}"),
    ("Jain steady", "jain_steady", "{:.3f}"),
    ("Jain all", "jain_all", "{:.3f}"),
    ("flood share", "flood_share", "{:.2f}"),
    ("long tok/s", "long_tokens_per_s", "{:,.0f}"),
    ("long lane share", "long_lane_share", "{:.2f}"),
    ("steady gave up", "steady_gave_up", "{:.2f}"),
    ("steady TTFT p50 s", "steady_ttft_p50_s", "{:.2f}"),
    ("steady TTFT p99 s", "steady_ttft_p99_s", "{:.2f}"),
    ("p99 / no flood", "steady_p99_over_no_flood", "{:.2f}"),
    ("short p99 s", "short_ttft_p99_s", "{:.2f}"),
    ("short p99 / no flood", "short_p99_over_no_flood", "{:.2f}"),
    ("short waited", "short_waited", "{:.3f}"),
)


def format_rows(table: list[dict[str, Any]]) -> list[str]:
    """The rows as right-aligned text columns, a header first."""
    cells = [[h for h, _k, _f in COLUMNS]]
    for r in table:
        cells.append(["-" if r[k] is None else f.format(r[k]) for _h, k, f in COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]


def _rounded(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def shape_from(args: argparse.Namespace) -> FloodShape:
    """The command line's fleet flags over the workload's defaults."""
    lanes = args.lanes
    lane_tps = args.prefill_tps / lanes if args.prefill_tps else LANE_PREFILL_TPS
    return FloodShape(
        seconds=args.flood_seconds,
        clusters=args.clusters,
        lanes=lanes,
        lane_prefill_tps=lane_tps,
        decode_tps=args.decode_tps,
        long_budget_concurrent=args.flood_long_concurrent,
    )


def _concurrent_text(shape: FloodShape) -> str:
    n = shape.long_budget_concurrent
    return f" and {n} requests" if n else ""


def run(args: argparse.Namespace) -> int:
    """``extproc simulate --workload tenant-flood``: the table, and ``--json``."""
    started = time.monotonic()
    shape = shape_from(args)
    table = [{k: _rounded(v) for k, v in r.items()} for r in rows(shape, args.seed)]
    print(
        f"tenant flood on {shape.clusters} clusters ({shape.lanes} lanes of "
        f"{shape.lane_prefill_tps:,.0f} prefill tokens/s each): a flood of "
        f"{shape.flood_tokens:,}-token requests at {shape.flood_factor:g}x what the long class "
        f"holds, beside {STEADY} steady tenants ({shape.steady_tokens:,} tokens) in the long "
        f"class (budget {shape.long_budget_tokens:,} tokens in flight per cluster"
        f"{_concurrent_text(shape)}), policy "
        f"{POLICY}; arrivals in [{shape.warmup_s:g}, {shape.seconds:g}) s measured, seed "
        f"{args.seed}"
    )
    print("\n".join(format_rows(table)))
    if args.json_out:
        summary = {"workload": "tenant-flood", "shape": dataclasses.asdict(shape), "rows": table}
        text = json.dumps(summary, indent=2, sort_keys=True) + "\n"
        Path(args.json_out).write_text(text, encoding="utf-8")
    # On the terminal only: the JSON is a pure function of the options and seed.
    print(f"\ntime: {time.monotonic() - started:.1f} s")
    return 0

"""`extproc bench pd-pools`: prefill:decode ratios at fleet scale, through the fleet simulator.

One ``extproc simulate`` run per layout, on the same traffic, fleet size and seed: a colocated
baseline (every cluster does both) and P/D layouts at the ratios asked for (``--pd P:D`` of the
simulator, extproc.sim.pd: roles and topology written as a fleet.yaml and compiled by the
processor's compiler, the prefill choice ``PdPlan.choose`` per request, the KV transfer over the
pair's link). Nothing is modelled here: this module only runs the simulator per layout and
prints one row per run (TTFT p50/p99 per class, hit ratio, served output tokens per second, KV
transfer p50/p99, how the pairs related).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from extproc.core.fleet import Budget
from extproc.sim.model import FleetShape
from extproc.sim.scenario import SimOptions, load_base, simulate

TRACE = Path(__file__).resolve().parents[2] / "third_party/mooncake/mooncake_synthetic_trace.jsonl"
COLOCATED = "colocated"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=str(TRACE), help="Mooncake-format JSONL trace")
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--clusters", type=int, default=64)
    parser.add_argument("--islands", type=int, default=8)
    parser.add_argument(
        "--ratios",
        default="colocated,16:48,24:40,32:32,40:24,48:16",
        help="layouts: 'colocated' and prefill:decode cluster counts",
    )
    parser.add_argument("--pd-classes", default="medium,long")
    parser.add_argument(
        "--pd-min-inflight",
        type=int,
        default=None,
        help="fleet.yaml disaggregation.min_inflight (default: the shipped 1)",
    )
    parser.add_argument("--utilisation", type=float, default=0.5)
    parser.add_argument("--policy", default="hash-2")
    parser.add_argument(
        "--burst",
        action="append",
        default=[],
        metavar="START,DUR,RATE,TOKENS",
        help="a long-context burst, as extproc simulate --burst",
    )
    parser.add_argument("--seed", type=int, default=0)


def options(args: argparse.Namespace, layout: str) -> SimOptions:
    return SimOptions(
        trace=args.trace,
        sessions=args.sessions,
        shape=FleetShape(
            args.clusters,
            spares=0,
            heterogeneous=False,
            utilisation=args.utilisation,
            kv_share=0.5,
            seed=args.seed,
        ),
        events=(),
        bursts=tuple(args.burst),
        policies=(args.policy,),
        seed=args.seed,
        long_budget=Budget(),
        pd=None if layout == COLOCATED else layout,
        pd_islands=args.islands,
        pd_classes=tuple(c for c in args.pd_classes.split(",") if c),
        pd_min_inflight=args.pd_min_inflight,
    )


def _pair(stats: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    a, b = stats.get("ttft_p50_s"), stats.get("ttft_p99_s")
    if a is None or b is None:
        return "-"
    return f"{a * scale:.{digits}f} / {b * scale:.{digits}f}"


def row(layout: str, summary: dict[str, Any], policy: str) -> str:
    p = summary["policies"][policy]
    classes = p["classes"]
    pd = p.get("pd")
    if pd:
        transfer = (
            f"{pd['transfer_p50_s'] * 1000:.1f} / {pd['transfer_p99_s'] * 1000:.1f}"
            if pd["transfer_p50_s"] is not None
            else "-"
        )
        pairs = ", ".join(f"{k} {v:,}" for k, v in pd["by_tier"].items())
        if pd["colocated_fallback"]:
            pairs += f", colocated {pd['colocated_fallback']:,}"
    else:
        transfer, pairs = "-", "-"
    tps = p["output_tokens_per_s"]
    return (
        f"| {layout} | {_pair(classes['short'])} | {_pair(classes['medium'])} | "
        f"{_pair(classes['long'])} | {p['hit_ratio'] * 100:.1f} | "
        f"{'-' if tps is None else f'{tps:,.0f}'} | {transfer} | {pairs} |"
    )


HEADER = (
    "| layout | short TTFT p50 / p99 s | medium TTFT p50 / p99 s | long TTFT p50 / p99 s | "
    "hit % | output tokens/s | KV transfer p50 / p99 ms | pairs |\n"
    "|---|---|---|---|---|---|---|---|"
)


def run(args: argparse.Namespace) -> int:
    layouts = [x.strip() for x in args.ratios.split(",") if x.strip()]
    base = load_base(options(args, COLOCATED))
    rows = []
    first: dict[str, Any] | None = None
    for layout in layouts:
        summary, _runs, _prepared = simulate(options(args, layout), base=base)
        first = first or summary
        rows.append(row(layout, summary, args.policy))
        print(rows[-1], flush=True)
    assert first is not None
    wl = first["workload"]
    print(
        f"\n{args.clusters} clusters ({args.islands} islands), {wl['requests']:,} requests, "
        f"{wl['sessions']:,} sessions of {wl['source']}, policy {args.policy}, "
        f"disaggregated classes {args.pd_classes}\n"
    )
    print(HEADER)
    print("\n".join(rows))
    return 0

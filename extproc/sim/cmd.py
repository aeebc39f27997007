"""``extproc simulate``: the routing policies on one simulated fleet, side by side.

Examples::

    extproc simulate --trace mooncake.jsonl --clusters 64 --sessions 250000 --json out.json
    extproc simulate --trace mooncake.jsonl --clusters 256 --sessions 1000000 --png out.png
    extproc simulate --workload synthetic --clusters 8 --burst 0.2T,0.1T,0.6x,150000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from extproc.core.endpoints import DEFAULT_BALANCE, DEFAULT_MIN_INFLIGHT
from extproc.core.fleet import Budget
from extproc.harness.layouts import LAYOUTS
from extproc.sim.engine import run_all
from extproc.sim.model import FleetShape
from extproc.sim.policies import POLICIES
from extproc.sim.report import format_table, plot, summarize, write_json
from extproc.sim.scenario import SimOptions, build, load_base


def non_negative(text: str) -> int:
    """A count of 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_budget(text: str) -> Budget:
    """``concurrent=1,inflight=400000,rate=50000,burst=100000`` (any subset; "none" = no cap)."""
    if text.strip() in ("", "none"):
        return Budget()
    fields = {"concurrent": 0, "inflight": 0, "rate": 0.0, "burst": 0}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise argparse.ArgumentTypeError(
                f"budget items are concurrent=, inflight=, rate=, burst=; got {part!r}"
            )
        try:
            fields[key] = float(value) if key == "rate" else int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"budget {key}: not a number: {value!r}") from None
        if fields[key] < 0:
            raise argparse.ArgumentTypeError(f"budget {key} must be >= 0")
    return Budget(
        max_inflight_tokens=int(fields["inflight"]),
        max_concurrent=int(fields["concurrent"]),
        tokens_per_second=float(fields["rate"]),
        burst_tokens=int(fields["burst"]),
    )


def parse_slo(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or seconds <= 0:
            raise argparse.ArgumentTypeError(f"SLO items are CLASS=SECONDS (> 0), got {part!r}")
        out[name.strip()] = seconds
    return out


def parse_policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policies {unknown}; known: {', '.join(POLICIES)}"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _workload_arguments(parser)
    _fleet_arguments(parser)
    _events_arguments(parser)
    _pd_arguments(parser)
    _admission_arguments(parser)
    _run_arguments(parser)


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The traffic: a trace, the synthetic workload or a layout, and its size."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace")
    source.add_argument(
        "--workload",
        choices=["synthetic", "tenant-flood"],
        help="built-in synthetic workload, or tenant-flood: one tenant's flood beside 20 steady"
        " tenants in the long class, each fairness order side by side (extproc.sim.flood)",
    )
    source.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        help="conversations behind one shared opening (extproc.harness.layouts)",
    )
    parser.add_argument(
        "--key",
        choices=["session", "opening", "chain"],
        default="session",
        help="how --layout requests are keyed: their session ids (a trusted header), or the "
        "processor's prefix key on their prompts (opening: the old key; chain: the default)",
    )
    parser.add_argument("--layout-conversations", type=int, default=400)
    parser.add_argument(
        "--synthetic-duration", type=float, default=120.0, help="synthetic workload length (s)"
    )
    parser.add_argument(
        "--flood-seconds",
        type=float,
        default=600.0,
        help="tenant-flood: requests arriving from 60 s (the warm-up) to this are measured",
    )
    parser.add_argument(
        "--flood-long-concurrent",
        type=non_negative,
        default=0,
        help="tenant-flood: the long class's budget also caps its requests in flight per "
        "cluster (default 0: only its 1,000,000 tokens in flight)",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="trace sessions to simulate: the base is copied (new ids, shifted times) to reach it; "
        "refused up front when the estimated memory exceeds --memory-limit-gb",
    )
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        help="refuse runs estimated above this (default: half of physical memory)",
    )


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated clusters and their engines."""
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--clusters", type=int, default=16)
    fleet.add_argument("--spares", type=int, default=1, help="clusters that 'add' events bring")
    fleet.add_argument("--homogeneous", action="store_true", help="one hardware profile")
    fleet.add_argument("--weights", choices=["equal", "capacity"], default="equal")
    fleet.add_argument(
        "--utilisation",
        type=float,
        default=0.5,
        help="size prefill so the ideal-cache prefill work is this share of capacity",
    )
    fleet.add_argument(
        "--sizing",
        choices=["ideal", "spread"],
        default=None,
        help="size prefill and KV from one ideal cache (default for --trace / --workload), "
        "or from a fleet spreading conversations evenly, each shared block held and "
        "prefilled once per cluster it spreads to (default for --layout)",
    )
    fleet.add_argument(
        "--kv-share",
        type=float,
        default=0.5,
        help="per-cluster KV = this x distinct prefix tokens of the run / clusters",
    )
    fleet.add_argument("--kv-tokens", type=int, default=None, help="absolute per-cluster KV")
    fleet.add_argument("--prefill-tps", type=float, default=None, help="absolute base prefill")
    fleet.add_argument("--decode-tps", type=float, default=50.0)
    fleet.add_argument("--lanes", type=int, default=8, help="prefill instances per cluster")
    fleet.add_argument("--max-concurrency", type=int, default=512)
    fleet.add_argument(
        "--engines-per-cluster",
        type=int,
        default=1,
        help="engines (replicas) per cluster, each with its own KV cache and its share of the"
        " cluster's KV, prefill lanes and concurrency (1: one cache per cluster)",
    )
    fleet.add_argument(
        "--engine-affinity",
        choices=["sticky", "round_robin"],
        default="sticky",
        help="with several engines per cluster: a session sticks to one (the processor's"
        " rendezvous with bounded load), or requests go round robin over them",
    )

    fleet.add_argument(
        "--engine-spill",
        choices=["within", "leave", "none"],
        default="within",
        help="sticky engines: a session whose engine is over its bounded-load cap goes to its"
        " runner-up engine in the same cluster (within, the processor's rule), to its"
        " secondary cluster (leave), or stays and queues (none)",
    )

    fleet.add_argument(
        "--engine-balance",
        type=float,
        default=DEFAULT_BALANCE,
        help="the engine bound's balance factor c: an engine is full above ceil(c x (cluster"
        " in flight + 1) / engines) (fleet.yaml engines.balance_factor)",
    )
    fleet.add_argument(
        "--engine-min-inflight",
        type=int,
        default=DEFAULT_MIN_INFLIGHT,
        help="the engine bound's floor: never full below this many in flight"
        " (fleet.yaml engines.min_inflight)",
    )


def _events_arguments(parser: argparse.ArgumentParser) -> None:
    """Fleet events and long-context bursts."""
    script = parser.add_argument_group("events and bursts")
    script.add_argument(
        "--event",
        action="append",
        metavar="KIND:CLUSTER@TIME",
        help="fail/recover/add/remove, TIME in s or e.g. 0.4T; default: one of each",
    )
    script.add_argument("--no-events", action="store_true")
    script.add_argument(
        "--burst",
        action="append",
        default=[],
        metavar="START,DUR,RATE,TOKENS",
        help="long-context burst, e.g. 0.8T,0.15T,0.6x,150000: RATE in req/s, /c per "
        "cluster, or x = multiple of the fleet's prefill capacity",
    )
    script.add_argument(
        "--window",
        action="append",
        default=[],
        metavar="START,END",
        help="also report TTFT for requests arriving in this window (bursts are windows)",
    )


def _pd_arguments(parser: argparse.ArgumentParser) -> None:
    """Disaggregated prefill/decode roles and budgets."""
    pd = parser.add_argument_group("disaggregated prefill/decode (extproc.sim.pd)")
    pd.add_argument(
        "--pd",
        metavar="P:D",
        default=None,
        help="P prefill-role and D decode-role clusters (P + D = --clusters), split evenly over"
        " --pd-islands islands; the --pd-classes prefill on a prefill cluster chosen as the"
        " processor chooses, move their KV over the pair's link and decode elsewhere",
    )
    pd.add_argument("--pd-islands", type=int, default=8)
    pd.add_argument(
        "--pd-min-inflight",
        type=int,
        default=None,
        help="fleet.yaml disaggregation.min_inflight: prefills in flight before the prefill"
        " choice may leave the hashed endpoint for load (default: the shipped 1)",
    )
    pd.add_argument(
        "--pd-saturation",
        type=float,
        default=None,
        help="fleet.yaml disaggregation.saturation_factor (default: the shipped 1.25)",
    )
    pd.add_argument(
        "--pd-classes",
        default="medium,long",
        help="classes served disaggregated (comma-separated); the others stay colocated",
    )
    pd.add_argument(
        "--pd-prefill-budget",
        type=parse_budget,
        default=Budget(),
        help="the prefill pool's budget per prefill cluster (bulkhead policies only)",
    )


def _admission_arguments(parser: argparse.ArgumentParser) -> None:
    """Request classes, budgets and SLOs."""
    admission = parser.add_argument_group("classes and admission")
    admission.add_argument("--short-below", type=int, default=2000)
    admission.add_argument("--long-from", type=int, default=100_000)
    admission.add_argument("--medium-budget", type=parse_budget, default=Budget())
    admission.add_argument("--long-budget", type=parse_budget, default=Budget(max_concurrent=1))
    admission.add_argument(
        "--slo",
        type=parse_slo,
        default={"short": 2.0, "medium": 15.0, "long": 120.0},
        help="TTFT targets, e.g. short=2,medium=15,long=120",
    )
    admission.add_argument("--max-retries", type=int, default=3, help="429 retries per request")


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    """Policies, seed, workers and outputs."""
    run = parser.add_argument_group("run and output")
    run.add_argument("--policies", type=parse_policies, default=tuple(POLICIES))
    run.add_argument(
        "--spill-wait", type=float, default=2.0, help="queue wait (s) that counts as saturated"
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes"
    )
    run.add_argument("--json", dest="json_out", metavar="FILE")
    run.add_argument("--png", dest="png_out", metavar="FILE")
    run.add_argument("--quiet", action="store_true", help="no progress bar on stderr")


class ProgressBar:
    """A one-line bar on stderr, redrawn at most twice a second."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = max(1, total)
        self.stream = stream
        self.started = time.monotonic()
        self.drawn = 0.0

    def __call__(self, done: Mapping[str, int]) -> None:
        now = time.monotonic()
        count = sum(done.values())
        if now - self.drawn < 0.5 and count < self.total:
            return
        self.drawn = now
        share = min(1.0, count / self.total)
        elapsed = now - self.started
        eta = f"{elapsed / share - elapsed:5.0f}s left" if share > 0 else "   ?s left"
        bar = "#" * int(share * 30)
        self.stream.write(
            f"\rsimulate [{bar:<30}] {share * 100:5.1f}%  {count:,}/{self.total:,} requests  {eta}"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def options_from(args: argparse.Namespace) -> SimOptions:
    """The parsed command line as the simulator's options."""
    shape = FleetShape(
        clusters=args.clusters,
        spares=args.spares,
        heterogeneous=not args.homogeneous,
        utilisation=args.utilisation,
        kv_share=args.kv_share,
        kv_tokens=args.kv_tokens,
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        lanes=args.lanes,
        max_concurrency=args.max_concurrency,
        weights=args.weights,
        seed=args.seed,
        engines=args.engines_per_cluster,
    )
    events: tuple[str, ...] | None = None
    if args.no_events:
        events = ()
    elif args.event:
        events = tuple(args.event)
    return SimOptions(
        trace=args.trace,
        layout=args.layout,
        layout_conversations=args.layout_conversations,
        key=args.key,
        synthetic_duration_s=args.synthetic_duration,
        sessions=args.sessions,
        shape=shape,
        events=events,
        bursts=tuple(args.burst),
        windows=tuple(args.window),
        short_below=args.short_below,
        long_from=args.long_from,
        medium_budget=args.medium_budget,
        long_budget=args.long_budget,
        slo_s=args.slo,
        policies=args.policies,
        spill_wait_s=args.spill_wait,
        max_retries=args.max_retries,
        seed=args.seed,
        sticky_engines=args.engine_affinity == "sticky",
        engine_spill=args.engine_spill,
        engine_balance=args.engine_balance,
        engine_min_inflight=args.engine_min_inflight,
        memory_limit_bytes=(
            int(args.memory_limit_gb * 2**30) if args.memory_limit_gb is not None else None
        ),
        jobs=args.jobs,
        sizing=args.sizing,
        pd=args.pd,
        pd_islands=args.pd_islands,
        pd_classes=tuple(c.strip() for c in args.pd_classes.split(",") if c.strip()),
        pd_prefill_budget=args.pd_prefill_budget,
        pd_min_inflight=args.pd_min_inflight,
        pd_saturation=args.pd_saturation,
    )


def run(args: argparse.Namespace) -> int:
    if args.workload == "tenant-flood":
        from extproc.sim import flood

        return flood.run(args)
    started = time.monotonic()
    options = options_from(args)
    try:
        prepared = build(options, load_base(options))
    except (OSError, ValueError) as exc:
        print(f"extproc simulate: {exc}", file=sys.stderr)
        return 2
    prepared_at = time.monotonic()
    total = len(prepared.scenario.traffic) * len(options.policies)
    bar = None if args.quiet else ProgressBar(total, sys.stderr)
    runs = run_all(prepared.scenario, prepared.config, options.policies, args.jobs, bar)
    if bar is not None:
        bar.close()
    simulated_at = time.monotonic()
    summary = summarize(prepared.scenario, runs, options.slo_s, prepared.windows, options.seed)
    print(format_table(summary))
    if args.json_out:
        write_json(summary, args.json_out)
    if args.png_out:
        plot(summary, args.png_out)
    finished = time.monotonic()
    # Timings go to the terminal only: the JSON is a pure function of the options and seed.
    print(
        f"\ntime: prepare {prepared_at - started:.1f} s, simulate "
        f"{simulated_at - prepared_at:.1f} s ({len(options.policies)} policies, "
        f"{args.jobs} jobs), report {finished - simulated_at:.1f} s, total "
        f"{finished - started:.1f} s"
    )
    return 0

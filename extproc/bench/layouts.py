"""`extproc bench layouts`: a shared opening in each position, four front doors side by side.

For each workload layout (extproc.harness.layouts: the shared opening in the system role, the
first user message, a tools array, an 8 KB / 32 KB completions preamble, Anthropic system +
content blocks; each with conversations with and without shared documents) the same requests,
replayed open-loop at the same instants through a real Envoy to fresh simulated clusters, go
through four set-ups:

1. ``round_robin`` — Envoy alone, round robin;
2. ``ring_hash`` — Envoy alone, consistent hashing on a session header every request carries
   (the best a client that names its sessions can get without body inspection);
3. ``opening`` — Envoy + extproc with the old prefix key (``prefix.key: opening``);
4. ``chain`` — Envoy + extproc with the chain key, the product default: load-aware affinity
   off, bounded-load placement of new sessions on (``affinity.balance_factor`` 1.1 on one
   replica, ``extproc.core.affinity.place_bounded``): a new conversation starts on the first
   cluster in its hash order that stays within that factor of the mean recent requests; its
   later turns follow (remembered);
5. ``chain_bounded`` — the chain key with load-aware affinity on (``affinity.enabled``), the
   same bound inside the full policy (``--balance`` sets another factor);
6. ``chain_hash`` — the chain key with the bound off (``balance_factor: 0``): pure hashing, the
   default before the bound applied without affinity (not run unless asked for).

Rows per layout: prefix-cache hit ratio ÷ the ideal (one infinite cache serving everything in
order, from the same block hashes the simulated clusters use), max/mean requests per cluster,
and the share of later turns served by the cluster that served their conversation's first turn.
Under each table, the max/mean that hashing each *conversation* independently to a uniform
cluster gives for the same requests (median and 90th percentile of 500 draws): the noise floor
of any per-conversation hash at this run size, against which the key's max/mean is judged.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from extproc.bench.routing import blocks_ideal, prompt_blocks
from extproc.harness.launch import FleetStack
from extproc.harness.layouts import LAYOUTS, LayoutConfig, generate_layout
from extproc.harness.replay import ReplayOptions, ReplayResult, run_replay
from extproc.harness.workload import ReplayRequest
from extproc.render.envoy import Mode

ENVOY_LAYOUTS = tuple(LAYOUTS)
SETUPS: tuple[str, ...] = ("round_robin", "ring_hash", "opening", "chain", "chain_bounded")
# Run only when named in --setups.
ALL_SETUPS: tuple[str, ...] = (*SETUPS, "chain_hash")
EXTPROC_SETUPS = ("opening", "chain", "chain_bounded", "chain_hash")
TARGET_HIT_VS_IDEAL = 0.95
TARGET_MAX_MEAN = 1.2


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    setup: str
    hit_vs_ideal: float | None
    max_mean: float | None
    later_on_first: float | None
    errors: int
    wall_s: float
    error_kinds: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # Envoy's ext_proc counters: requests Envoy let through without a decision (failure_mode
    # open: the fallback route, round robin) and message timeouts. A loaded machine shows up
    # here; such requests are routed off their key.
    fail_open: int = 0
    message_timeouts: int = 0


def _run(main: Any) -> ReplayResult:
    import asyncio

    try:
        import uvloop
    except ImportError:
        result: ReplayResult = asyncio.run(main)
        return result
    result = uvloop.run(main)
    return result


def later_on_first(result: ReplayResult) -> float | None:
    first: dict[str, str] = {}
    later = kept = 0
    for outcome in sorted(result.outcomes, key=lambda o: o.index):
        if outcome.outcome != "2xx" or not outcome.session_id or not outcome.served_by:
            continue
        sid = outcome.session_id
        if sid in first:
            later += 1
            kept += outcome.served_by == first[sid]
        else:
            first[sid] = outcome.served_by
    return kept / later if later else None


def max_mean(result: ReplayResult, clusters: int) -> float | None:
    counts = result.clusters
    total = sum(counts.values())
    return max(counts.values()) / (total / clusters) if total else None


def hash_floor(
    requests: Sequence[ReplayRequest], clusters: int, draws: int = 500, seed: int = 1
) -> tuple[float, float]:
    """(median, 90th percentile) max/mean requests per cluster when every conversation is put
    on an independent uniform cluster: the floor of per-conversation hashing at this size."""
    sizes = list(Counter(r.session_id for r in requests).values())
    mean = len(requests) / clusters
    rng = random.Random(seed)
    found = []
    for _ in range(draws):
        load = [0] * clusters
        for size in sizes:
            load[rng.randrange(clusters)] += size
        found.append(max(load) / mean)
    found.sort()
    return found[draws // 2], found[draws * 9 // 10]


def run_setup(
    setup: str,
    requests: Sequence[ReplayRequest],
    clusters: int,
    speedup: float,
    workdir: Path,
    nested_share: float = 0.4,
    balance: float | None = None,
    message_timeout_ms: int | None = None,
) -> tuple[ReplayResult, int, int]:
    """The replay's result, and Envoy's ext_proc fail-open and message-timeout counts."""
    mode: Mode = "extproc" if setup in EXTPROC_SETUPS else setup  # type: ignore[assignment]
    overrides: dict[str, Any] = {}
    if mode == "extproc":
        key = "opening" if setup == "opening" else "chain"
        overrides = {"prefix": {"key": key, "nested_share": nested_share}}
        if message_timeout_ms is not None:
            overrides["processor"] = {"message_timeout_ms": message_timeout_ms}
    if setup == "chain_bounded":
        overrides["affinity"] = {"enabled": True}
        if balance is not None:
            overrides["affinity"]["balance_factor"] = balance
    if setup == "chain_hash":
        overrides["affinity"] = {"balance_factor": 0}
    if setup == "ring_hash":
        requests = [dataclasses.replace(r, send_session_header=True) for r in requests]
    stack = FleetStack(
        workdir,
        clusters=clusters,
        mode=mode,
        fleet_overrides=overrides,
        processor_args=("--log-level", "warning"),
        access_log=False,
    )
    stack.start(attempts=4)  # fresh ports each time: a shared busy machine loses some races
    try:
        options = ReplayOptions(speedup=speedup, concurrency=256, timeout_s=60.0)
        result = _run(run_replay(list(requests), stack.url, options))
        fail_open = timeouts = 0
        if mode == "extproc":
            fail_open = stack.envoy_stat("http.ingress.ext_proc.failure_mode_allowed")
            timeouts = stack.envoy_stat("http.ingress.ext_proc.message_timeouts")
        return result, fail_open, timeouts
    finally:
        stack.stop()


def run_layout(
    layout: str,
    config: LayoutConfig,
    clusters: int,
    speedup: float,
    workdir: Path,
    nested_share: float = 0.4,
    setups: Sequence[str] = SETUPS,
    balance: float | None = None,
    message_timeout_ms: int | None = None,
) -> tuple[float, list[Row]]:
    requests = generate_layout(dataclasses.replace(config, layout=layout))
    ideal = blocks_ideal(prompt_blocks(requests))
    rows = []
    for setup in setups:
        started = time.monotonic()
        try:
            result, fail_open, timeouts = run_setup(
                setup,
                requests,
                clusters,
                speedup,
                workdir / f"{layout}-{setup}",
                nested_share,
                balance,
                message_timeout_ms,
            )
        except (TimeoutError, RuntimeError) as exc:
            # A stack that would not start on a loaded machine: reported, not fatal.
            print(f"{layout}/{setup}: not measured ({exc})", flush=True)
            rows.append(Row(setup, None, None, None, 0, time.monotonic() - started))
            continue
        hit = result.hit_ratio
        errors = sum(1 for o in result.outcomes if o.outcome != "2xx")
        rows.append(
            Row(
                setup,
                hit / ideal if (hit is not None and ideal) else None,
                max_mean(result, clusters),
                later_on_first(result),
                errors,
                time.monotonic() - started,
                dict(
                    Counter(
                        f"{o.outcome}:{o.status}:{(o.error or '')[:60]}"
                        for o in result.outcomes
                        if o.outcome != "2xx"
                    )
                ),
                fail_open,
                timeouts,
            )
        )
    return ideal, rows


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_table(
    layout: str,
    ideal: float,
    rows: Sequence[Row],
    requests: int,
    floor: tuple[float, float] | None = None,
) -> str:
    head = "| | " + " | ".join(r.setup for r in rows) + " |"
    sep = "|---" * (len(rows) + 1) + "|"
    lines = [
        f"**{layout}** ({requests} requests, ideal hit ratio {ideal:.3f})",
        "",
        head,
        sep,
        "| hit ratio ÷ ideal | " + " | ".join(_num(r.hit_vs_ideal) for r in rows) + " |",
        "| max/mean requests per cluster | " + " | ".join(_num(r.max_mean) for r in rows) + " |",
        "| later turns on the first turn's cluster | "
        + " | ".join(_num(r.later_on_first) for r in rows)
        + " |",
        "| errors | " + " | ".join(str(r.errors) for r in rows) + " |",
        "| ext_proc fail-open (message timeouts) | "
        + " | ".join(
            f"{r.fail_open} ({r.message_timeouts})" if r.setup in EXTPROC_SETUPS else "n/a"
            for r in rows
        )
        + " |",
    ]
    if floor is not None:
        lines += [
            "",
            f"per-conversation hashing floor at this size: max/mean median {floor[0]:.3f}, "
            f"p90 {floor[1]:.3f}",
        ]
    for row in rows:
        if row.setup not in ("chain", "chain_bounded", "chain_hash"):
            continue
        ok = (
            row.hit_vs_ideal is not None
            and row.hit_vs_ideal >= TARGET_HIT_VS_IDEAL
            and row.max_mean is not None
            and row.max_mean <= TARGET_MAX_MEAN
        )
        lines += [
            "",
            f"{row.setup} vs targets (hit ≥ {TARGET_HIT_VS_IDEAL}x ideal, max/mean ≤ "
            f"{TARGET_MAX_MEAN}): {'met' if ok else 'NOT met'}",
        ]
    return "\n".join(lines)


def parse_cost(layouts: Sequence[str], config: LayoutConfig, repeats: int = 5) -> str:
    """Microseconds per request to parse and key the layouts' requests, old key vs chain key,
    measured side by side in one process (best of ``repeats`` passes, alternating keys)."""
    from extproc.core.chains import ChainSketch
    from extproc.core.facts import ParseLimits, parse_request
    from extproc.core.keys import KeyRules

    headers = {"content-type": "application/json"}
    lines = [
        "| layout | body KiB (mean) | opening key µs/request | chain key µs/request | ratio |",
        "|---|---|---|---|---|",
    ]
    for layout in layouts:
        requests = generate_layout(dataclasses.replace(config, layout=layout))
        bodies = [(r.path, orjson.dumps(r.materialize())) for r in requests]
        best = {"opening": float("inf"), "chain": float("inf")}
        for _ in range(repeats):
            for key in ("opening", "chain"):
                rules = KeyRules(prefix_key=key, sketch=ChainSketch())
                started = time.perf_counter()
                for path, body in bodies:
                    parse_request(path, headers, body, rules, ParseLimits())
                best[key] = min(best[key], (time.perf_counter() - started) / len(bodies))
        kib = sum(len(b) for _, b in bodies) / len(bodies) / 1024
        lines.append(
            f"| {layout} | {kib:.1f} | {best['opening'] * 1e6:.0f} | {best['chain'] * 1e6:.0f} "
            f"| {best['chain'] / best['opening']:.2f} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default=",".join(ENVOY_LAYOUTS))
    parser.add_argument("--setups", default=",".join(SETUPS), help="any of " + ",".join(ALL_SETUPS))
    parser.add_argument("--conversations", type=int, default=800)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--documents",
        type=int,
        default=40,
        help="shared documents the layout's RAG conversations draw from",
    )
    parser.add_argument(
        "--balance",
        type=float,
        default=None,
        help="chain_bounded: affinity.balance_factor (bounded-load placement of new sessions; "
        "default: the product's, 1.1 on one replica)",
    )
    parser.add_argument(
        "--message-timeout-ms",
        type=int,
        default=None,
        help="the processor's ext_proc message timeout (default: the stack's 5000 ms); a "
        "loaded machine needs more, or Envoy fails open and routes round robin",
    )
    parser.add_argument(
        "--bound",
        type=float,
        default=1.1,
        help="--offline: the bounded-load row's cap on a cluster's requests (x the mean)",
    )
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--speedup", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/bench-layouts")
    parser.add_argument(
        "--common-after",
        type=int,
        default=4,
        help="--offline: the chain key's prefix.common_after (distinct conversations that make "
        "a root chain common)",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="no Envoy: chain key vs opening key vs per-conversation hashing vs an approximate "
        "radix tree per cluster (sgl-router cache_aware), same requests (extproc.bench.radix)",
    )
    parser.add_argument(
        "--nested-share",
        type=float,
        default=0.4,
        help="the chain key's prefix.nested_share (how hot a document must be to be spread)",
    )
    parser.add_argument(
        "--parse-only",
        action="store_true",
        help="no Envoy: the CPU cost of parsing + keying each layout, old key vs chain key",
    )


def run(args: argparse.Namespace) -> int:
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in ENVOY_LAYOUTS]
    if unknown:
        print(f"unknown or non-Envoy layouts: {unknown}; choose from {ENVOY_LAYOUTS}")
        return 2
    config = LayoutConfig(
        conversations=args.conversations,
        turns=args.turns,
        documents=args.documents,
        seed=args.seed,
    )
    if args.parse_only:
        print(parse_cost(layouts, config))
        return 0
    if args.offline:
        from extproc.bench.radix import offline_table

        print(
            offline_table(
                layouts, config, args.clusters, args.nested_share, args.bound, args.common_after
            )
        )
        return 0
    setups = [name for name in args.setups.split(",") if name]
    if not setups or any(name not in ALL_SETUPS for name in setups):
        print(f"--setups: choose from {ALL_SETUPS}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Mapping[str, Any]] = {}
    for layout in layouts:
        ideal, rows = run_layout(
            layout,
            config,
            args.clusters,
            args.speedup,
            out,
            args.nested_share,
            setups,
            args.balance,
            args.message_timeout_ms,
        )
        n = args.conversations * args.turns
        requests = generate_layout(dataclasses.replace(config, layout=layout))
        floor = hash_floor(requests, args.clusters)
        print(format_table(layout, ideal, rows, n, floor), flush=True)
        print(flush=True)
        report[layout] = {
            "ideal": ideal,
            "hash_floor": floor,
            "rows": [dataclasses.asdict(r) for r in rows],
        }
    (out / "layouts.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0

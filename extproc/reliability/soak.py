"""`extproc soak`: steady load through Envoy + processor for a long time, watching for growth.

Every ``--interval-s`` it samples the processor's RSS and open FDs (/proc), its asyncio task
count and worst event-loop lag (/metrics), and the decision latency p99 of that interval. After
the run the load stops, streams settle, and the verdict checks the stated bounds:

- RSS growth after warm-up <= ``--max-rss-growth-pct`` (default 5 %): median of the last three
  samples against the median of the first three samples after warm-up (medians, so one GC
  moment does not decide a verdict);
- FDs stable: no sample after warm-up more than ``--fd-slack`` above the first one after it;
- after settling: no budget held and no ext_proc stream open.

Writes ``soak.json``, ``soak.png`` (matplotlib, from the ``report`` extra) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc.harness.launch import FleetStack, wait_until
from extproc.reliability import probes
from extproc.reliability.redis_proc import RedisProc
from extproc.reliability.traffic import SteadyLoad, TrafficOptions


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    rss_mb: float
    fds: int
    tasks: float
    loop_lag_ms: float
    decision_p99_ms: float | None
    requests: int  # client-side outcomes so far
    streams_active: float


@dataclass(frozen=True, slots=True)
class Verdict:
    rss_warm_mb: float
    rss_end_mb: float
    rss_growth_pct: float
    fds_warm: int
    fds_max_after_warmup: int
    held_after_settle: float
    streams_after_settle: float
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=60.0, help="load duration")
    parser.add_argument(
        "--warmup-minutes",
        type=float,
        default=None,
        help="samples before this are not judged (default: 10%% of the run, at most 5)",
    )
    parser.add_argument("--interval-s", type=float, default=30.0, help="sampling interval")
    parser.add_argument("--rate", type=float, default=30.0, help="requests per second")
    parser.add_argument("--clusters", type=int, default=3)
    parser.add_argument("--redis", action="store_true", help="share budgets through a Redis")
    parser.add_argument(
        "--abort-share",
        type=float,
        default=0.0,
        help="share of requests the client gives up on after 10-300 ms (mid-prefill or"
        " mid-stream): Envoy ends their ext_proc streams while the request is in flight",
    )
    parser.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    parser.add_argument("--fd-slack", type=int, default=8)
    parser.add_argument("--out", default="out/soak", help="directory for soak.json/soak.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--envoy-reset",
        action="store_true",
        help="an Envoy without the graceful ext_proc close (processor.envoy_graceful_close:"
        " false): the processor waits for Envoy's reset at every stream end, the fallback",
    )


def judge(
    samples: Sequence[Sample],
    warmup_s: float,
    max_growth_pct: float,
    fd_slack: int,
    held: float,
    streams: float,
) -> Verdict:
    problems: list[str] = []
    after = [s for s in samples if s.t_s >= warmup_s]
    if len(after) < 2:
        problems.append(f"only {len(after)} samples after warm-up: run longer or sample faster")
        after = list(samples) or [Sample(0, 0, 0, 0, 0, None, 0, 0)]
    warm = statistics.median(s.rss_mb for s in after[:3])
    end = statistics.median(s.rss_mb for s in after[-3:])
    growth = 100.0 * (end - warm) / warm if warm else 0.0
    if growth > max_growth_pct:
        problems.append(f"RSS grew {growth:.1f}% after warm-up (bound {max_growth_pct:g}%)")
    fds_warm = after[0].fds
    fds_max = max(s.fds for s in after)
    if fds_max > fds_warm + fd_slack:
        problems.append(f"FDs grew from {fds_warm} to {fds_max} (slack {fd_slack})")
    if held:
        problems.append(f"{held:g} requests' budget still held after settling")
    if streams:
        problems.append(f"{streams:g} ext_proc streams still open after settling")
    return Verdict(warm, end, growth, fds_warm, fds_max, held, streams, tuple(problems))


def table(samples: Sequence[Sample]) -> str:
    head = (
        f"{'t (min)':>8} {'RSS MB':>8} {'FDs':>5} {'tasks':>6} {'lag ms':>7} "
        f"{'p99 ms':>7} {'requests':>9}"
    )
    lines = [head]
    for s in samples:
        p99 = "-" if s.decision_p99_ms is None else f"{s.decision_p99_ms:.2f}"
        lines.append(
            f"{s.t_s / 60:>8.1f} {s.rss_mb:>8.1f} {s.fds:>5} {s.tasks:>6.0f} "
            f"{s.loop_lag_ms:>7.1f} {p99:>7} {s.requests:>9}"
        )
    return "\n".join(lines)


def plot(samples: Sequence[Sample], verdict: Verdict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 8))
    FigureCanvasAgg(fig)
    t = [s.t_s / 60 for s in samples]
    panels: list[tuple[str, list[float]]] = [
        ("RSS (MB)", [s.rss_mb for s in samples]),
        ("open FDs", [float(s.fds) for s in samples]),
        ("asyncio tasks", [s.tasks for s in samples]),
        ("event-loop lag (ms, worst per interval)", [s.loop_lag_ms for s in samples]),
        (
            "decision p99 (ms, per interval)",
            [float("nan") if s.decision_p99_ms is None else s.decision_p99_ms for s in samples],
        ),
    ]
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (label, ys) in zip(axes, panels, strict=True):
        ax.plot(t, ys, marker=".")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("minutes")
    status = "PASS" if verdict.ok else "FAIL"
    fig.suptitle(
        f"soak: RSS growth after warm-up {verdict.rss_growth_pct:+.1f}% — {status}", fontsize=10
    )
    fig.savefig(str(path), dpi=90)


async def drive(
    args: argparse.Namespace, stack: FleetStack
) -> tuple[list[Sample], float, float, float]:
    proc = stack.procs[0]
    assert proc.popen is not None
    pid, port = proc.popen.pid, stack.metrics_ports[0]
    load = SteadyLoad(
        stack.url,
        TrafficOptions(rate_per_s=args.rate, concurrency=256, seed=args.seed, max_tokens=16),
    )
    load.abort_share = args.abort_share
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    samples: list[Sample] = []
    start = time.monotonic()
    end = start + args.minutes * 60
    hist = probes.buckets(await asyncio.to_thread(probes.scrape, port), "fleet_decision_seconds")
    while True:
        now = time.monotonic()
        if now >= end:
            break
        await asyncio.sleep(min(args.interval_s, end - now))
        scraped = await asyncio.to_thread(probes.scrape, port)
        fresh = probes.buckets(scraped, "fleet_decision_seconds")
        p99 = probes.interval_quantile(hist, fresh, 0.99)
        hist = fresh
        sample = Sample(
            t_s=time.monotonic() - start,
            rss_mb=probes.rss_bytes(pid) / 2**20,
            fds=probes.open_fds(pid),
            tasks=probes.value(scraped, "fleet_asyncio_tasks") or 0.0,
            loop_lag_ms=1000 * (probes.value(scraped, "fleet_event_loop_lag_seconds") or 0.0),
            decision_p99_ms=None if p99 is None else 1000 * p99,
            requests=len(load.outcomes),
            streams_active=probes.total(scraped, "fleet_extproc_streams_active"),
        )
        samples.append(sample)
        print(table([sample]).splitlines()[1], flush=True)
    stop.set()
    await runner

    def settled() -> bool:
        s = probes.scrape(port)
        return (
            probes.total(s, "fleet_budget_inflight_requests") == 0
            and probes.total(s, "fleet_extproc_streams_active") == 0
        )

    try:
        await asyncio.to_thread(wait_until, settled, 30, "budget and streams to settle", 0.5)
    except TimeoutError as exc:
        # Not fatal here: the verdict reports the figures that did not settle.
        print(f"soak: {exc}", flush=True)
    final = await asyncio.to_thread(probes.scrape, port)
    held = probes.total(final, "fleet_budget_inflight_requests")
    streams = probes.total(final, "fleet_extproc_streams_active")
    # Streams that ended in Envoy's reset: ~0 with the graceful close, every one without.
    cancelled = probes.total(final, "fleet_extproc_streams_cancelled_total")
    counts = load.counts()
    print(f"outcomes: {dict(counts)}  (generator skipped {load.skipped})", flush=True)
    return samples, held, streams, cancelled


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warmup_min = (
        args.warmup_minutes
        if args.warmup_minutes is not None
        else min(5.0, max(args.minutes * 0.1, args.interval_s / 60))
    )
    redis = RedisProc(out / "redis.log") if args.redis else None
    overrides: dict[str, Any] = {"redis": {"url": redis.url}} if redis else {}
    if args.envoy_reset:
        overrides["processor"] = {"envoy_graceful_close": False}
    stack = FleetStack(
        out / "fleet",
        clusters=args.clusters,
        sim_args=("--time-scale", "0.05"),
        fleet_overrides=overrides,
        access_log=False,
    )
    try:
        if redis:
            redis.start()
        stack.start()
        print(
            f"soak: {args.minutes:g} min at {args.rate:g} req/s, sample every "
            f"{args.interval_s:g}s, warm-up {warmup_min:g} min",
            flush=True,
        )
        print(table([]), flush=True)
        samples, held, streams, cancelled = asyncio.run(drive(args, stack))
    finally:
        stack.stop()
        if redis:
            redis.stop()
    verdict = judge(samples, warmup_min * 60, args.max_rss_growth_pct, args.fd_slack, held, streams)
    report = {
        "command": "extproc soak " + " ".join(_argv(args)),
        "minutes": args.minutes,
        "warmup_minutes": warmup_min,
        "rate_per_s": args.rate,
        "abort_share": args.abort_share,
        "samples": [asdict(s) for s in samples],
        "streams_cancelled": cancelled,
        "verdict": {**asdict(verdict), "ok": verdict.ok},
    }
    (out / "soak.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if not args.no_plot:
        plot(samples, verdict, out / "soak.png")
    print(table(samples))
    print(
        f"RSS {verdict.rss_warm_mb:.1f} MB after warm-up -> {verdict.rss_end_mb:.1f} MB at end "
        f"({verdict.rss_growth_pct:+.2f}%, bound {args.max_rss_growth_pct:g}%); FDs "
        f"{verdict.fds_warm} -> max {verdict.fds_max_after_warmup}; held after settle "
        f"{verdict.held_after_settle:g}; streams open {verdict.streams_after_settle:g}; "
        f"streams ended by a reset {cancelled:g}"
    )
    for problem in verdict.problems:
        print(f"FAIL: {problem}")
    print("soak: PASS" if verdict.ok else "soak: FAIL")
    return 0 if verdict.ok else 1


def _argv(args: argparse.Namespace) -> list[str]:
    parts = [f"--minutes {args.minutes:g}", f"--rate {args.rate:g}"]
    parts.append(f"--interval-s {args.interval_s:g}")
    if args.redis:
        parts.append("--redis")
    if args.abort_share:
        parts.append(f"--abort-share {args.abort_share:g}")
    if args.envoy_reset:
        parts.append("--envoy-reset")
    return parts

"""One run of `extproc bench peers`: a fresh engine fleet, one set-up in front, one workload.

A run starts the engines, the router (pinned to its own CPU in the ``isolated`` placement),
reads the engines' own counters and the router's CPU time, replays the workload (with the faults
of a fault run injected on schedule), reads them again, optionally measures the latency of one
connection, and stops everything.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from extproc.bench.peer_procs import (
    EngineCounters,
    EngineFleet,
    all_cpus,
    counter_deltas,
    cpu_seconds,
    pin,
    pin_self,
    rss_bytes,
)
from extproc.bench.peer_routers import Router, make_router
from extproc.bench.peer_workloads import BOUNDS, PeerWorkload
from extproc.harness.prompts import API_PATHS
from extproc.harness.replay import ReplayOptions, ReplayResult, run_replay
from extproc.harness.workload import ReplayRequest

Placement = Literal["isolated", "shared"]
# Fault schedule (seconds after the replay starts): one engine killed for 10 s, then the router
# restarted.
KILL_AT_S = 8.0
ENGINE_DOWN_S = 10.0
RESTART_AT_S = 30.0
KILLED_ENGINE = "e2"
PROBE_REQUESTS = 60


@dataclass(frozen=True, slots=True)
class Engines:
    """What every engine is, the same in every set-up."""

    count: int
    prefill_tps: float
    decode_tps: float
    max_concurrency: int
    max_output: int
    kv_capacity_tokens: int

    def sim_args(self) -> tuple[str, ...]:
        return (
            "--prefill-tps",
            f"{self.prefill_tps:g}",
            "--decode-tps",
            f"{self.decode_tps:g}",
            "--max-concurrency",
            str(self.max_concurrency),
            "--max-output",
            str(self.max_output),
            "--kv-capacity-tokens",
            str(self.kv_capacity_tokens),
        )


@dataclass(frozen=True, slots=True)
class RunSpec:
    setup: str
    workload: PeerWorkload
    placement: Placement = "isolated"
    replicas: int = 1
    faults: bool = False
    probe: bool = False

    @property
    def slug(self) -> str:
        parts = [self.workload.name, self.placement, self.setup.replace(":", "-")]
        if self.replicas > 1:
            parts.append(f"x{self.replicas}")
        if self.faults:
            parts.append("faults")
        return "-".join(parts)


@dataclass(slots=True)
class RunResult:
    spec: RunSpec
    replay: ReplayResult
    engines: dict[str, EngineCounters]
    router_cpu_s: float | None
    router_rss_bytes: int
    probe: list[float] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)
    start_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Context:
    out_dir: Path
    engines: Engines
    bin_dir: Path | None
    progress: Callable[[str], None] | None = None
    tuned: Mapping[str, Any] = field(default_factory=dict)
    # Real llama.cpp engines serving this GGUF instead of simulated ones.
    llamacpp_model: Path | None = None
    probe_requests: int = PROBE_REQUESTS


def placement_cpus(placement: Placement) -> tuple[set[int], set[int]]:
    """(client and engines, router): the router alone on the last CPU when isolated."""
    cpus = sorted(all_cpus())
    if placement == "shared" or len(cpus) < 2:
        return set(cpus), set(cpus)
    return set(cpus[:-1]), {cpus[-1]}


def _run(main: Coroutine[Any, Any, Any]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _redis(workdir: Path) -> Any:
    from extproc.reliability.redis_proc import RedisProc

    redis = RedisProc(workdir / "redis.log")
    redis.start()
    return redis


def start_fleet(placement: Placement, ctx: Context, name: str) -> EngineFleet:
    """The engines of one part, started with the client's CPUs (they inherit them)."""
    workdir = ctx.out_dir / "logs" / f"{name}-engines"
    shutil.rmtree(workdir, ignore_errors=True)
    pin_self(placement_cpus(placement)[0])
    fleet = EngineFleet(workdir, ctx.engines.count, ctx.engines.sim_args())
    fleet.llamacpp_model = ctx.llamacpp_model
    fleet.start_timeout_s = 180.0 if ctx.llamacpp_model else 90.0
    return fleet.start()


def execute(spec: RunSpec, ctx: Context, fleet: EngineFleet) -> RunResult:
    """One set-up on ``fleet``, fresh again (reset, or a new process where one was killed)."""
    workdir = ctx.out_dir / "logs" / spec.slug
    shutil.rmtree(workdir, ignore_errors=True)
    client_cpus, router_cpus = placement_cpus(spec.placement)
    started = time.monotonic()
    pin_self(client_cpus)
    fleet.reset()
    redis = None
    router: Router | None = None
    try:
        if spec.replicas > 1 and spec.setup.startswith("extproc"):
            redis = _redis(workdir)
        router = make_router(
            spec.setup,
            fleet.urls,
            dict(fleet.ports),
            workdir,
            ctx.bin_dir,
            spec.replicas,
            None if redis is None else redis.url,
            ctx.tuned,
        )
        router.start()
        if router_cpus != client_cpus:
            pin(router.pids(), router_cpus)
        return _measure(spec, ctx, fleet, router, router_cpus, started)
    finally:
        if router is not None:
            router.stop()
        if redis is not None:
            redis.stop()


def _measure(
    spec: RunSpec,
    ctx: Context,
    fleet: EngineFleet,
    router: Router,
    router_cpus: set[int],
    started: float,
) -> RunResult:
    ready = time.monotonic()
    before = fleet.counters()
    cpu_before = cpu_seconds(router.pids())
    urls = router.urls
    options = ReplayOptions(
        concurrency=spec.workload.closed_loop or 4096,
        timeout_s=180.0,
        class_bounds=BOUNDS,
        more_targets=tuple(urls[1:]),
        progress=ctx.progress,
        progress_interval_s=10.0,
    )
    events: dict[str, float] = {}
    replay = _run(_drive(spec, options, urls[0], fleet, router, router_cpus, events))
    deltas = counter_deltas(fleet.counters(), before)
    cpu = None if spec.faults else cpu_seconds(router.pids()) - cpu_before
    rss = rss_bytes(router.pids())
    probe = _probe(urls[0], ctx.probe_requests) if spec.probe else []
    return RunResult(spec, replay, deltas, cpu, rss, probe, events, ready - started)


async def _drive(
    spec: RunSpec,
    options: ReplayOptions,
    target: str,
    fleet: EngineFleet,
    router: Router,
    router_cpus: set[int],
    events: dict[str, float],
) -> ReplayResult:
    origin = time.monotonic()
    replay = asyncio.create_task(run_replay(spec.workload.requests, target, options))
    if spec.faults:
        await _faults(origin, fleet, router, router_cpus, events)
    return await replay


async def _faults(
    origin: float,
    fleet: EngineFleet,
    router: Router,
    router_cpus: set[int],
    events: dict[str, float],
) -> None:
    async def at(offset: float) -> None:
        await asyncio.sleep(max(0.0, origin + offset - time.monotonic()))

    def mark(name: str) -> None:
        events[name] = time.monotonic() - origin

    await at(KILL_AT_S)
    fleet.kill(KILLED_ENGINE)
    mark("engine_killed")
    await at(KILL_AT_S + ENGINE_DOWN_S)
    await asyncio.to_thread(fleet.revive, KILLED_ENGINE)
    mark("engine_back")
    await at(RESTART_AT_S)
    mark("router_stopped")
    await asyncio.to_thread(router.restart)
    if router_cpus != set(all_cpus()):
        pin(router.pids(), router_cpus)
    mark("router_back")


def probe_requests(count: int = PROBE_REQUESTS) -> list[ReplayRequest]:
    """Small unique non-streamed requests, one output token each, sent one after another."""
    out = []
    for i in range(count):
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": f"probe {i}: " + "ping " * 40}],
            "max_tokens": 1,
        }
        out.append(
            ReplayRequest(
                0.0,
                "openai-chat",
                API_PATHS["openai-chat"],
                body,
                None,
                False,
                "probe",
                60,
                False,
                1,
            )
        )
    return out


def _probe(target: str, count: int) -> list[float]:
    """Latency of each request over one kept-alive connection, in seconds (the first, which
    opens the connection, is left out)."""
    options = ReplayOptions(concurrency=1, timeout_s=60.0, class_bounds=BOUNDS)
    result: ReplayResult = _run(run_replay(probe_requests(count), target, options))
    ordered = sorted(result.outcomes, key=lambda o: o.sent_s)[1:]
    return [o.latency_s for o in ordered if o.outcome == "2xx" and o.latency_s is not None]


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

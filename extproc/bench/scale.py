"""``extproc bench scale``: the two data paths at 16 to 512 clusters.

For each fleet size and endpoints per cluster, and for each design —

- ``pairs``: one aggregate cluster per ordered (primary, secondary) pair, N·(N-1) of them
  (``processor.mode: route``);
- ``pool_cds``: the pool as first built: one pool cluster holding every endpoint inline (a
  reload replaces the whole cluster by CDS), active health checks every second; override_host
  picks the processor's endpoints (``processor.mode: endpoint_picker``);
- ``pool``: the pool as rendered now: the same cluster with its endpoints by EDS (a reload
  rewrites only the endpoint list) and health checks every ``POOL_HEALTH_CHECK_INTERVAL_S`` —

it renders the Envoy bootstrap + CDS file (file-based CDS, as ``extproc serve --envoy-cds``
runs it), starts a real Envoy on it and reports: config size, render time, Envoy's start to
``/ready`` (wall clock, and Envoy's own CPU time to get there: on a shared machine the wall
clock is mostly the wait for a core), Envoy's RSS once ready, the time for one added cluster to
be applied (the CDS and EDS files rewritten with N+1 clusters until Envoy counts the update, has
no cluster warming and holds the N+1 clusters' endpoints), and the processor's decision time at
that size (rendezvous placement: the plain loop, the packed and the numpy miss paths, a cache
hit; and the whole ``Pipeline.decide`` per request on repeating sessions).

The endpoints are loopback ports nothing listens on: Envoy's health checks fail fast
(connection refused), which costs Envoy what a fleet of dead hosts costs; no request is sent.
The pairs design takes minutes and GBs from 256 clusters on: runs above
``--pairs-max-clusters`` are skipped and listed as such, and any Envoy not ready within
``--ready-timeout`` is stopped and reported as a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from prometheus_client import CollectorRegistry

from extproc.config.load import parse_config
from extproc.config.runtime import Runtime, compile_runtime
from extproc.core.placement import VECTOR_MIN_CLUSTERS, Rendezvous
from extproc.harness.launch import LOOPBACK, Proc, envoy_binary, free_port, http_get
from extproc.ledger.gate import build_gate
from extproc.pipeline.endpoint_health import EndpointHealth
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.reliability.probes import cpu_seconds, rss_bytes
from extproc.render.envoy import FALLBACK_CLUSTER, EnvoyOptions
from extproc.render.envoy_dynamic import (
    PoolEndpoints,
    endpoints_doc,
    endpoints_path,
    pool_endpoints,
    split_bootstrap,
    write_atomically,
)

Design = Literal["pairs", "pool_cds", "pool"]
DESIGNS: tuple[Design, ...] = ("pairs", "pool_cds", "pool")
MODE_OF: dict[Design, str] = {
    "pairs": "route",
    "pool_cds": "endpoint_picker",
    "pool": "endpoint_picker",
}
# The health-check interval of the pool before it was spread out (pool_cds).
FIRST_POOL_HEALTH_CHECK_INTERVAL = "1s"
# Endpoint ports: a block nothing on this machine listens on by default (below the Linux
# ephemeral range, 32768+).
FIRST_ENDPOINT_PORT = 20000


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_ints, default=[16, 64, 128, 256, 512])
    parser.add_argument("--endpoints", type=_ints, default=[1, 8], help="endpoints per cluster")
    parser.add_argument(
        "--designs", type=lambda t: [d for d in t.split(",") if d], default=list(DESIGNS)
    )
    parser.add_argument(
        "--pairs-max-clusters",
        type=int,
        default=64,
        help="skip the pairs design above this many clusters (128: ~20 s idle, over 300 s on a"
        " loaded machine; 256: ~4 min and ~3.5 GB)",
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--reload-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument(
        "--decisions-only", action="store_true", help="only the processor's decision times"
    )
    parser.add_argument(
        "--envoy-only", action="store_true", help="only the Envoy rows, no decision times"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="Envoy runs per row, interleaved by design"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time decisions by the process's CPU time, not the wall clock (a shared machine)",
    )
    parser.add_argument("--requests", type=int, default=2000, help="decide() calls per size")
    parser.add_argument("--workdir", default=None, help="keep configs and logs here")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")


@dataclass
class EnvoyRow:
    design: Design
    clusters: int
    endpoints: int
    envoy_clusters: int = 0
    config_bytes: int = 0
    render_s: float = 0.0
    ready_s: float | None = None
    # Envoy's own CPU time (user + system) from exec to ready: what its start-up costs whatever
    # the machine's load; on a shared machine ready_s is mostly the wait for a core.
    ready_cpu_s: float | None = None
    rss_mb: float | None = None
    reload_s: float | None = None
    rss_after_reload_mb: float | None = None
    skipped: str | None = None


@dataclass
class DecisionRow:
    clusters: int
    loop_us: float
    miss_us: float  # the processor's own path for a miss (numpy from VECTOR_MIN_CLUSTERS)
    hit_us: float
    packed_miss_us: float = 0.0  # the big-integer path alone, measured in the same passes
    weighted_miss_us: float = 0.0  # the processor's path with unequal weights (1, 2, 3, 4, ...)
    decide_us: dict[str, float] = field(default_factory=dict)
    # New sessions only (every request a first turn), first design: the default bound off,
    # judged by the full ranking and snapshot (the path before the kept totals), and as served.
    new_session_us: dict[str, float] = field(default_factory=dict)


def fleet_doc(n: int, per: int, design: Design, ports: Sequence[int]) -> dict[str, Any]:
    listener, admin, grpc = ports
    return {
        "version": 1,
        "listener": {"address": LOOPBACK, "port": listener, "admin_port": admin},
        "processor": {
            "address": LOOPBACK,
            "port": grpc,
            "metrics_port": 0,
            "mode": MODE_OF[design],
        },
        "clusters": [
            {
                "name": f"c{i:03d}",
                "endpoints": [
                    f"{LOOPBACK}:{FIRST_ENDPOINT_PORT + i * per + j}" for j in range(per)
                ],
            }
            for i in range(n)
        ],
    }


def runtime_of(doc: dict[str, Any]) -> Runtime:
    return compile_runtime(parse_config(doc))


@dataclass(frozen=True)
class Rendered:
    bootstrap: bytes
    cds: bytes
    eds: bytes  # empty when the design has no EDS file
    envoy_clusters: int


def render(runtime: Runtime, design: Design, workdir: Path) -> Rendered:
    cds_path = str(workdir / "cds.json")
    opts = EnvoyOptions(access_log_path=None)
    pool: PoolEndpoints = "file" if design == "pool" else "inline"
    bootstrap, cds = split_bootstrap(runtime, cds_path, opts, pool=pool)
    if design == "pool_cds":
        for cluster in cds["resources"]:
            for check in cluster.get("health_checks", []):
                check["interval"] = FIRST_POOL_HEALTH_CHECK_INTERVAL
                check["no_traffic_interval"] = FIRST_POOL_HEALTH_CHECK_INTERVAL
    assignments = pool_endpoints(runtime, opts) if design == "pool" else []
    eds = orjson.dumps(endpoints_doc(runtime.version, assignments)) if assignments else b""
    return Rendered(orjson.dumps(bootstrap), orjson.dumps(cds), eds, len(cds["resources"]))


def write_dynamic(rendered: Rendered, workdir: Path, previous: Rendered | None = None) -> bool:
    """The EDS file, then the CDS file if it changed: whether the CDS file was written."""
    if rendered.eds:
        write_atomically(endpoints_path(workdir / "cds.json"), rendered.eds.decode())
    if previous is not None and previous.cds == rendered.cds:
        return False
    write_atomically(workdir / "cds.json", rendered.cds.decode())
    return True


def _stats(admin: int, pattern: str) -> dict[str, int]:
    """Envoy's counters matching ``pattern``; empty when the admin port did not answer in time
    (an Envoy busy applying tens of thousands of clusters answers late: the caller polls)."""
    try:
        _status, body = http_get(admin, f"/stats?filter={pattern}", timeout=10)
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in body.decode().splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().lstrip("-").isdigit():
            out[name.strip()] = int(value)
    return out


CDS_STATS = (
    r"^cluster_manager\.(cds\.update_success|cds\.update_rejected|warming_clusters)$"
    rf"|^cluster\.{FALLBACK_CLUSTER}\.(membership_total|update_rejected)$"
)


def _ready(admin: int) -> bool:
    try:
        return http_get(admin, "/ready", timeout=2)[0] == 200
    except OSError:
        return False


def measure_envoy(
    n: int, per: int, design: Design, workdir: Path, ready_timeout: float, reload_timeout: float
) -> EnvoyRow:
    row = EnvoyRow(design, n, per)
    ports = [free_port() for _ in range(3)]
    t0 = time.perf_counter()
    runtime = runtime_of(fleet_doc(n, per, design, ports))
    rendered = render(runtime, design, workdir)
    row.render_s = time.perf_counter() - t0
    row.envoy_clusters = rendered.envoy_clusters
    row.config_bytes = len(rendered.bootstrap) + len(rendered.cds) + len(rendered.eds)
    (workdir / "bootstrap.json").write_bytes(rendered.bootstrap)
    write_dynamic(rendered, workdir)
    argv = [
        envoy_binary(),
        "-c",
        str(workdir / "bootstrap.json"),
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "--log-level",
        "error",
    ]
    envoy = Proc("envoy", argv, workdir / "envoy.log")
    admin = ports[1]
    start = time.perf_counter()
    envoy.start()
    try:
        while not _ready(admin):
            if not envoy.alive:
                raise RuntimeError(f"envoy exited:\n{envoy.log_text()[-2000:]}")
            if time.perf_counter() - start > ready_timeout:
                row.skipped = f"not ready within {ready_timeout:g} s"
                return row
            time.sleep(0.05)
        row.ready_s = time.perf_counter() - start
        assert envoy.popen is not None
        row.ready_cpu_s = cpu_seconds(envoy.popen.pid)
        row.rss_mb = rss_bytes(envoy.popen.pid) / 1e6
        row.reload_s = _reload(n, per, design, ports, workdir, admin, reload_timeout, rendered)
        row.rss_after_reload_mb = rss_bytes(envoy.popen.pid) / 1e6
        return row
    finally:
        envoy.stop(timeout=30)


def _reload(
    n: int,
    per: int,
    design: Design,
    ports: Sequence[int],
    workdir: Path,
    admin: int,
    limit: float,
    previous: Rendered,
) -> float | None:
    """One more cluster through the CDS/EDS files: seconds until Envoy has applied it."""
    before: dict[str, int] = {}
    deadline = time.perf_counter() + limit
    while not before:
        if time.perf_counter() > deadline:
            return None
        before = _stats(admin, CDS_STATS)
    rendered = render(runtime_of(fleet_doc(n + 1, per, design, ports)), design, workdir)
    start = time.perf_counter()
    cds_written = write_dynamic(rendered, workdir, previous)
    rejected = (
        "cluster_manager.cds.update_rejected",
        f"cluster.{FALLBACK_CLUSTER}.update_rejected",
    )
    while time.perf_counter() - start < limit:
        now = _stats(admin, CDS_STATS)
        if any(now.get(k, 0) > before.get(k, 0) for k in rejected):
            raise RuntimeError(f"Envoy rejected the update ({design}, {n + 1} clusters)")
        cds_done = not cds_written or now.get("cluster_manager.cds.update_success", 0) > before.get(
            "cluster_manager.cds.update_success", 0
        )
        hosts = now.get(f"cluster.{FALLBACK_CLUSTER}.membership_total", 0)
        settled = now.get("cluster_manager.warming_clusters", 1) == 0
        if cds_done and settled and hosts == (n + 1) * per:
            return time.perf_counter() - start
        time.sleep(0.02)
    return None


# Decision times are read on the wall clock, or on the process's CPU time (--cpu-time), which
# on a machine shared by many processes leaves out the time this one waited for a core (at
# load ~30 on 2 cores, ~10x the CPU time of a decision).
Clock = Callable[[], float]


def _per_call_us(fn: Any, args: Sequence[Any], clock: Clock) -> float:
    start = clock()
    for a in args:
        fn(a)
    return (clock() - start) / len(args) * 1e6


def placement_times(
    n: int, clock: Clock = time.perf_counter, samples: int = 2000, repeats: int = 3
) -> tuple[float, float, float, float, float]:
    """(plain loop, miss, cache hit, packed miss, weighted miss) µs per top2 at ``n`` clusters.

    "miss" is what the processor runs (``Rendezvous`` as built by the config); "packed miss" the
    big-integer path alone, in the same passes so the two compare side by side. Each figure is
    the best of ``repeats`` passes (the machine may be shared: the least disturbed pass).
    """
    rng = random.Random(n)
    points = [rng.getrandbits(64) for _ in range(samples)]
    names = tuple(f"c{i:03d}" for i in range(n))
    weights = tuple(float(1 + i % 4) for i in range(n))
    loop = Rendezvous(names, (1.0,) * n, cache_size=0, vectorise=False)
    loop_us = min(_per_call_us(loop.top2, points, clock) for _ in range(repeats))
    miss_us = hit_us = packed_us = weighted_us = float("inf")
    for _ in range(repeats):
        placer = Rendezvous(names, (1.0,) * n)  # a new placer: every point is a miss
        miss_us = min(miss_us, _per_call_us(placer.top2, points, clock))
        hit_us = min(hit_us, _per_call_us(placer.top2, points, clock))
        packed = Rendezvous(names, (1.0,) * n, numpy=False)
        packed_us = min(packed_us, _per_call_us(packed.top2, points, clock))
        weighted = Rendezvous(names, weights)
        weighted_us = min(weighted_us, _per_call_us(weighted.top2, points, clock))
    return loop_us, miss_us, hit_us, packed_us, weighted_us


def _chat(session: int, turn: int) -> tuple[dict[str, str], bytes]:
    messages = [{"role": "user", "content": f"turn {t} of a conversation"} for t in range(turn + 1)]
    body = orjson.dumps({"model": "m", "messages": messages, "max_tokens": 16})
    headers = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
        "x-session-id": f"scale-{session}",
    }
    return headers, body


async def decide_us(
    runtime: Runtime,
    requests: int,
    clock: Clock = time.perf_counter,
    turns: int = 5,
    share_totals: bool = True,
    warm: int = 0,
) -> float:
    """Mean µs of ``Pipeline.decide`` (admission included) on sessions of ``turns`` turns
    each. ``share_totals`` False: the bound judged without the load table's kept totals.
    ``warm``: new sessions decided first, untimed (the bound's counts as in steady traffic,
    not the warm-up in which every cluster is over its share)."""
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(0))
    # As `extproc serve` runs the pool design: a prober's ready set (here: every endpoint, not
    # probed; building the set per request would be the benchmark's cost, not the processor's).
    health = EndpointHealth(runtime.endpoints, {c.name: c.health_path for c in runtime.clusters})
    health.ready = frozenset(e for eps in runtime.endpoints.values() for e in eps)
    pipeline = Pipeline(
        RuntimeHolder(runtime),
        Metrics(registry),
        gate,
        endpoint_health=health if runtime.endpoint_picker else None,
        share_totals=share_totals,
    )
    work = [_chat(i // turns, i % turns) for i in range(requests)]
    try:
        for i in range(warm):
            headers, body = _chat(-1 - i, 0)
            settled = await pipeline.decide(headers, body, time.monotonic())
            if isinstance(settled, Routed):
                await pipeline.release(settled.hold)
        took = 0.0
        for headers, body in work:
            start = clock()
            outcome = await pipeline.decide(headers, body, time.monotonic())
            took += clock() - start
            if isinstance(outcome, Routed):
                await pipeline.release(outcome.hold)
        return took / len(work) * 1e6
    finally:
        await pipeline.aclose()
        await gate.close()


def measure_decisions(
    n: int, designs: Sequence[Design], requests: int, clock: Clock = time.perf_counter
) -> DecisionRow:
    loop_us, miss_us, hit_us, packed_us, weighted_us = placement_times(n, clock)
    row = DecisionRow(n, loop_us, miss_us, hit_us, packed_us, weighted_us)
    for design in designs:
        runtime = runtime_of(fleet_doc(n, 8, design, (1, 2, 3)))
        row.decide_us[design] = asyncio.run(decide_us(runtime, requests, clock))
    if designs:
        doc = fleet_doc(n, 8, designs[0], (1, 2, 3))
        unbound = runtime_of({**doc, "affinity": {"balance_factor": 0}})
        bound = runtime_of(doc)
        # Interleaved rounds, best of each: the three compare side by side on a shared machine.
        # Each first places 4 sessions per cluster untimed: the bound's steady state.
        for _ in range(3):
            for name, runtime, totals in (
                (NEW_BOUND_OFF, unbound, True),
                (NEW_BOUND_OLD, bound, False),
                (NEW_BOUND, bound, True),
            ):
                took = asyncio.run(decide_us(runtime, requests, clock, 1, totals, 4 * n))
                row.new_session_us[name] = min(row.new_session_us.get(name, took), took)
    return row


NEW_BOUND_OFF = "bound off"
NEW_BOUND_OLD = "bound, previous path"
NEW_BOUND = "bound (default)"


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def envoy_table(rows: Sequence[EnvoyRow]) -> str:
    lines = [
        "| design | clusters x endpoints | Envoy clusters | config | render | ready "
        "| Envoy CPU to ready | RSS | +1 cluster reload | RSS after reload |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r.design} | {r.clusters} x {r.endpoints} |"
        if r.skipped and r.ready_s is None and not r.config_bytes:
            lines.append(f"{head} - | - | - | skipped: {r.skipped} | - | - | - | - |")
            continue
        lines.append(
            f"{head} {r.envoy_clusters:,} | {r.config_bytes / 1e6:.2f} MB | {r.render_s:.2f} s "
            f"| {_fmt(r.ready_s, ' s', 2) if r.ready_s is not None else r.skipped} "
            f"| {_fmt(r.ready_cpu_s, ' s', 2)} | {_fmt(r.rss_mb, ' MB', 0)} "
            f"| {_fmt(r.reload_s, ' s', 2)} | {_fmt(r.rss_after_reload_mb, ' MB', 0)} |"
        )
    return "\n".join(lines)


def decision_table(rows: Sequence[DecisionRow], designs: Sequence[Design]) -> str:
    new = (NEW_BOUND_OFF, NEW_BOUND_OLD, NEW_BOUND) if designs else ()
    lines = [
        "| clusters | top2 loop | top2 miss, packed | top2 miss | top2 miss, weighted "
        "| top2 cache hit | "
        + " | ".join([f"decide(), {d}" for d in designs] + [f"new session, {n}" for n in new])
        + " |",
        "|---|---|---|---|---|---|" + "---|" * (len(designs) + len(new)),
    ]
    for r in rows:
        lines.append(
            f"| {r.clusters} | {r.loop_us:.1f} µs | {r.packed_miss_us:.1f} µs "
            f"| {r.miss_us:.1f} µs | {r.weighted_miss_us:.1f} µs | {r.hit_us:.2f} µs | "
            + " | ".join(
                [f"{r.decide_us[d]:.0f} µs" for d in designs]
                + [f"{r.new_session_us[n]:.0f} µs" for n in new]
            )
            + " |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    designs: list[Design] = [d for d in DESIGNS if d in args.designs]
    unknown = set(args.designs) - set(DESIGNS)
    if unknown:
        print(f"extproc bench scale: unknown design(s) {sorted(unknown)}; use {DESIGNS}")
        return 2
    # The two pool designs differ only in Envoy's config: one processor, one decision time.
    deciders = [d for d in designs if d != "pool_cds"]
    decisions = []
    clock: Clock = time.process_time if args.cpu_time else time.perf_counter
    if not args.envoy_only:
        decisions = [measure_decisions(n, deciders, args.requests, clock) for n in args.sizes]
        print(
            f"Decision time (µs per call, {'CPU time' if args.cpu_time else 'wall clock'};"
            " placement: equal weights unless weighted; miss = the processor's path, numpy from"
            f" {VECTOR_MIN_CLUSTERS} clusters; decide(): 8 endpoints/cluster)"
        )
        print(decision_table(decisions, deciders), flush=True)
    envoy_rows: list[EnvoyRow] = []
    if not args.decisions_only:
        root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-scale-"))
        for per in args.endpoints:
            for n in args.sizes:
                for design in [d for _ in range(args.repeat) for d in designs]:
                    if design == "pairs" and n > args.pairs_max_clusters:
                        row = EnvoyRow(design, n, per)
                        row.skipped = f"above --pairs-max-clusters {args.pairs_max_clusters}"
                    else:
                        workdir = root / f"{design}-{n}x{per}-{len(envoy_rows)}"
                        workdir.mkdir(parents=True, exist_ok=True)
                        row = measure_envoy(
                            n, per, design, workdir, args.ready_timeout, args.reload_timeout
                        )
                    envoy_rows.append(row)
                    print(json.dumps(asdict(row)), flush=True)
        print()
        print("Envoy (1 worker thread, file-based CDS; endpoints refuse connections)")
        print(envoy_table(envoy_rows))
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "decision_clock": "cpu" if args.cpu_time else "wall",
                    "decisions": [asdict(r) for r in decisions],
                    "envoy": [asdict(r) for r in envoy_rows],
                },
                indent=2,
            )
        )
    return 0

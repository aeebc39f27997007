"""`extproc bench profile`: where a processor's CPU goes through Envoy, split by library.

Runs the set-ups of `bench overhead` (the same Envoy, upstream, wrk load and request) one at a
time and, while wrk drives each, samples its processor with ``perf record -g`` (C frames: on
Python 3.11 the interpreter shows as itself, without Python function names). Each sample is
charged to the shared object of its innermost frame, and the shared objects to layers: the
kernel (sockets, epoll, scheduling), grpcio's C core (its one extension module, the Cython
glue included), the CPython interpreter (every Python line: grpc.aio's, asyncio's and ours),
protobuf, the event loop (uvloop, libuv inside), libc (malloc, memcpy). Beside the split,
each set-up's processor CPU per request and the front Envoy's: the ext_proc exchanges cost
Envoy CPU too, on the same cores.

The Python share is split further by `extproc bench handler` (the processor's own handler
code in process, without gRPC), or with ``--python`` through Envoy: each processor runs under
cProfile (extproc/bench/pyprofile.py), switched on for exactly the measured wrk run, and the
report lists its Python functions per request (calls and self time) instead of the layers.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from extproc.bench import pyprofile
from extproc.bench.overhead import SETUPS, Bench, tree_cpu_seconds

# Shared objects by the layer they belong to; the first pattern that matches names it.
LAYERS: tuple[tuple[str, str], ...] = (
    ("kernel", r"^\[(kernel\.kallsyms|vdso|unknown)\]$"),
    ("grpc C core", r"cygrpc|libgrpc"),
    ("protobuf", r"_message\.|upb|protobuf"),
    ("event loop", r"uvloop|loop\.cpython|libuv|_asyncio"),
    ("CPython interpreter", r"python3|libpython"),
    ("libc / allocator", r"^(libc|libm|ld-linux|libstdc\+\+|libgcc|libpthread)"),
    ("JSON (orjson / msgspec)", r"orjson|msgspec"),
)
OTHER = "other"
LAYER_NAMES = (*(name for name, _ in LAYERS), OTHER)
PERF_FREQ = 999
# Self time only (the innermost frame's object), no call graphs in the text.
REPORT_FLAGS = ("--no-children", "-g", "none")


def layer_of(dso: str) -> str:
    for name, pattern in LAYERS:
        if re.search(pattern, Path(dso).name if not dso.startswith("[") else dso):
            return name
    return OTHER


_ROW = re.compile(r"^\s*([0-9.]+)%\s+(\S.*?)\s*$")


def split_by_layer(report: str) -> dict[str, float]:
    """Percent of samples per layer from ``perf report --sort dso --stdio`` (self time)."""
    shares = dict.fromkeys(LAYER_NAMES, 0.0)
    for line in report.splitlines():
        if line.startswith("#"):
            continue
        m = _ROW.match(line)
        if m:
            shares[layer_of(m.group(2))] += float(m.group(1))
    return shares


@dataclass
class Profile:
    setup: str
    requests: int
    rps: float
    p50_ms: float
    processor_us_per_req: float | None
    envoy_us_per_req: float
    samples: int = 0
    shares: dict[str, float] = field(default_factory=dict)
    # --python: the processor's Python self time per request under cProfile, and its functions.
    python_us_per_req: float | None = None
    functions: list[pyprofile.Row] = field(default_factory=list)


def _perf_samples(header: str) -> int:
    m = re.search(r"^# Samples: ([0-9.]+)([KM]?)", header, re.M)
    if not m:
        return 0
    scale = {"": 1, "K": 1000, "M": 1_000_000}[m.group(2)]
    return int(float(m.group(1)) * scale)


def profile_setup(
    bench: Bench, setup: str, size: str, connections: int, warmup: float, perf: str | None
) -> Profile:
    front, processor = bench.start_setup(setup)
    try:
        for _ in range(5):
            if not bench.run_wrk(setup, size, 4, processor, duration=warmup).bypassed:
                break
        recorder = None
        data = bench.workdir / f"perf-{setup}.data"
        if perf and processor is not None and processor.popen is not None:
            pid = str(processor.popen.pid)
            recorder = subprocess.Popen(
                [perf, "record", "-F", str(PERF_FREQ), "-g", "-o", str(data), "-p", pid],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)  # perf attaches before the load starts
        assert front.popen is not None
        stats = bench.python_profile / f"{setup}.prof" if bench.python_profile else None
        toggled = stats is not None and processor is not None and processor.popen is not None
        if toggled:
            assert processor is not None
            processor.signal(pyprofile.SIGNAL)  # profiler on
            time.sleep(0.2)
        envoy0 = tree_cpu_seconds(front.popen.pid)
        result = bench.run_wrk(setup, size, connections, processor)
        if toggled:
            assert processor is not None and stats is not None
            processor.signal(pyprofile.SIGNAL)  # off: the stats are written
            deadline = time.monotonic() + 30
            while not stats.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)  # the write completes
        envoy_us = (tree_cpu_seconds(front.popen.pid) - envoy0) / max(1, result.requests) * 1e6
        out = Profile(
            setup, result.requests, result.rps, result.p50_ms, result.proc_cpu_us_per_req, envoy_us
        )
        if recorder is not None and perf:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(60)
            report = subprocess.run(
                [perf, "report", "-i", str(data), "--sort", "dso", "--stdio", *REPORT_FLAGS],
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            ).stdout
            out.samples = _perf_samples(report)
            out.shares = split_by_layer(report)
        if toggled and stats is not None and stats.exists():
            out.python_us_per_req, out.functions = pyprofile.per_request(stats, result.requests)
        return out
    finally:
        front.stop()
        if processor is not None:
            processor.stop()
        bench.procs = [p for p in bench.procs if p not in (front, processor)]


def table(profiles: list[Profile]) -> list[str]:
    procs = [p for p in profiles if p.shares]
    lines = [
        "| set-up | rps | p50 ms | processor CPU us/req | front Envoy CPU us/req |",
        "|---|---|---|---|---|",
    ]
    for p in profiles:
        cpu = f"{p.processor_us_per_req:.0f}" if p.processor_us_per_req is not None else "-"
        lines.append(
            f"| {p.setup} | {p.rps:.0f} | {p.p50_ms:.3f} | {cpu} | {p.envoy_us_per_req:.0f} |"
        )
    if procs:
        lines += [
            "",
            "| processor CPU by layer (perf samples) | "
            + " | ".join(f"{p.setup}: % / us per req" for p in procs)
            + " |",
            "|---|" + "---|" * len(procs),
        ]
        for name in LAYER_NAMES:
            cells = [
                f"{p.shares.get(name, 0.0):.1f} / "
                f"{p.shares.get(name, 0.0) / 100 * (p.processor_us_per_req or 0):.0f}"
                for p in procs
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("| samples | " + " | ".join(str(p.samples) for p in procs) + " |")
    lines += python_table(profiles)
    return lines


def python_table(profiles: list[Profile], top: int = 25) -> list[str]:
    """--python: each set-up's Python self time per request, then its top functions."""
    profiled = [p for p in profiles if p.python_us_per_req is not None]
    if not profiled:
        return []
    lines = [
        "",
        "Python under cProfile (inflated several times for small calls: compare set-ups):",
        "",
        "| set-up | Python self time, us/req | functions |",
        "|---|---|---|",
    ]
    lines += [f"| {p.setup} | {p.python_us_per_req:.0f} | {len(p.functions)} |" for p in profiled]
    for p in profiled:
        lines += [
            "",
            f"{p.setup}: calls / self us / cumulative us per request",
            "",
            "| function | calls | self | cumulative |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r.function} | {r.calls_per_req:.2f} | {r.self_us_per_req:.1f} "
            f"| {r.total_us_per_req:.1f} |"
            for r in p.functions[:top]
        ]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--setups", default="envoy,bare,header")
    parser.add_argument("--size", default="1KB")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of wrk per set-up")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--no-perf", action="store_true", help="CPU per request only (no perf record)"
    )
    parser.add_argument(
        "--python",
        action="store_true",
        help="cProfile each processor during the measured run (Python functions per request)"
        " instead of perf's layers",
    )


def run(args: argparse.Namespace) -> int:
    setups = [s for s in args.setups.split(",") if s]
    if any(s not in SETUPS for s in setups):
        print(f"unknown set-ups {setups}; choose from {list(SETUPS)}", file=sys.stderr)
        return 2
    wrk = shutil.which("wrk")
    if not wrk:
        print("wrk not found: `make bench-deps` installs it", file=sys.stderr)
        return 2
    use_perf = not (args.no_perf or args.python)
    perf = shutil.which("perf") if use_perf else None
    if use_perf and perf is None:
        print("perf not found (linux-perf / linux-tools); or pass --no-perf", file=sys.stderr)
        return 2
    profiles = []
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        bench = Bench(Path(tmp), args.duration, wrk)
        if args.python:
            bench.python_profile = Path(tmp)
        try:
            bench.start_upstream()
            for setup in setups:
                prof = profile_setup(bench, setup, args.size, args.connections, args.warmup, perf)
                profiles.append(prof)
                cpu = prof.processor_us_per_req
                print(
                    f"{setup}: {prof.requests} requests, {prof.rps:.0f} rps, processor"
                    f" {cpu if cpu is None else round(cpu)} us/req",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            bench.stop_all()
    print(f"{args.size}, {args.connections} connections, {args.duration:g} s per set-up")
    print("\n".join(table(profiles)))
    return 0

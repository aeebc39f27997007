"""Processes of `extproc bench peers`: the engines' fleet, CPU placement, CPU time and memory.

Every set-up runs on a fresh :class:`EngineFleet` (new engine processes: empty caches, idle
queues). Placement pins whole process trees (every thread) to a CPU set, as ``taskset -a -p``
does; CPU time and resident memory are read from ``/proc`` for a router's whole process tree.
"""

from __future__ import annotations

import http.client
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from extproc.harness.launch import LOOPBACK, Proc, free_port, http_get, wait_until

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- /proc --------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(p) for p in task.read_text().split()]
        except OSError:
            continue
    return found


def process_tree(pids: Iterable[int]) -> list[int]:
    """These processes and all their descendants (those still running)."""
    out: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in out or not Path(f"/proc/{pid}").exists():
            continue
        out.append(pid)
        todo += _children(pid)
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of these processes' trees (their threads included)."""
    total = 0
    for pid in process_tree(pids):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / _CLOCK_TICKS


def rss_bytes(pids: Iterable[int]) -> int:
    """Resident memory of these processes' trees."""
    total = 0
    for pid in process_tree(pids):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of these process trees onto ``cpus`` (threads and processes they start
    later inherit it)."""
    for pid in process_tree(pids):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except (OSError, ValueError):
                continue  # the thread ended meanwhile


def all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def pin_self(cpus: set[int]) -> None:
    """This process (the client) and what it starts from now on (the engines)."""
    os.sched_setaffinity(0, cpus)


# -- the engines --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One engine's own counters: prompt tokens looked up in / served from its prefix cache,
    and requests it answered."""

    queried_tokens: float
    cached_tokens: float
    requests: float

    def minus(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.queried_tokens - before.queried_tokens,
            self.cached_tokens - before.cached_tokens,
            self.requests - before.requests,
        )


def parse_counters(text: str) -> EngineCounters:
    """Prompt tokens queried / served from the prefix cache, and requests answered, from an
    engine's /metrics: vLLM's prefix-cache counters and the simulator's request count, or
    llama.cpp's evaluated and reused prompt tokens (it counts no requests: its ``requests``
    are its prompt tokens, so max/mean over engines is over tokens there)."""
    from prometheus_client.parser import text_string_to_metric_families

    queried = cached = requests = evaluated = reused = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:prefix_cache_queries_total":
                queried += sample.value
            elif name == "vllm:prefix_cache_hits_total":
                cached += sample.value
            elif name == "sim_requests_total" and sample.labels.get("code") == "200":
                requests += sample.value
            elif name == "llamacpp:prompt_tokens_total":
                evaluated += sample.value
            elif name == "llamacpp:prompt_tokens_cached_total":
                reused += sample.value
    if evaluated or reused:
        return EngineCounters(evaluated + reused, reused, evaluated + reused)
    return EngineCounters(queried, cached, requests)


@dataclass
class EngineFleet:
    """``count`` engines e1..eN, each its own process on its own loopback port: simulated
    engines playing vLLM (``sim-cluster --engine vllm``), or, with ``llamacpp_model``, real
    llama.cpp servers (``extproc.harness.real_engines``) serving that GGUF as ``sim``."""

    workdir: Path
    count: int
    sim_args: tuple[str, ...]
    start_timeout_s: float = 90.0
    llamacpp_model: Path | None = None
    procs: dict[str, Proc] = field(default_factory=dict, init=False)
    ports: dict[str, int] = field(default_factory=dict, init=False)

    @property
    def names(self) -> list[str]:
        return [f"e{i}" for i in range(1, self.count + 1)]

    @property
    def urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{self.ports[name]}" for name in self.names]

    def start(self) -> EngineFleet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        taken: set[int] = set()
        for name in self.names:
            port = free_port()
            while port in taken:
                port = free_port()
            taken.add(port)
            self.ports[name] = port
            self._launch(name)
        try:
            for name in self.names:
                self.wait_ready(name)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, name: str) -> None:
        argv = [sys.executable, "-m", "extproc", "sim-cluster", "--name", name, "--engine"]
        argv += ["vllm", "--port", str(self.ports[name]), *self.sim_args]
        if self.llamacpp_model is not None:
            argv = llamacpp_argv(self.llamacpp_model, self.ports[name])
        proc = Proc(f"engine-{name}", argv, self.workdir / f"engine-{name}.log")
        proc.start()
        self.procs[name] = proc

    def wait_ready(self, name: str) -> None:
        port = self.ports[name]

        def up() -> bool:
            if not self.procs[name].alive:
                raise RuntimeError(f"engine {name} exited:\n{self.procs[name].log_text()[-2000:]}")
            try:
                return http_get(port, "/health")[0] == 200
            except OSError:
                return False

        wait_until(up, self.start_timeout_s, f"engine {name}")

    def kill(self, name: str) -> None:
        """SIGKILL: the engine dies with its cache and its requests in flight."""
        self.procs[name].kill()

    def revive(self, name: str) -> None:
        """A new process on the same port: the engine is back, with an empty cache."""
        self._launch(name)
        self.wait_ready(name)

    def reset(self, timeout_s: float = 60.0) -> None:
        """Every engine fresh again (empty cache, no queue) once its last request is done: a
        simulated one resets, a real one is started again."""
        if self.llamacpp_model is not None:
            for name in self.names:
                self.procs[name].stop()
                self._launch(name)
            for name in self.names:
                self.wait_ready(name)
            return
        for name in self.names:
            wait_until(lambda n=name: _post(self.ports[n], "/admin/reset") == 200, timeout_s,
                       f"engine {name} reset", 0.2)  # fmt: skip

    def counters(self) -> dict[str, EngineCounters]:
        out: dict[str, EngineCounters] = {}
        for name in self.names:
            try:
                _status, body = http_get(self.ports[name], "/metrics", timeout=10.0)
            except OSError:
                out[name] = EngineCounters(0.0, 0.0, 0.0)
                continue
            out[name] = parse_counters(body.decode())
        return out

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs.values() if p.popen is not None and p.alive]

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


# llama.cpp as a GPU-like engine: no host-RAM prompt cache (a prefix that lost its slot costs
# a full prefill again), 2 slots with 8,192 tokens of context each, one thread.
LLAMACPP_SLOTS = 2
LLAMACPP_CTX = 16384


def llamacpp_argv(model: Path, port: int) -> list[str]:
    from extproc.harness.real_engines import llamacpp

    spec = llamacpp.LlamaCppSpec(
        model, "sim", n_ctx=LLAMACPP_CTX, slots=LLAMACPP_SLOTS, threads=1, cache_ram_mib=0
    )
    return llamacpp.LlamaCppEngine("engine", Path("."), spec).argv(port)


def _post(port: int, path: str) -> int:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=5.0)
    try:
        conn.request("POST", path, body=b"")
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0
    finally:
        conn.close()


def counter_deltas(
    after: Mapping[str, EngineCounters], before: Mapping[str, EngineCounters]
) -> dict[str, EngineCounters]:
    """Per engine, what one run added. An engine restarted during the run counts from zero
    again: its new process's counters are all the run added after the restart."""
    out: dict[str, EngineCounters] = {}
    for name, now in after.items():
        then = before.get(name, EngineCounters(0.0, 0.0, 0.0))
        restarted = now.queried_tokens < then.queried_tokens or now.requests < then.requests
        out[name] = now if restarted else now.minus(then)
    return out


def sum_counters(values: Sequence[EngineCounters]) -> EngineCounters:
    return EngineCounters(
        sum(v.queried_tokens for v in values),
        sum(v.cached_tokens for v in values),
        sum(v.requests for v in values),
    )

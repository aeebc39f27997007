"""What every real engine process shares: a port, a log, a health check, start/stop/kill.

An engine kind supplies its argv (``EngineProcess.argv``); ``start_engines`` starts several at
once (their model loads overlap) and waits until each answers ``health_path`` with 200, so a
caller gets engines that serve. Every engine listens on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from extproc.harness.launch import LOOPBACK, Proc, free_port, http_get

REPO = Path(__file__).resolve().parents[3]
ENGINES_DIR = REPO / ".engines"


def engine_python(kind: str) -> Path:
    """The interpreter of engine ``kind``'s venv: ``$FLEET_<KIND>_PYTHON``, else the one
    ``make engine-deps`` creates under ``.engines/<kind>``."""
    override = os.environ.get(f"FLEET_{kind.upper()}_PYTHON")
    path = Path(override) if override else ENGINES_DIR / kind / "bin" / "python"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run `make engine-deps` first")
    return path


class EngineExited(RuntimeError):
    """The engine process ended before it served."""


@dataclass
class EngineProcess:
    """One engine: ``start`` picks a free port, ``wait_ready`` waits for its health check."""

    name: str
    workdir: Path
    health_path: str = "/health"
    port: int = 0
    proc: Proc | None = field(default=None, init=False)

    def argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return {}

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive

    @property
    def pid(self) -> int | None:
        return None if self.proc is None or self.proc.popen is None else self.proc.popen.pid

    def start(self, port: int | None = None) -> None:
        """Start the process (on ``port``, else the port it had, else a free one)."""
        self.port = port or self.port or free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = Proc(
            self.name, self.argv(self.port), self.workdir / f"{self.name}.log", self.env()
        )
        self.proc.start()

    def ready(self) -> bool:
        if not self.alive:
            raise EngineExited(f"{self.name} exited:\n{self.log_text()[-3000:]}")
        try:
            return http_get(self.port, self.health_path, timeout=2.0)[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:g}s")
            time.sleep(0.1)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is not None:
            self.proc.stop(timeout)

    def kill(self) -> None:
        """SIGKILL, and wait until the process is gone."""
        if self.proc is not None:
            self.proc.kill()

    def pause(self) -> None:
        """SIGSTOP: the engine holds its port and connections but answers nothing."""
        if self.proc is not None:
            self.proc.signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.signal(signal.SIGCONT)

    def restart(self, timeout: float) -> None:
        """Stop (if running) and start again on the same port; wait until it serves."""
        self.stop()
        self.start(self.port)
        self.wait_ready(timeout)

    def metrics_text(self) -> str:
        status, body = http_get(self.port, "/metrics", timeout=5.0)
        if status != 200:
            raise RuntimeError(f"{self.name} /metrics answered {status}")
        return body.decode()

    def log_text(self) -> str:
        return "" if self.proc is None else self.proc.log_text()


def start_engines(engines: Sequence[EngineProcess], timeout: float, attempts: int = 2) -> None:
    """Start every engine, then wait until all serve. An engine that dies before serving (its
    free port taken meanwhile on a busy machine) is started again on a fresh port."""
    for engine in engines:
        engine.start()
    for engine in engines:
        for attempt in range(attempts):
            try:
                engine.wait_ready(timeout)
                break
            except EngineExited:
                if attempt == attempts - 1:
                    stop_engines(engines)
                    raise
                engine.start(free_port())
            except BaseException:
                stop_engines(engines)
                raise


def stop_engines(engines: Sequence[EngineProcess]) -> None:
    """SIGTERM them all, then wait for each (their shutdowns overlap)."""
    for engine in engines:
        if engine.proc is not None:
            engine.proc.signal(signal.SIGTERM)
    for engine in engines:
        engine.stop()


@contextmanager
def running(engines: Sequence[EngineProcess], timeout: float) -> Iterator[Sequence[EngineProcess]]:
    """``start_engines`` … ``stop_engines`` around a block."""
    start_engines(engines, timeout)
    try:
        yield engines
    finally:
        stop_engines(engines)

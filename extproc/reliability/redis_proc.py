"""A real ``redis-server`` on loopback for the chaos and soak runs, with the faults they inject.

Persistence is off (a restart starts empty, like a crashed cache node replaced by a fresh one).
``kill()`` is SIGKILL, ``pause()``/``resume()`` SIGSTOP/SIGCONT (a hung server that still
holds its connections open), ``start()`` again reuses the port.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from extproc.harness.launch import LOOPBACK, free_port, wait_until


def ping(port: int, timeout: float = 0.5) -> bool:
    """True when a Redis server answers PING (raw RESP: no client library needed)."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisProc:
    log_path: Path
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH (make system-deps installs it)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [exe, "--bind", LOOPBACK, "--port", str(self.port), "--save", "", "--appendonly"]
        argv += ["no", "--logfile", str(self.log_path)]
        self.popen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: ping(self.port), 10, f"redis-server on port {self.port}")

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.popen is not None and self.alive:
            self.popen.kill()
            self.popen.wait(5)

    def pause(self) -> None:
        if self.popen is not None and self.alive:
            self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.popen is not None and self.alive:
            self.popen.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """SIGTERM then start again on the same port: a fresh, empty Redis."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.popen is None:
            return
        if self.alive:
            self.resume()  # a stopped process cannot act on SIGTERM
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

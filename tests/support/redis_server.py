"""A real ``redis-server`` on a free 127.0.0.1 port, for tests.

    with RedisServer() as server:          # started, PING answered
        client = redis.Redis.from_url(server.url)
        server.stop()                      # SIGTERM (server.kill() for SIGKILL)
        server.start()                     # same port again
        server.pause(); server.resume()    # SIGSTOP / SIGCONT: a hung server
    # stopped, temp dir removed

Persistence is off (``--save "" --appendonly no``): a restart starts empty, like a crashed
cache node replaced by a fresh one. Use it as a pytest fixture with ``yield`` inside ``with``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from extproc.harness.launch import LOOPBACK, free_port
from extproc.reliability.redis_proc import ping

# The processor's own loopback helpers: one definition of "a free port" and of "Redis answers".
HOST = LOOPBACK


@functools.cache
def _debug_command_args(executable: str) -> tuple[str, ...]:
    """DEBUG SLEEP is how fault tests make Redis busy; Redis 7 turned DEBUG off by default
    and added the option that turns it back on (older servers reject the option)."""
    out = subprocess.run([executable, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"v=(\d+)\.", out.stdout)
    if match is None or int(match.group(1)) < 7:
        return ()
    return ("--enable-debug-command", "local")


class _Started:
    """``with`` starts the server(s) and closes them on exit, also when start() fails half-way."""

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RedisServer(_Started):
    def __init__(
        self,
        port: int | None = None,
        *,
        executable: str = "redis-server",
        startup_timeout_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        path = shutil.which(executable)
        if path is None:
            raise RuntimeError(f"{executable} not found on PATH (install the redis-server package)")
        self.executable = path
        self.port = port or free_port()
        self._port_chosen = port is not None
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = extra_args
        self._tmp = Path(tempfile.mkdtemp(prefix="redis-test-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self._tmp / "redis.log"

    def _command(self) -> list[str]:
        return [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._tmp),
            "--logfile",
            str(self.log_path),
            "--daemonize",
            "no",
            *_debug_command_args(self.executable),
            *self.extra_args,
        ]

    def start(self) -> RedisServer:
        """Start (or restart) on ``self.port`` and wait until PING works."""
        if self.running:
            return self
        for _attempt in range(3):
            self._proc = subprocess.Popen(
                self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                if ping(self.port):
                    return self
                time.sleep(0.02)
            self._reap()
            if self._port_chosen:
                break
            # Another process took the port between free_port() and bind: pick a new one.
            self.port = free_port()
        log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"redis-server did not start on {HOST}:{self.port}\n{log}")

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 5.0) -> None:
        """Stop the server with ``sig`` and wait for it to exit (SIGKILL if it lingers)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)
        self._proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket but answers nothing (a hung or partitioned
        Redis, where only timeouts help — unlike a stopped one, which refuses connections)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self, sig: signal.Signals = signal.SIGTERM) -> RedisServer:
        self.stop(sig)
        return self.start()

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait(timeout=5)
            self._proc = None

    def close(self) -> None:
        """Stop the server and remove its temp dir; safe to call more than once."""
        try:
            self.resume()  # a paused server would ignore SIGTERM until the SIGKILL fallback
            self.stop()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    for _attempt in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def command(port: int, *args: str, timeout: float = 2.0) -> str:
    """One command through redis-cli (raw output), for cluster administration in tests."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError("redis-cli not found on PATH (install the redis-server package)")
    out = subprocess.run(
        [cli, "-h", HOST, "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return out.stdout


class RedisClusterServers(_Started):
    """A real Redis Cluster on 127.0.0.1: ``masters`` primaries with ``replicas`` each.

        with RedisClusterServers() as cluster:      # 3 primaries + 3 replicas, state ok
            url = cluster.url                       # redis+cluster://127.0.0.1:<port>
            port = cluster.primary_for("{c1:short}")
            cluster.node(port).kill()               # its replica takes over
            cluster.wait_ok()

    Every node is a ``RedisServer`` started with ``--cluster-enabled yes``; the cluster is
    formed by ``redis-cli --cluster create``. ``node_timeout_ms`` is short so a killed primary
    is failed over in about a second.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, *, node_timeout_ms: int = 1000) -> None:
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: dict[int, RedisServer] = {}

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.seed_port}"

    @property
    def seed_port(self) -> int:
        alive = [p for p, n in self.nodes.items() if n.running]
        return alive[0]

    def node(self, port: int) -> RedisServer:
        return self.nodes[port]

    def start(self) -> RedisClusterServers:
        total = self.masters * (1 + self.replicas)
        for _ in range(total):
            port = free_cluster_port()
            server = RedisServer(
                port,
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(self.node_timeout_ms),
                    # A lone surviving shard keeps serving its own slots.
                    "--cluster-require-full-coverage",
                    "no",
                    # Replicas sync at once (the default waits 5 s for more replicas): a
                    # replica that never synced cannot take over from its primary.
                    "--repl-diskless-sync-delay",
                    "0",
                ),
            )
            self.nodes[port] = server.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli not found on PATH (install the redis-server package)")
        addresses = [f"{HOST}:{p}" for p in self.nodes]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas)],
            input="yes\n",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed:\n{created.stdout}{created.stderr}"
            )
        self.wait_ok()
        return self

    def cluster_ok(self) -> bool:
        """Every live node reports cluster_state:ok and agrees on ``masters`` live primaries,
        and every live replica is in sync with its primary (so it could take over)."""
        for port, server in self.nodes.items():
            if not server.running:
                continue
            if "cluster_state:ok" not in command(port, "CLUSTER", "INFO"):
                return False
            if len(self.primaries(port)) != self.masters:
                return False
            info = command(port, "INFO", "replication")
            if "role:slave" in info and "master_link_status:up" not in info:
                return False
        return True

    def primaries(self, via: int | None = None) -> list[int]:
        """Ports of the primaries that serve slots, as node ``via`` sees the cluster."""
        out = command(via or self.seed_port, "CLUSTER", "NODES")
        ports: list[int] = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 9 or "master" not in fields[2] or "fail" in fields[2]:
                continue
            ports.append(int(fields[1].split("@", 1)[0].rsplit(":", 1)[1]))
        return ports

    def replicas_of(self, primary: int) -> list[int]:
        """Ports of the replicas that follow the primary on port ``primary``."""
        lines = [line.split() for line in command(primary, "CLUSTER", "NODES").splitlines()]
        ids = {int(f[1].split("@", 1)[0].rsplit(":", 1)[1]): f[0] for f in lines if len(f) >= 8}
        return [
            int(f[1].split("@", 1)[0].rsplit(":", 1)[1])
            for f in lines
            if len(f) >= 8 and "slave" in f[2] and f[3] == ids[primary]
        ]

    def is_primary(self, port: int) -> bool:
        return "role:master" in command(port, "INFO", "replication", timeout=0.5)

    def primary_for(self, key: str) -> int:
        """Port of the primary serving ``key``'s slot."""
        slot = int(command(self.seed_port, "CLUSTER", "KEYSLOT", key).strip())
        return self._slot_owner(slot)

    def _slot_owner(self, slot: int) -> int:
        out = command(self.seed_port, "CLUSTER", "NODES")
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 9 or "master" not in fields[2] or "fail" in fields[2]:
                continue
            for part in fields[8:]:
                lo, _, hi = part.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return int(fields[1].split("@", 1)[0].rsplit(":", 1)[1])
        raise RuntimeError(f"no live primary serves slot {slot}")

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.cluster_ok():
            if time.monotonic() > deadline:
                raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def close(self) -> None:
        for server in self.nodes.values():
            server.close()

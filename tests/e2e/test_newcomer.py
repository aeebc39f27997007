"""The README's "A first deployment", followed as written, against simulated clusters.

The test reads the section's fleet.yaml and its shell commands from README.md itself and runs
them in order in a fresh directory: the commands it does not know how to check fail the test,
so the README cannot gain a step the newcomer path does not cover. Only the ports change
(each fixed port of the README becomes a free one: several fleets share this machine), and
Envoy gets --disable-hot-restart (several Envoys on one machine must not share memory).
Each step's stated result is checked: the config check says "valid"; the processor logs READY;
the rendered bootstrap starts an Envoy; the request is a 200 from the cluster `explain` names
as primary, and a later turn goes there too; the metrics line the README quotes counts it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.harness.launch import envoy_binary, free_port, http_get, wait_until

REPO = Path(__file__).resolve().parents[2]
SECTION = "## A first deployment"
METRICS_LINE = 'fleet_requests_total{api="openai.chat",outcome="routed",request_class="short"}'

pytestmark = pytest.mark.e2e


def _section() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end > 0 else len(text)]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", section, re.MULTILINE | re.DOTALL)


def _commands(section: str) -> list[str]:
    lines: list[str] = []
    for block in _blocks(section, "sh"):
        joined = block.replace("\\\n", " ")
        lines += [ln.strip() for ln in joined.splitlines() if ln.strip()]
    return lines


class Walk:
    """The newcomer's shell: a working directory, the venv on PATH, background processes."""

    def __init__(self, workdir: Path, ports: dict[str, str]) -> None:
        self.workdir = workdir
        self.ports = ports
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        self.background: list[Background] = []
        self.served: str | None = None

    def port(self, text: str) -> str:
        for old, new in self.ports.items():
            text = re.sub(rf"\b{old}\b", new, text)
        return text

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        exe = shutil.which(argv[0], path=self.env["PATH"])
        assert exe, f"{argv[0]} not on PATH"
        return subprocess.run(
            [exe, *argv[1:]],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def start(self, name: str, argv: list[str]) -> Background:
        exe = shutil.which(argv[0], path=self.env["PATH"])
        assert exe, f"{argv[0]} not on PATH"
        proc = Background(name, [exe, *argv[1:]], self.workdir, self.env)
        self.background.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.background):
            proc.stop()


class Background:
    """A command run with `&` in the walk's directory, its output kept in a log file."""

    def __init__(self, name: str, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = cwd / f"{name}.log"
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def _curl(walk: Walk, argv: list[str]) -> tuple[int, dict[str, str], bytes]:
    """A `curl -s [-D -] URL [-H h]... [-d body]` line, sent as curl would send it."""
    url, headers, body = "", {}, None
    it = iter(argv[1:])
    for arg in it:
        if arg == "-H":
            name, _, value = next(it).partition(":")
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            body = next(it).encode()
        elif arg == "-D":
            assert next(it) == "-"
        elif arg != "-s":
            url = arg
    host, _, rest = url.partition(":")
    port, _, path = rest.partition("/")
    assert host == "localhost", url
    conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=60)
    try:
        conn.request("POST" if body is not None else "GET", "/" + path, body, headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _step(walk: Walk, line: str, fleet_text: str) -> None:
    background = line.endswith("&")
    line = walk.port(line.removesuffix("&").strip())
    pipeline = [shlex.split(part) for part in line.split(" | ")]
    argv = pipeline[0]
    if argv[:2] == ["extproc", "sim-cluster"]:
        assert background
        sim = walk.start(argv[argv.index("--name") + 1], argv)
        port = int(argv[argv.index("--port") + 1])
        wait_until(lambda: _get_ok(port, "/health") or not sim.alive(), 90, f"cluster on {port}")
        assert sim.alive(), sim.log_text()
    elif argv[:3] == ["extproc", "config", "check"]:
        (walk.workdir / argv[3]).write_text(fleet_text, encoding="utf-8")
        done = walk.run(argv)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"{argv[3]}: valid"), done.stdout
        assert "clusters (3):" in done.stdout and "short: < 8192 tokens" in done.stdout
    elif argv[:2] == ["extproc", "serve"]:
        assert background
        proc = walk.start("extproc", argv)
        wait_until(
            lambda: "READY grpc=" in proc.log_text() or not proc.alive(), 90, "READY or exit"
        )
        assert proc.alive(), proc.log_text()
    elif argv[:2] == ["extproc", "envoy"]:
        done = walk.run(argv)
        assert done.returncode == 0, done.stderr
        assert (walk.workdir / argv[argv.index("-o") + 1]).is_file()
    elif argv[0] == "envoy":
        assert background
        envoy = walk.start("envoy", [envoy_binary(), *argv[1:], "--disable-hot-restart"])
        admin = int(walk.ports["9901"])
        wait_until(lambda: _get_ok(admin, "/ready") or not envoy.alive(), 90, "Envoy ready")
        assert envoy.alive(), envoy.log_text()
    elif argv[0] == "curl" and len(pipeline) == 1:
        status, headers, body = _curl(walk, argv)
        assert status == 200, body
        walk.served = headers.get("x-served-by")
        assert walk.served in ("c1", "c2", "c3"), headers
        again = _curl(walk, argv)  # a later turn of the same session
        assert again[0] == 200 and again[1].get("x-served-by") == walk.served
    elif argv[:2] == ["extproc", "explain"]:
        done = walk.run(argv)
        assert done.returncode == 0, done.stderr
        decision = json.loads(done.stdout)
        assert decision["primary"] == walk.served, decision
        assert decision["class"] == "short"
        assert decision["secondary"] in ("c1", "c2", "c3")
    elif argv[0] == "curl" and pipeline[1][0] == "grep":
        status, _, body = _curl(walk, argv)
        assert status == 200
        pattern = pipeline[1][1].lstrip("^")
        found = [ln for ln in body.decode().splitlines() if ln.startswith(pattern)]
        counted = [ln for ln in found if ln.startswith(METRICS_LINE)]
        assert counted and float(counted[0].split()[-1]) >= 2, found
    else:
        raise AssertionError(f"README step not covered by this test: {line}")


def _get_ok(port: int, path: str) -> bool:
    try:
        return http_get(port, path)[0] == 200
    except OSError:
        return False


def test_the_readmes_first_deployment_works_as_written(tmp_path: Path) -> None:
    section = _section()
    assert METRICS_LINE in section  # the result the README states is the one checked
    (fleet_block,) = _blocks(section, "yaml")
    fixed = ["8001", "8002", "8003", "10000", "9901", "50051", "9464"]
    walk = Walk(tmp_path, {p: str(free_port()) for p in fixed})
    listener = {"port": int(walk.ports["10000"]), "admin_port": int(walk.ports["9901"])}
    processor = {"port": int(walk.ports["50051"]), "metrics_port": int(walk.ports["9464"])}
    data = yaml.safe_load(fleet_block)
    assert "listener" not in data and "processor" not in data  # the defaults are what it uses
    fleet_text = walk.port(fleet_block) + yaml.safe_dump(
        {"listener": listener, "processor": processor}
    )
    commands = _commands(section)
    assert len(commands) == 10, commands
    try:
        for line in commands:
            _step(walk, line, fleet_text)
    except BaseException:
        for proc in walk.background:
            print(f"--- {proc.name}\n{proc.log_text()[-2000:]}")
        raise
    finally:
        walk.stop()

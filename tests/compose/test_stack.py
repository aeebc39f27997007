"""The compose harness run for real: stand-in images checked, stack up, traffic, failover, down.

compose/stack-test.sh (`make compose-test`) provides the Docker daemon, builds the stand-ins and
the project image, and sets COMPOSE_TEST_PROJECT (the compose project name), FLEET_HTTP_PORT (the
loopback port Envoy's listener is published on), FLEET_TRACES_PORT (the OTLP collector's JSON
view, published the same way) and COMPOSE_TEST_OUT (where the report goes). Without them there is
no stack to test and the module is skipped. The stack runs with the tracing override: every
request is traced, to the stack's own collector.

All traffic goes to 127.0.0.1:FLEET_HTTP_PORT / FLEET_TRACES_PORT or stays between the project's
containers, and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import yaml

from extproc.config import load_runtime
from extproc.harness.sim_cluster import SIM_TRACEPARENT_HEADER
from tests.e2e.predict import ranked_for

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.standins.yml", "docker-compose.tracing.yml")
OFFICIAL = json.loads((COMPOSE_DIR / "standins" / "official.json").read_text())["images"]
PROJECT_IMAGE = "fleet-extproc:dev"
CHAT = "/v1/chat/completions"

PROJECT = os.environ.get("COMPOSE_TEST_PROJECT", "")
PORT = os.environ.get("FLEET_HTTP_PORT", "")
TRACES_PORT = os.environ.get("FLEET_TRACES_PORT", "")
# Envoy and the processors' batch exporters flush every 5 s; a loaded machine is slower.
SPAN_WAIT_S = 90.0
OUT = Path(os.environ.get("COMPOSE_TEST_OUT", REPO / "out" / "compose-test"))

pytestmark = [
    pytest.mark.skipif(
        not (PROJECT and PORT and TRACES_PORT),
        reason="run by compose/stack-test.sh (make compose-test)",
    ),
    # Bringing the stack up waits for every health check; each step below is bounded on its own.
    pytest.mark.timeout(900),
]

Json = dict[str, Any]


def run(argv: list[str], timeout: float = 120, check: bool = True) -> str:
    # vfs copies an image's whole file system for every container it creates: on a busy machine
    # creating the stack's containers at once takes longer than docker-compose's 60 s default.
    env = {**os.environ, "COMPOSE_HTTP_TIMEOUT": str(int(timeout))}
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{argv} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result.stdout


def docker(*args: str, timeout: float = 120) -> str:
    return run(["docker", *args], timeout)


def compose(*args: str, timeout: float = 300, check: bool = True) -> str:
    files = [a for name in COMPOSE_FILES for a in ("-f", str(COMPOSE_DIR / name))]
    return run(["docker-compose", "-p", PROJECT, *files, *args], timeout, check)


def inspect(*names: str) -> list[Json]:
    out: list[Json] = json.loads(docker("inspect", *names))
    return out


def container(service: str) -> str:
    cid = compose("ps", "-q", service).strip()
    assert cid, f"no container for {service}"
    return cid


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s: {what}"
        time.sleep(0.5)


def in_container(service: str, code: str) -> str:
    """Run Python in a service's container: its ports are reachable there on loopback."""
    return compose("exec", "-T", service, "python", "-c", code, timeout=60)


def fetch(service: str, port: int, path: str) -> str:
    code = (
        "import urllib.request, sys; "
        f"sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=5)"
        ".read().decode())"
    )
    return in_container(service, code)


def timestamp(text: str) -> float:
    """Docker's RFC 3339 nanosecond timestamps, as seconds."""
    head, _, frac = text.rstrip("Z").partition(".")
    whole = datetime.fromisoformat(head + "+00:00").timestamp()
    return whole + float(f"0.{frac[:6] or '0'}")


def services() -> Json:
    files = [a for name in COMPOSE_FILES for a in ("-f", str(COMPOSE_DIR / name))]
    out = run(["docker-compose", *files, "config"], 60)
    loaded: Json = yaml.safe_load(out)["services"]
    return loaded


def flag_set(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
        return out
    return [*out, flag, value]


# --- the stand-ins against the official images' record -----------------------------------------


@pytest.mark.parametrize("official", sorted(OFFICIAL))
def test_built_standin_has_the_official_image_config(official: str) -> None:
    record = OFFICIAL[official]
    config = inspect(record["standin"])[0]["Config"]
    want = record["config"]
    assert config["Entrypoint"] == want["entrypoint"]
    assert config["Cmd"] == want["cmd"]
    assert config["User"] == want["user"]
    assert sorted(config.get("ExposedPorts") or {}) == want["exposed_ports"]
    assert config.get("Healthcheck") == want["healthcheck"]
    if "volumes" in want:
        assert sorted(config.get("Volumes") or {}) == want["volumes"]
    if "workdir" in want:
        assert config["WorkingDir"] == want["workdir"]


# --- the stack ----------------------------------------------------------------------------------


class Stack:
    def __init__(self) -> None:
        self.services = services()
        self.runtime = load_runtime(COMPOSE_DIR / "fleet.yaml")
        self.report: Json = {}
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=30
        )
        self.replay_dir = OUT / "replay"
        self.replay_dir.mkdir(parents=True, exist_ok=True)
        # The replay container runs as the image's uid 10001 and writes its report here.
        self.replay_dir.chmod(0o777)

    def up(self) -> None:
        started = time.monotonic()
        # Envoy last: compose waits for every processor and simulated cluster to be healthy.
        compose("up", "-d", "--no-build", "envoy", timeout=600)
        long_running = [s for s in self.services if s != "replay"]

        def healthy() -> bool:
            for state in (c["State"] for c in inspect(*map(container, long_running))):
                assert state["Running"], state
                health = state.get("Health")
                if health is not None and health["Status"] != "healthy":
                    return False
            return True

        wait_until(healthy, 180, "every service running and healthy")
        self.report["stack_up_to_healthy_s"] = round(time.monotonic() - started, 1)

    def chat(self, session: str, text: str) -> tuple[int, str | None]:
        raw = self.client.chat.completions.with_raw_response.create(
            model="sim",
            messages=[{"role": "user", "content": text}],
            max_tokens=2,
            extra_headers={"x-session-id": session},
        )
        raw.parse()
        return raw.status_code, raw.headers.get("x-served-by")

    def wait_for_envoy(self) -> None:
        def answers() -> bool:
            try:
                return self.chat("compose-warmup", "hello")[0] == 200
            except openai.APIError:
                return False

        wait_until(answers, 60, "Envoy answers on the published port")

    def replay(self, name: str, seconds: int) -> Json:
        argv = list(self.services["replay"]["command"])
        argv = flag_set(argv, "--duration", str(seconds))
        argv = flag_set(argv, "--workload-duration", str(seconds))
        argv = flag_set(argv, "--chat-rate", "4")
        argv = flag_set(argv, "--json-out", f"/out/{name}.json")
        argv = [*argv, "--quiet"]
        # --no-deps: the stack is up, and a stopped cluster stays stopped (compose would restart
        # it as a dependency of Envoy).
        compose(
            "run", "--rm", "--no-deps", "-T", "-v", f"{self.replay_dir}:/out", "replay", *argv,
            timeout=seconds + 240,
        )  # fmt: skip
        result: Json = orjson.loads((self.replay_dir / f"{name}.json").read_bytes())
        return result

    def save_state(self) -> None:
        """Every container's log and docker inspect (health check history), for a failed run."""
        ids = compose("ps", "-q", "-a", check=False).split()
        if not ids:
            return
        (OUT / "containers.json").write_text(json.dumps(inspect(*ids), indent=1))
        with (OUT / "stack.log").open("w") as log:
            for cid in ids:
                log.write(f"===== {cid}\n")
                log.flush()
                subprocess.run(
                    ["docker", "logs", "-t", cid],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=60,
                    check=False,
                )

    def down(self) -> None:
        compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=180)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    OUT.mkdir(parents=True, exist_ok=True)
    stack = Stack()
    try:
        stack.up()
        stack.wait_for_envoy()
        yield stack
    finally:
        stack.save_state()
        stack.down()
        (OUT / "report.json").write_text(json.dumps(stack.report, indent=2) + "\n")


def assert_all_answered(result: Json, clusters: set[str]) -> Counter[str]:
    outcomes = result["requests"]
    assert len(outcomes) >= 20, len(outcomes)
    kinds = Counter(o["outcome"] for o in outcomes)
    # Every request answered, or told when to come back.
    assert set(kinds) <= {"2xx", "429"}, kinds
    hintless = [o for o in outcomes if o["outcome"] == "429" and not o["retry_after"]]
    assert not hintless, hintless[:3]
    served = Counter(o["served_by"] for o in outcomes if o["outcome"] == "2xx")
    assert set(served) == clusters, served
    return kinds


def test_project_image_size_and_start_to_healthy(stack: Stack) -> None:
    image = inspect(PROJECT_IMAGE)[0]
    assert image["Config"]["User"] == "10001:10001"
    stack.report["project_image_bytes"] = image["Size"]
    for service in ("extproc-a", "extproc-b"):
        cid = container(service)
        state = inspect(cid)[0]["State"]
        started = timestamp(state["StartedAt"])
        passed = [h for h in state["Health"]["Log"] if h["ExitCode"] == 0]
        assert passed, state["Health"]
        logs = run(["docker", "logs", "-t", cid], 30)
        ready = next(line for line in logs.splitlines() if " READY " in line)
        stack.report[service] = {
            "start_to_ready_s": round(timestamp(ready.split(" ", 1)[0]) - started, 2),
            "start_to_healthy_s": round(timestamp(passed[0]["End"]) - started, 2),
        }


def test_standins_run_what_the_official_images_run(stack: Stack) -> None:
    # Checked in the running stack (exec, no extra containers): what each official image's users
    # rely on, beyond the config test_built_standin_has_the_official_image_config compares.
    version = in_container("extproc-a", "import sys; print('%d.%d' % sys.version_info[:2])")
    assert version.strip() == "3.11"  # the processor's interpreter is the Python base's
    (envoy,) = [k for k in OFFICIAL if k.startswith("envoyproxy/envoy:")]
    release = envoy.rpartition("-v")[2]
    # No shell in the official image: exec the binary itself.
    assert f"/{release}/" in compose("exec", "-T", "envoy", "/usr/local/bin/envoy", "--version")
    uids = docker("top", container("envoy"), "-o", "pid,uid,comm").split()
    assert OFFICIAL[envoy]["config"]["user"] in uids and "envoy" in uids, uids
    # Redis: started as root by the entrypoint, serving as the image's redis user (uid 999).
    uids = docker("top", container("redis"), "-o", "pid,uid,comm").split()
    assert "999" in uids and "redis-server" in uids, uids


def trace_spans(trace_id: str) -> list[Json]:
    """One trace's spans, parents first, from the collector's JSON view on the host."""
    url = f"http://127.0.0.1:{TRACES_PORT}/traces/{trace_id}"
    with urllib.request.urlopen(url, timeout=10) as response:
        spans: list[Json] = json.loads(response.read())["spans"]
    return spans


def test_one_request_is_one_trace_through_envoy_the_processor_and_the_engine(
    stack: Stack,
) -> None:
    trace_id = secrets.token_hex(16)
    raw = stack.client.chat.completions.with_raw_response.create(
        model="sim",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        extra_headers={
            "x-session-id": "compose-trace",
            "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
        },
    )
    raw.parse()
    assert raw.status_code == 200
    engine_parent = raw.headers[SIM_TRACEPARENT_HEADER]

    def complete() -> bool:
        spans = trace_spans(trace_id)
        names = {(s["service"], s["name"]) for s in spans}
        # Envoy's spans come with its 5 s flush, the processor's with its exporter's.
        return ("fleet-extproc", "fleet.decision") in names and any(
            s["service"] == "envoy" for s in spans
        )

    wait_until(complete, SPAN_WAIT_S, "Envoy's and the processor's spans at the collector")
    spans = trace_spans(trace_id)
    (OUT / "trace.json").write_text(json.dumps(spans, indent=1) + "\n")
    by_id = {s["span_id"]: s for s in spans}
    decisions = [s for s in spans if s["name"] == "fleet.decision"]
    assert len(decisions) == 1, decisions
    (decision,) = decisions
    # The decision's parent is Envoy's ext_proc call, in the client's trace.
    assert by_id[decision["parent_span_id"]]["service"] == "envoy", spans
    steps = {s["name"] for s in spans if s["parent_span_id"] == decision["span_id"]}
    assert {"fleet.session_lookup", "fleet.budget_reservation", "fleet.engine_pick"} <= steps
    assert decision["attributes"]["fleet.decision"] == "kept"
    assert decision["attributes"]["fleet.served_by"] == raw.headers["x-served-by"]
    # The engine's parent is the processor's decision span.
    _version, engine_trace, parent_id, _flags = engine_parent.split("-")
    assert (engine_trace, parent_id) == (trace_id, decision["span_id"])

    url = f"http://127.0.0.1:{TRACES_PORT}/traces/{trace_id}?view=tree"
    with urllib.request.urlopen(url, timeout=10) as response:
        tree = response.read().decode()
    tree += f"sim engine {raw.headers['x-served-by']}: received traceparent {engine_parent}\n"
    (OUT / "trace.txt").write_text(tree)
    stack.report["trace"] = {
        "trace_id": trace_id,
        "spans": len(spans),
        "services": sorted({s["service"] for s in spans}),
    }


def test_replay_is_answered_by_every_cluster_and_both_replicas_share_redis(stack: Stack) -> None:
    result = stack.replay("replay", 12)
    kinds = assert_all_answered(result, {c.name for c in stack.runtime.config.clusters})
    stack.report["replay"] = dict(kinds)

    for service in ("extproc-a", "extproc-b"):
        metrics = fetch(service, stack.runtime.config.processor.metrics_port, "/metrics")
        routed = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("fleet_requests_total{") and 'outcome="routed"' in line
        )
        assert routed > 0, service
        readiness = orjson.loads(
            fetch(service, stack.runtime.config.processor.metrics_port, "/readyz")
        )
        assert readiness["ledger"] == "redis", (service, readiness)
        stack.report.setdefault("routed", {})[service] = routed

    # One ledger: both replicas hold connections to the same Redis, which ran the ledger's scripts.
    clients = compose("exec", "-T", "redis", "redis-cli", "client", "list", timeout=30)
    client_ips = {
        f.split("=", 1)[1].rpartition(":")[0] for f in clients.split() if f.startswith("addr=")
    }
    for service in ("extproc-a", "extproc-b"):
        networks = inspect(container(service))[0]["NetworkSettings"]["Networks"]
        assert {n["IPAddress"] for n in networks.values()} & client_ips, (service, clients)
    stats = compose("exec", "-T", "redis", "redis-cli", "info", "commandstats", timeout=30)
    scripts = [
        ln for ln in stats.splitlines() if ln.startswith(("cmdstat_evalsha:", "cmdstat_eval:"))
    ]
    assert scripts, stats


def test_stopped_cluster_sessions_fail_over_without_a_failed_request(stack: Stack) -> None:
    body = orjson.dumps(
        {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    # Where a session starts is the processor's decision: its hash primary, or a later
    # candidate when bounded-load placement of new sessions (on by default, the replay job ran
    # before) spills it. Its later turns follow that first cluster, and Envoy's failover target
    # is the first other cluster in its hash order.
    orders = {
        f"compose-failover-{i}": ranked_for(
            stack.runtime, CHAT, body, {"x-session-id": f"compose-failover-{i}"}
        )
        for i in range(30)
    }
    first: dict[str, str] = {}
    for session, order in orders.items():
        status, by = stack.chat(session, "hi")
        assert status == 200 and by in order, (session, by, order)
        first[session] = by
    for session in orders:
        assert stack.chat(session, "hi") == (200, first[session]), session
    victim = "c2"
    moved = {s for s, cluster in first.items() if cluster == victim}
    assert len(moved) >= 3, Counter(first.values())

    compose("stop", "-t", "10", f"sim-{victim}", timeout=60)
    served: Counter[str] = Counter()
    for _ in range(3):
        for session, order in orders.items():
            status, by = stack.chat(session, "hi")
            want = next(c for c in order if c != victim) if session in moved else first[session]
            assert (status, by) == (200, want), (session, order, first[session])
            served[by or ""] += 1
    stack.report["failover"] = {"sessions_moved": len(moved), "served": dict(served)}

    # The replay job again, with the cluster still down: nothing fails, the others serve it all.
    others = {c.name for c in stack.runtime.config.clusters} - {victim}
    kinds = assert_all_answered(stack.replay("replay-failover", 8), others)
    stack.report["replay_failover"] = dict(kinds)


def test_down_leaves_nothing_behind(stack: Stack) -> None:
    stack.save_state()
    stack.down()
    label = f"label=com.docker.compose.project={PROJECT}"
    assert docker("ps", "-aq", "--filter", label).strip() == ""
    assert docker("network", "ls", "-q", "--filter", label).strip() == ""
    assert docker("volume", "ls", "-q", "--filter", label).strip() == ""

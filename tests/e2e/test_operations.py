"""Operating it: metrics after traffic, readiness that follows Redis, hot reload that Envoy
follows without a restart, and a SIGTERM that drains without losing a request or a budget."""

from __future__ import annotations

import collections
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import redis

from extproc.config import load_runtime
from extproc.harness.launch import Client, FleetStack, http_get, wait_until
from tests.e2e.conftest import MakeClient, chat_body, dump_logs
from tests.e2e.predict import PURE_HASH, placement_for
from tests.support.redis_server import RedisServer

CHAT = "/v1/chat/completions"


def _metric(stack: FleetStack, name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    total = 0.0
    for (n, got), value in stack.processor_metrics().items():
        if n == name and all(item in got for item in want):
            total += value
    return total


def test_metrics_carry_the_right_labels_after_traffic(
    fleet4: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(fleet4.listener_port)
    before = _metric(fleet4, "fleet_requests_total", api="openai.chat", outcome="routed")
    for i in range(5):
        assert client.post_json(CHAT, chat_body(f"metrics {i}"))[0] == 200
    anthropic = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert client.post_json("/v1/messages", anthropic)[0] == 200
    assert client.post_json(CHAT, b"{nope")[0] == 400
    after = _metric(fleet4, "fleet_requests_total", api="openai.chat", outcome="routed")
    assert after - before == 5
    assert (
        _metric(fleet4, "fleet_requests_total", api="anthropic.messages", request_class="short")
        >= 1
    )
    assert _metric(fleet4, "fleet_requests_total", api="openai.chat", outcome="bad_request") >= 1
    # Every routed request counts one decision; by default a new session may be "spilled"
    # (bounded-load placement) and a later turn follow it ("override").
    decided = sum(
        _metric(fleet4, "fleet_route_decisions_total", kind=kind)
        for kind in ("primary", "spilled", "override")
    )
    assert decided >= 6 and _metric(fleet4, "fleet_route_decisions_total", kind="primary") >= 1
    assert _metric(fleet4, "fleet_decision_seconds_count") >= 6
    assert _metric(fleet4, "fleet_request_body_bytes_count") >= 7
    version = load_runtime(fleet4.fleet_path).version
    assert _metric(fleet4, "fleet_config_info", version=version) == 1
    wait_until(lambda: _metric(fleet4, "fleet_extproc_streams_active") == 0, 5, "streams closed")
    status, body = http_get(fleet4.metrics_ports[0], "/healthz")
    assert status == 200 and orjson.loads(body)["status"] == "alive"


@pytest.fixture
def dynamic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("dynamic"),
        clusters=3,
        dynamic_cds=True,
        # Pure hashing predicts first turns (no balance spills): tests the reload.
        fleet_overrides={"affinity": PURE_HASH},
    )
    with stack:
        yield stack


def test_reload_adds_a_cluster_without_restarting_envoy_or_the_processor(
    dynamic: FleetStack, make_client: MakeClient
) -> None:
    envoy_pid = dynamic.envoy.popen.pid if dynamic.envoy and dynamic.envoy.popen else None
    processor_pid = dynamic.procs[0].popen.pid if dynamic.procs[0].popen else None
    client = make_client(dynamic.listener_port)
    bodies = [(f"reload-{i}", chat_body("hello")) for i in range(200)]
    for sid, body in bodies[:20]:
        assert client.post_json(CHAT, body, {"x-session-id": sid})[0] == 200

    dynamic.add_cluster("c4")
    runtime = load_runtime(dynamic.fleet_path)
    assert "c4" in runtime.cluster_names
    moved = [
        (sid, body)
        for sid, body in bodies
        if placement_for(runtime, CHAT, body, {"x-session-id": sid}).primary == "c4"
    ]
    assert 25 <= len(moved) <= 75  # ≈1/4 of 200 sessions move to the new cluster

    def c4_serves() -> bool:
        sid, body = moved[0]
        status, hdrs, _ = client.post_json(CHAT, body, {"x-session-id": sid})
        assert status == 200
        return hdrs["x-served-by"] == "c4"

    wait_until(c4_serves, 15, f"c4 to take traffic:\n{dump_logs(dynamic)}", interval=0.3)
    served = collections.Counter()
    for sid, body in bodies:
        status, hdrs, _ = client.post_json(CHAT, body, {"x-session-id": sid})
        assert status == 200
        expected = placement_for(runtime, CHAT, body, {"x-session-id": sid}).primary
        served[hdrs["x-served-by"] == expected] += 1
    assert served[False] == 0, served
    assert dynamic.envoy is not None and dynamic.envoy.popen is not None
    assert dynamic.envoy.popen.pid == envoy_pid and dynamic.envoy.alive
    assert dynamic.procs[0].popen is not None and dynamic.procs[0].popen.pid == processor_pid
    assert _metric(dynamic, "fleet_config_reloads_total", result="applied") == 1

    # An invalid file is rejected; the running config keeps serving.
    good = dynamic.fleet_path.read_text()
    dynamic.fleet_path.write_text(good.replace("version: 1", "version: 1\nbogus_field: true"))
    wait_until(
        lambda: _metric(dynamic, "fleet_config_reloads_total", result="rejected") >= 1,
        10,
        "the invalid config to be rejected",
    )
    assert "bogus_field: unknown field" in dynamic.procs[0].log_text()
    sid, body = moved[0]
    status, hdrs, _ = client.post_json(CHAT, body, {"x-session-id": sid})
    assert status == 200 and hdrs["x-served-by"] == "c4"
    assert _metric(dynamic, "fleet_config_info", version=runtime.version) == 1


def _ready(stack: FleetStack) -> tuple[int, dict[str, object]]:
    status, body = http_get(stack.metrics_ports[0], "/readyz")
    return status, orjson.loads(body)


@pytest.mark.parametrize("policy", ["closed", "local"])
def test_readiness_follows_redis(
    tmp_path_factory: pytest.TempPathFactory, make_client: MakeClient, policy: str
) -> None:
    classes = [
        {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 64}},
        {"name": "long"},
    ]
    with RedisServer() as redis_server:
        stack = FleetStack(
            tmp_path_factory.mktemp(f"ready-{policy}"),
            clusters=2,
            fleet_overrides={
                "classes": classes,
                "redis": {"url": redis_server.url, "on_unavailable": policy, "timeout_ms": 100},
            },
        )
        with stack:
            client = make_client(stack.listener_port)
            assert (
                _ready(stack) == (200, _ready(stack)[1]) and _ready(stack)[1]["ledger"] == "redis"
            )
            redis_server.kill()
            wait_until(lambda: _ready(stack)[1]["ledger"] == "local", 10, "degraded readiness")
            status, detail = _ready(stack)
            assert detail["degraded"] is True
            # closed: a replica that can only reject is not ready; local: knowingly degraded.
            assert status == (503 if policy == "closed" else 200), detail
            answer = client.post_json(CHAT, chat_body("during outage"))[0]
            assert answer == (503 if policy == "closed" else 200)
            redis_server.start()
            wait_until(
                lambda: _ready(stack)[0] == 200 and _ready(stack)[1]["ledger"] == "redis",
                10,
                "recovery",
            )
            assert client.post_json(CHAT, chat_body("after outage"))[0] == 200


def test_sigterm_drains_without_losing_requests_or_budget(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    classes = [
        {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 64}},
        {"name": "long"},
    ]
    with RedisServer() as redis_server:
        stack = FleetStack(
            tmp_path_factory.mktemp("drain"),
            clusters=2,
            # Requests take ~0.3 s so that some are in flight when the signal arrives.
            sim_args=("--time-scale", "0.1", "--decode-tps", "50"),
            # timeout_ms: on a loaded test machine Redis can take more than the default 50 ms;
            # a release that times out leaves its lease to expire (lease_ttl_s), not to be
            # checked right after the drain.
            fleet_overrides={
                "classes": classes,
                "redis": {"url": redis_server.url, "timeout_ms": 1000},
            },
        )
        with stack:
            statuses: collections.Counter[int] = collections.Counter()
            errors: list[BaseException] = []
            stop = threading.Event()

            def traffic(worker: int) -> None:
                client = Client(stack.listener_port)
                i = 0
                try:
                    while not stop.is_set():
                        i += 1
                        status, _, _ = client.post_json(CHAT, chat_body(f"drain {worker} {i}", 16))
                        statuses[status] += 1
                except Exception as exc:  # noqa: BLE001 - recorded, asserted on below
                    errors.append(exc)
                finally:
                    client.close()

            with ThreadPoolExecutor(6) as pool:
                for w in range(6):
                    pool.submit(traffic, w)
                time.sleep(1.0)
                processor = stack.procs[0]
                processor.signal(signal.SIGTERM)
                assert processor.popen is not None
                code = processor.popen.wait(20)
                time.sleep(0.5)  # traffic goes on, failing open, after the processor is gone
                stop.set()
            assert code == 0, processor.log_text()[-2000:]
            assert not errors, errors
            assert set(statuses) == {200}, statuses
            assert sum(statuses.values()) > 30
            log = processor.log_text()
            assert '"held_after_drain":0' in log, log[-2000:]
            # Nothing is left reserved in the shared ledger either.
            r = redis.Redis.from_url(redis_server.url)
            try:
                for key in r.scan_iter("fleet:*:state"):
                    state = r.hgetall(key)
                    assert int(state.get(b"count", b"0")) == 0, (key, state)
                    assert float(state.get(b"tokens", b"0")) == 0, (key, state)
                assert any(True for _ in r.scan_iter("fleet:*:state"))
            finally:
                r.close()


def test_debug_logs_carry_request_id_and_never_prompt_or_raw_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    stack = FleetStack(
        tmp_path_factory.mktemp("logs"), clusters=2, processor_args=("--log-level", "debug")
    )
    with stack:
        client = Client(stack.listener_port)
        try:
            secret_prompt = "my very private prompt text 12345"
            status, headers, _ = client.post_json(
                CHAT,
                chat_body(secret_prompt),
                {"x-session-id": "raw-session-id-abc", "x-request-id": "req-42"},
            )
        finally:
            client.close()
        assert status == 200
        # The edge replaces a client's request id with its own and returns it in the response.
        request_id = headers["x-request-id"]
        assert request_id != "req-42"
        marker = f'"request_id":"{request_id}"'
        wait_until(lambda: marker in stack.procs[0].log_text(), 5, "log line")
        log = stack.procs[0].log_text()
        line = next(ln for ln in log.splitlines() if marker in ln)
        doc = orjson.loads(line)
        assert doc["msg"] == "routed" and len(doc["session"]) == 16
        assert secret_prompt not in log
        assert "raw-session-id-abc" not in log

"""Flow control through a real Envoy, two processor replicas sharing one Redis ledger: place,
then wait, then refuse (extproc/core/flow.py, ARCHITECTURE.md "Flow control").

The long class admits ONE request per cluster fleet-wide, waits up to 20 s, four waiters in the
fleet-wide queue (one Redis queue for both replicas, extproc/ledger/queue.lua). Each long
request holds its budget ~0.8 s on the simulated cluster. The waiters' Redis re-check runs every
30 s only, so a waiter admitted within seconds was woken by a release notice, usually published
by the other replica. Envoy's message timer is the rendered default
(processor.message_timeout_ms, 2 s; Envoy's own default is 200 ms): every wait of several
seconds below outlives both, which works only because the processor re-arms the timer
(override_message_timeout, within the rendered max_message_timeout).
"""

from __future__ import annotations

import math
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import openai
import orjson
import pytest
import yaml

from extproc.config import Runtime, load_runtime
from extproc.config.schema import ProcessorConfig
from extproc.explain import explain_remote
from extproc.harness.launch import Client, FleetStack, wait_until
from extproc.render.gateway import gateway_message_timeout_ms
from tests.e2e.conftest import dump_logs
from tests.e2e.predict import PURE_HASH, facts_for
from tests.support.flow import NO_PLACEMENT
from tests.support.redis_server import RedisServer

CHAT = "/v1/chat/completions"
# 20 decode tokens/s: a long request (16 output tokens) holds its budget ~0.8 s.
# --max-output: the holders below ask for hundreds of tokens (the simulated cluster caps at 64).
SIM_ARGS = (
    *("--time-scale", "1", "--prefill-tps", "1000000", "--decode-tps", "20"),
    *("--max-output", "1000"),
)
LONG_OUTPUT = 16
MAX_WAIT_S = 20.0
MAX_QUEUE = 4  # fleet-wide: both replicas share one queue in Redis
CLASSES: list[dict[str, Any]] = [
    {"name": "short", "max_input_tokens": 64, "budget": {"max_concurrent": 64}},
    {
        "name": "long",
        "budget": {"max_concurrent": 1},
        "wait": {"max_wait_s": MAX_WAIT_S, "max_queue": MAX_QUEUE},
    },
]
LONG_TEXT = "tool output line, long enough to be a long request. " * 12
DEFAULT_TIMER_S = ProcessorConfig().message_timeout_ms / 1000
SHORTS = 16


def long_body(tag: str, output: int = LONG_OUTPUT) -> bytes:
    messages = [{"role": "user", "content": f"{tag}: {LONG_TEXT}"}]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": output})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with RedisServer() as redis_server:
        running = FleetStack(
            tmp_path_factory.mktemp("flow"),
            clusters=3,
            sim_args=SIM_ARGS,
            processors=2,
            processor_args=("--seed", "5"),
            fleet_overrides={
                # The shipped default timer (the harness raises it to 5 s for loaded machines).
                "processor": {"message_timeout_ms": ProcessorConfig().message_timeout_ms},
                "classes": CLASSES,
                "redis": {"url": redis_server.url, "replicas": 2, "timeout_ms": 500},
                "flow": {"place_new_sessions": True, "redis_poll_ms": 30_000},
                # Pure hashing predicts first turns (no balance spills): tests flow control.
                "affinity": PURE_HASH,
            },
        )
        with running:
            yield running


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def ranked(runtime: Runtime, sid: str) -> list[str]:
    facts = facts_for(runtime, CHAT, long_body(sid), {"x-session-id": sid})
    assert facts.input_tokens >= 64  # a long request
    return runtime.policy.placers["long"].ranked(facts.session.point)


def post(stack: FleetStack, sid: str, body: bytes) -> tuple[int, dict[str, str], float]:
    client = Client(stack.listener_port)
    started = time.monotonic()
    try:
        status, headers, _ = client.post_json(CHAT, body, {"x-session-id": sid})
        return status, headers, time.monotonic() - started
    finally:
        client.close()


def metric(stack: FleetStack, name: str, **labels: str) -> float:
    """Summed over the stack's replicas."""
    want = tuple(sorted(labels.items()))
    total = 0.0
    for i in range(len(stack.metrics_ports)):
        for (n, lab), value in stack.processor_metrics(i).items():
            if n == name and all(kv in lab for kv in want):
                total += value
    return total


def polled(check: Callable[[], bool]) -> Callable[[], bool]:
    """``check`` for wait_until, false (poll again) when a replica's metrics endpoint did not
    answer within its 1 s timeout (a busy replica on a loaded machine)."""

    def run() -> bool:
        try:
            return check()
        except OSError:
            return False

    return run


def idle(stack: FleetStack) -> bool:
    return (
        metric(stack, "fleet_flow_queue_depth") == 0
        and metric(stack, "fleet_budget_inflight_requests", request_class="long") == 0
    )


def test_max_message_timeout_is_rendered(stack: FleetStack) -> None:
    envoy_yaml = stack.envoy_path.read_text()
    assert "max_message_timeout" in envoy_yaml and "21s" in envoy_yaml
    # The rendered default timer, which every wait below outlives.
    assert f"message_timeout: {DEFAULT_TIMER_S:g}s" in envoy_yaml


def test_burst_within_max_wait_is_served_without_retries(stack: FleetStack) -> None:
    runtime = load_runtime(stack.fleet_path)
    sid = "burst-agent"
    primary = ranked(runtime, sid)[0]
    # Two turns alone: the session is known (never moved) and releases have been observed.
    for turn in range(2):
        status, headers, _ = post(stack, sid, long_body(f"warm {turn}"))
        assert status == 200 and headers["x-served-by"] == primary, dump_logs(stack)
    admitted_before = metric(stack, "fleet_flow_waits_total", result="admitted")
    short_waits_before = metric(stack, "fleet_flow_waits_total", request_class="short")
    # One runs, four wait: they fit the fleet-wide queue however Envoy spreads the streams.
    burst = 1 + MAX_QUEUE
    client = openai.OpenAI(api_key="t", base_url=f"{stack.url}/v1", max_retries=0, timeout=60)

    def long_call(i: int) -> tuple[int, str, float]:
        started = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": f"burst {i}: {LONG_TEXT}"}],
            max_tokens=LONG_OUTPUT,
            extra_headers={"x-session-id": sid},
        )
        raw.parse()
        return raw.status_code, raw.headers["x-served-by"], time.monotonic() - started

    def short_ttft(i: int) -> float:
        started = time.monotonic()
        stream = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"quick {i}"}],
            max_tokens=2,
            stream=True,
            extra_headers={"x-session-id": f"short-{i}"},
        )
        with stream:
            ttft = next(
                time.monotonic() - started
                for chunk in stream
                if chunk.choices and chunk.choices[0].delta.content
            )
            for _ in stream:
                pass
        return ttft

    with ThreadPoolExecutor(burst + SHORTS) as pool:
        # The same short requests without the burst first: the baseline for "unaffected".
        alone = list(pool.map(short_ttft, range(SHORTS)))
        longs = [pool.submit(long_call, i) for i in range(burst)]
        wait_until(
            polled(lambda: metric(stack, "fleet_flow_queue_depth", request_class="long") >= 2),
            60,
            "the burst queued",
        )
        during = list(pool.map(short_ttft, range(SHORTS, 2 * SHORTS)))
        results = [f.result() for f in longs]
    with client:
        pass
    # Every long request served (no client retries: max_retries=0), all on the session's primary
    # (not the fail-open fallback a fired message timer would give), one after another.
    assert all(status == 200 for status, _, _ in results), results
    assert {served for _, served, _ in results} == {primary}, (results, dump_logs(stack))
    longest = max(took for _, _, took in results)
    # The last ones waited for several releases, longer than the message timer.
    assert longest > DEFAULT_TIMER_S + 1.0, results
    assert metric(stack, "fleet_flow_waits_total", result="admitted") - admitted_before >= 3
    # Short requests never queue behind the burst: every one was answered, and flow control
    # never made one wait (its class has budget to spare), while the long class queued. (Their
    # TTFT is printed as a figure: on a loaded machine it follows the machine, not the queue.)
    assert len(during) == SHORTS
    assert metric(stack, "fleet_flow_waits_total", request_class="short") == short_waits_before
    print(
        f"burst: longest {longest:.2f}s; short TTFT p99 {percentile(alone, 99):.3f}s alone, "
        f"{percentile(during, 99):.3f}s during the burst"
    )
    wait_until(polled(lambda: idle(stack)), 60, "queues empty and budget released")


def releases_per_s(stack: FleetStack, sid: str) -> float:
    """The release rate of the session's primary compartment the processors estimate now (the
    shared ledger's, so every replica's): the evidence each 429's hint is computed from."""
    admin = f"http://127.0.0.1:{stack.metrics_ports[0]}"
    shown = explain_remote(admin, CHAT, {"x-session-id": sid}, long_body("rate"), timeout_s=60)
    usage = shown["budget_usage_on_primary"]
    assert isinstance(usage, dict) and usage["ledger"] == "redis", shown
    rate = float(usage["releases_per_second"])
    assert rate > 0, shown  # the earlier turns were released: the hint has evidence
    return rate


def test_burst_beyond_max_queue_gets_immediate_429s_with_honest_hints(stack: FleetStack) -> None:
    """Honest: a refused request's hint covers about as many releases of its budget as the
    burst's admitted requests actually went through before the budget was free (within 2x
    either way). Hints are seconds at the processors' observed release rate, so each is turned
    into releases with that rate, read from the processors before and after the refusals: a
    count against a count, whatever the machine's speed (a loaded machine stretches both the
    hint and the requests, not always by the same factor at the same moment)."""
    runtime = load_runtime(stack.fleet_path)
    sid = "burst-agent"  # known session, releases observed by the previous test
    ranked(runtime, sid)
    burst = 2 + 2 * MAX_QUEUE + 4  # more than the queue can hold
    waits_before = {
        result: metric(stack, "fleet_flow_waits_total", request_class="long", result=result)
        for result in ("overflow", "too_long", "timeout")
    }
    rates = [releases_per_s(stack, sid)]
    with ThreadPoolExecutor(burst) as pool:
        futures = [pool.submit(post, stack, sid, long_body(f"over {i}")) for i in range(burst)]
        refused_first = next(f for f in as_completed(futures) if f.result()[0] == 429)
        rates.append(releases_per_s(stack, sid))
        results = [f.result() for f in futures]
    assert refused_first.result()[0] == 429
    statuses = Counter(status for status, _, _ in results)
    assert statuses[200] <= 1 + 2 * MAX_QUEUE and statuses[429] >= burst - 1 - 2 * MAX_QUEUE
    assert statuses[200] + statuses[429] == burst, statuses
    # At once, not after waiting: every 429 was flow control's immediate refusal (queue full or
    # the wait too long), none a waiter's timeout.
    waits_after = {
        result: metric(stack, "fleet_flow_waits_total", request_class="long", result=result)
        for result in waits_before
    }
    refusals = sum(waits_after[r] - waits_before[r] for r in ("overflow", "too_long"))
    assert refusals == statuses[429], (waits_before, waits_after, statuses)
    assert waits_after["timeout"] == waits_before["timeout"], (waits_before, waits_after)
    # The releases the budget went through before it was free for a refused request: every
    # admitted request of the burst (each was admitted after the refusals began or was the one
    # running, and ended before the budget was free again).
    needed = statuses[200]
    low, high = min(rates), max(rates)
    hints = [int(headers["retry-after"]) for status, headers, _ in results if status == 429]
    for hint in hints:
        assert needed / 2 <= hint * high and hint * low <= 2 * needed, (hints, rates, needed)
    print(f"429 hints {hints}; release rate {low:.2f}-{high:.2f}/s; {needed} admitted")
    wait_until(polled(lambda: idle(stack)), 60, "queues empty and budget released")


def test_new_session_on_full_primary_lands_on_next_candidate_and_stays(stack: FleetStack) -> None:
    runtime = load_runtime(stack.fleet_path)
    holder = "holder-agent"
    full = ranked(runtime, holder)[0]
    fresh = next(f"fresh-{i}" for i in range(2000) if ranked(runtime, f"fresh-{i}")[0] == full)
    expected = ranked(runtime, fresh)[1]
    with ThreadPoolExecutor(1) as pool:
        # ~15 s on the simulated cluster's clock: it holds the primary while the fresh turn
        # is decided.
        running = pool.submit(post, stack, holder, long_body("hold", output=300))
        wait_until(
            polled(lambda: metric(stack, "fleet_budget_inflight_requests", cluster=full) == 1),
            60,
            "the holder admitted",
        )
        waits_before = metric(stack, "fleet_flow_waits_total", request_class="long")
        status, headers, _ = post(stack, fresh, long_body("fresh turn 0"))
        assert status == 200 and headers["x-served-by"] == expected, (headers, dump_logs(stack))
        # Placed at once, not queued behind the holder: flow control made nobody wait.
        assert metric(stack, "fleet_flow_waits_total", request_class="long") == waits_before
        assert running.result()[0] == 200
    # The primary is free again; later turns still follow the placement (their cache is there).
    for turn in (1, 2):
        status, headers, _ = post(stack, fresh, long_body(f"fresh turn {turn}"))
        assert status == 200 and headers["x-served-by"] == expected
    assert metric(stack, "fleet_flow_placements_total", request_class="long") >= 1
    wait_until(polled(lambda: idle(stack)), 60, "queues empty and budget released")


def test_clients_leaving_the_queue_leave_nothing_held(stack: FleetStack) -> None:
    runtime = load_runtime(stack.fleet_path)
    sid = "leaver-agent"
    full = ranked(runtime, sid)[0]
    cancelled_before = metric(stack, "fleet_flow_waits_total", result="cancelled")
    with ThreadPoolExecutor(1) as pool:
        # ~20 s (the simulated cluster's clock, not the CPU's): outlasts the steps below even
        # on a starved machine.
        running = pool.submit(post, stack, sid, long_body("hold", output=400))
        wait_until(
            polled(lambda: metric(stack, "fleet_budget_inflight_requests", cluster=full) == 1),
            60,
            "the holder admitted",
        )
        # Two more turns join the queue (within MAX_QUEUE); their clients hang up while waiting.
        socks = []
        body = long_body("leaver")
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", stack.listener_port), timeout=5)
            head = (
                f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"x-session-id: {sid}\r\ncontent-length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            socks.append(sock)
        wait_until(
            polled(lambda: metric(stack, "fleet_flow_queue_depth", cluster=full) == 2),
            60,
            "two waiters queued",
        )
        # explain, on a replica's live state: the next turn would wait (or overflow) here.
        admin = f"http://127.0.0.1:{stack.metrics_ports[0]}"
        shown = explain_remote(admin, CHAT, {"x-session-id": sid}, body)
        flow = shown["flow_on_primary"]
        assert isinstance(flow, dict) and shown["primary"] == full, shown
        assert flow["would"] in {"wait", "overflow"} and flow["estimated_wait_s"] > 0, flow
        for sock in socks:
            sock.close()
        wait_until(
            polled(lambda: metric(stack, "fleet_flow_queue_depth", cluster=full) == 0),
            60,
            "the waiters gone",
        )
        # Left while the holder still runs: nothing was ever taken for them.
        assert not running.done()
        assert metric(stack, "fleet_budget_inflight_requests", cluster=full) == 1
        assert metric(stack, "fleet_flow_waits_total", result="cancelled") - cancelled_before == 2
        assert running.result()[0] == 200
    wait_until(polled(lambda: idle(stack)), 60, "budget released")


# --- Envoy Gateway's filter: one message timer, no max_message_timeout --------------------


@dataclass
class GatewayTimerStack(FleetStack):
    """A fleet whose ext_proc filter has the timers Envoy Gateway renders from the
    EnvoyExtensionPolicy: ``message_timeout`` from its ``messageTimeout`` and no
    ``max_message_timeout`` (the policy has no such field), so Envoy ignores the processor's
    ``override_message_timeout``. ``policy_timer``: the policy's timer as rendered
    (render/gateway.gateway_message_timeout_ms); False: the bare ``message_timeout_ms`` it
    rendered before, the control that shows the test tells the two apart."""

    policy_timer: bool = True

    def write_configs(self) -> None:
        super().write_configs()
        runtime = load_runtime(self.fleet_path)
        timer_ms = runtime.config.processor.message_timeout_ms
        if self.policy_timer:
            timer_ms = gateway_message_timeout_ms(runtime)
        bootstrap = yaml.safe_load(self.envoy_path.read_text())
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        (ext,) = [
            f["typed_config"]
            for f in hcm["typed_config"]["http_filters"]
            if f["name"] == "envoy.filters.http.ext_proc"
        ]
        ext["message_timeout"] = f"{timer_ms / 1000:g}s"
        del ext["max_message_timeout"]
        self.envoy_path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))


GATEWAY_HOLD_TOKENS = 160  # the holder keeps the long budget ~8 s at 20 tokens/s
EXT_PROC_STATS = "http.ingress.ext_proc."


@pytest.fixture(scope="module", params=["policy-timer", "bare-timer"])
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayTimerStack]:
    running = GatewayTimerStack(
        tmp_path_factory.mktemp("flow-gateway"),
        clusters=2,
        sim_args=SIM_ARGS,
        policy_timer=request.param == "policy-timer",
        fleet_overrides={
            "processor": {"message_timeout_ms": ProcessorConfig().message_timeout_ms},
            "classes": CLASSES,
            "flow": NO_PLACEMENT,
            # Pure hashing predicts first turns (no balance spills): tests the gateway's timer.
            "affinity": PURE_HASH,
        },
    )
    with running:
        yield running


def test_under_envoy_gateways_timer_a_wait_past_the_old_timer_is_answered_and_budgeted(
    gateway: GatewayTimerStack,
) -> None:
    runtime = load_runtime(gateway.fleet_path)
    timer_s = gateway_message_timeout_ms(runtime) / 1000
    assert timer_s == DEFAULT_TIMER_S + MAX_WAIT_S + 1  # what the policy renders here
    envoy_yaml = gateway.envoy_path.read_text()
    assert "max_message_timeout" not in envoy_yaml
    bare = f"message_timeout: {DEFAULT_TIMER_S:g}s"
    assert (bare in envoy_yaml) is not gateway.policy_timer
    sid = "gateway-agent"
    primary = ranked(runtime, sid)[0]
    for turn in range(2):  # releases observed: the wait estimate has a rate to go by
        status, headers, _ = post(gateway, sid, long_body(f"warm {turn}"))
        assert status == 200 and headers["x-served-by"] == primary, dump_logs(gateway)
    admitted_before = metric(gateway, "fleet_flow_waits_total", result="admitted")
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(post, gateway, sid, long_body("hold", output=GATEWAY_HOLD_TOKENS))
        wait_until(
            polled(lambda: metric(gateway, "fleet_budget_inflight_requests", cluster=primary) == 1),
            60,
            "the holder admitted",
        )
        status, headers, took = post(gateway, sid, long_body("waiter"))
        holder_running = not holder.done()
        assert holder.result()[0] == 200
    timeouts = gateway.envoy_stat(EXT_PROC_STATS + "message_timeouts")
    failed_open = gateway.envoy_stat(EXT_PROC_STATS + "failure_mode_allowed")
    admitted = metric(gateway, "fleet_flow_waits_total", result="admitted") - admitted_before
    label = "policy" if gateway.policy_timer else "bare"
    print(
        f"{label} timer: waiter {status} after {took:.2f}s, message timeouts {timeouts}, "
        f"failed open {failed_open}, admitted after a wait {admitted}"
    )
    assert status == 200, dump_logs(gateway)
    if gateway.policy_timer:
        # Answered by the processor after waiting out the holder, on the session's primary,
        # longer than the old timer; Envoy ignored the processor's override (no max here).
        assert not holder_running and took > DEFAULT_TIMER_S + 1.0, took
        assert headers["x-served-by"] == primary and admitted == 1
        assert timeouts == 0 and failed_open == 0, dump_logs(gateway)
        assert gateway.envoy_stat(EXT_PROC_STATS + "override_message_timeout_ignored") >= 1
    else:
        # The bare timer cut the wait: the request passed without the processor's answer
        # while the holder still had the class's only budget (unplaced, unbudgeted).
        assert timeouts >= 1 and failed_open >= 1 and holder_running, took
        assert admitted == 0
    wait_until(polled(lambda: idle(gateway)), 60, "queues empty and budget released")

"""Fair shares among tenants inside a class, through a real Envoy, two processor replicas
sharing one Redis (the fleet-wide queue, extproc/ledger/queue.lua) and the real OpenAI SDK.

One cluster; the catch-all class admits ONE request at a time fleet-wide and lets the rest wait.
Tenants are told apart by their API key (``flow.tenant_fallback: api_key``), as the SDK sends
it. A flooding tenant holds the class and queues four large requests; a steady tenant's small
request, sent after them, is served before the flood's queue drains (tokens fairness). A client
that names a tenant in the trusted tenant header is not believed: Envoy strips the header.

A second stack (the ``limited`` fixture) gives every tenant ``max_concurrent: 3`` under a class
budget of 16, with two replicas: the tenant's count is one fleet-wide count in Redis, so exactly
three of its requests run at once across both replicas (a per-replica share would stop at
2 = 2 x (3 // 2)), its fourth gets the tenant's 429, and it is admitted again after a release.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import openai
import pytest

from extproc.explain import explain_remote
from extproc.harness.launch import FleetStack, wait_until
from tests.e2e.conftest import dump_logs
from tests.e2e.test_flow import metric, polled
from tests.support.redis_server import RedisServer

# 20 decode tokens/s: a request of 10 output tokens holds the class ~0.5 s.
# The cap on output is lifted so that the holder below streams until the test ends it.
SIM_ARGS = (
    *("--time-scale", "1", "--prefill-tps", "1000000", "--decode-tps", "20"),
    *("--max-output", "1000000"),
)
OUTPUT = 10
FLOOD_TEXT = "an agent's long tool transcript line. " * 200  # ~2,000 tokens
STEADY_TEXT = "a short question. " * 20  # ~100 tokens
QUEUED_FLOODS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with RedisServer() as redis_server:
        running = FleetStack(
            tmp_path_factory.mktemp("fair"),
            clusters=1,
            sim_args=SIM_ARGS,
            processors=2,
            fleet_overrides={
                "classes": [
                    {
                        "name": "any",
                        "budget": {"max_concurrent": 1},
                        "wait": {"max_wait_s": 120, "max_queue": 16},
                    }
                ],
                "redis": {"url": redis_server.url, "replicas": 2, "timeout_ms": 500},
                "flow": {
                    "tenant_header": "x-tenant",
                    "tenant_fallback": "api_key",
                    "fairness": "tokens",
                    # A tenant that may start 1 token a minute: any request of it is refused.
                    "tenants": {"blocked": {"tokens_per_minute": 1}},
                    "redis_poll_ms": 1000,
                    "tenant_metrics_top": 2,
                },
            },
        )
        with running:
            yield running


TENANT_MAX = 3


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with RedisServer() as redis_server:
        running = FleetStack(
            tmp_path_factory.mktemp("limited"),
            clusters=1,
            sim_args=SIM_ARGS,
            processors=2,
            fleet_overrides={
                "classes": [{"name": "any", "budget": {"max_concurrent": 16}}],
                "redis": {"url": redis_server.url, "replicas": 2, "timeout_ms": 500},
                "flow": {
                    "tenant_header": "x-tenant",
                    "tenant_fallback": "api_key",
                    "tenant_limit": {"max_concurrent": TENANT_MAX},
                },
            },
        )
        with running:
            yield running


def client_for(stack: FleetStack, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=api_key, base_url=f"{stack.url}/v1", max_retries=0, timeout=300)


def test_steady_tenant_is_served_before_the_floods_queue_drains(stack: FleetStack) -> None:
    def call(name: str, api_key: str, text: str) -> tuple[str, int]:
        raw = client_for(stack, api_key).chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": f"{name}: {text}"}],
            max_tokens=OUTPUT,
            extra_headers={"x-session-id": name},
        )
        assert raw.status_code == 200
        # The engine numbers requests as they reach it ("chatcmpl-sim<n>"): with one admitted
        # at a time, that is the order the processor admitted them in.
        return name, int(raw.parse().id.rpartition("sim")[2])

    for i in range(len(stack.grpc_ports)):  # a stream to a replica not yet up fails open
        stack.wait_processor_health(i)
    # The flood's first request holds the class as a stream this test ends: nothing is
    # admitted until every other request waits, however slowly they arrive.
    holder = client_for(stack, "sk-flood").chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": f"flood-0: {FLOOD_TEXT}"}],
        max_tokens=100_000,
        stream=True,
        extra_headers={"x-session-id": "flood-0"},
    )
    next(iter(holder))
    inflight = "fleet_budget_inflight_requests"
    wait_until(polled(lambda: metric(stack, inflight) >= 1), 180, "the holder's reservation")
    depth = "fleet_flow_queue_depth"
    calls: list[Future[tuple[str, int]]] = []

    def queued(n: int) -> Callable[[], bool]:
        # True also when a request was answered instead of queueing: its result says how.
        return polled(lambda: metric(stack, depth) >= n or any(c.done() for c in calls))

    with ThreadPoolExecutor(1 + QUEUED_FLOODS) as pool:
        try:
            for i in range(1, 1 + QUEUED_FLOODS):
                calls.append(pool.submit(call, f"flood-{i}", "sk-flood", FLOOD_TEXT))
                # One at a time, so their arrival order (and the flood's counter) is known.
                wait_until(queued(i), 180, f"flood-{i} queued")
            calls.append(pool.submit(call, "steady", "sk-steady", STEADY_TEXT))
            wait_until(queued(1 + QUEUED_FLOODS), 180, "steady queued")
            for early in (c for c in calls if c.done()):
                raise AssertionError(f"answered before the class was free: {early.result()}")
            holder.close()  # the client goes away: the budget is released, the queue drains
            done = [c.result(timeout=300) for c in calls]
        except BaseException:
            print(dump_logs(stack))
            print("failed open:", stack.envoy_stat("http.ingress.ext_proc.failure_mode_allowed"))
            holder.close()
            raise
    order = [name for name, _ in sorted(done, key=lambda x: x[1])]
    # One at a time, in the fleet-wide fair order: the flood's first queued request (its
    # counter was at V), then the steady tenant (it starts at V too, and arrived later), then
    # the rest of the flood, each a large request further on. FIFO would serve it last.
    assert order == ["flood-1", "steady", "flood-2", "flood-3", "flood-4"], order
    # Per-tenant metrics: bounded (two tenants and "other" per replica), keyed labels only.
    labels = {
        dict(lab)["tenant"]
        for i in range(len(stack.metrics_ports))
        for (name, lab), _ in stack.processor_metrics(i).items()
        if name == "fleet_tenant_served_tokens_total"
    }
    assert "other" in labels and 1 < len(labels) <= 2 * 2 + 1, labels
    assert not any("sk-" in label or "flood" in label for label in labels), labels


def test_a_tenant_header_sent_by_the_client_is_ignored(stack: FleetStack) -> None:
    """``blocked`` may start 1 token a minute: were the client's x-tenant believed, this
    request would get the tenant's 429. Envoy strips it (internal_only_headers), so the
    request is its API key's tenant and is served."""
    wait_until(
        polled(lambda: metric(stack, "fleet_budget_inflight_requests") == 0),
        120,
        "the class free again",
    )
    raw = client_for(stack, "sk-spoof").chat.completions.with_raw_response.create(
        model="m",
        messages=[{"role": "user", "content": STEADY_TEXT}],
        max_tokens=2,
        extra_headers={"x-tenant": "blocked"},
    )
    assert raw.status_code == 200, dump_logs(stack)


def test_explain_names_the_tenant_by_its_label_only(stack: FleetStack) -> None:
    answer: dict[str, Any] = explain_remote(
        f"http://127.0.0.1:{stack.metrics_ports[0]}",
        "/v1/chat/completions",
        {"authorization": "Bearer sk-secret-key-of-a-tenant"},
        b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}',
    )
    tenant = answer["tenant"]
    assert tenant["source"] == "api_key" and tenant["fairness"] == "tokens"
    assert len(tenant["label"]) == 16 and "sk-secret" not in str(answer)
    assert tenant["queue"]["queued"] == 0


def test_a_tenants_max_concurrent_is_one_count_across_both_replicas(limited: FleetStack) -> None:
    stack = limited
    for i in range(len(stack.grpc_ports)):
        stack.wait_processor_health(i)
    client = client_for(stack, "sk-limited")
    inflight = "fleet_budget_inflight_requests"

    def hold(name: str) -> Any:
        stream = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"{name}: {STEADY_TEXT}"}],
            max_tokens=100_000,
            stream=True,
            extra_headers={"x-session-id": name},
        )
        next(iter(stream))  # admitted: the engine streams
        return stream

    def ask(name: str) -> int:
        raw = client.chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": f"{name}: {STEADY_TEXT}"}],
            max_tokens=2,
            extra_headers={"x-session-id": name},
        )
        return raw.status_code

    holders: list[Any] = []
    try:
        for i in range(TENANT_MAX):
            holders.append(hold(f"held-{i}"))
        wait_until(
            polled(lambda: metric(stack, inflight) == TENANT_MAX), 120, "the tenant's requests"
        )
        per_replica = [
            sum(v for (name, _), v in stack.processor_metrics(i).items() if name == inflight)
            for i in range(len(stack.metrics_ports))
        ]
        print("held per replica:", per_replica)
        # Each replica's explain reads the tenant's one fleet-wide count, whichever replica
        # admitted the requests.
        for port in stack.metrics_ports:
            limits = explain_remote(
                f"http://127.0.0.1:{port}",
                "/v1/chat/completions",
                {"authorization": "Bearer sk-limited"},
                b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}',
            )["tenant"]["limits"]
            assert (limits["counted_in"], limits["inflight"]) == ("redis", TENANT_MAX), limits
        with pytest.raises(openai.RateLimitError) as refused:
            ask("over")
        headers = refused.value.response.headers
        assert f'"tenant-concurrency";q={TENANT_MAX}' in headers["ratelimit-policy"], headers
        assert "tenant" in refused.value.message and "own limit" in refused.value.message
        # Another tenant is not held back by this one.
        assert (
            client_for(stack, "sk-other")
            .chat.completions.with_raw_response.create(
                model="m",
                messages=[{"role": "user", "content": STEADY_TEXT}],
                max_tokens=2,
            )
            .status_code
            == 200
        )
        holders.pop().close()  # the client goes away: its lease and its tenant's count go
        wait_until(polled(lambda: metric(stack, inflight) == TENANT_MAX - 1), 120, "one released")
        assert ask("after-release") == 200
        assert metric(stack, "fleet_requests_total", outcome="tenant_concurrency") == 1
    except BaseException:
        print(dump_logs(stack))
        raise
    finally:
        for h in holders:
            h.close()

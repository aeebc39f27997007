"""Bulkheads through a real Envoy: a long-context burst gets 429s with retry hints while short
requests sent at the same time are all admitted; nothing leaks, even with client aborts."""

from __future__ import annotations

import asyncio
import random
import socket
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import orjson
import pytest

from extproc.harness.launch import LOOPBACK, Client, FleetStack, wait_until
from tests.e2e.conftest import dump_logs
from tests.support.flow import NO_PLACEMENT, refused_at_once
from tests.support.redis_server import RedisServer

CHAT = "/v1/chat/completions"
LONG_TOKENS = 40_000  # ≈160 KB of JSON at 4 bytes per token
CLASSES: list[dict[str, Any]] = [
    {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 256}},
    {
        "name": "long",
        # Two long requests in flight per cluster, and never more than 100K tokens' worth.
        "budget": {"max_inflight_tokens": 100_000, "max_concurrent": 2},
    },
]
# Simulated clusters slow enough that a long request holds its budget for a while (~0.5 s).
SIM_ARGS = ("--time-scale", "0.2", "--prefill-tps", "20000", "--decode-tps", "50")


def long_body(i: int) -> bytes:
    text = f"agent {i} context: " + "tool output line. " * (LONG_TOKENS * 4 // 18)
    return orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    )


def short_body(i: int) -> bytes:
    content = f"quick question {i}"
    return orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    )


@pytest.fixture(scope="module")
def bulkheaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("bulkhead"),
        clusters=3,
        sim_args=SIM_ARGS,
        fleet_overrides={"classes": refused_at_once(CLASSES), "flow": NO_PLACEMENT},
        processor_args=("--seed", "7"),
    )
    with stack:
        yield stack


def _post(stack: FleetStack, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    client = Client(stack.listener_port)
    try:
        return client.post_json(path, body)
    finally:
        client.close()


def test_long_burst_gets_429s_while_short_requests_pass(bulkheaded: FleetStack) -> None:
    with ThreadPoolExecutor(48) as pool:
        longs = [pool.submit(_post, bulkheaded, CHAT, long_body(i)) for i in range(24)]
        anthropic = [
            pool.submit(_post, bulkheaded, "/v1/messages", long_body(100 + i)) for i in range(6)
        ]
        shorts = [pool.submit(_post, bulkheaded, CHAT, short_body(i)) for i in range(24)]
        long_results = [f.result() for f in longs]
        anthropic_results = [f.result() for f in anthropic]
        short_results = [f.result() for f in shorts]

    assert [s for s, _, _ in short_results] == [200] * 24, dump_logs(bulkheaded)
    statuses = Counter(s for s, _, _ in long_results + anthropic_results)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] >= 6, statuses  # 30 long requests, at most 6 in flight fleet-wide
    assert statuses[200] >= 3, statuses

    for status, headers, body in long_results:
        if status != 429:
            continue
        retry_after = int(headers["retry-after"])
        assert retry_after >= 1
        assert headers["x-fleet-class"] == "long"
        assert int(headers["x-ratelimit-limit-tokens"]) == 100_000
        assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) <= 100_000
        assert headers["x-ratelimit-reset-tokens"].endswith("s")
        assert "ratelimit-policy" in headers and "ratelimit" in headers
        err = orjson.loads(body)["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_exceeded"
    for status, _headers, body in anthropic_results:
        if status == 429:
            doc = orjson.loads(body)
            assert doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error"

    # Once the burst has drained the long class is admitted again.
    for i in range(3):
        status, _, data = _post(bulkheaded, CHAT, long_body(1000 + i))
        assert status == 200, data[:300]


def test_request_larger_than_its_whole_budget_gets_413(bulkheaded: FleetStack) -> None:
    text = "x" * (110_000 * 4)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    status, headers, data = _post(bulkheaded, CHAT, body)
    assert status == 413
    err = orjson.loads(data)["error"]
    assert err["code"] == "request_too_large"
    assert "never be admitted" in err["message"]
    assert headers["x-fleet-class"] == "long"


def _inflight(stack: FleetStack) -> dict[str, float]:
    samples = stack.processor_metrics()
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name in ("fleet_budget_inflight_tokens", "fleet_budget_inflight_requests"):
            out[f"{name}{dict(labels)}"] = value
        if name == "fleet_extproc_streams_active":
            out[name] = value
    return out


async def _abort_storm(port: int, n: int, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    sem = asyncio.Semaphore(40)
    url = f"http://127.0.0.1:{port}{CHAT}"
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            long = rng.random() < 0.2
            body = long_body(i) if long else short_body(i)
            # Half the clients give up early: before routing, mid-prefill or mid-stream.
            timeout = rng.uniform(0.005, 0.3) if rng.random() < 0.5 else 30.0
            doc_stream = rng.random() < 0.5
            if doc_stream:
                body = body[:-1] + b',"stream":true}'
            async with sem:
                try:
                    async with session.post(
                        url,
                        data=body,
                        headers={"content-type": "application/json"},
                        timeout=aiohttp.ClientTimeout(total=timeout),
                    ) as resp:
                        await resp.read()
                        outcomes[str(resp.status)] += 1
                except TimeoutError:
                    outcomes["aborted"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


def test_no_budget_leaks_after_1000_requests_with_random_aborts(bulkheaded: FleetStack) -> None:
    outcomes = asyncio.run(_abort_storm(bulkheaded.listener_port, 1000, seed=11))
    assert sum(outcomes.values()) == 1000
    assert outcomes["aborted"] >= 100, outcomes
    assert outcomes["200"] >= 100, outcomes

    def drained() -> bool:
        return all(v == 0 for v in _inflight(bulkheaded).values())

    wait_until(drained, 15, f"in-flight gauges to return to zero: {_inflight(bulkheaded)}")
    gauges = _inflight(bulkheaded)
    assert any("long" in k for k in gauges), gauges  # the gauges exist and were used


def test_two_processors_sharing_redis_enforce_one_budget(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    classes = [
        {"name": "short", "max_input_tokens": 2048},
        {"name": "long", "budget": {"max_concurrent": 1}},
    ]
    with RedisServer() as redis_server:
        stack = FleetStack(
            tmp_path_factory.mktemp("shared"),
            clusters=2,
            # 20 tokens/s on the simulated cluster's clock: the holder below would keep the
            # budget for minutes; it leaves (hangs up) once the others were decided.
            sim_args=(
                *("--time-scale", "1", "--prefill-tps", "1000000", "--decode-tps", "20"),
                *("--max-output", "4000"),  # the simulated cluster caps at 64 otherwise
            ),
            processors=2,
            fleet_overrides={
                "classes": refused_at_once(classes),
                "flow": NO_PLACEMENT,
                # Generous: the test is about the shared budget; a timed-out ledger call would
                # admit on the replica's local share instead.
                "redis": {"url": redis_server.url, "replicas": 2, "timeout_ms": 2000},
            },
        )
        with stack:
            # One session: every request's primary is the same cluster, whose long budget is
            # ONE request fleet-wide. Envoy spreads the ext_proc streams over both processors.
            headers = {"x-session-id": "one-agent", "content-type": "application/json"}

            def post(i: int) -> int:
                client = Client(stack.listener_port)
                try:
                    return client.request("POST", CHAT, long_body(i), headers)[0]
                finally:
                    client.close()

            def held() -> float:
                try:
                    scraped = [stack.processor_metrics(i) for i in range(2)]
                except OSError:  # a busy replica's metrics did not answer in time: poll again
                    return -1
                return sum(
                    v
                    for m in scraped
                    for (n, _l), v in m.items()
                    if n == "fleet_budget_inflight_requests"
                )

            body = orjson.loads(long_body(0))
            body["max_tokens"] = 4000  # ~200 s: longer than any machine needs for the rest
            holder = socket.create_connection((LOOPBACK, stack.listener_port), timeout=60)
            raw = orjson.dumps(body)
            holder.sendall(
                f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"x-session-id: one-agent\r\ncontent-length: {len(raw)}\r\n\r\n".encode()
                + raw
            )
            try:
                wait_until(lambda: held() == 1, 60, "the holder admitted")
                # While it holds the one budget, every other request is refused, whichever
                # processor decides it.
                with ThreadPoolExecutor(9) as pool:
                    statuses = Counter(pool.map(post, range(1, 10)))
                # The holder is still running, and nothing else was admitted meanwhile.
                readings: list[float] = []
                wait_until(lambda: readings.append(held()) or readings[-1] >= 0, 60, "a reading")
                assert readings[-1] == 1, readings
            finally:
                holder.close()
            assert statuses[429] == 9, (statuses, dump_logs(stack))
            # The holder hung up: its budget comes back.
            wait_until(lambda: held() == 0, 60, "the holder's budget released")
            served = [stack.processor_metrics(i) for i in range(2)]
            decided = [
                sum(v for (n, _l), v in m.items() if n == "fleet_requests_total") for m in served
            ]
            assert all(d > 0 for d in decided), decided  # both processors took part

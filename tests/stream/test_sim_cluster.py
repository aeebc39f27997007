"""The simulated cluster over real HTTP: API formats, usage, prefix caching, faults, metrics."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.harness.kvmodel import ClusterParams
from extproc.harness.prompts import BLOCK_TOKENS, block_hashes, canonical_prompt
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster

pytestmark = pytest.mark.timeout(10)

PARAMS = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=0.001)
KNOWN_ORCA_KEYS = {"cpu_utilization", "mem_utilization", "application_utilization", "eps"}


@pytest.fixture
async def sim() -> AsyncIterator[RunningSimCluster]:
    running = await start_sim_cluster(SimClusterConfig(name="c7", params=PARAMS, max_output=16))
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kwargs: Any
) -> tuple[int, dict[str, str], bytes]:
    # BytesIO: aiohttp warns about raw bytes bodies over 1 MiB.
    async with http.post(url, data=io.BytesIO(orjson.dumps(body)), **kwargs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def sse_events(raw: bytes) -> list[tuple[str | None, bytes]]:
    """(event name, data) pairs of an SSE body."""
    events: list[tuple[str | None, bytes]] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name: str | None = None
        data = b""
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :].encode()
        events.append((name, data))
    return events


def parse_orca_text(value: str) -> dict[str, float]:
    """Parse like Envoy's ORCA TEXT parser: prefix, comma list, key=value, no duplicates."""
    assert value.startswith("TEXT ")
    metrics: dict[str, float] = {}
    for item in value[len("TEXT ") :].split(","):
        key, _, raw = item.strip().partition("=")
        assert key not in metrics
        assert key in KNOWN_ORCA_KEYS or (
            key.startswith("named_metrics.") and len(key) > len("named_metrics.")
        )
        metrics[key] = float(raw)
        assert metrics[key] >= 0
    return metrics


async def test_chat_non_stream_returns_openai_body_usage_and_load_headers(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    content = "x" * 3000
    status, headers, raw = await post(
        http, sim.url + "/v1/chat/completions", chat(content, max_tokens=5)
    )
    assert status == 200
    body = orjson.loads(raw)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert len(body["choices"][0]["message"]["content"]) == 5 * 4
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_tokens = -(-len(canonical_prompt("openai-chat", chat(content))) // 4)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert headers["x-served-by"] == "c7"
    orca = parse_orca_text(headers["endpoint-load-metrics"])
    assert {"cpu_utilization", "mem_utilization", "named_metrics.kv_cache"} <= set(orca)
    assert orca["named_metrics.queue"] == int(orca["named_metrics.queue"])
    fleet = dict(item.split("=") for item in headers["x-fleet-load"].split(","))
    assert set(fleet) == {"kv", "queue", "inflight"}
    assert float(headers["x-sim-ttft-ms"]) == pytest.approx(prompt_tokens / 20_000 * 1000, 0.01)


async def test_second_request_sharing_a_prefix_reports_the_shared_blocks_as_cached(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    shared = "s" * 5000
    first, second = chat(shared + "tail-one" * 50), chat(shared + "tail-two" * 50)
    expected_blocks = 0
    for a, b in zip(
        block_hashes(canonical_prompt("openai-chat", first)),
        block_hashes(canonical_prompt("openai-chat", second)),
        strict=False,
    ):
        if a != b:
            break
        expected_blocks += 1
    assert expected_blocks == 2  # 8 framing chars + 5000 shared chars = 2 full blocks

    url = sim.url + "/v1/chat/completions"
    _, headers_1, raw_1 = await post(http, url, first)
    _, headers_2, raw_2 = await post(http, url, second)
    assert orjson.loads(raw_1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = orjson.loads(raw_2)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == expected_blocks * BLOCK_TOKENS
    assert headers_2["x-sim-cached-tokens"] == str(cached)
    assert float(headers_2["x-sim-ttft-ms"]) < float(headers_1["x-sim-ttft-ms"])


async def test_reset_empties_the_cache_and_is_refused_while_a_request_runs(
    http: aiohttp.ClientSession,
) -> None:
    slow = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=1.0)  # 0.4 s each
    running = await start_sim_cluster(SimClusterConfig(name="c8", params=slow, max_output=16))
    try:
        url = running.url + "/v1/chat/completions"
        body = chat("r" * 5000, max_tokens=16)
        await post(http, url, body)
        in_flight = asyncio.create_task(post(http, url, body))
        for _ in range(1000):  # until the request has reached the model (bounded)
            if running.cluster.model.load(time.monotonic()).inflight:
                break
            await asyncio.sleep(0.005)
        status, _, _ = await post(http, running.url + "/admin/reset", {})
        assert status == 409  # a request is running
        cached = orjson.loads((await in_flight)[2])["usage"]["prompt_tokens_details"]
        assert cached["cached_tokens"] > 0
        status, _, _ = await post(http, running.url + "/admin/reset", {})
        assert status == 200
        _, _, raw = await post(http, url, body)
        assert orjson.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        await running.close()


async def test_chat_stream_sends_chunks_then_usage_then_done(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    status, headers, raw = await post(
        http, sim.url + "/v1/chat/completions", chat("hello", stream=True, max_tokens=40)
    )
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["x-served-by"] == "c7"
    events = sse_events(raw)
    assert events[-1] == (None, b"[DONE]")
    chunks = [orjson.loads(data) for _, data in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text) == 16 * 4  # max_tokens 40 capped by max_output 16
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"  # the cap ended it, not max_tokens
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]
    assert all("usage" not in c for c in chunks[:-1])


async def test_completions_stream_and_non_stream(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    url = sim.url + "/v1/completions"
    status, _, raw = await post(http, url, {"prompt": "abcd" * 10, "max_tokens": 3})
    body = orjson.loads(raw)
    assert status == 200 and body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 10
    status, _, raw = await post(http, url, {"prompt": "abcd" * 10, "max_tokens": 3, "stream": True})
    events = sse_events(raw)
    assert events[-1] == (None, b"[DONE]")
    assert orjson.loads(events[-2][1])["usage"]["completion_tokens"] == 3


async def test_anthropic_messages_non_stream_and_stream(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    url = sim.url + "/v1/messages"
    request = {
        "model": "claude-sim",
        "max_tokens": 4,
        "system": "sys " * 700,
        "messages": [{"role": "user", "content": "question"}],
    }
    status, headers, raw = await post(http, url, request)
    body = orjson.loads(raw)
    assert status == 200 and body["type"] == "message" and body["stop_reason"] == "max_tokens"
    assert body["content"][0]["type"] == "text"
    assert body["usage"]["output_tokens"] == 4
    assert body["usage"]["cache_read_input_tokens"] == 0
    assert "endpoint-load-metrics" in headers

    status, _, raw = await post(http, url, {**request, "stream": True})
    events = sse_events(raw)
    names = [name for name, _ in events]
    assert names[0] == "message_start"
    assert names[1] == "content_block_start"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = orjson.loads(events[0][1])["message"]["usage"]
    final = orjson.loads(events[-2][1])["usage"]
    # The system prompt (2800 chars + framing) fills one block, cached from the first request.
    assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"] == BLOCK_TOKENS
    assert (
        final["input_tokens"] + final["cache_read_input_tokens"]
        == body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]
    )
    assert final["output_tokens"] == 4


@pytest.mark.parametrize(
    ("path", "body", "error_key"),
    [
        ("/v1/chat/completions", b"{nope", "error"),
        ("/v1/chat/completions", b'{"messages": []}', "error"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
         b'"max_tokens": 0}', "error"),
        ("/v1/messages", b'{"max_tokens": 5}', "type"),
    ],
    ids=["bad-json", "no-messages", "zero-max-tokens", "anthropic-no-messages"],
)  # fmt: skip
async def test_bad_requests_get_400_in_the_apis_error_format(
    sim: RunningSimCluster, http: aiohttp.ClientSession, path: str, body: bytes, error_key: str
) -> None:
    async with http.post(sim.url + path, data=body) as resp:
        assert resp.status == 400
        payload = orjson.loads(await resp.read())
    assert error_key in payload
    if error_key == "type":
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "invalid_request_error"


async def test_fault_error_returns_the_given_status_until_cleared(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    url = sim.url + "/v1/chat/completions"
    status, _, raw = await post(http, sim.url + "/admin/fault", {"mode": "error", "status": 502})
    assert status == 200 and orjson.loads(raw)["mode"] == "error"
    status, headers, raw = await post(http, url, chat("hi"))
    assert status == 502
    assert headers["x-served-by"] == "c7"
    assert orjson.loads(raw)["error"]["code"] == 502
    await post(http, sim.url + "/admin/fault", {"mode": "none"})
    status, _, _ = await post(http, url, chat("hi"))
    assert status == 200


async def test_fault_hang_never_answers_until_cleared(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    url = sim.url + "/v1/chat/completions"
    await post(http, sim.url + "/admin/fault", {"mode": "hang"})
    with pytest.raises(asyncio.TimeoutError):
        await post(http, url, chat("hi"), timeout=aiohttp.ClientTimeout(total=0.3))
    # A request waiting while the cluster hangs is answered once the fault is cleared.
    pending = asyncio.create_task(post(http, url, chat("hi")))
    await asyncio.sleep(0.1)
    assert not pending.done()
    await post(http, sim.url + "/admin/fault", {"mode": "none"})
    status, _, _ = await asyncio.wait_for(pending, 2)
    assert status == 200


async def test_fault_refuse_fails_health_and_drops_connections(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    await post(http, sim.url + "/admin/fault", {"mode": "refuse"})
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 503
        assert resp.headers["x-served-by"] == "c7"
    with pytest.raises(aiohttp.ClientConnectionError):
        await post(http, sim.url + "/v1/chat/completions", chat("hi"))
    await post(http, sim.url + "/admin/fault", {"mode": "none"})
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200


async def test_executions_are_counted_per_request_id_and_reset_runs_then_drops(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    url = sim.url + "/v1/chat/completions"
    for request_id in ("a", "b", "a"):
        status, _, _ = await post(http, url, chat("hi"), headers={"x-request-id": request_id})
        assert status == 200
    # A refusal (429/503 before any generation) is no execution.
    await post(http, sim.url + "/admin/fault", {"mode": "error", "status": 429})
    status, _, _ = await post(http, url, chat("hi"), headers={"x-request-id": "c"})
    assert status == 429
    # "reset": the generation starts, then the connection drops without a response.
    await post(http, sim.url + "/admin/fault", {"mode": "reset"})
    with pytest.raises(aiohttp.ClientConnectionError):
        await post(http, url, chat("hi"), headers={"x-request-id": "d"})
    await post(http, sim.url + "/admin/fault", {"mode": "none"})
    async with http.get(sim.url + "/admin/executions") as resp:
        assert resp.status == 200
        assert (await resp.json())["executions"] == {"a": 2, "b": 1, "d": 1}


async def test_fault_slow_multiplies_times(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    url = sim.url + "/v1/chat/completions"
    _, normal, _ = await post(http, url, chat("a" * 4000))
    await post(http, sim.url + "/admin/fault", {"mode": "slow", "factor": 3.0})
    _, slow, _ = await post(http, url, chat("b" * 4000))
    assert float(slow["x-sim-ttft-ms"]) == pytest.approx(3 * float(normal["x-sim-ttft-ms"]))


@pytest.mark.parametrize(
    "payload",
    [{"mode": "explode"}, {"mode": "error", "status": 200}, {"mode": "slow", "factor": 0}, []],
    ids=["unknown-mode", "non-error-status", "zero-factor", "not-an-object"],
)
async def test_invalid_fault_payloads_are_rejected(
    sim: RunningSimCluster, http: aiohttp.ClientSession, payload: object
) -> None:
    async with http.post(sim.url + "/admin/fault", data=orjson.dumps(payload)) as resp:
        assert resp.status == 400
    async with http.get(sim.url + "/admin/fault") as resp:
        assert (await resp.json())["mode"] == "none"


async def test_metrics_count_requests_hits_and_tokens(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    url = sim.url + "/v1/chat/completions"
    body = chat("m" * 6000)
    await post(http, url, body)
    await post(http, url, body)
    async with http.get(sim.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['sim_requests_total{api="openai-chat",code="200"}'] == 2
    assert samples["sim_prefix_cache_hits_total"] == 1
    prompt = samples["sim_prompt_tokens_total"]
    assert samples["sim_cached_tokens_total"] == 2 * BLOCK_TOKENS
    assert samples["sim_uncached_tokens_total"] == prompt - 2 * BLOCK_TOKENS
    for name in ("sim_queue_depth", "sim_kv_usage_ratio", "sim_inflight_requests"):
        assert name in samples
    assert "vllm:kv_cache_usage_perc" in samples
    assert samples['sim_fault_mode{mode="none"}'] == 1


async def test_health_and_models(sim: RunningSimCluster, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200
        assert resp.headers["x-served-by"] == "c7"
    async with http.get(sim.url + "/v1/models") as resp:
        assert (await resp.json())["object"] == "list"


async def test_concurrent_requests_queue_behind_each_other(http: aiohttp.ClientSession) -> None:
    # Real time: prefill at 20k tokens/s with time_scale 0.01 -> 10k tokens take 5 ms.
    params = ClusterParams(prefill_tps=20_000.0, time_scale=0.01)
    running = await start_sim_cluster(SimClusterConfig(name="q", params=params, max_output=1))
    try:
        url = running.url + "/v1/chat/completions"
        long_body = chat("L" * 1_600_000)  # 400k tokens: 20 simulated s, 200 ms real
        long_task = asyncio.create_task(post(http, url, long_body))
        # Send the short one only once the long one is admitted (its upload takes a moment).
        model = running.cluster.model
        while model.load(time.monotonic()).inflight == 0:
            assert not long_task.done()
            await asyncio.sleep(0.001)
        _, headers, _ = await post(http, url, chat("short"))
        await long_task
    finally:
        await running.close()
    # The short request waited for most of the long prefill (a convoy), in simulated ms.
    assert float(headers["x-sim-ttft-ms"]) > 2000


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_disconnects_ends_its_request_at_once(stream: bool) -> None:
    """Like vLLM and SGLang, the engine aborts a request whose client went away: it leaves the
    in-flight count at once instead of running to its planned end."""
    # 16 output tokens at 1 token/s (time_scale 1): 15 s of decode if nobody stopped it.
    params = ClusterParams(prefill_tps=20_000.0, decode_tps=1.0, time_scale=1.0)
    registry = CollectorRegistry()
    running = await start_sim_cluster(
        SimClusterConfig(name="a", params=params, max_output=16), registry=registry
    )
    try:
        reader, writer = await asyncio.open_connection(running.host, running.port)
        body = orjson.dumps(chat("hello", stream=stream, max_tokens=16))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n"
            b"x-fleet-class: long\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        concurrency = running.cluster.concurrency
        await _until(lambda: concurrency.inflight.get("long", 0) == 1)
        if stream:
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")  # the first token is out
        writer.close()
        await writer.wait_closed()
        await _until(lambda: concurrency.inflight["long"] == 0)
        assert registry.get_sample_value("sim_client_disconnects_total") == 1
    finally:
        await running.close()

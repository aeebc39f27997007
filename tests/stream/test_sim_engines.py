"""The simulated cluster playing vLLM and SGLang (``engine=``): their /metrics families read
by the processor's own parsers, and their response headers (vLLM's ORCA reports on request,
only on non-streaming responses; nothing from SGLang)."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from extproc.core.engine_metrics import parse_engine_metrics
from extproc.core.load import ORCA_FORMAT_HEADER, ORCA_HEADER, parse_orca
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster

pytestmark = pytest.mark.timeout(20)

FAST = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=0.001)
CHAT = "/v1/chat/completions"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def started(engine: str, params: ClusterParams = FAST) -> RunningSimCluster:
    return await start_sim_cluster(
        SimClusterConfig(name="e1", params=params, max_output=16, engine=engine)  # type: ignore[arg-type]
    )


def chat(content: str, **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra})


async def post(
    http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with http.post(url, data=io.BytesIO(body), headers=headers or {}) as resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()


async def page(http: aiohttp.ClientSession, sim: RunningSimCluster) -> str:
    async with http.get(sim.url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def test_vllm_metrics_page_is_read_by_the_vllm_parser(http: aiohttp.ClientSession) -> None:
    sim = await started("vllm")
    try:
        prompt = "m" * 6000
        await post(http, sim.url + CHAT, chat(prompt))
        await post(http, sim.url + CHAT, chat(prompt))
        text = await page(http, sim)
    finally:
        await sim.close()
    # The engine's own label set, on every family; no unlabelled copies of its names.
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim"}' in text
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="sim"}' in text
    assert "\nvllm:num_requests_waiting " not in text
    assert "sglang:" not in text
    sample = parse_engine_metrics("vllm", text)
    assert sample is not None
    assert (sample.waiting, sample.running) == (0, 0)
    assert sample.prefix_queries is not None and sample.prefix_hits is not None
    # The second request found the first one's blocks.
    assert 0 < sample.prefix_hits < sample.prefix_queries
    assert parse_engine_metrics("sglang", text) is None


async def test_sglang_metrics_page_is_read_by_the_sglang_parser(
    http: aiohttp.ClientSession,
) -> None:
    sim = await started("sglang")
    try:
        prompt = "s" * 6000
        status, headers, _ = await post(
            http, sim.url + CHAT, chat(prompt), {ORCA_FORMAT_HEADER: "TEXT"}
        )
        await post(http, sim.url + CHAT, chat(prompt))
        text = await page(http, sim)
    finally:
        await sim.close()
    assert status == 200
    # SGLang sends no load report of any kind.
    assert ORCA_HEADER not in headers and "x-fleet-load" not in headers
    assert 'sglang:token_usage{model_name="sim"}' in text
    assert "vllm:" not in text
    sample = parse_engine_metrics("sglang", text)
    assert sample is not None
    assert (sample.waiting, sample.running) == (0, 0)
    assert sample.hit_rate is not None and 0 < sample.hit_rate < 1
    assert parse_engine_metrics("vllm", text) is None


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
async def test_vllm_sends_orca_only_when_asked_and_not_on_streams(
    http: aiohttp.ClientSession, fmt: str
) -> None:
    sim = await started("vllm")
    try:
        url = sim.url + CHAT
        _, asked, _ = await post(http, url, chat("hello"), {ORCA_FORMAT_HEADER: fmt})
        _, unasked, _ = await post(http, url, chat("hello"))
        _, streamed, _ = await post(
            http, url, chat("hello", stream=True), {ORCA_FORMAT_HEADER: fmt}
        )
    finally:
        await sim.close()
    value = asked[ORCA_HEADER]
    assert value.startswith(fmt + " ")
    if fmt == "TEXT":
        assert "named_metrics.kv_cache_usage_perc=" in value
        assert "named_metrics.num_requests_waiting=" in value
    report = parse_orca(value)
    assert report is not None
    assert report.kv is not None and report.queue == 0
    for headers in (unasked, streamed):
        assert ORCA_HEADER not in headers
        assert "x-fleet-load" not in headers


async def test_scrape_sees_a_running_request(http: aiohttp.ClientSession) -> None:
    # Real time: 16 output tokens at 20 tokens/s keep one request running for ~0.8 s.
    slow = ClusterParams(prefill_tps=20_000.0, decode_tps=20.0, time_scale=1.0)
    sim = await started("vllm", slow)
    try:
        pending = asyncio.ensure_future(post(http, sim.url + CHAT, chat("k" * 4000)))
        deadline = time.monotonic() + 5
        seen = None
        while time.monotonic() < deadline and not pending.done():
            sample = parse_engine_metrics("vllm", await page(http, sim))
            if sample is not None and sample.running == 1:
                seen = sample
                break
            await asyncio.sleep(0.02)
        status, _, _ = await pending
    finally:
        await sim.close()
    assert status == 200
    assert seen is not None, "the running request never showed in vllm:num_requests_running"
    assert seen.kv is not None and seen.kv > 0


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="engine must be one of"):
        SimClusterConfig(engine="tgi")  # type: ignore[arg-type]

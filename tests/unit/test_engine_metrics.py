"""Engine /metrics parsing: vLLM's and SGLang's names and text format, odd pages, combining
endpoints into a cluster report, the prefix-cache hit ratio."""

from __future__ import annotations

import pytest

from extproc.core.engine_metrics import (
    EngineSample,
    cluster_report,
    parse_engine_metrics,
    prefix_hit_ratio,
    series_values,
)
from extproc.core.load import LoadReport

# The layout prometheus_client prints for vLLM's v1 loggers (two data-parallel engines), with a
# histogram and a deprecated name around the lines that matter.
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.7
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 200.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 12.5
"""

SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
"""


def test_vllm_page_sums_counts_and_averages_kv_over_ranks() -> None:
    sample = parse_engine_metrics("vllm", VLLM_PAGE)
    assert sample == EngineSample(
        kv=pytest.approx(0.6),
        waiting=5,
        running=5,
        prefix_queries=2000.0,
        prefix_hits=800.0,
    )


def test_sglang_page() -> None:
    sample = parse_engine_metrics("sglang", SGLANG_PAGE)
    assert sample == EngineSample(
        kv=0.28, waiting=2, running=7, hit_rate=pytest.approx(0.0075075526)
    )


def test_each_engine_reads_only_its_own_names() -> None:
    assert parse_engine_metrics("sglang", VLLM_PAGE) is None
    assert parse_engine_metrics("vllm", SGLANG_PAGE) is None
    # vLLM before the rename (gpu_cache_usage_perc, removed in 0.12) is not read as KV.
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.9\nvllm:num_requests_waiting 2\n'
    assert parse_engine_metrics("vllm", old) == EngineSample(kv=None, waiting=2, running=None)


def test_label_values_may_hold_braces_quotes_and_spaces() -> None:
    page = 'vllm:num_requests_waiting{model_name="a} \\"b\\", c",engine="0"} 3 1700000000000\n'
    assert series_values(page, "vllm:num_requests_waiting") == [3.0]


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-1", "abc", ""])
def test_unusable_values_are_skipped(value: str) -> None:
    page = f'sglang:num_queue_reqs{{model_name="m"}} {value}\nsglang:num_queue_reqs{{x="y"}} 4\n'
    assert series_values(page, "sglang:num_queue_reqs") == [4.0]


def test_unclosed_label_set_is_skipped() -> None:
    page = 'sglang:token_usage{model_name="m 0.5\nsglang:token_usage 0.25\n'
    assert series_values(page, "sglang:token_usage") == [0.25]


def test_utilisation_above_one_saturates() -> None:
    sample = parse_engine_metrics("sglang", "sglang:token_usage 1.4\n")
    assert sample is not None and sample.kv == 1.0


def test_empty_page_is_no_sample() -> None:
    assert parse_engine_metrics("vllm", "") is None
    assert parse_engine_metrics("vllm", "# HELP x y\n") is None


def test_cluster_report_combines_endpoints() -> None:
    a = EngineSample(kv=0.2, waiting=1, running=3)
    b = EngineSample(kv=0.6, waiting=4, running=0)
    c = EngineSample(kv=None, waiting=None, running=2)
    assert cluster_report([a, b, c]) == LoadReport(
        kv=pytest.approx(0.4), queue=5, inflight=10, cpu=None, source="scrape"
    )
    assert cluster_report([]) is None


def test_prefix_hit_ratio_from_counter_deltas() -> None:
    before = EngineSample(None, 0, 0, prefix_queries=1000.0, prefix_hits=100.0)
    after = EngineSample(None, 0, 0, prefix_queries=1400.0, prefix_hits=400.0)
    assert prefix_hit_ratio(before, after) == pytest.approx(0.75)
    assert prefix_hit_ratio(None, after) is None
    assert prefix_hit_ratio(after, after) is None  # nothing looked up since
    # Counters that went back: the engine restarted; no ratio for this interval.
    assert prefix_hit_ratio(after, before) is None
    sglang = EngineSample(0.1, 0, 0, hit_rate=0.3)
    assert prefix_hit_ratio(None, sglang) == 0.3

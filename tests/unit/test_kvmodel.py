"""The pure cluster model: prefix-cache accounting, LRU eviction, TTFT arithmetic, queueing."""

from __future__ import annotations

import itertools

import pytest

from extproc.harness.kvmodel import ClusterModel, ClusterParams, ModelRequest, PrefixCache

BLOCK = 512


def request(blocks: list[int], prompt_tokens: int | None = None, output: int = 1) -> ModelRequest:
    tokens = len(blocks) * BLOCK if prompt_tokens is None else prompt_tokens
    return ModelRequest(tuple(blocks), tokens, output)


def model(**changes: float) -> ClusterModel:
    params = {
        "kv_capacity_tokens": 1_000_000,
        "prefill_tps": 1000.0,
        "decode_tps": 50.0,
        "max_concurrency": 64,
        "time_scale": 1.0,
    }
    params.update(changes)
    return ClusterModel(ClusterParams(**params))  # type: ignore[arg-type]


def test_second_request_with_shared_prefix_gets_shared_blocks_cached() -> None:
    m = model()
    first = m.admit(request([1, 2, 3, 4]), now=0.0)
    second = m.admit(request([1, 2, 3, 9, 10], prompt_tokens=5 * BLOCK - 100), now=10.0)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 3 * BLOCK
    assert second.uncached_tokens == 5 * BLOCK - 100 - 3 * BLOCK


def test_a_block_counts_only_when_its_whole_prefix_is_cached() -> None:
    m = model()
    m.admit(request([1, 2, 3]), now=0.0)
    # Hash 2 is resident, but the chain breaks at the first block, so nothing is reused.
    assert m.admit(request([7, 2, 3]), now=1.0).cached_tokens == 0


def test_cached_tokens_never_exceed_the_prompt() -> None:
    m = model()
    m.admit(request([1, 2]), now=0.0)
    plan = m.admit(request([1, 2], prompt_tokens=700), now=1.0)
    assert plan.cached_tokens == 700
    assert plan.uncached_tokens == 0


def test_lru_evicts_the_oldest_request_when_capacity_is_exceeded() -> None:
    m = model(kv_capacity_tokens=4 * BLOCK)
    m.admit(request([1, 2]), now=0.0)
    m.admit(request([3, 4]), now=1.0)
    m.admit(request([5, 6]), now=2.0)
    assert m.cache.match([1, 2]) == 0
    assert m.cache.match([3, 4]) == 2
    assert m.cache.match([5, 6]) == 2
    assert m.cache.evictions == 2


def test_a_hit_refreshes_recency() -> None:
    m = model(kv_capacity_tokens=4 * BLOCK)
    m.admit(request([1, 2]), now=0.0)
    m.admit(request([3, 4]), now=1.0)
    m.admit(request([1, 2]), now=2.0)  # [1, 2] is now newer than [3, 4]
    m.admit(request([5, 6]), now=3.0)
    assert m.cache.match([1, 2]) == 2
    assert m.cache.match([3, 4]) == 0


def test_under_pressure_a_request_loses_its_tail_before_its_head() -> None:
    cache = PrefixCache(capacity_blocks=3)
    cache.touch([1, 2, 3])
    cache.touch([9])
    assert cache.match([1, 2, 3]) == 2
    assert 3 not in cache


def test_ttft_is_prefill_of_uncached_tokens_scaled_by_time_scale() -> None:
    m = model(prefill_tps=1000.0, decode_tps=50.0, time_scale=0.01)
    plan = m.admit(request([1, 2, 3, 4], prompt_tokens=2000, output=11), now=5.0)
    assert plan.sim_ttft_s == pytest.approx(2.0)  # 2000 tokens at 1000 tokens/s
    assert plan.ttft == pytest.approx(0.02)  # on the caller's clock, 100x faster
    # The prefill emits the first token; the other 10 take 10 / 50 simulated seconds.
    assert plan.done_at - plan.first_token_at == pytest.approx(10 / 50 * 0.01)


def test_cache_hit_shortens_ttft_by_the_cached_tokens() -> None:
    m = model(prefill_tps=1000.0)
    m.admit(request([1, 2, 3, 4]), now=0.0)
    plan = m.admit(request([1, 2, 3, 4, 5]), now=100.0)
    assert plan.cached_tokens == 4 * BLOCK
    assert plan.ttft == pytest.approx(BLOCK / 1000.0)


def test_short_request_queued_behind_a_long_prefill_waits_for_it() -> None:
    m = model(prefill_tps=20_000.0)
    long = m.admit(request(list(range(100, 300)), prompt_tokens=100_000), now=0.0)
    short = m.admit(request([1], prompt_tokens=500), now=0.1)
    assert long.first_token_at == pytest.approx(5.0)
    assert short.prefill_start == pytest.approx(long.first_token_at)
    assert short.ttft == pytest.approx(5.0 - 0.1 + 500 / 20_000)


def test_prefill_is_fifo_in_admission_order() -> None:
    m = model(prefill_tps=1000.0)
    plans = [m.admit(request([i], prompt_tokens=100 * (5 - i)), now=0.01 * i) for i in range(5)]
    starts = [p.prefill_start for p in plans]
    assert starts == sorted(starts)
    for earlier, later in itertools.pairwise(plans):
        assert later.prefill_start >= earlier.first_token_at


def test_idle_cluster_starts_prefill_at_arrival() -> None:
    m = model(prefill_tps=1000.0)
    m.admit(request([1], prompt_tokens=100), now=0.0)
    plan = m.admit(request([2], prompt_tokens=100), now=50.0)
    assert plan.prefill_start == 50.0


def test_concurrency_limit_holds_a_request_until_a_slot_frees() -> None:
    m = model(max_concurrency=1, prefill_tps=1000.0, decode_tps=10.0)
    first = m.admit(request([1], prompt_tokens=100, output=11), now=0.0)
    second = m.admit(request([2], prompt_tokens=100, output=1), now=0.0)
    assert first.done_at == pytest.approx(0.1 + 1.0)
    assert second.slot_at == pytest.approx(first.done_at)
    assert second.prefill_start == pytest.approx(first.done_at)


def test_slowdown_multiplies_durations_of_later_requests() -> None:
    m = model(prefill_tps=1000.0, time_scale=0.5)
    normal = m.admit(request([1], prompt_tokens=1000), now=0.0)
    m.set_slowdown(4.0)
    slow = m.admit(request([2], prompt_tokens=1000), now=100.0)
    assert normal.ttft == pytest.approx(0.5)
    assert slow.ttft == pytest.approx(2.0)
    assert slow.sim_ttft_s == pytest.approx(4.0)
    with pytest.raises(ValueError):
        m.set_slowdown(0.0)


def test_load_snapshot_counts_queued_and_running_requests() -> None:
    m = model(kv_capacity_tokens=10_000, prefill_tps=1000.0, decode_tps=10.0)
    m.admit(request([1], prompt_tokens=1000, output=11), now=0.0)  # prefill 0..1, decode 1..2
    m.admit(request([2], prompt_tokens=1000, output=1), now=0.0)  # queued until 1, done at 2
    at_half = m.load(0.5)
    assert (at_half.inflight, at_half.queued) == (2, 1)
    assert at_half.kv_usage == pytest.approx(1011 / 10_000)  # the waiting one holds no KV
    later = m.load(1.5)
    assert (later.inflight, later.queued) == (2, 0)
    assert later.kv_usage == pytest.approx((1011 + 1001) / 10_000)
    assert m.load(2.5).inflight == 0
    assert m.load(10.0).cache_fill == pytest.approx(2 * BLOCK / 10_000)


@pytest.mark.parametrize(
    "changes",
    [
        {"kv_capacity_tokens": 0},
        {"prefill_tps": 0.0},
        {"decode_tps": -1.0},
        {"max_concurrency": 0},
        {"time_scale": 0.0},
    ],
    ids=["no-capacity", "no-prefill", "negative-decode", "no-concurrency", "zero-time-scale"],
)
def test_invalid_params_fail_loudly(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ClusterParams(**changes)  # type: ignore[arg-type]

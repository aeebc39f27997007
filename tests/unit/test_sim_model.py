"""The simulator's cluster model is the e2e harness's ClusterModel, plus prefill lanes."""

from __future__ import annotations

import random

import pytest

from extproc.harness.kvmodel import ClusterModel, ClusterParams, ModelRequest
from extproc.sim.model import PROFILES, ClusterSpec, ClusterState, FleetShape, build_fleet

BLOCK = 512


def _spec(lanes: int = 1, kv_tokens: int = 60 * BLOCK, concurrency: int = 4) -> ClusterSpec:
    return ClusterSpec("c1", "balanced", 5000.0, kv_tokens, 40.0, lanes, concurrency, 1.0)


def _stream(seed: int, n: int) -> list[tuple[float, tuple[int, ...], int, int]]:
    """Conversations that grow and share prefixes, plus one-off prompts, arriving Poisson."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_key = 1
    now = 0.0
    out = []
    for _ in range(n):
        now += rng.expovariate(2.0)
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
            if rng.random() < 0.3:
                # Branch: same head, different tail (the cache must stop at the first miss).
                conv = conv[: rng.randint(1, len(conv))]
                convs.append(conv)
            conv.extend(range(next_key, next_key + rng.randint(1, 4)))
            next_key = conv[-1] + 1
        else:
            conv = list(range(next_key, next_key + rng.randint(1, 20)))
            next_key = conv[-1] + 1
            convs.append(conv)
        prompt = (len(conv) - 1) * BLOCK + rng.randint(1, BLOCK)
        out.append((now, tuple(conv), prompt, rng.randint(1, 300)))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_lane_is_clustermodel_request_by_request(seed: int) -> None:
    # Small KV and concurrency so eviction and slot waits both happen.
    spec = _spec()
    state = ClusterState(spec, BLOCK)
    model = ClusterModel(
        ClusterParams(
            kv_capacity_tokens=spec.kv_capacity_tokens,
            prefill_tps=spec.prefill_tps,
            decode_tps=spec.decode_tps,
            max_concurrency=spec.max_concurrency,
        )
    )
    evicted = False
    for now, keys, prompt, output in _stream(seed, 1500):
        plan = model.admit(ModelRequest(keys, prompt, output), now)
        cached, first, done = state.serve(keys, prompt, output, now)
        assert cached == plan.cached_tokens
        assert first == pytest.approx(plan.first_token_at, rel=1e-12, abs=1e-9)
        assert done == pytest.approx(plan.done_at, rel=1e-12, abs=1e-9)
        assert list(state.cache) == list(model.cache._lru)  # same blocks, same LRU order
        evicted = evicted or model.cache.evictions > 0
    assert evicted and state.evictions == model.cache.evictions


def test_binary_search_lookup_equals_a_linear_scan_under_eviction() -> None:
    state = ClusterState(_spec(kv_tokens=25 * BLOCK), BLOCK)
    for now, keys, prompt, output in _stream(9, 2000):
        linear = 0
        for k in keys:
            if k not in state.cache:
                break
            linear += 1
        assert state.match(keys) == linear
        state.serve(keys, prompt, output, now)


def test_a_request_takes_the_lane_that_frees_first() -> None:
    state = ClusterState(_spec(lanes=2, concurrency=100), BLOCK)
    lane_tps = 5000.0 / 2
    _, first_a, _ = state.serve([1, 2, 3, 4], 4 * BLOCK, 1, 0.0)  # long, lane 0
    _, first_b, _ = state.serve([9], BLOCK, 1, 0.0)  # short, lane 1: not behind the long one
    assert first_a == pytest.approx(4 * BLOCK / lane_tps)
    assert first_b == pytest.approx(BLOCK / lane_tps)
    _, first_c, _ = state.serve([20], BLOCK, 1, 0.0)  # both busy: behind the short one
    assert first_c == pytest.approx(2 * BLOCK / lane_tps)


def test_a_crash_loses_the_cache_and_a_restart_frees_the_lanes() -> None:
    state = ClusterState(_spec(concurrency=100), BLOCK)
    state.serve([1, 2], 2 * BLOCK, 1, 0.0)
    state.crash()
    state.restart(50.0)
    cached, first, _ = state.serve([1, 2], 2 * BLOCK, 1, 50.0)
    assert cached == 0
    assert first == pytest.approx(50.0 + 2 * BLOCK / 5000.0)


def test_the_fleet_is_sized_from_the_offered_work_and_seeded() -> None:
    shape = FleetShape(clusters=40, spares=2, utilisation=0.5, kv_share=0.5, seed=4)
    fleet = build_fleet(shape, prefill_tokens_per_s=1e6, distinct_tokens=80_000_000)
    assert [c.name for c in fleet] == [f"c{i}" for i in range(1, 43)]
    assert fleet == build_fleet(shape, 1e6, 80_000_000)
    assert len({c.profile for c in fleet}) > 1
    # The base clusters' prefill capacity is twice the offered work at utilisation 0.5.
    assert sum(c.prefill_tps for c in fleet[:40]) == pytest.approx(2e6)
    mean_kv = sum(c.kv_capacity_tokens for c in fleet) / len(fleet)
    assert 0.5 * 80e6 / 40 * 0.6 < mean_kv < 0.5 * 80e6 / 40 * 1.4
    weighted = build_fleet(FleetShape(40, weights="capacity", seed=4), 1e6, 80_000_000)
    prefill_of = {p.name: p.prefill for p in PROFILES}
    assert all(c.weight == prefill_of[c.profile] for c in weighted)
    assert all(c.weight == 1.0 for c in fleet)


def test_bad_specs_fail_loudly() -> None:
    with pytest.raises(ValueError, match="lanes"):
        ClusterSpec("c1", "x", 1.0, 100, 1.0, 0, 1, 1.0)
    with pytest.raises(ValueError, match="weights"):
        FleetShape(4, weights="fast")

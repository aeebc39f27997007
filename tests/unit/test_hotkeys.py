"""The hot-key estimator: decayed per-key share of its hash primary's load, with injected time."""

from __future__ import annotations

import math

import pytest

from extproc.core.hotkeys import HotKeys


def feed(hot: HotKeys, plan: list[tuple[str, str]], start: float, step: float) -> float:
    now = start
    for key, cluster in plan:
        hot.observe(key, cluster, now)
        now += step
    return now


def test_a_key_with_most_of_its_clusters_requests_has_that_share() -> None:
    hot = HotKeys(half_life_s=10.0)
    plan = [("viral", "c1"), ("viral", "c1"), ("viral", "c1"), ("other", "c1")] * 25
    now = feed(hot, plan, 0.0, 0.01)
    assert hot.share("viral", "c1", now) == pytest.approx(0.75, abs=0.01)
    assert hot.share("other", "c1", now) == pytest.approx(0.25, abs=0.01)


def test_share_is_per_cluster() -> None:
    hot = HotKeys(half_life_s=10.0)
    now = feed(hot, [("a", "c1"), ("b", "c2"), ("b", "c2"), ("b", "c2")] * 10, 0.0, 0.01)
    assert hot.share("a", "c1", now) == pytest.approx(1.0)
    assert hot.share("b", "c2", now) == pytest.approx(1.0)
    assert hot.share("a", "c2", now) == 0.0  # a's load was charged to c1, its hash primary


def test_below_the_volume_floor_nothing_is_hot() -> None:
    hot = HotKeys(half_life_s=10.0)
    now = feed(hot, [("k", "c1"), ("k", "c1"), ("j", "c1")], 0.0, 0.1)
    assert hot.share("k", "c1", now, min_volume=20) == 0.0
    assert hot.share("k", "c1", now, min_volume=1) == pytest.approx(2 / 3, abs=0.02)


def test_volume_decays_with_the_half_life() -> None:
    hot = HotKeys(half_life_s=5.0)
    hot.observe("k", "c1", 100.0, weight=8.0)
    assert hot.volume("k", 100.0) == pytest.approx(8.0)
    assert hot.volume("k", 105.0) == pytest.approx(4.0)
    assert hot.volume("k", 115.0) == pytest.approx(1.0)


def test_a_key_that_cooled_down_loses_its_share() -> None:
    hot = HotKeys(half_life_s=2.0)
    now = feed(hot, [("viral", "c1")] * 50, 0.0, 0.01)
    assert hot.share("viral", "c1", now) == pytest.approx(1.0)
    # Twenty half-lives of other traffic later the viral burst is ~1e-6 of it.
    now = feed(hot, [("k1", "c1"), ("k2", "c1"), ("k3", "c1")] * 200, now, 40.0 / 600)
    assert hot.share("viral", "c1", now) < 0.01


def test_steady_rate_settles_at_rate_times_half_life_over_ln2() -> None:
    hot = HotKeys(half_life_s=4.0)
    now = feed(hot, [("k", "c1")] * 2000, 0.0, 0.1)  # 10 req/s for 200 s
    assert hot.volume("k", now) == pytest.approx(10 * 4.0 / math.log(2), rel=0.05)


def test_rebasing_the_landmark_keeps_the_values() -> None:
    # Thousands of half-lives apart: without moving the landmark 2**(t/h) would overflow.
    hot = HotKeys(half_life_s=0.01)
    hot.observe("k", "c1", 0.0, weight=1.0)
    for i in range(1, 6):
        t = i * 10.0  # 1000 half-lives per step
        hot.observe("k", "c1", t, weight=3.0)
        assert hot.volume("k", t) == pytest.approx(3.0)
        assert hot.share("k", "c1", t) == pytest.approx(1.0)


def test_a_key_whose_hash_primary_changed_starts_over_there() -> None:
    hot = HotKeys(half_life_s=10.0)
    feed(hot, [("k", "c1")] * 10, 0.0, 0.01)
    hot.observe("k", "c2", 1.0)
    assert hot.volume("k", 1.0) == pytest.approx(1.0)
    assert hot.share("k", "c1", 1.0) == 0.0


def test_memory_is_bounded_and_heavy_keys_survive_pruning() -> None:
    hot = HotKeys(half_life_s=60.0, max_keys=50)
    now = feed(hot, [("heavy", "c1")] * 100, 0.0, 0.001)
    now = feed(hot, [(f"cold-{i}", "c1") for i in range(1000)], now, 0.001)
    assert len(hot) < 100
    assert hot.volume("heavy", now) > 90
    # Pruned keys' load still counts in the cluster's total: it was real load.
    assert hot.share("heavy", "c1", now) == pytest.approx(100 / 1100, rel=0.05)


@pytest.mark.parametrize(("half_life", "max_keys"), [(0.0, 10), (-1.0, 10), (1.0, 0)])
def test_invalid_parameters_fail_loudly(half_life: float, max_keys: int) -> None:
    with pytest.raises(ValueError):
        HotKeys(half_life, max_keys)


@pytest.mark.parametrize(
    ("key", "cluster", "min_volume"),
    [("viral", "c1", 0.0), ("viral", "c1", 30.0), ("other", "c1", 5.0), ("new", "c2", 0.0)],
)
def test_share_if_observed_is_the_share_right_after_observing(
    key: str, cluster: str, min_volume: float
) -> None:
    """explain previews a decision: it must see the share the live request will see."""
    plan = [("viral", "c1"), ("viral", "c1"), ("other", "c1"), ("viral", "c2")] * 10
    previewed = HotKeys(half_life_s=10.0)
    now = feed(previewed, plan, 0.0, 0.05)
    before = len(previewed)
    expected_hot = HotKeys(half_life_s=10.0)
    feed(expected_hot, plan, 0.0, 0.05)
    expected_hot.observe(key, cluster, now)
    preview = previewed.share_if_observed(key, cluster, now, min_volume)
    assert preview == pytest.approx(expected_hot.share(key, cluster, now, min_volume))
    assert len(previewed) == before  # nothing recorded

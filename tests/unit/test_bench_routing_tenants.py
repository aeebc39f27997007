"""``extproc bench routing --workload tenant-flood``: the workload generator and the report
compute what they claim (no Envoy, no clusters: the parts that are pure)."""

from __future__ import annotations

import math

import pytest

from extproc.bench.fairness_stats import jain, pct


def test_jain_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert jain([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    # (1 + 3)^2 / (2 * (1 + 9)) = 16 / 20
    assert jain([1.0, 3.0]) == pytest.approx(0.8)
    assert math.isnan(jain([0.0, 0.0]))


def test_pct_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted on purpose
    assert pct(values, 99) == 99.0
    assert pct(values, 50) == 50.0
    assert pct(values, 100) == 100.0
    assert pct([7.0], 99) == 7.0
    assert math.isnan(pct([], 99))

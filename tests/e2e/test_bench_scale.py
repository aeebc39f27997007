"""`extproc bench scale` on a real Envoy at a CI-sized fleet (issue 21): every design starts,
and one added cluster reaches Envoy (the bench waits until Envoy holds the N+1 clusters'
endpoints), so the lead's long run cannot fail on a design that never settles."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.bench.scale import DESIGNS, Design, measure_envoy


@pytest.mark.parametrize("design", DESIGNS)
def test_each_design_starts_and_applies_one_added_cluster(design: Design, tmp_path: Path) -> None:
    row = measure_envoy(20, 2, design, tmp_path, ready_timeout=120, reload_timeout=120)
    assert row.skipped is None
    assert row.ready_s is not None and row.rss_mb is not None
    assert row.ready_cpu_s is not None and row.ready_cpu_s > 0  # read from Envoy's /proc
    assert row.reload_s is not None, "Envoy never held the added cluster's endpoints"
    # pairs: 20 clusters, the fallback, 20 x 19 aggregates; the pools: one cluster.
    assert row.envoy_clusters == (20 + 1 + 20 * 19 if design == "pairs" else 1)

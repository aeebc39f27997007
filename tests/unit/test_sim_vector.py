"""The simulator's numpy placement is the core's rendezvous placement, key by key."""

from __future__ import annotations

import random

import numpy as np
import pytest

from extproc.core.keys import KeySource, hash_key
from extproc.core.placement import Rendezvous, mix64
from extproc.sim.vector import EpochTables, mix64_np, ranking, restrict


def _points(n: int, seed: int) -> np.ndarray:
    rng = random.Random(seed)
    # Spread over the whole 64-bit range, including the top bit numpy must not sign-extend.
    return np.array([rng.getrandbits(64) for _ in range(n)], dtype=np.uint64)


def test_mix64_matches_the_core_on_edge_and_random_values() -> None:
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, *(_points(2000, 1).tolist())]
    got = mix64_np(np.array(values, dtype=np.uint64)).tolist()
    assert got == [mix64(v) for v in values]


@pytest.mark.parametrize("clusters", [2, 8, 64, 257])
@pytest.mark.parametrize("weighted", [False, True], ids=["equal-weights", "weighted"])
def test_vectorised_top2_equals_rendezvous_top2(clusters: int, weighted: bool) -> None:
    names = [f"c{i + 1}" for i in range(clusters)]
    wrng = random.Random(clusters)
    weights = [wrng.choice([0.7, 1.0, 1.5]) if weighted else 1.0 for _ in names]
    if weighted and len(set(weights)) == 1:
        weights[0] = 2.0  # make sure the logarithmic path is the one under test
    core = Rendezvous(tuple(names), tuple(weights))
    points = _points(3000, clusters)
    table = ranking(points, names, weights, depth=2)
    for p, row in zip(points.tolist(), table.tolist(), strict=True):
        placement = core.top2(p)
        assert names[row[0]] == placement.primary
        expected_secondary = placement.secondary
        assert (names[row[1]] if clusters > 1 else None) == expected_secondary


@pytest.mark.parametrize("weighted", [False, True], ids=["equal-weights", "weighted"])
def test_vectorised_ranking_is_the_core_preference_order(weighted: bool) -> None:
    names = [f"c{i + 1}" for i in range(32)]
    weights = [1.0 + (i % 3) * 0.5 if weighted else 1.0 for i in range(32)]
    core = Rendezvous(tuple(names), tuple(weights))
    points = _points(1500, 7)
    table = ranking(points, names, weights, depth=6)
    for p, row in zip(points.tolist(), table.tolist(), strict=True):
        assert [names[c] for c in row] == core.ranked(p)[:6]


def test_session_points_come_from_the_gateway_key_function() -> None:
    # The simulator places sessions by the point the gateway derives from x-session-id.
    names = [f"c{i + 1}" for i in range(16)]
    labels = [f"trace-{i}" for i in range(500)]
    points = np.array([hash_key(KeySource.HEADER, s.encode()).point for s in labels], np.uint64)
    table = ranking(points, names, [1.0] * 16, depth=2)
    core = Rendezvous(tuple(names), (1.0,) * 16)
    for label, row in zip(labels, table.tolist(), strict=True):
        key = hash_key(KeySource.HEADER, label.encode())
        assert names[row[0]] == core.top2(key.point).primary


def test_an_epoch_without_some_clusters_equals_rendezvous_over_the_members() -> None:
    names = [f"c{i + 1}" for i in range(20)]
    members = np.ones(20, dtype=bool)
    members[[3, 11]] = False
    points = _points(2000, 3)
    tables = EpochTables(points, names, [1.0] * 20, [np.ones(20, dtype=bool), members], depth=3)
    subset = Rendezvous(tuple(n for n, m in zip(names, members, strict=True) if m), (1.0,) * 18)
    for p, row in zip(points.tolist(), tables.tables[1].tolist(), strict=True):
        placement = subset.top2(p)
        assert (names[row[0]], names[row[1]]) == (placement.primary, placement.secondary)
        assert [names[c] for c in row] == subset.ranked(p)[:3]


def test_restrict_pads_rows_that_run_out_of_members() -> None:
    rank = np.array([[0, 1, 2]], dtype=np.int16)
    members = np.array([False, True, False])
    assert restrict(rank, members, 2).tolist() == [[1, -1]]


@pytest.mark.parametrize("n", [16, 64])
def test_adding_or_removing_one_cluster_moves_about_one_nth_of_sessions(n: int) -> None:
    names = [f"c{i + 1}" for i in range(n + 1)]
    base = np.zeros(n + 1, dtype=bool)
    base[:n] = True
    added = np.ones(n + 1, dtype=bool)
    removed = base.copy()
    removed[0] = False
    tables = EpochTables(_points(40_000, n), names, [1.0] * (n + 1), [base, added, removed], 2)
    # Binomial noise at 40k sessions is under 3% of 1/N at these sizes; 10% is > 3 sigma.
    assert tables.moved(0, 1) == pytest.approx(1 / (n + 1), rel=0.1)
    assert tables.moved(0, 2) == pytest.approx(1 / n, rel=0.1)
    # The sessions a removal moves go exactly to their old secondary (the planned failover).
    moved = tables.tables[0][:, 0] != tables.tables[2][:, 0]
    assert (tables.tables[2][moved, 0] == tables.tables[0][moved, 1]).all()

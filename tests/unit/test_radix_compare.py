"""The approximate radix-tree router the chain key is compared with (extproc.bench.radix)."""

from __future__ import annotations

from collections import Counter

from extproc.bench.radix import RadixParams, RadixRouter, bounded_placement, compare
from extproc.core.placement import Rendezvous
from extproc.harness.layouts import LayoutConfig, generate_layout

NAMES = ("c1", "c2", "c3", "c4")


def test_longest_prefix_wins_above_the_threshold_else_the_smallest_tree() -> None:
    router = RadixRouter(NAMES, RadixParams(grain=8))
    a = router.route("alpha " * 40, 0.0)
    b = router.route("bravo " * 40, 0.1)
    assert a != b  # no match: the smallest (empty) tree, not the one already holding text
    assert router.route("alpha " * 40 + "and a follow-up", 0.2) == a
    assert router.route("bravo " * 40 + "more", 0.3) == b
    # Below the threshold (a short shared start of a long text): the smallest tree again.
    assert router.route("alpha " * 2 + "x" * 2000, 0.4) not in (a, b)


def test_imbalance_sends_to_the_least_loaded_worker() -> None:
    params = RadixParams(grain=8, balance_abs_threshold=2, balance_rel_threshold=1.5)
    router = RadixRouter(NAMES, params)
    text = "shared opening " * 30
    placed = [router.route(text + str(i), 0.0) for i in range(12)]
    assert len(set(placed)) > 1  # the match would keep them on one worker; the load does not


def test_the_comparison_judges_every_router_on_the_same_requests() -> None:
    requests = generate_layout(LayoutConfig(layout="first-user", conversations=40, turns=2))
    rows = {row.router: row for row in compare(requests, 4)}
    assert set(rows) == {
        "chain key",
        "chain key, new keys bounded at 1.1x mean",
        "opening key",
        "per-conversation hash",
        "radix tree, sgl-router defaults",
        "radix tree, balance abs 4",
    }
    # The old key collapses a shared first-user opening onto one cluster; the chain key does not.
    assert rows["opening key"].max_mean == 4.0
    assert rows["chain key"].max_mean < 2.0
    assert rows["chain key"].later_on_first == 1.0
    assert all(0.0 <= row.hit_vs_ideal <= 1.0 for row in rows.values())


def test_bounded_placement_caps_new_keys_and_keeps_every_key_where_it_started() -> None:
    placer = Rendezvous.of([(n, 1.0) for n in NAMES])
    # Four heavy keys (20 requests each) and 200 one-request keys, interleaved.
    points = [1_000 + k for _ in range(20) for k in range(4)]
    points = [p for pair in zip(points, range(200), strict=False) for p in pair] + list(
        range(80, 200)
    )
    placed = bounded_placement(points, placer, len(NAMES), 1.1)
    where: dict[int, str] = {}
    for point, cluster in zip(points, placed, strict=True):
        assert where.setdefault(point, cluster) == cluster  # a key never moves
    counts = Counter(placed)
    assert max(counts.values()) <= 1.1 * len(points) / len(NAMES) + 20  # one key's overshoot
    # Unbounded, the hash alone: a key's first cluster is its rendezvous primary.
    free = bounded_placement(points, placer, len(NAMES), float("inf"))
    assert free == [placer.ranked(p)[0] for p in points]

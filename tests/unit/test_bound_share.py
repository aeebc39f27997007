"""The share bound judged from the load table's kept totals (LoadTable.share, the
``share`` argument of extproc.core.affinity.place_bounded) decides exactly as the full ranking
and snapshot do, on random fleets: sizes 1-512, random decayed counts, unhealthy clusters
(failing over, no ready endpoint), a LoRA adapter's loaded tier, overrides, seen and new
sessions."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.affinity import (
    AffinityParams,
    Decision,
    Override,
    RecentShare,
    SessionView,
    Shortcut,
    place_bounded,
    share_verdict,
)
from extproc.core.load import ClusterLoad, LoadReport
from extproc.core.models import Candidates
from extproc.core.placement import HEAD_MIN_CLUSTERS, Rendezvous
from extproc.pipeline.fleet_state import MAX_TOTALS, RESYNC_UPDATES, LoadTable

HALF_LIFE = 60.0


def _decide(
    load: LoadTable,
    placer: Candidates,
    point: int,
    session: SessionView,
    now: float,
    params: AffinityParams,
    ready: frozenset[str] | None,
    with_share: bool,
) -> Decision:
    """place_bounded fed as pipeline.Pipeline._follow_override feeds it."""
    within = len(placer.preferred.names) if placer.preferred is not None else None
    tier = placer.preferred if placer.preferred is not None else placer.rest
    assert tier is not None
    members = tier.names

    def order() -> list[str]:
        return placer.ranked(point)

    def loads():  # type: ignore[no-untyped-def]
        return load.snapshot(order(), now, ready, HALF_LIFE)

    def share(cluster: str) -> RecentShare | None:
        return load.share(members, cluster, now, ready, HALF_LIFE)

    def head(k: int) -> list[str]:
        return placer.ranked_head(point, k)

    def cluster(name: str) -> ClusterLoad:
        return load.cluster(name, now, ready, HALF_LIFE)

    def recent(name: str) -> float:
        return load.recent(name, now, HALF_LIFE)

    def first_within(low: float, high: float) -> tuple[str | None, bool]:
        assert tier is not None
        return load.first_within(tier, point, now, HALF_LIFE, low, high)

    kept = first_within if len(members) >= HEAD_MIN_CLUSTERS else None
    shortcut = Shortcut(share, head, cluster, len(placer.names), recent, kept)
    return place_bounded(
        placer.top2(point),
        placer.names,
        order,
        loads,
        session,
        now,
        params,
        within,
        shortcut if with_share else None,
    )


@st.composite
def fleets(draw: st.DrawFn) -> tuple[LoadTable, Candidates, frozenset[str] | None, float]:
    n = draw(st.one_of(st.integers(1, 8), st.integers(1, 16), st.sampled_from([64, 256, 512])))
    names = tuple(f"c{i:03d}" for i in range(n))
    loaded = draw(st.integers(0, n))
    tier = names[:loaded] if draw(st.booleans()) else ()
    rest = [c for c in names if c not in tier]
    placer = Candidates(
        Rendezvous.of([(c, 1.0) for c in tier]) if tier else None,
        Rendezvous.of([(c, 1.0) for c in rest]) if rest else None,
    )
    load = LoadTable()
    now = 1000.0
    # Decayed counts: placements at increasing instants, or all at one instant (whole counts:
    # a cluster's count can sit exactly on the limit).
    steps = [0.0] if draw(st.booleans()) else [0.0, 0.0, 0.5, 7.0, 90.0]
    if draw(st.booleans()):
        # Every cluster counted (the bound's steady state: most clusters near the limit, a
        # spill searches far down the hash order).
        rng = random.Random(draw(st.integers(0, 2**32)))
        for cluster in names:
            for _ in range(rng.randint(0, 6)):
                load.placed(cluster, now, HALF_LIFE)
    for _ in range(draw(st.integers(0, 60))):
        now += draw(st.sampled_from(steps))
        cluster = names[draw(st.integers(0, n - 1))]
        for _ in range(draw(st.integers(1, 40))):
            load.placed(cluster, now, HALF_LIFE)
    for _ in range(draw(st.integers(0, 2))):
        failing = names[draw(st.integers(0, n - 1))]
        load.mark_failing(failing, now + draw(st.sampled_from([-1.0, 0.0, 5.0])))
    # KV pressure reports: a pressured cluster is no spill's secondary.
    for _ in range(draw(st.integers(0, 3))):
        pressured = names[draw(st.integers(0, n - 1))]
        load.record(pressured, LoadReport(0.95, None, None, None, "fleet"), now)
    ready = None
    if draw(st.booleans()):
        dropped = set(draw(st.lists(st.sampled_from(names), max_size=3)))
        ready = frozenset(c for c in names if c not in dropped)
    return load, placer, ready, now + draw(st.sampled_from([0.0, 0.0, 0.25, 30.0]))


@settings(derandomize=True, database=None, max_examples=500, deadline=None)
@given(
    fleets(),
    st.integers(0, 2**64 - 1),
    st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0, 3.0]),
    st.booleans(),
    st.sampled_from([None, "hash", "other", "expired"]),
    st.sampled_from([None, None, 0.0, 2e-16, -2e-16, 1e-12, -1e-12, 1e-9, -1e-9, 1e-3, -1e-3]),
    st.booleans(),
    st.integers(0, 3),
)
def test_the_kept_totals_decide_as_the_full_snapshot(
    fleet: tuple[LoadTable, Candidates, frozenset[str] | None, float],
    point: int,
    factor: float,
    seen: bool,
    override: str | None,
    near: float | None,
    press_primary: bool,
    near_rank: int,
) -> None:
    load, placer, ready, now = fleet
    if press_primary:
        # A spill's secondary is then not the hash primary (the first candidate in hash order).
        pressed = LoadReport(0.95, None, None, None, "fleet")
        load.record(placer.top2(point).primary, pressed, now)
    if near is not None:
        # The factor that puts the hash primary's next request on the limit (times 1 + near):
        # the verdicts rounding could flip.
        members = placer.preferred.names if placer.preferred is not None else placer.names
        total = sum(load.recent(n, now, HALF_LIFE) for n in members)
        # On the limit: the hash primary, or a later candidate a spill would consider.
        ranking = placer.ranked(point)
        mine = load.recent(ranking[min(near_rank, len(ranking) - 1)], now, HALF_LIFE)
        factor = (mine + 1.0) * len(members) / (total + 1.0) * (1.0 + near)
    params = AffinityParams(balance_factor=factor, new_session_ttl_s=60.0, override_ttl_s=300.0)
    kept = None
    if override is not None:
        target = placer.names[-1] if override == "other" else placer.top2(point).primary
        kept = Override(target, now - 1.0 if override == "expired" else now + 100.0)
    session = SessionView(seen=seen, override=kept)
    # Twice: the first read sums the totals exactly, the second decays the kept total.
    for _ in range(2):
        old = _decide(load, placer, point, session, now, params, ready, with_share=False)
        new = _decide(load, placer, point, session, now, params, ready, with_share=True)
        assert new == old


def test_an_incrementally_kept_total_matches_the_exact_sum() -> None:
    names = tuple(f"c{i:03d}" for i in range(64))
    load = LoadTable()
    now = 0.0
    assert load.share(names, "c000", now, None, HALF_LIFE) == RecentShare(0.0, 0.0, 64)
    for i in range(RESYNC_UPDATES + 50):
        now += 0.01 * (i % 7)
        load.placed(names[(i * 13) % 64], now, HALF_LIFE)
        if i % 997 == 0:
            known = load.share(names, "c005", now, None, HALF_LIFE)
            assert known is not None
            exact = sum(load.recent(n, now, HALF_LIFE) for n in names)
            assert abs(known.total - exact) <= 1e-12 * exact
            assert known.recent == load.recent("c005", now, HALF_LIFE)


def test_overlapping_and_evicted_lists_keep_exact_totals_through_placements() -> None:
    """A placement brings up to date only the kept totals its cluster is a member of; every
    list's total still equals its members' exact sum, through overlapping lists, more lists
    than are kept (the oldest dropped and summed again when asked), and a new half-life."""
    rng = random.Random(3)
    clusters = [f"c{i}" for i in range(12)]
    lists = [tuple(rng.sample(clusters, rng.randint(1, 12))) for _ in range(MAX_TOTALS + 8)]
    load = LoadTable()
    now, half_life = 0.0, HALF_LIFE
    for step in range(3000):
        now += rng.uniform(0.0, 0.5)
        if step == 2000:
            half_life = HALF_LIFE / 4
        load.placed(rng.choice(clusters), now, half_life)
        if step % 7 == 0:
            names = rng.choice(lists)
            known = load.share(names, names[0], now, None, half_life)
            assert known is not None
            exact = sum(load.recent(n, now, half_life) for n in names)
            assert abs(known.total - exact) <= 1e-9 * max(exact, 1.0)


def test_an_unhealthy_member_or_out_of_order_instants_leave_it_to_the_exact_path() -> None:
    names = ("a", "b", "c")
    load = LoadTable()
    load.placed("a", 10.0, HALF_LIFE)
    assert load.share(names, "a", 10.0, None, HALF_LIFE) is not None
    assert load.share(names, "a", 9.0, None, HALF_LIFE) is None  # before the latest placement
    assert load.share(names, "a", 10.0, frozenset({"a", "b"}), HALF_LIFE) is None  # c not ready
    load.mark_failing("b", 20.0)
    assert load.share(names, "a", 15.0, None, HALF_LIFE) is None
    assert load.share(names, "a", 20.0, None, HALF_LIFE) is not None  # b healthy again


def test_a_verdict_within_rounding_of_the_limit_is_not_taken() -> None:
    # Limit 1.0 x (3 + 1) / 4 = 1.0: recent 0 + 1 sits on it (the exact judge: not over).
    assert share_verdict(RecentShare(0.0, 3.0, 4), 1.0) is None
    assert share_verdict(RecentShare(0.0, 3.0 + 1e-12, 4), 1.0) is None
    assert share_verdict(RecentShare(0.0, 3.1, 4), 1.0) is False
    assert share_verdict(RecentShare(0.0, 2.9, 4), 1.0) is True


@settings(derandomize=True, database=None, max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2, 5, 47, 48, 64, 300, 512]),
    st.integers(0, 2**64 - 1),
    st.integers(1, 600),
    st.booleans(),
    st.integers(0, 8),
)
def test_the_head_of_the_ranking_is_the_rankings_own(
    n: int, point: int, k: int, weighted: bool, loaded: int
) -> None:
    names = tuple(f"c{i:03d}" for i in range(n))
    weights = [float(1 + i % 4) if weighted else 1.0 for i in range(n)]
    placer = Rendezvous(names, tuple(weights))
    assert placer.ranked_head(point, k) == placer.ranked(point)[:k]
    # first_of: the first of the ranking among a set of lanes (every k-th lane, or none).
    lanes = np.array([i % k == 0 for i in range(n)]) if k <= n else np.zeros(n, dtype=bool)
    chosen = {names[i] for i in range(n) if lanes[i]}
    expected = next((c for c in placer.ranked(point) if c in chosen), None)
    assert placer.first_of(point, lanes) == expected
    tier = names[: min(loaded, n)]
    rest = names[len(tier) :]
    both = Candidates(
        Rendezvous.of([(c, 1.0) for c in tier]) if tier else None,
        Rendezvous.of([(c, 1.0) for c in rest]) if rest else None,
    )
    assert both.ranked_head(point, k) == both.ranked(point)[:k]


def test_the_first_candidate_on_the_limit_is_left_to_the_exact_path() -> None:
    names = tuple(f"c{i:03d}" for i in range(64))
    placer = Rendezvous.of([(c, 1.0) for c in names])
    point = 12345
    first = placer.ranked(point)[0]
    load = LoadTable()
    for name in names:
        for _ in range(3 if name == first else 5):
            load.placed(name, 10.0, HALF_LIFE)
    assert load.share(placer.names, first, 10.0, None, HALF_LIFE) is not None
    # count + 1: 4 on the first candidate in hash order, 6 on every other.
    assert load.first_within(placer, point, 10.0, HALF_LIFE, 4.5, 4.6) == (first, True)
    assert load.first_within(placer, point, 10.0, HALF_LIFE, 3.9, 4.1) == (first, False)
    assert load.first_within(placer, point, 10.0, HALF_LIFE, 3.0, 3.5) == (None, True)
    # Later placements reach the arrays: the first candidate (now 6) and the second (now 7)
    # are over 6.6, so the third in hash order is the first within.
    ranking = placer.ranked(point)
    for name in (first, first, first, ranking[1], ranking[1]):
        load.placed(name, 10.0, HALF_LIFE)
    assert load.first_within(placer, point, 10.0, HALF_LIFE, 6.5, 6.6) == (ranking[2], True)

"""Engine choice inside a cluster (core/endpoints.py): the cluster properties, one level down.

Points are random 64-bit values from a seeded Random: the session digest is a uniform hash.
"""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest

from extproc.core.endpoints import (
    adapter_engines,
    endpoint_order,
    engine_cap,
    pick_endpoints,
    pick_engine,
)

SESSIONS = 20_000


@functools.cache
def points(n: int = SESSIONS, seed: int = 7) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.getrandbits(64) for _ in range(n))


def engines(m: int, cluster: str = "c1") -> tuple[str, ...]:
    return tuple(f"{cluster}-e{i}.svc:8000" for i in range(m))


def choose(eps: tuple[str, ...], ready: frozenset[str] | None = None) -> list[str]:
    ready = frozenset(eps) if ready is None else ready
    out = [pick_engine(p, eps, ready) for p in points()]
    assert None not in out
    return [e for e in out if e is not None]


@pytest.mark.parametrize("m", [2, 3, 4, 8])
def test_sessions_spread_evenly_over_engines(m: int) -> None:
    counts = Counter(choose(engines(m)))
    assert len(counts) == m
    mean = SESSIONS / m
    assert max(counts.values()) / mean < 1.06, counts


def test_choice_is_sticky_and_independent_of_config_order() -> None:
    eps = engines(4)
    first = choose(eps)
    assert choose(eps) == first
    assert choose(tuple(reversed(eps))) == first


@pytest.mark.parametrize("m", [3, 4, 8])
def test_adding_an_engine_moves_about_one_in_m_plus_one_all_to_it(m: int) -> None:
    before = choose(engines(m))
    grown = engines(m + 1)
    after = choose(grown)
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert {b for _, b in moved} == {grown[-1]}  # nobody moves between the old engines
    share = len(moved) / SESSIONS
    assert abs(share - 1 / (m + 1)) < 0.02, share


@pytest.mark.parametrize("m", [3, 4, 8])
def test_an_unready_engine_sends_each_session_to_one_other_engine(m: int) -> None:
    eps = engines(m)
    before = choose(eps)
    down = eps[0]
    ready = frozenset(eps) - {down}
    after = choose(eps, ready)
    moved = Counter()
    for a, b in zip(before, after, strict=True):
        if a == down:
            assert b != down
            moved[b] += 1
        else:
            assert a == b  # only the down engine's sessions move
    share = sum(moved.values()) / SESSIONS
    assert abs(share - 1 / m) < 0.02, share
    # Each of its sessions goes to its own runner-up: the set of them spreads over the others,
    # while every single session lands on ONE engine turn after turn (choose() is a function).
    assert len(moved) == m - 1
    assert max(moved.values()) / (sum(moved.values()) / (m - 1)) < 1.15, moved
    assert choose(eps, ready) == after
    # Back: every session returns to its first engine.
    assert choose(eps) == before


@pytest.mark.parametrize(("m", "balance"), [(3, 1.25), (4, 1.25), (4, 1.1), (8, 1.5)])
def test_bounded_load_caps_every_engine_even_for_one_hot_session(m: int, balance: float) -> None:
    eps = engines(m)
    ready = frozenset(eps)
    rng = random.Random(3)
    inflight: Counter[str] = Counter()
    hot = points()[0]
    for step in range(3_000):
        # Half the arrivals are one hot session; requests finish at random.
        point = hot if step % 2 else rng.choice(points())
        cap = engine_cap(sum(inflight.values()), m, balance)
        chosen = pick_engine(point, eps, ready, inflight, balance)
        assert chosen is not None
        inflight[chosen] += 1
        assert inflight[chosen] <= cap
        if inflight and rng.random() < 0.45:
            done = rng.choice(sorted(e for e, n in inflight.items() if n))
            inflight[done] -= 1
    assert max(inflight.values()) <= engine_cap(sum(inflight.values()) - 1, m, balance)


def test_bounded_load_spills_to_the_sessions_runner_up_in_the_same_cluster() -> None:
    eps = engines(4)
    ready = frozenset(eps)
    point = points()[5]
    order = endpoint_order(point, eps)
    full = {order[0]: 10}  # its engine holds everything in flight: over ⌈1.25 · 11 / 4⌉ = 4
    assert pick_engine(point, eps, ready, full, 1.25) == order[1]
    # Under the cap, or without a balance factor, it stays on its own engine.
    assert pick_engine(point, eps, ready, {order[0]: 1, order[1]: 2}, 1.25) == order[0]
    assert pick_engine(point, eps, ready, full, None) == order[0]


def test_engine_cap_always_leaves_room() -> None:
    for m in range(1, 9):
        for n in range(0, 50):
            for c in (1.0, 1.1, 1.25, 2.0):
                assert engine_cap(n, m, c) * m >= n + 1


def test_pick_endpoints_primary_engine_then_secondary_engine_both_sticky() -> None:
    eps = {"c1": engines(3, "c1"), "c2": engines(3, "c2"), "c3": engines(3, "c3")}
    ready = frozenset(e for es in eps.values() for e in es)
    point = points()[11]
    picked = pick_endpoints(point, ["c2", "c1", "c3"], eps, ready)
    assert picked == [endpoint_order(point, eps["c2"])[0], endpoint_order(point, eps["c1"])[0]]
    # The primary's engine down: another engine of the primary, not the secondary cluster.
    down = picked[0]
    less = ready - {down}
    again = pick_endpoints(point, ["c2", "c1", "c3"], eps, less)
    assert again[0] in eps["c2"] and again[0] != down
    assert again[1] == picked[1]
    # The whole primary down: the secondary's own sticky engine first, then the third cluster's.
    without_c2 = ready - set(eps["c2"])
    failover = pick_endpoints(point, ["c2", "c1", "c3"], eps, without_c2)
    assert failover == [picked[1], endpoint_order(point, eps["c3"])[0]]


def test_no_ready_engine_gives_none() -> None:
    assert pick_engine(1, engines(3), frozenset()) is None
    assert pick_endpoints(1, ["c1"], {"c1": engines(3)}, frozenset()) == []


def test_an_adapters_sessions_prefer_its_loaded_engines_until_they_are_full() -> None:
    eps = engines(4)
    ready = frozenset(eps)
    loaded = frozenset(eps[1:3])
    # Lightly loaded: every session lands on a loaded engine, spread over both, each sticky.
    chosen = [pick_engine(p, eps, ready, {}, 1.25, 4, loaded) for p in points()[:2_000]]
    counts = Counter(chosen)
    assert set(counts) == set(loaded), counts
    assert max(counts.values()) / (len(chosen) / 2) < 1.1, counts
    again = [pick_engine(p, eps, ready, {}, 1.25, 4, loaded) for p in points()[:2_000]]
    assert again == chosen
    # A session's own order within the loaded ones is its rendezvous order.
    point = points()[9]
    first_loaded = [e for e in endpoint_order(point, eps) if e in loaded]
    assert pick_engine(point, eps, ready, None, None, 1, loaded) == first_loaded[0]
    # Its loaded engines full (bounded load over all four): the next in its order, loaded
    # ones first; one of them not ready: the other loaded one.
    full = dict.fromkeys(loaded, 10)
    unloaded = [e for e in endpoint_order(point, eps) if e not in loaded]
    assert pick_engine(point, eps, ready, full, 1.25, 4, loaded) == unloaded[0]
    assert (
        pick_engine(point, eps, ready - {first_loaded[0]}, {}, 1.25, 4, loaded) == (first_loaded[1])
    )
    # No loaded engine ready: the plain rendezvous choice.
    assert pick_engine(point, eps, ready - loaded, {}, 1.25, 4, loaded) == unloaded[0]
    # pick_endpoints passes the preference to each cluster's choice.
    both = {"c1": eps, "c2": engines(2, "c2")}
    picked = pick_endpoints(
        point, ["c1", "c2"], both, ready | set(both["c2"]), 2, {}, 1.25, 4, loaded
    )
    assert picked[0] == first_loaded[0]
    assert picked[1] == endpoint_order(point, both["c2"])[0]


def test_an_engine_signal_never_takes_a_session_out_of_its_cluster() -> None:
    # The engine-level rule (SIMULATION.md "Engine-level spill"): a full engine spills to
    # another engine of the same cluster; leaving the cluster is the cluster-level decision
    # (core.affinity), not the engine choice's. Every engine of the primary far over any cap:
    # the primary's engine still comes first, the secondary's second.
    eps = {"c1": engines(3, "c1"), "c2": engines(3, "c2")}
    ready = frozenset(e for es in eps.values() for e in es)
    loads = dict.fromkeys(eps["c1"], 50)
    for point in points()[:200]:
        picked = pick_endpoints(point, ["c1", "c2"], eps, ready, 2, loads, 1.25, 4)
        assert picked[0] in eps["c1"] and picked[1] in eps["c2"]


def test_route_mode_names_an_adapters_loaded_engine_then_the_failovers() -> None:
    eps = {"c1": engines(3, "c1"), "c2": engines(3, "c2")}
    ready = frozenset(e for es in eps.values() for e in es)
    loaded = frozenset({eps["c1"][1], eps["c1"][2], eps["c2"][0]})
    for point in points()[:300]:
        named = adapter_engines(point, "c1", "c2", eps, loaded, ready, {}, 1.25, 4)
        # The primary's loaded engine first (the session's own among the two), then the
        # secondary's, its loaded one first: the retry's host.
        mine = next(e for e in endpoint_order(point, eps["c1"]) if e in loaded)
        assert named == (mine, eps["c2"][0]), (point, named)
        assert adapter_engines(point, "c1", "c2", eps, loaded, ready, {}, 1.25, 4) == named
    point = points()[3]
    # No loaded engine ready in the primary: nothing named (the pair and the hash decide),
    # even though the secondary has one.
    assert adapter_engines(point, "c1", "c2", eps, loaded, ready - loaded, {}, 1.25, 4) == ()
    assert adapter_engines(point, "c2", "c1", eps, frozenset(eps["c1"]), ready) == ()
    # No secondary, or none of its engines ready: the primary's next engine is the retry's.
    alone = adapter_engines(point, "c1", None, eps, loaded, ready)
    assert alone[0] in loaded and alone[1] in loaded and alone[0] != alone[1]
    down = ready - set(eps["c2"])
    assert adapter_engines(point, "c1", "c2", eps, loaded, down)[1] in eps["c1"]
    # Only one engine in all: one name.
    assert adapter_engines(point, "c1", None, eps, loaded, {eps["c1"][1]}) == (eps["c1"][1],)
    # Bounded load among the primary's loaded engines: the session's own full, the other one.
    first = adapter_engines(point, "c1", "c2", eps, loaded, ready)[0]
    other = next(e for e in loaded if e in eps["c1"] and e != first)
    full = {first: 10}
    assert adapter_engines(point, "c1", "c2", eps, loaded, ready, full, 1.25, 4)[0] == other

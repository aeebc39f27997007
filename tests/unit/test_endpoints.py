"""Engine choice inside a cluster (core/endpoints.py): the cluster properties, one level down.

Points are random 64-bit values from a seeded Random: the session digest is a uniform hash.
"""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest

from extproc.core.endpoints import (
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

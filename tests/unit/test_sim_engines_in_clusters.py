"""The fleet simulator's clusters of several engines (extproc/sim/engines.py): one KV cache per
engine, so a session's cache follows it only when it sticks to one engine."""

from __future__ import annotations

import random

from extproc.core.endpoints import pick_engine
from extproc.sim.engines import EngineCluster, cluster_state, engine_spec
from extproc.sim.model import ClusterSpec, ClusterState

BLOCK = 16


def spec(engines: int) -> ClusterSpec:
    return ClusterSpec(
        name="c1",
        profile="balanced",
        prefill_tps=40_000.0,
        kv_capacity_tokens=400_000,
        decode_tps=50.0,
        lanes=8,
        max_concurrency=64,
        weight=1.0,
        engines=engines,
    )


def conversations(n: int, turns: int, seed: int = 1) -> list[tuple[int, list[int]]]:
    """(session point, block keys of the turn's prompt) in arrival order: every session's turn
    t re-sends its earlier turns' blocks and adds 8 new ones."""
    rng = random.Random(seed)
    points = [rng.getrandbits(64) for _ in range(n)]
    out = []
    for t in range(1, turns + 1):
        for s, point in enumerate(points):
            out.append((point, [s * 1_000 + k for k in range(8 * t)]))
    return out


def cached_share(state: ClusterState, requests: list[tuple[int, list[int]]]) -> float:
    cached = total = 0
    now = 0.0
    for point, keys in requests:
        now += 0.01
        got, _first, _done = state.serve(keys, len(keys) * BLOCK, 1, now, point)
        cached += got
        total += len(keys) * BLOCK
    return cached / total


def test_engine_specs_share_the_cluster() -> None:
    parts = [engine_spec(spec(4), i) for i in range(4)]
    assert [p.name for p in parts] == ["c1-e1", "c1-e2", "c1-e3", "c1-e4"]
    assert sum(p.kv_capacity_tokens for p in parts) == 400_000
    assert sum(p.prefill_tps for p in parts) == 40_000.0
    assert all(p.lanes == 2 and p.max_concurrency == 16 and p.engines == 1 for p in parts)
    assert type(cluster_state(spec(1), BLOCK)) is ClusterState
    assert isinstance(cluster_state(spec(4), BLOCK), EngineCluster)


def test_sticky_engines_keep_the_cache_round_robin_loses_most_of_it() -> None:
    requests = conversations(61, 6)  # 61: round robin shifts each session by one engine a turn
    one_cache = cached_share(ClusterState(spec(1), BLOCK), requests)
    sticky = cached_share(EngineCluster(spec(4), BLOCK, sticky=True), requests)
    spray = cached_share(EngineCluster(spec(4), BLOCK, sticky=False), requests)
    # Turn t of a session finds its first t-1 turns cached: (0+1+...+5)/(1+...+6) = 15/21.
    assert abs(one_cache - 15 / 21) < 0.01
    assert abs(sticky - one_cache) < 0.01  # each session on one engine: as good as one cache
    # Round robin: a session's turn lands on the engine that served its turn 4 requests ago
    # only by chance, so most of its history is on other engines.
    assert spray < 0.5 * sticky, (spray, sticky)


def test_sticky_choice_is_the_processors() -> None:
    cluster = EngineCluster(spec(3), BLOCK, sticky=True, balance=None)
    point = 0x1234_5678_9ABC_DEF0
    chosen = cluster.choose(point, 0.0)
    expected = pick_engine(point, cluster.engine_names, cluster.engine_names)
    assert cluster.engine_names[chosen] == expected

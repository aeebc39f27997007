"""Relief of a hot cluster (GPU over a threshold; with affinity off, scraped KV use at
kv_migrate_threshold): which of its sessions leave, least active first (extproc.core.relief),
the shell's table of who is where (extproc.pipeline.relief) and since when a cluster is hot
(extproc.pipeline.fleet_state), what placement makes of it with affinity off (place_bounded,
flow control's placement) and on (place), and the pipeline wiring with the product default
(affinity off)."""

from __future__ import annotations

import random
import time
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.core.affinity import (
    AffinityParams,
    Decision,
    Override,
    SessionView,
    place,
    place_bounded,
)
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.keys import KeySource
from extproc.core.load import ClusterLoad, FleetSnapshot, LoadReport
from extproc.core.placement import Placement
from extproc.core.relief import (
    ReliefParams,
    SessionActivity,
    cool_first,
    cool_secondary,
    rounds_due,
    to_move,
)
from extproc.ledger.gate import build_gate
from extproc.pipeline.explain import hot_candidates
from extproc.pipeline.fleet_state import LoadTable
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from extproc.pipeline.relief import ReliefTable

RELIEF = ReliefParams(move_after_s=10.0, move_fraction=0.25)


def act(key: str, last_seen: float, requests: float) -> SessionActivity:
    return SessionActivity(key.encode(), last_seen, requests)


# -- the pure rule ---------------------------------------------------------------------------


def test_rounds_come_once_the_cluster_has_stayed_hot_and_every_period_after() -> None:
    assert rounds_due(100.0, 109.9, RELIEF) == 0  # a blip moves nothing
    assert rounds_due(100.0, 110.0, RELIEF) == 1
    assert rounds_due(100.0, 135.0, RELIEF) == 3
    assert rounds_due(100.0, 135.0, ReliefParams(10.0, 0.0)) == 0  # relief off


def test_a_round_moves_the_least_active_fraction_and_keeps_the_most_active() -> None:
    now = 200.0
    sessions = [
        act("busy", 199.0, 12.0),  # many recent requests
        act("quiet", 120.0, 3.0),  # seen long ago: its count has decayed to almost nothing
        act("steady", 195.0, 4.0),
        act("once", 198.0, 1.0),
    ]
    moved = to_move(sessions, "hot", 1, now, RELIEF)
    # 4 x 0.75 = 3 stay: the one that leaves is the one whose cache is most likely gone.
    assert moved == {b"quiet"}
    two_rounds = to_move(sessions, "hot", 2, now, RELIEF)  # 4 x 0.75^2 = 2.25: 2 stay
    assert two_rounds == {b"quiet", b"once"}


def test_equal_activity_leaves_the_older_last_request_first() -> None:
    sessions = [act("new", 100.0, 1.0), act("old", 100.0, 1.0)]
    # Same count at the same instant: the key breaks the tie, deterministically.
    assert to_move(sessions, "hot", 1, 100.0, RELIEF) == {b"new"}
    # An older request that decayed to the same activity as a newer one with more requests.
    older = [act("a", 90.0, 2.0), act("b", 100.0, 1.0)]
    assert to_move(older, "hot", 1, 100.0, RELIEF) == {b"a"}


def test_relief_never_empties_a_cluster_at_hot_and_does_at_critical() -> None:
    alone = [act("only", 100.0, 1.0)]
    assert to_move(alone, "hot", 50, 100.0, RELIEF) == frozenset()
    pair = [act("a", 100.0, 1.0), act("b", 100.0, 5.0)]
    assert to_move(pair, "hot", 50, 100.0, RELIEF) == {b"a"}
    assert to_move(pair, "critical", 1, 100.0, RELIEF) == {b"a", b"b"}
    assert to_move(pair, None, 5, 100.0, RELIEF) == frozenset()
    assert to_move(pair, "hot", 0, 100.0, RELIEF) == frozenset()


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.floats(0.0, 100.0), min_size=0, max_size=40),
    rounds=st.integers(0, 12),
    fraction=st.floats(0.0, 1.0),
)
def test_every_mover_is_less_active_than_every_session_that_stays(
    counts: list[float], rounds: int, fraction: float
) -> None:
    params = ReliefParams(10.0, fraction)
    sessions = [act(f"s{i}", 100.0, c) for i, c in enumerate(counts)]
    moved = to_move(sessions, "hot", rounds, 100.0, params)
    stay = [s for s in sessions if s.key not in moved]
    assert len(stay) >= min(1, len(sessions))
    if moved:
        assert max(s.requests for s in sessions if s.key in moved) <= min(s.requests for s in stay)
        # Bounded: never more than the rounds' share (rounded up to one session).
        assert len(moved) <= max(1, len(sessions) - len(sessions) * (1 - fraction) ** rounds + 1)


# -- the shell's table -----------------------------------------------------------------------


def test_the_table_marks_the_least_active_once_a_spell_has_lasted() -> None:
    table = ReliefTable(100)
    for t in (1.0, 2.0, 3.0):
        table.seen("c1", b"busy", t, 600.0, RELIEF)
    table.seen("c1", b"quiet", 1.0, 600.0, RELIEF)
    table.seen("c2", b"elsewhere", 1.0, 600.0, RELIEF)
    assert not table.leaves("c1", b"quiet", "hot", 5.0, 600.0, RELIEF)  # the spell starts
    assert not table.leaves("c1", b"quiet", "hot", 14.9, 600.0, RELIEF)
    # A preview sees the round coming and changes nothing.
    assert table.leaves("c1", b"quiet", "hot", 15.0, 600.0, RELIEF, record=False)
    assert table.leaves("c1", b"quiet", "hot", 15.0, 600.0, RELIEF)
    assert not table.leaves("c1", b"busy", "hot", 15.0, 600.0, RELIEF)
    # Later rounds never take the one session left unmarked.
    assert not table.leaves("c1", b"busy", "hot", 95.0, 600.0, RELIEF)
    # The quiet one moved: it is c2's now and no longer marked anywhere.
    table.seen("c2", b"quiet", 16.0, 600.0, RELIEF)
    assert table.held("c1") == 1 and table.held("c2") == 2
    table.cooled("c1")
    assert not table.in_spell("c1")


def test_a_preview_starts_no_spell() -> None:
    table = ReliefTable(100)
    table.seen("c1", b"a", 1.0, 600.0, RELIEF)
    table.seen("c1", b"b", 1.0, 600.0, RELIEF)
    assert not table.leaves("c1", b"a", "hot", 5.0, 600.0, RELIEF, record=False)
    assert not table.in_spell("c1")


def test_the_table_forgets_sessions_past_their_ttl_and_beyond_its_bound() -> None:
    table = ReliefTable(2)
    table.seen("c1", b"a", 0.0, 60.0, RELIEF)
    table.seen("c1", b"b", 10.0, 60.0, RELIEF)
    table.seen("c1", b"c", 20.0, 60.0, RELIEF)  # over the bound: the oldest goes
    assert len(table) == 2 and table.held("c1") == 2
    table.seen("c1", b"d", 100.0, 60.0, RELIEF)  # b and c expired
    assert len(table) == 1


# -- placement with affinity off (place_bounded) ---------------------------------------------

RANKED = ("c1", "c2", "c3")
HASHED = Placement("c1", "c2")
OFF = AffinityParams(balance_factor=0.0)


def bounded(
    session: SessionView,
    snapshot: FleetSnapshot,
    params: AffinityParams = OFF,
    hot: frozenset[str] | None = None,
    hashed: Placement = HASHED,
) -> Decision:
    if hot is None:
        hot = frozenset(n for n, c in snapshot.clusters.items() if c.gpu)
    return place_bounded(
        hashed, RANKED, lambda: RANKED, lambda: snapshot, session, 100.0, params, hot=hot
    )


HOT_C1 = FleetSnapshot.of({"c1": ClusterLoad(gpu="gpu_memory")})


@pytest.mark.parametrize("params", [OFF, AffinityParams(balance_factor=1.1)])
def test_without_affinity_a_new_session_avoids_a_hot_primary(params: AffinityParams) -> None:
    d = bounded(SessionView(seen=False), HOT_C1, params)
    assert d.kind == "spilled" and d.placement == Placement("c2", "c3")
    assert d.override_to_write == Override("c2", 100.0 + params.override_ttl_s)


def test_without_affinity_a_hot_cluster_is_avoided_like_an_unhealthy_one() -> None:
    both = FleetSnapshot.of(
        {"c1": ClusterLoad(gpu="gpu_temperature"), "c2": ClusterLoad(healthy=False)}
    )
    assert bounded(SessionView(seen=False), both).placement.primary == "c3"
    everywhere = FleetSnapshot.of({n: ClusterLoad(gpu="gpu_memory") for n in RANKED})
    # Nowhere cooler: the hash placement stands (the budget decides, as on a full fleet).
    assert bounded(SessionView(seen=False), everywhere).kind == "primary"


def test_without_affinity_a_hot_secondary_is_not_a_spill_target() -> None:
    # c1 over its share, c2 hot: the spill skips c2.
    snapshot = FleetSnapshot.of(
        {
            "c1": ClusterLoad(recent=50.0),
            "c2": ClusterLoad(gpu="gpu_memory"),
            "c3": ClusterLoad(recent=0.0),
        }
    )
    d = bounded(SessionView(seen=False), snapshot, AffinityParams(balance_factor=1.1))
    assert d.placement.primary == "c3"


def test_without_affinity_an_existing_session_stays_unless_relief_picked_it() -> None:
    stays = bounded(SessionView(seen=True), HOT_C1)
    assert stays.kind == "primary" and stays.placement == HASHED
    moved = bounded(SessionView(seen=True, leave="gpu_memory"), HOT_C1)
    assert moved.kind == "migrated" and moved.placement == Placement("c2", "c3")
    assert (moved.migrated_from, moved.migration_reason) == ("c1", "gpu_memory")
    assert moved.override_to_write is not None and moved.override_to_write.cluster == "c2"
    # Picked, but the cluster cooled down since: it stays with its cache.
    cooled = bounded(SessionView(seen=True, leave="gpu_memory"), FleetSnapshot.of({}))
    assert cooled.kind == "primary"


def test_without_affinity_an_override_on_a_hot_cluster_is_followed_until_picked() -> None:
    on_c3 = Override("c3", 500.0)
    hot_c3 = FleetSnapshot.of({"c3": ClusterLoad(gpu="gpu_slowdown")})
    kept = bounded(SessionView(seen=True, override=on_c3), hot_c3)
    assert kept.kind == "override" and kept.placement.primary == "c3"
    moved = bounded(SessionView(seen=True, override=on_c3, leave="gpu_slowdown"), hot_c3)
    assert moved.kind == "migrated" and moved.placement.primary == "c1"
    assert moved.migration_reason == "gpu_slowdown"


def test_without_affinity_a_picked_session_stays_when_every_other_cluster_is_hot() -> None:
    hot = FleetSnapshot.of({n: ClusterLoad(gpu="gpu_memory") for n in RANKED})
    d = bounded(SessionView(seen=True, leave="gpu_memory"), hot)
    assert d.kind == "primary"


# -- placement with affinity on (place) ------------------------------------------------------

ON = AffinityParams(enabled=True)


def test_with_affinity_a_picked_session_migrates_off_a_hot_cluster() -> None:
    held = place(KeySource.HEADER, RANKED, HOT_C1, SessionView(seen=True), 100.0, ON)
    assert held.kind == "primary"
    moved = place(
        KeySource.HEADER, RANKED, HOT_C1, SessionView(seen=True, leave="gpu_memory"), 100.0, ON
    )
    assert moved.kind == "migrated" and moved.placement.primary == "c2"
    assert moved.migration_reason == "gpu_memory"
    override = SessionView(seen=True, override=Override("c1", 900.0), leave="gpu_temperature")
    again = place(KeySource.HEADER, RANKED, HOT_C1, override, 100.0, ON)
    assert again.kind == "migrated" and again.migration_reason == "gpu_temperature"
    cool = place(
        KeySource.HEADER,
        RANKED,
        FleetSnapshot.of({}),
        SessionView(seen=True, leave="gpu_memory"),
        100.0,
        ON,
    )
    assert cool.kind == "primary"


# -- the pipeline, product default (affinity off, no share bound) ----------------------------


def _runtime(move_fraction: float = 0.25) -> Runtime:
    return compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [
                    {
                        "name": f"c{i}",
                        "endpoints": [f"127.0.0.1:80{i:02d}"],
                        "gpus": [
                            {"endpoint": f"127.0.0.1:80{i:02d}", "exporter": "127.0.0.1:9400"}
                        ],
                    }
                    for i in (1, 2, 3)
                ],
                "affinity": {"balance_factor": 0},
                "gpu_health": {
                    "enabled": True,
                    "move_after_ms": 10000,
                    "move_fraction": move_fraction,
                },
            }
        )
    )


def _headers(sid: str) -> dict[str, str]:
    return {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
        "x-session-id": sid,
    }


BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def _send(pipeline: Pipeline, sid: str, now: float) -> Routed:
    routed = await pipeline.decide(_headers(sid), BODY, now)
    assert isinstance(routed, Routed)
    await pipeline.release(routed.hold)
    return routed


async def _on_c1(pipeline: Pipeline, tag: str, count: int) -> list[str]:
    """Session ids whose hash primary is c1 (found by preview: nothing is recorded)."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        sid = f"{tag}{i}"
        i += 1
        previewed = await pipeline.preview(_headers(sid), BODY, 0.0)
        if isinstance(previewed, Routed) and previewed.route.placement.primary == "c1":
            found.append(sid)
    return found


async def test_the_product_default_avoids_a_hot_cluster_and_moves_its_least_active() -> None:
    runtime = _runtime()
    registry = CollectorRegistry()
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry))
    assert not runtime.affinity.enabled and runtime.affinity.balance_factor == 0
    quiet, busy, steady = await _on_c1(pipeline, "held", 3)
    unseen = await _on_c1(pipeline, "new", 2)
    for sid in (quiet, busy, steady):
        assert (await _send(pipeline, sid, 1.0)).route.placement.primary == "c1"
    for t in (2.0, 3.0, 4.0):
        await _send(pipeline, busy, t)
        await _send(pipeline, steady, t + 0.5)
    await _send(pipeline, busy, 4.8)

    pipeline.fleet.gpu_checked("c1", "gpu_memory", at=5.0, until=1000.0)
    # New sessions whose hash primary is c1 start elsewhere; the ones c1 holds stay.
    fresh = await _send(pipeline, unseen[0], 5.0)
    assert fresh.route.placement.primary != "c1" and fresh.kind == "spilled"
    for sid in (quiet, busy, steady):
        assert (await _send(pipeline, sid, 6.0)).route.placement.primary == "c1"
    # Hot for 10 s (since the verdict at 5.0): one round; floor(3 x 0.75) = 2 of c1's three
    # sessions stay, the quietest leaves.
    assert (await _send(pipeline, busy, 16.0)).route.placement.primary == "c1"
    moved = await _send(pipeline, quiet, 16.5)
    assert moved.route.placement.primary != "c1" and moved.kind == "migrated"
    assert registry.get_sample_value("fleet_migrations_total", {"reason": "gpu_memory"}) == 1.0
    assert (await _send(pipeline, busy, 16.6)).route.placement.primary == "c1"
    assert (await _send(pipeline, steady, 16.6)).route.placement.primary == "c1"
    # A new session is still kept off c1, and its later turns follow it there.
    later = await _send(pipeline, unseen[1], 16.7)
    assert later.route.placement.primary != "c1"
    # Once c1 cools down: the moved session follows its new cluster (its override), the
    # others stay where their caches are.
    pipeline.fleet.gpu_checked("c1", None, at=17.0, until=1000.0)
    again = await _send(pipeline, quiet, 17.0)
    assert again.route.placement.primary == moved.route.placement.primary
    assert (await _send(pipeline, busy, 17.0)).route.placement.primary == "c1"
    assert (await _send(pipeline, unseen[1], 17.0)).route.placement.primary == (
        later.route.placement.primary
    )


# -- since when a cluster is hot: the scrapers' clock, not the first request's ----------------


def test_a_spell_is_dated_from_the_verdict_when_the_shell_knows_it() -> None:
    table = ReliefTable(100)
    table.seen("c1", b"busy", 1.0, 600.0, RELIEF)
    table.seen("c1", b"busy", 2.0, 600.0, RELIEF)
    table.seen("c1", b"quiet", 1.0, 600.0, RELIEF)
    # Hot since 3.0 (the verdict), first asked at 13.5: a round is already due.
    assert table.leaves("c1", b"quiet", "hot", 13.5, 600.0, RELIEF, since=3.0)
    assert not table.leaves("c1", b"busy", "hot", 13.5, 600.0, RELIEF, since=3.0)


def test_the_load_table_keeps_the_start_of_an_unbroken_hot_spell() -> None:
    table = LoadTable()
    table.record_gpu("c1", "gpu_memory", at=5.0, until=65.0)
    table.record_gpu("c1", "gpu_temperature", at=10.0, until=70.0)  # still hot: same spell
    assert table.hot_since("c1", 20.0) == 5.0
    assert table.hot_reason("c1", 20.0) == "gpu_temperature"
    assert table.hot(20.0) == {"c1"}
    # The verdict lapsed before the next one: a new spell.
    table.record_gpu("c1", "gpu_memory", at=100.0, until=160.0)
    assert table.hot_since("c1", 100.0) == 100.0
    table.record_gpu("c1", None, at=110.0, until=170.0)
    assert table.hot_since("c1", 110.0) is None and table.hot(110.0) == frozenset()


def scrape(kv: float) -> LoadReport:
    return LoadReport(kv=kv, queue=None, inflight=None, cpu=None, source="scrape")


def test_kv_use_at_the_migrate_threshold_makes_a_cluster_hot_only_with_kv_relief() -> None:
    table = LoadTable()
    table.record("c1", scrape(0.99), 1.0)
    assert table.hot_reason("c1", 1.0) is None  # KV relief off (affinity on): no verdict
    table.kv_relief = (0.97, 10.0)
    table.record("c1", scrape(0.98), 5.0)
    table.record("c1", scrape(0.99), 6.0)
    assert table.hot_reason("c1", 6.0) == "kv_cache" and table.hot_since("c1", 6.0) == 5.0
    assert table.hot(6.0) == {"c1"}
    assert table.hot_reason("c1", 16.5) is None  # the report is stale: not trusted
    # Busy below the threshold: not hot, and the next spell starts over.
    table.record("c1", scrape(0.90), 7.0)
    assert table.hot_reason("c1", 7.0) is None and table.hot(7.0) == frozenset()
    table.record("c1", scrape(0.97), 8.0)
    assert table.hot_since("c1", 8.0) == 8.0
    # A GPU verdict is named first; the spell is the earlier of the two.
    table.record_gpu("c1", "gpu_memory", at=9.0, until=60.0)
    assert table.hot_reason("c1", 9.0) == "gpu_memory" and table.hot_since("c1", 9.0) == 8.0
    table.forget_scraped("c1")
    assert table.hot_since("c1", 9.5) == 9.0


# -- hot clusters are not failover targets, nor flow control's placements ---------------------


def test_cool_first_and_cool_secondary_skip_hot_clusters_while_a_cool_one_exists() -> None:
    assert cool_first(("c2", "c3"), {"c2"}) == ("c3",)
    assert cool_first(("c2", "c3"), {"c2", "c3"}) == ("c2", "c3")
    assert cool_secondary(("c1", "c2", "c3"), "c1", {"c2"}) == "c3"
    assert cool_secondary(("c1", "c2", "c3"), "c1", {"c2", "c3"}) == "c2"
    assert cool_secondary(("c1", "c2", "c3"), "c1", ()) == "c2"  # pure hashing's


def test_without_affinity_a_hot_hashed_secondary_is_replaced_by_the_next_cool_one() -> None:
    hot_c2 = FleetSnapshot.of({"c2": ClusterLoad(gpu="gpu_memory")})
    new = bounded(SessionView(seen=False), hot_c2)
    assert new.kind == "primary" and new.placement == Placement("c1", "c3")
    held = bounded(SessionView(seen=True), hot_c2)
    assert held.placement == Placement("c1", "c3")
    on_c3 = bounded(SessionView(seen=True, override=Override("c3", 900.0)), hot_c2, hot=None)
    assert on_c3.placement == Placement("c3", "c1")
    # No healthy cool candidate: the hashed secondary stands.
    c3_down = FleetSnapshot.of(
        {"c2": ClusterLoad(gpu="gpu_memory"), "c3": ClusterLoad(healthy=False)}
    )
    assert bounded(SessionView(seen=False), c3_down).placement == HASHED
    # Nothing hot: pure hashing's pair, whatever the snapshot says of load.
    assert bounded(SessionView(seen=False), FleetSnapshot.of({})).placement == HASHED


def test_without_affinity_a_kv_hot_cluster_is_avoided_from_the_hot_set_alone() -> None:
    # The snapshot carries no GPU verdict: the shell's hot set (KV at kv_migrate_threshold)
    # is what place_bounded reads.
    quiet = FleetSnapshot.of({})
    d = bounded(SessionView(seen=False), quiet, hot=frozenset({"c1"}))
    assert d.kind == "spilled" and d.placement == Placement("c2", "c3")
    moved = bounded(SessionView(seen=True, leave="kv_cache"), quiet, hot=frozenset({"c1"}))
    assert moved.kind == "migrated" and moved.migration_reason == "kv_cache"


# -- the pipeline: the spell's clock, KV relief, secondaries, flow control -------------------


def _ranked(pipeline: Pipeline, sid: str) -> tuple[str, ...]:
    runtime = pipeline.runtime
    facts = parse_request(
        "/v1/chat/completions", _headers(sid), BODY, runtime.key_rules, runtime.parse_limits
    )
    assert isinstance(facts, RequestFacts)
    placer = next(iter(runtime.policy.placers.values()))
    return tuple(placer.ranked(facts.session.point))


def _ranked_as(pipeline: Pipeline, tag: str, order: tuple[str, ...]) -> str:
    for i in range(10_000):
        if _ranked(pipeline, f"{tag}{i}") == order:
            return f"{tag}{i}"
    raise AssertionError(f"no session ranked {order}")


async def test_relief_begins_move_after_the_verdict_even_with_no_request_in_between() -> None:
    registry = CollectorRegistry()
    pipeline = Pipeline(RuntimeHolder(_runtime()), Metrics(registry))
    quiet, busy, steady = await _on_c1(pipeline, "held", 3)
    for sid in (quiet, busy, steady):
        await _send(pipeline, sid, 1.0)
    for t in (2.0, 3.0, 4.0):
        await _send(pipeline, busy, t)
        await _send(pipeline, steady, t + 0.5)
    # Hot from the scrape at 5.0; no request of c1's sessions until 15.5, after one period.
    pipeline.fleet.gpu_checked("c1", "gpu_memory", at=5.0, until=1000.0)
    moved = await _send(pipeline, quiet, 15.5)
    assert moved.kind == "migrated" and moved.route.placement.primary != "c1"
    assert (await _send(pipeline, busy, 15.6)).route.placement.primary == "c1"


def _kv_runtime(move_fraction: float = 0.25) -> Runtime:
    return compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [
                    {"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"], "engine": "vllm"}
                    for i in (1, 2, 3)
                ],
                "affinity": {"balance_factor": 0},
                "engine_metrics": {"enabled": True},
                "gpu_health": {"move_after_ms": 10000, "move_fraction": move_fraction},
            }
        )
    )


async def test_kv_use_at_the_migrate_threshold_relieves_a_cluster_without_affinity() -> None:
    runtime = _kv_runtime()
    assert not runtime.affinity.enabled and runtime.kv_relief_at == 0.97
    registry = CollectorRegistry()
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry))
    quiet, busy, steady = await _on_c1(pipeline, "held", 3)
    unseen = await _on_c1(pipeline, "new", 3)
    for sid in (quiet, busy, steady):
        await _send(pipeline, sid, 1.0)
    for t in (2.0, 3.0, 4.0):
        await _send(pipeline, busy, t)
        await _send(pipeline, steady, t + 0.5)

    # Busy, over the pressure threshold but below the migrate one: nothing changes there.
    for t in range(5, 20):
        pipeline.fleet.scraped("c1", scrape(0.92), float(t))
    assert (await _send(pipeline, unseen[0], 19.0)).route.placement.primary == "c1"
    for sid in (quiet, busy, steady):
        assert (await _send(pipeline, sid, 19.5)).route.placement.primary == "c1"

    # At the migrate threshold from 20.0 on: no new session starts there, and one period later
    # the least active of the sessions it holds leaves, counted under its own reason.
    for t in range(20, 31):
        pipeline.fleet.scraped("c1", scrape(0.98), float(t))
    fresh = await _send(pipeline, unseen[1], 29.0)
    assert fresh.route.placement.primary != "c1" and fresh.kind == "spilled"
    assert (await _send(pipeline, busy, 29.5)).route.placement.primary == "c1"
    assert (await _send(pipeline, steady, 29.5)).route.placement.primary == "c1"
    moved = await _send(pipeline, unseen[0], 30.0)  # 4 sessions, 0.25 each round: one leaves
    assert moved.kind == "migrated" and moved.route.placement.primary != "c1"
    assert registry.get_sample_value("fleet_migrations_total", {"reason": "kv_cache"}) == 1.0
    assert (await _send(pipeline, quiet, 30.2)).route.placement.primary == "c1"
    # Back below the threshold: the spell ends, and new sessions start on c1 again.
    pipeline.fleet.scraped("c1", scrape(0.5), 31.0)
    assert not pipeline.fleet.relief.in_spell("c1")
    assert (await _send(pipeline, unseen[2], 31.0)).route.placement.primary == "c1"


async def test_a_new_sessions_hot_secondary_is_replaced_by_a_cool_one() -> None:
    pipeline = Pipeline(RuntimeHolder(_runtime()), Metrics(CollectorRegistry()))
    sid = _ranked_as(pipeline, "s", ("c1", "c2", "c3"))
    assert (await _send(pipeline, sid, 1.0)).route.placement == Placement("c1", "c2")
    pipeline.fleet.gpu_checked("c2", "gpu_temperature", at=2.0, until=1000.0)
    other = _ranked_as(pipeline, "n", ("c1", "c2", "c3"))
    assert (await _send(pipeline, other, 3.0)).route.placement == Placement("c1", "c3")
    assert (await _send(pipeline, sid, 3.0)).route.placement == Placement("c1", "c3")


async def test_flow_controls_placement_skips_a_hot_cluster() -> None:
    doc: dict[str, Any] = {
        "version": 1,
        "clusters": [
            {
                "name": f"c{i}",
                "endpoints": [f"127.0.0.1:80{i:02d}"],
                "gpus": [{"endpoint": f"127.0.0.1:80{i:02d}", "exporter": "127.0.0.1:9400"}],
            }
            for i in (1, 2, 3)
        ],
        "classes": [{"name": "long", "budget": {"max_concurrent": 1}}],
        "affinity": {"balance_factor": 0},
        "gpu_health": {"enabled": True},
        "flow": {"place_new_sessions": True},
    }
    runtime = compile_runtime(parse_config(doc))
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(1))
    await gate.start()
    try:
        pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)
        holder = _ranked_as(pipeline, "h", ("c1", "c3", "c2"))
        first = await pipeline.decide(_headers(holder), BODY, 1.0)
        assert isinstance(first, Routed) and first.route.placement.primary == "c1"
        pipeline.fleet.gpu_checked("c2", "gpu_memory", at=1.5, until=1000.0)
        # c1's budget is full; the new session's next candidate, c2, is hot: c3 instead,
        # failing over to c1 rather than to the hot c2.
        new = _ranked_as(pipeline, "n", ("c1", "c2", "c3"))
        placed = await pipeline.decide(_headers(new), BODY, 2.0)
        assert isinstance(placed, Routed) and placed.kind == "placed"
        assert placed.route.placement == Placement("c3", "c1")
        await pipeline.release(placed.hold)
        await pipeline.release(first.hold)
    finally:
        await gate.close()


def test_explain_names_each_hot_candidate_with_its_reason() -> None:
    table = LoadTable()
    table.kv_relief = (0.97, 10.0)
    table.record("c1", scrape(0.98), 1.0)
    table.record("c2", scrape(0.50), 1.0)
    table.record_gpu("c3", "gpu_temperature", at=1.0, until=60.0)
    order = ["c2", "c1", "c3"]
    assert hot_candidates(table, order, 2.0) == {"c1": "kv_cache", "c3": "gpu_temperature"}
    assert hot_candidates(table, order, 12.0) == {"c3": "gpu_temperature"}  # stale KV report

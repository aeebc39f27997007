"""The affinity policy, one rule at a time, with injected snapshots, session views and clock."""

from __future__ import annotations

import collections
import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import ConfigError, compile_runtime, parse_config
from extproc.config.runtime import DEFAULT_BALANCE_FACTOR, Overrides, Runtime
from extproc.core.affinity import (
    AffinityParams,
    Decision,
    Override,
    SessionView,
    place,
)
from extproc.core.api import Api
from extproc.core.facts import RequestFacts
from extproc.core.keys import KeySource, hash_key
from extproc.core.load import ClusterLoad, FleetSnapshot
from extproc.core.placement import Placement, Rendezvous
from extproc.harness.launch import envoy_binary
from extproc.pipeline.fleet_state import LoadTable
from extproc.render.envoy import render_bootstrap

NOW = 1000.0
RANKED = ("c1", "c2", "c3", "c4")  # one session's candidates in hash order
PARAMS = AffinityParams(
    enabled=True,
    saturation_factor=1.5,
    min_inflight=4,
    kv_pressure_threshold=0.85,
    kv_migrate_threshold=0.97,
    new_session_ttl_s=60.0,
    override_ttl_s=300.0,
    signal_max_age_s=10.0,
    hot_key_share=0.5,
    hot_key_spread=3,
)
NEW = SessionView(seen=False)
EXISTING = SessionView(seen=True)


def facts(source: KeySource = KeySource.HEADER, key: str = "s1") -> RequestFacts:
    return RequestFacts(
        api=Api.OPENAI_CHAT,
        model="m",
        session=hash_key(source, key.encode()),
        input_tokens=100,
        max_output_tokens=16,
        tier=None,
        stream=False,
        body_bytes=400,
    )


def reported(kv: float, age: float = 1.0, inflight: int = 0) -> ClusterLoad:
    return ClusterLoad(inflight=inflight, kv=kv, queue=0, reported_at=NOW - age)


def snap(**clusters: ClusterLoad) -> FleetSnapshot:
    return FleetSnapshot.of(clusters)


def decide(
    snapshot: FleetSnapshot,
    session: SessionView = NEW,
    *,
    f: RequestFacts | None = None,
    ranked: tuple[str, ...] = RANKED,
    params: AffinityParams = PARAMS,
    now: float = NOW,
    within: int | None = None,
) -> Decision:
    source = (f or facts()).session.source
    return place(source, ranked, snapshot, session, now, params, within)


# -- a quiet fleet is pure hashing ------------------------------------------------------------


def test_quiet_fleet_places_exactly_like_pure_hashing() -> None:
    placer = Rendezvous.of([(f"c{i}", 1.0 + (i % 3)) for i in range(1, 9)])
    empty = snap()
    for i in range(500):
        f = facts(key=f"session-{i}")
        ranked = tuple(placer.ranked(f.session.point))
        for session in (NEW, EXISTING):
            d = decide(empty, session, f=f, ranked=ranked)
            assert d.kind == "primary" and d.override_to_write is None
            assert d.placement == placer.top2(f.session.point)


# -- new sessions: spill off a saturated or pressured primary ---------------------------------


def test_new_session_spills_off_a_kv_pressured_primary_and_is_remembered() -> None:
    d = decide(snap(c1=reported(0.90)))
    assert d.kind == "spilled"
    assert d.placement == Placement("c2", "c3")  # the pressured c1 is no failover target either
    assert d.override_to_write == Override("c2", NOW + PARAMS.override_ttl_s)


def test_spill_takes_the_next_candidate_in_hash_order_that_has_room() -> None:
    d = decide(snap(c1=reported(0.90), c2=reported(0.86), c3=ClusterLoad(inflight=9)))
    assert d.kind == "spilled" and d.placement.primary == "c4"


def test_new_session_spills_off_a_primary_over_the_saturation_factor() -> None:
    # mean over the four candidates = 10/4 = 2.5; 1.5 x 2.5 = 3.75 < 8 in flight on c1
    d = decide(snap(c1=ClusterLoad(inflight=8), c2=ClusterLoad(inflight=2)))
    assert d.kind == "spilled" and d.placement.primary == "c2"


def test_a_few_requests_on_an_idle_fleet_are_not_load() -> None:
    # 3 in flight is far above the mean (0.75) but below min_inflight.
    d = decide(snap(c1=ClusterLoad(inflight=3)))
    assert d.kind == "primary" and d.placement.primary == "c1"


def test_reported_inflight_counts_other_replicas_traffic() -> None:
    d = decide(snap(c1=ClusterLoad(inflight=1, reported_inflight=12, reported_at=NOW - 1)))
    assert d.kind == "spilled"


@pytest.mark.parametrize("kv", [0.84, 0.5, 0.0])
def test_below_the_pressure_threshold_a_new_session_stays(kv: float) -> None:
    assert decide(snap(c1=reported(kv))).kind == "primary"


def test_a_stale_report_is_ignored() -> None:
    d = decide(snap(c1=reported(0.99, age=PARAMS.signal_max_age_s + 0.1)))
    assert d.kind == "primary" and d.placement.primary == "c1"


def test_new_session_with_no_room_anywhere_stays_on_a_usable_primary() -> None:
    # c1 saturated, every other candidate KV-pressured: spilling would only evict someone
    # else's cache; the class budget on c1 decides instead.
    busy = {n: reported(0.9) for n in RANKED[1:]} | {"c1": ClusterLoad(inflight=20)}
    d = decide(snap(**busy))
    assert d.kind == "primary" and d.placement.primary == "c1"


def test_new_session_with_a_pressured_primary_and_no_room_takes_the_first_usable() -> None:
    clusters = {
        "c1": reported(0.95),
        "c2": reported(0.90),
        "c3": ClusterLoad(inflight=30),  # saturated but not pressured
        "c4": reported(0.99),
    }
    d = decide(snap(**clusters))
    assert d.kind == "spilled" and d.placement.primary == "c3"


def test_when_every_cluster_is_pressured_the_session_keeps_its_hash_primary() -> None:
    d = decide(snap(**{n: reported(0.9) for n in RANKED}))
    assert d.kind == "primary" and d.placement.primary == "c1"


def test_new_session_avoids_an_unhealthy_primary() -> None:
    d = decide(snap(c1=ClusterLoad(healthy=False)))
    assert d.kind == "spilled" and d.placement == Placement("c2", "c3")


# -- existing sessions: stay while busy, migrate when failing or memory-critical --------------


@pytest.mark.parametrize(
    "primary",
    [
        pytest.param(reported(0.90), id="kv-pressured"),
        pytest.param(ClusterLoad(inflight=40), id="saturated"),
        pytest.param(reported(0.96, inflight=40), id="pressured-and-saturated"),
    ],
)
def test_existing_session_stays_on_a_merely_busy_primary(primary: ClusterLoad) -> None:
    d = decide(snap(c1=primary), EXISTING)
    assert d.kind == "primary" and d.placement.primary == "c1"
    assert d.override_to_write is None and d.migrated_from is None


def test_existing_session_migrates_off_a_memory_critical_primary() -> None:
    d = decide(snap(c1=reported(0.98)), EXISTING)
    assert d.kind == "migrated"
    assert d.placement.primary == "c2"
    assert d.migrated_from == "c1" and d.migration_reason == "memory_pressure"
    assert d.override_to_write == Override("c2", NOW + PARAMS.override_ttl_s)


def test_existing_session_migrates_off_an_unhealthy_primary() -> None:
    d = decide(snap(c1=ClusterLoad(healthy=False)), EXISTING)
    assert d.kind == "migrated" and d.migration_reason == "unhealthy"
    assert d.placement == Placement("c2", "c3")


def test_migration_prefers_a_candidate_with_room() -> None:
    clusters = {"c1": ClusterLoad(healthy=False), "c2": ClusterLoad(inflight=30)}
    d = decide(snap(**clusters), EXISTING)
    assert d.kind == "migrated" and d.placement.primary == "c3"


def test_with_nowhere_to_go_an_existing_session_stays() -> None:
    clusters = {n: reported(0.99) for n in RANKED}
    d = decide(snap(**clusters), EXISTING)
    assert d.kind == "primary" and d.placement.primary == "c1"


# -- overrides ----------------------------------------------------------------------------------


def test_a_spilled_session_follows_its_override_even_after_pressure_is_gone() -> None:
    session = SessionView(seen=True, override=Override("c3", NOW + 250.0))
    d = decide(snap(), session)
    assert d.kind == "override" and d.placement == Placement("c3", "c1")
    assert d.override_to_write is None  # plenty of TTL left: no store write


def test_an_override_in_use_is_refreshed_before_it_could_lapse() -> None:
    # Less than max(new_session_ttl, override_ttl / 2) = 150 s left: extend it.
    session = SessionView(seen=True, override=Override("c3", NOW + 100.0))
    d = decide(snap(), session)
    assert d.override_to_write == Override("c3", NOW + PARAMS.override_ttl_s)


def test_refresh_keeps_an_override_alive_as_long_as_the_seen_mark() -> None:
    params = dataclasses.replace(PARAMS, new_session_ttl_s=200.0, override_ttl_s=240.0)
    session = SessionView(seen=True, override=Override("c3", NOW + 199.0))
    d = decide(snap(), session, params=params)
    assert d.override_to_write == Override("c3", NOW + 240.0)


def test_an_expired_override_is_ignored() -> None:
    session = SessionView(seen=True, override=Override("c3", NOW))
    d = decide(snap(), session)
    assert d.kind == "primary" and d.placement.primary == "c1"


def test_an_override_to_a_cluster_outside_the_candidates_is_ignored() -> None:
    # e.g. the request grew into a class with another eligible set, or the cluster was removed
    session = SessionView(seen=True, override=Override("c9", NOW + 100.0))
    assert decide(snap(), session).placement.primary == "c1"


def test_an_overridden_session_stays_while_its_cluster_is_busy() -> None:
    session = SessionView(seen=True, override=Override("c3", NOW + 250.0))
    d = decide(snap(c3=reported(0.92, inflight=50)), session)
    assert d.kind == "override" and d.placement.primary == "c3"


def test_an_overridden_session_migrates_when_its_cluster_fails() -> None:
    session = SessionView(seen=True, override=Override("c3", NOW + 250.0))
    d = decide(snap(c3=ClusterLoad(healthy=False)), session)
    assert d.kind == "migrated" and d.migrated_from == "c3"
    assert d.placement.primary == "c1"  # back to the hash primary, which has room again
    assert d.override_to_write == Override("c1", NOW + PARAMS.override_ttl_s)


# -- hot keys ------------------------------------------------------------------------------------


def hot_view(salt: int = 0, share: float = 0.8, seen: bool = True) -> SessionView:
    return SessionView(seen=seen, key_share=share, salt=salt)


def test_a_hot_prefix_key_is_spread_evenly_over_its_top_k() -> None:
    f = facts(KeySource.PREFIX, "viral system prompt + first message")
    served = collections.Counter(
        decide(snap(), hot_view(salt), f=f).placement.primary for salt in range(300)
    )
    assert set(served) == {"c1", "c2", "c3"}  # top 3 of the hash order, never c4
    assert all(n == 100 for n in served.values())


def test_a_hot_key_goes_to_the_least_loaded_of_its_top_k() -> None:
    f = facts(KeySource.PREFIX, "viral")
    loads = snap(c1=ClusterLoad(inflight=9), c2=ClusterLoad(inflight=2), c3=ClusterLoad(inflight=5))
    for salt in range(10):
        d = decide(loads, hot_view(salt), f=f)
        assert d.kind == "hot_spread" and d.placement.primary == "c2"
        assert d.override_to_write is None  # a shared key is never pinned


def test_a_hot_key_skips_pressured_candidates() -> None:
    f = facts(KeySource.PREFIX, "viral")
    served = {
        decide(snap(c2=reported(0.9)), hot_view(salt), f=f).placement.primary for salt in range(9)
    }
    assert served == {"c1", "c3"}


def test_a_key_below_the_hot_share_is_not_spread() -> None:
    f = facts(KeySource.PREFIX, "popular")
    for salt in range(6):
        d = decide(snap(), hot_view(salt, share=0.49), f=f)
        assert d.kind == "primary" and d.placement.primary == "c1"


@pytest.mark.parametrize("source", [KeySource.HEADER, KeySource.BODY])
def test_an_explicit_session_id_is_never_spread(source: KeySource) -> None:
    # One conversation: spreading it would cost a re-prefill on almost every turn.
    f = facts(source, "one-busy-agent")
    assert {decide(snap(), hot_view(s, share=1.0), f=f).kind for s in range(6)} == {"primary"}


def test_hot_spread_is_limited_to_k_and_to_the_candidates() -> None:
    f = facts(KeySource.PREFIX, "viral")
    params = dataclasses.replace(PARAMS, hot_key_spread=2)
    served = {decide(snap(), hot_view(s), f=f, params=params).placement.primary for s in range(8)}
    assert served == {"c1", "c2"}
    two = ("c1", "c2")
    served = {decide(snap(), hot_view(s), f=f, ranked=two).placement.primary for s in range(8)}
    assert served == {"c1", "c2"}


def test_with_one_usable_top_k_candidate_the_ordinary_rules_decide() -> None:
    f = facts(KeySource.PREFIX, "viral")
    loads = snap(c2=reported(0.9), c3=ClusterLoad(healthy=False))
    d = decide(loads, hot_view(1), f=f)
    assert d.kind == "primary" and d.placement.primary == "c1"


def test_hot_spread_wins_over_an_override() -> None:
    # An override would pin every user of the shared key to one cluster again.
    f = facts(KeySource.PREFIX, "viral")
    session = SessionView(seen=True, override=Override("c4", NOW + 100), key_share=0.9, salt=1)
    assert decide(snap(), session, f=f).kind == "hot_spread"


# -- edges ---------------------------------------------------------------------------------------


def test_a_single_cluster_fleet_has_no_secondary_and_nowhere_to_spill() -> None:
    d = decide(snap(c1=reported(0.99)), NEW, ranked=("c1",))
    assert d.kind == "primary" and d.placement == Placement("c1", None)


def test_the_secondary_skips_unusable_clusters() -> None:
    d = decide(snap(c2=reported(0.9), c3=ClusterLoad(healthy=False)))
    assert d.placement == Placement("c1", "c4")


def test_with_no_usable_secondary_the_next_in_hash_order_is_the_failover() -> None:
    d = decide(snap(**{n: reported(0.9) for n in ("c2", "c3", "c4")}))
    assert d.placement == Placement("c1", "c2")


def test_unhealthy_clusters_do_not_drag_the_saturation_mean_down() -> None:
    # Healthy mean = (6 + 5) / 2 = 5.5; 1.5 x 5.5 = 8.25 > 6: c1 is not saturated, even though
    # the mean over all four (with two dead, idle clusters) would be 2.75.
    clusters = {
        "c1": ClusterLoad(inflight=6),
        "c2": ClusterLoad(inflight=5),
        "c3": ClusterLoad(healthy=False),
        "c4": ClusterLoad(healthy=False),
    }
    assert decide(snap(**clusters)).kind == "primary"


def test_the_decision_depends_only_on_its_inputs() -> None:
    loads = snap(c1=reported(0.9), c2=ClusterLoad(inflight=7))
    assert decide(loads) == decide(loads)
    later = decide(loads, now=NOW + 100.0)  # the c1 report is stale by then
    assert later.kind == "primary"


# -- bounded-load placement of new sessions (balance_factor) ------------------------------------

BALANCED = dataclasses.replace(PARAMS, balance_factor=1.2)


def recent(**counts: float) -> FleetSnapshot:
    return snap(**{name: ClusterLoad(recent=counts.get(name, 0.0)) for name in RANKED})


def test_a_new_session_starts_on_the_first_candidate_within_the_bound_and_is_remembered() -> None:
    # 40 recent requests over 4 candidates: a cluster may take the 41st while it stays within
    # 1.2 x 41 / 4 = 12.3, so 12 must not grow to 13.
    loads = recent(c1=13.0, c2=12.0, c3=9.0, c4=6.0)
    decision = decide(loads, params=BALANCED)
    assert decision.kind == "spilled"
    assert decision.placement.primary == "c3"  # c2 (12 -> 13) would pass the bound too
    assert decision.override_to_write == Override("c3", NOW + BALANCED.override_ttl_s)


def test_within_the_bound_a_new_session_keeps_its_hash_primary() -> None:
    decision = decide(recent(c1=11.0, c2=12.0, c3=9.0, c4=8.0), params=BALANCED)
    assert decision.kind == "primary"
    assert decision.placement == Placement("c1", "c2")


def test_the_bound_never_moves_an_existing_or_overridden_session() -> None:
    loads = recent(c1=30.0, c2=1.0, c3=1.0, c4=1.0)
    assert decide(loads, EXISTING, params=BALANCED).placement.primary == "c1"
    overridden = SessionView(seen=True, override=Override("c1", NOW + 100.0))
    assert decide(loads, overridden, params=BALANCED).placement.primary == "c1"
    # Off (the default), the same counts change nothing for a new session either.
    assert decide(loads, params=PARAMS).placement.primary == "c1"


def test_a_migrating_session_goes_where_envoy_failed_over_whatever_its_share() -> None:
    # c1 failed (Envoy failed over to the secondary, c2, where the session's cache now is).
    # c2 is far over its share: a new session would skip it, a migrating one must not.
    loads = snap(
        c1=ClusterLoad(healthy=False, recent=1.0),
        c2=ClusterLoad(recent=30.0),
        c3=ClusterLoad(recent=1.0),
        c4=ClusterLoad(recent=1.0),
    )
    assert decide(loads, params=BALANCED).placement.primary == "c3"  # new: over its share
    moved = decide(loads, EXISTING, params=BALANCED)
    assert (moved.kind, moved.placement.primary, moved.migrated_from) == ("migrated", "c2", "c1")
    assert moved.placement.primary == decide(loads, EXISTING, params=PARAMS).placement.primary


def test_on_an_idle_fleet_the_bound_leaves_the_hash_alone() -> None:
    # No cluster can take the first request within 1.2 x 1 / 4: the hash primary, not a spill.
    assert decide(recent(), params=BALANCED).kind == "primary"


def test_bounded_placement_evens_out_many_new_sessions_that_hash_unevenly() -> None:
    placer = Rendezvous.of([(n, 1.0) for n in RANKED])
    counts = dict.fromkeys(RANKED, 0.0)
    spilled = 0
    for i in range(400):
        ranked = tuple(placer.ranked(hash_key(KeySource.PREFIX, b"%d" % i).point))
        loads = snap(**{n: ClusterLoad(recent=counts[n]) for n in RANKED})
        decision = decide(loads, ranked=ranked, params=BALANCED)
        spilled += decision.kind == "spilled"
        counts[decision.placement.primary] += 1
    assert max(counts.values()) <= 1.2 * 400 / 4 + 1
    assert 0 < spilled < 400 / 2  # most sessions still start on their hash primary


def test_the_shell_counts_placed_requests_with_a_half_life() -> None:
    table = LoadTable()
    for _ in range(8):
        table.placed("c1", NOW, 60.0)
    table.placed("c2", NOW, 60.0)
    later = table.snapshot(RANKED, NOW + 60.0, half_life_s=60.0)
    assert later.get("c1").recent == pytest.approx(4.0)  # one half-life: half of 8
    assert later.get("c2").recent == pytest.approx(0.5)
    assert later.get("c3").recent == 0.0
    # Not asked for (bounded placement off): nothing is read.
    assert table.snapshot(RANKED, NOW).get("c1").recent == 0.0


# -- config: the affinity: section ---------------------------------------------------------------


def fleet(**affinity: object) -> dict[str, object]:
    return {
        "version": 1,
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"]} for i in (1, 2, 3)],
        "affinity": affinity,
    }


def config_problems(**affinity: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(fleet(**affinity), "test.yaml")
    return info.value.problems


def test_affinity_is_off_by_default_and_pure_hashing_asks_envoy_for_nothing_more() -> None:
    runtime = compile_runtime(parse_config({"version": 1, "clusters": fleet()["clusters"]}))
    # Every policy parameter at the core's default, except bounded-load placement of new
    # sessions: on by default (1.1) for a single replica, inert while affinity is off.
    assert runtime.affinity == AffinityParams(balance_factor=DEFAULT_BALANCE_FACTOR)
    assert runtime.affinity.enabled is False
    mode = _processing_mode(runtime)
    assert mode["response_header_mode"] == "SKIP"


@pytest.mark.parametrize(
    ("redis", "cli_url", "affinity", "expected"),
    [
        pytest.param({}, None, {}, DEFAULT_BALANCE_FACTOR, id="one-replica-memory"),
        # Several replicas with memory alone: a spill is known only to the replica that made it,
        # so the session's later turns on the others would go back to its hash primary.
        pytest.param({"replicas": 3}, None, {}, 0.0, id="replicas-without-redis-off"),
        pytest.param(
            {"replicas": 3, "url": "redis://127.0.0.1:1"},
            None,
            {},
            DEFAULT_BALANCE_FACTOR,
            id="replicas-sharing-redis",
        ),
        pytest.param(
            {"replicas": 3}, "redis://127.0.0.1:1", {}, DEFAULT_BALANCE_FACTOR, id="redis-from-cli"
        ),
        pytest.param({}, None, {"balance_factor": 0}, 0.0, id="turned-off"),
        pytest.param({"replicas": 3}, None, {"balance_factor": 1.3}, 1.3, id="asked-for"),
    ],
)
def test_bounded_placement_of_new_sessions_is_on_by_default_where_later_turns_find_the_spill(
    redis: dict[str, object], cli_url: str | None, affinity: dict[str, object], expected: float
) -> None:
    doc = {**fleet(enabled=True, **affinity), "redis": redis}
    runtime = compile_runtime(parse_config(doc), overrides=Overrides(redis_url=cli_url))
    assert runtime.affinity.enabled
    assert runtime.affinity.balance_factor == expected


def test_enabled_affinity_compiles_and_asks_for_the_response_headers(tmp_path: Path) -> None:
    runtime = compile_runtime(
        parse_config(fleet(enabled=True, kv_pressure_threshold=0.8, hot_key_spread=2))
    )
    assert runtime.affinity.enabled
    assert runtime.affinity.kv_pressure_threshold == 0.8
    assert runtime.affinity.hot_key_spread == 2
    bootstrap = render_bootstrap(runtime)
    # Response phases are turned on per inference request by the processor (a mode override):
    # the filter allows it, and renders them off so nothing else waits on the processor.
    assert runtime.response_phases
    assert _processing_mode(runtime)["response_header_mode"] == "SKIP"
    assert _filter_of(runtime)["allow_mode_override"] is True
    # The rendered bootstrap is one Envoy accepts.
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def _filter_of(runtime: Runtime) -> dict[str, object]:
    listener = render_bootstrap(runtime)["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc: dict[str, object] = hcm["http_filters"][0]["typed_config"]
    return ext_proc


def _processing_mode(runtime: Runtime) -> dict[str, str]:
    mode = _filter_of(runtime)["processing_mode"]
    assert isinstance(mode, dict)
    return mode


@pytest.mark.parametrize(
    ("affinity", "expected"),
    [
        pytest.param(
            {"kv_pressure_threshold": 0.9, "kv_migrate_threshold": 0.8},
            "affinity.kv_migrate_threshold: must be >= kv_pressure_threshold (0.9)",
            id="migrate-below-pressure",
        ),
        pytest.param(
            {"new_session_ttl_s": 60, "override_ttl_s": 30},
            "affinity.override_ttl_s: must be >= new_session_ttl_s (60)",
            id="override-outlived-by-seen-mark",
        ),
        pytest.param(
            {"saturation_factor": 1.0}, "affinity.saturation_factor: must be > 1", id="factor"
        ),
        pytest.param(
            {"kv_pressure_threshold": 1.2},
            "affinity.kv_pressure_threshold: must be <= 1",
            id="threshold-above-one",
        ),
        pytest.param({"hot_key_spread": 1}, "affinity.hot_key_spread: must be >= 2", id="spread"),
        pytest.param(
            {"signal_max_age_s": 0}, "affinity.signal_max_age_s: must be > 0", id="max-age"
        ),
        pytest.param({"bogus": 1}, "affinity.bogus: unknown field", id="unknown-key"),
        pytest.param(
            {"balance_factor": 1.0},
            "affinity.balance_factor: must be 0 (off) or > 1",
            id="balance-at-the-mean",
        ),
    ],
)
def test_invalid_affinity_settings_fail_at_load_time_with_their_path(
    affinity: dict[str, object], expected: str
) -> None:
    assert expected in config_problems(enabled=True, **affinity)


# -- a LoRA adapter: moves stay among the clusters that have it loaded --------------------------
# ``within=2``: the adapter is loaded on c1 and c2 (the Candidates.preferred tier, ranked first);
# c3 and c4 serve its base model and would have to load it first.


def test_an_adapter_session_spills_only_to_a_cluster_that_has_it_loaded() -> None:
    loads = snap(c1=reported(0.90))
    assert decide(loads, within=2).placement == Placement("c2", "c3")
    # Loaded on c1 and c2, both pressured: the idle c3 and c4 would have to load it first, so
    # the session starts on its hash primary and the budget decides (as with no room anywhere).
    both = snap(c1=reported(0.90), c2=reported(0.90))
    assert decide(both).placement.primary == "c3"  # no adapter: the first with room
    d = decide(both, within=2)
    assert (d.kind, d.placement.primary, d.override_to_write) == ("primary", "c1", None)
    # Loaded on c1 alone: nowhere to spill to, whatever the others hold.
    assert decide(loads, within=1).placement.primary == "c1"


def test_an_adapter_sessions_saturation_and_share_are_judged_among_its_loaded_clusters() -> None:
    # 8 in flight on each loaded cluster: over 1.5 x the mean of the four (4), not of the two (8).
    busy = snap(c1=ClusterLoad(inflight=8), c2=ClusterLoad(inflight=8))
    assert decide(busy).kind == "spilled"
    assert decide(busy, within=2).kind == "primary"
    # The share bound as place_bounded's ``within`` (tests/unit/test_bounded_placement.py).
    shares = recent(c1=20.0, c2=10.0)
    assert decide(shares, params=BALANCED).placement.primary == "c3"
    d = decide(shares, params=BALANCED, within=2)
    assert (d.kind, d.placement) == ("spilled", Placement("c2", "c1"))


def test_a_hot_adapter_key_is_spread_only_over_its_loaded_clusters() -> None:
    f = facts(KeySource.PREFIX, "viral system prompt on an adapter")
    spread = {decide(snap(), hot_view(s), f=f, within=2).placement.primary for s in range(30)}
    assert spread == {"c1", "c2"}
    # Loaded on one cluster: nothing to spread over, the ordinary rules keep it there.
    alone = {decide(snap(), hot_view(s), f=f, within=1).placement.primary for s in range(30)}
    assert alone == {"c1"}


def test_an_adapter_session_migrates_within_its_loaded_clusters_while_one_is_healthy() -> None:
    # c1 failed; c2 (loaded) is saturated, c3 (not loaded) idle. A session moving for its
    # primary's failure re-prefills anyway, but on c3 it would load the adapter first too.
    loads = snap(c1=ClusterLoad(healthy=False), c2=ClusterLoad(inflight=30))
    assert decide(loads, EXISTING).placement.primary == "c3"
    moved = decide(loads, EXISTING, within=2)
    assert (moved.kind, moved.placement.primary, moved.migrated_from) == ("migrated", "c2", "c1")
    # An override on a loaded cluster that runs out of memory moves within the tier too.
    on_c2 = SessionView(seen=True, override=Override("c2", NOW + 250.0))
    critical = snap(c2=reported(0.98), c1=ClusterLoad(inflight=30))
    assert decide(critical, on_c2).placement.primary == "c3"
    moved = decide(critical, on_c2, within=2)
    assert (moved.kind, moved.placement.primary) == ("migrated", "c1")


def test_an_adapter_session_leaves_its_loaded_clusters_only_when_none_is_healthy() -> None:
    down = snap(c1=ClusterLoad(healthy=False), c2=ClusterLoad(healthy=False))
    for session in (NEW, EXISTING):
        assert decide(down, session, within=2) == decide(down, session)
        assert decide(down, session, within=2).placement.primary == "c3"
    # A pressured loaded cluster is still a healthy one: with no room anywhere among them, the
    # session goes there (a new one, and one leaving its failed primary), not to the idle c3.
    pressured = snap(c1=ClusterLoad(healthy=False), c2=reported(0.92))
    assert decide(pressured).placement.primary == "c3"
    for session in (NEW, EXISTING):
        assert decide(pressured, session, within=2).placement.primary == "c2"


_STATES = st.sampled_from(
    [
        ClusterLoad(),
        ClusterLoad(healthy=False),
        reported(0.5, inflight=2),
        reported(0.9),
        reported(0.99),
        ClusterLoad(inflight=12),
        ClusterLoad(recent=20.0),
        ClusterLoad(healthy=False, recent=5.0),
    ]
)


@settings(derandomize=True, database=None, max_examples=400, deadline=None)
@given(
    states=st.lists(_STATES, min_size=4, max_size=4),
    within=st.integers(1, 4),
    seen=st.booleans(),
    override_to=st.sampled_from([None, *RANKED]),
    share=st.sampled_from([0.0, 0.9]),
    salt=st.integers(0, 5),
    source=st.sampled_from(list(KeySource)),
    balance=st.sampled_from([0.0, 1.2]),
)
def test_an_adapter_session_starts_and_moves_only_among_its_loaded_clusters(
    states: list[ClusterLoad],
    within: int,
    seen: bool,
    override_to: str | None,
    share: float,
    salt: int,
    source: KeySource,
    balance: float,
) -> None:
    loads = snap(**dict(zip(RANKED, states, strict=True)))
    override = None if override_to is None else Override(override_to, NOW + 100.0)
    session = SessionView(seen, override, share, salt)
    params = dataclasses.replace(PARAMS, balance_factor=balance)
    f = facts(source, "k")
    d = decide(loads, session, f=f, params=params, within=within)
    tier = RANKED[:within]
    if within == len(RANKED) or not any(s.healthy for s in states[:within]):
        # Every candidate has it, or failover: with no loaded cluster healthy, the rules run
        # over every candidate, exactly as for a base model.
        assert d == decide(loads, session, f=f, params=params)
        return
    # While one loaded cluster is healthy the session runs on a healthy one, among them; only
    # an override outside them (placed while they were down, say) is followed there, since the
    # session's cache is there: nothing moves a session out.
    assert states[RANKED.index(d.placement.primary)].healthy, d
    if d.placement.primary not in tier:
        assert (d.kind, d.placement.primary) == ("override", override_to), d


def test_with_no_room_anywhere_a_saturated_primary_gives_way_to_an_unsaturated_cluster() -> None:
    # Two candidates: c1 saturated (a backlog), c2 idle but over its share after the spills
    # that the backlog caused. The new session goes to c2, not back to the backlogged c1.
    loads = snap(
        c1=ClusterLoad(inflight=6, recent=10.0),
        c2=ClusterLoad(inflight=0, recent=12.0),
    )
    decision = decide(loads, ranked=("c1", "c2"), params=BALANCED)
    assert (decision.kind, decision.placement.primary) == ("spilled", "c2")
    # Over its share but not saturated, the primary still takes it (no room anywhere).
    calm = snap(c1=ClusterLoad(inflight=1, recent=12.0), c2=ClusterLoad(inflight=0, recent=12.0))
    assert decide(calm, ranked=("c1", "c2"), params=BALANCED).placement.primary == "c1"

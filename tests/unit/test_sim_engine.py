"""The fleet simulator end to end on small seeded runs: agreement, determinism, properties."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from extproc.core.fleet import Budget
from extproc.core.keys import KeySource, hash_key
from extproc.core.placement import Rendezvous
from extproc.harness.kvmodel import ClusterModel, ClusterParams, ModelRequest
from extproc.harness.trace import Trace, ideal_hit_ratio, read_trace
from extproc.sim.engine import SERVED, PolicyRun
from extproc.sim.model import FleetShape
from extproc.sim.scenario import Prepared, SimOptions, simulate
from extproc.sim.traffic import BaseTraffic, base_from_trace, expand, mooncake_like

REPO = Path(__file__).resolve().parents[2]
# Vendored with its README (upstream, license) in third_party/mooncake/.
MOONCAKE_TRACE = REPO / "third_party" / "mooncake" / "mooncake_synthetic_trace.jsonl"
SMALL = mooncake_like(seed=11, sessions=1500, duration_s=600.0)
ALL = (
    "round-robin",
    "least-loaded",
    "hash-primary",
    "hash-2",
    "hash-2+bulkheads",
    "hash-2+bulkheads+spill",
    "hash-2+bulkheads+affinity",
)


def _options(**changes: object) -> SimOptions:
    defaults: dict[str, object] = {
        "sessions": 6000,
        "shape": FleetShape(8, spares=1, utilisation=0.5, kv_share=0.5, seed=3),
        "seed": 5,
    }
    defaults.update(changes)
    return SimOptions(**defaults)  # type: ignore[arg-type]


def _base(trace: Trace = SMALL) -> BaseTraffic:
    return base_from_trace(trace)


@pytest.fixture(scope="module")
def events_run() -> tuple[dict[str, object], dict[str, PolicyRun], Prepared]:
    """All six policies, default events (fail, add, remove, recover), 8 clusters."""
    return simulate(_options(policies=ALL), base=_base())


def _direct_hit_ratio(trace: Trace, prepared: Prepared) -> float:
    """The trace through one kvmodel.ClusterModel per cluster, placed by Rendezvous.top2."""
    specs = prepared.scenario.clusters[: prepared.scenario.n_base]
    ring = Rendezvous(tuple(c.name for c in specs), tuple(c.weight for c in specs))
    models = {
        c.name: ClusterModel(
            ClusterParams(
                kv_capacity_tokens=c.kv_capacity_tokens,
                prefill_tps=c.prefill_tps,
                decode_tps=c.decode_tps,
                max_concurrency=c.max_concurrency,
            )
        )
        for c in specs
    }
    cached = prompt = 0
    for r in trace.requests:
        # Chained block keys, like the harness's prompt block hashes: one key per prefix.
        keys, parent = [], b""
        for block_id in r.hash_ids:
            parent = hashlib.blake2b(parent + block_id.to_bytes(8, "big"), digest_size=8).digest()
            keys.append(int.from_bytes(parent, "big"))
        point = hash_key(KeySource.HEADER, f"trace-{r.session}".encode()).point
        plan = models[ring.top2(point).primary].admit(
            ModelRequest(tuple(keys), r.input_length, max(1, r.output_length)), r.arrival_s
        )
        cached += plan.cached_tokens
        prompt += r.input_length
    return cached / prompt


def _agreement(trace: Trace) -> None:
    _summary, runs, prepared = simulate(
        _options(sessions=None, events=(), policies=("hash-2",)), base=base_from_trace(trace)
    )
    run = runs["hash-2"]
    assert (run.status == SERVED).all()
    simulated = run.cached.sum() / sum(r.input_length for r in trace.requests)
    direct = _direct_hit_ratio(trace, prepared)
    assert simulated == pytest.approx(direct, abs=0.02)
    # Not only close: the same cache arithmetic on the same placement gives the same tokens.
    assert simulated == pytest.approx(direct, abs=1e-4)
    assert simulated <= ideal_hit_ratio(trace.requests) + 1e-9


def test_simulator_agrees_with_clustermodel_instances_on_a_small_trace() -> None:
    _agreement(SMALL)


def test_simulator_agrees_with_clustermodel_instances_on_the_mooncake_trace() -> None:
    _agreement(read_trace(MOONCAKE_TRACE))


def test_same_seed_same_json_and_worker_processes_change_nothing() -> None:
    options = _options(policies=("least-loaded", "hash-2+bulkheads+spill", ALL[-1]))
    first, _, _ = simulate(options, base=_base())
    again, _, _ = simulate(options, base=_base())
    forked, _, _ = simulate(options, jobs=2, base=_base())
    text = json.dumps(first, sort_keys=True)
    assert json.dumps(again, sort_keys=True) == text
    assert json.dumps(forked, sort_keys=True) == text
    other, _, _ = simulate(_options(policies=options.policies, seed=6), base=_base())
    assert json.dumps(other, sort_keys=True) != text


def test_copies_multiply_sessions_keep_the_ideal_and_keep_each_session_intact() -> None:
    base = _base()
    from extproc.sim.scenario import classes_of

    traffic = expand(base, 5, classes_of(SimOptions()), seed=2)
    assert traffic.n_sessions == 5 * base.n_sessions
    assert len(traffic) == 5 * len(base)
    assert sum(base.ideal_cached) / sum(base.input_tokens) == pytest.approx(
        ideal_hit_ratio(SMALL.requests)
    )
    tmpl = np.asarray(traffic.templates)
    inputs = np.asarray(traffic.t_input)[tmpl]
    ideal = np.asarray(traffic.ideal_cached)
    assert ideal.sum() / inputs.sum() == pytest.approx(ideal_hit_ratio(SMALL.requests))
    # Copy 0 is the trace itself; every copy keeps each session's inner gaps.
    times = np.asarray(traffic.times)
    copy0 = np.asarray(traffic.copy_of) == 0
    assert sorted(times[copy0].tolist()) == pytest.approx(sorted(base.times))
    sess = np.asarray(traffic.sessions)
    base_gaps = {}
    for s, t in zip(base.sessions, base.times, strict=True):
        base_gaps.setdefault(s, []).append(t)
    for g in (0, base.n_sessions + 3, 4 * base.n_sessions + 17):
        mine = np.sort(times[sess == g])
        ref = np.asarray(base_gaps[g % base.n_sessions])
        assert np.diff(mine) == pytest.approx(np.diff(ref))


def test_every_request_is_accounted_for_and_no_budget_leaks(events_run: tuple) -> None:
    summary, runs, prepared = events_run
    n = len(prepared.scenario.traffic)
    for name, run in runs.items():
        assert len(run.status) == n
        served = run.status == SERVED
        assert (run.cached[served] >= 0).all() and np.isfinite(run.ttft[served]).all()
        assert (run.ttft[served] >= 0).all()
        assert run.leaked_tickets == 0, name
        p = summary["policies"][name]
        assert p["served"] + p["not_served"] == n


def test_affinity_beats_round_robin_on_hits_and_cost(events_run: tuple) -> None:
    summary, _, _ = events_run
    pol = summary["policies"]
    ideal = summary["workload"]["ideal_hit_ratio"]
    for name in ALL[2:]:
        assert pol[name]["hit_ratio"] > 2 * pol["round-robin"]["hit_ratio"]
        assert pol[name]["trace_hit_ratio"] <= ideal
        assert pol[name]["cost_usd"]["input"] < pol["round-robin"]["cost_usd"]["input"]


def test_no_budget_means_no_429_and_budgets_only_refuse_their_class(events_run: tuple) -> None:
    summary, _, _ = events_run
    for name in ("round-robin", "least-loaded", "hash-primary", "hash-2"):
        for stats in summary["policies"][name]["classes"].values():
            assert stats["rate_429"] == 0
    # Only the long class has a budget by default.
    for name in ALL[4:]:
        classes = summary["policies"][name]["classes"]
        assert classes["short"]["rate_429"] == 0 and classes["medium"]["rate_429"] == 0


def test_a_failed_clusters_sessions_move_to_their_secondary() -> None:
    summary, runs, prepared = simulate(
        _options(events=("fail:c2@0.3T", "recover:c2@0.7T"), policies=("hash-primary", "hash-2")),
        base=_base(),
    )
    (failure,) = runs["hash-2"].failures
    table = prepared.scenario.tables.tables[0]
    assert failure.by_session, "some sessions of the failed cluster came back during the outage"
    # Every displaced session had c2 as its primary and was served by its own secondary.
    assert {int(table[s, 0]) for s in failure.by_session} == {failure.cluster}
    assert set(failure.spread) <= {int(table[s, 1]) for s in failure.by_session}
    assert failure.cluster not in failure.spread
    # The plan covers every session whose primary is c2, each sent to its secondary.
    (plan,) = summary["failover_plan"]
    n_trace = prepared.scenario.traffic.n_trace_sessions
    assert plan["sessions"] == int((table[:n_trace, 0] == failure.cluster).sum())
    assert plan["survivors"] == 7 and plan["tokens_max_over_mean"] >= 1.0
    # With no planned secondary every request of those sessions lands somewhere new.
    pol = summary["policies"]
    assert (
        pol["hash-2"]["failures"][0]["reprefill_tokens"]
        < (pol["hash-primary"]["failures"][0]["reprefill_tokens"])
    )


# The failback comparison needs enough of c2's sessions to come back after its recovery: with
# the 1,500-session trace only a handful do, and which policy re-prefills more there depended on
# the seed (seeds 5-10: the aware policy lower on 2 of 6). With 4,000 sessions it re-prefilled 0
# tokens on failback for every seed tried (5, 6, 7, 9) against 51-75k for hash-2.
FAILBACK = mooncake_like(seed=11, sessions=4000, duration_s=600.0)


def test_core_affinity_migrates_off_a_failed_cluster_and_keeps_sessions_there() -> None:
    policies = ("hash-2", "hash-2+bulkheads+affinity")
    base = _base(FAILBACK)
    summary, runs, _ = simulate(
        _options(events=("fail:c2@0.2T", "recover:c2@0.4T"), policies=policies), base=base
    )
    decisions = runs["hash-2+bulkheads+affinity"].decisions
    # extproc.core.affinity.place decided every request: migrations off the dead c2, then the
    # overrides it wrote keep those sessions where their cache now is.
    assert sum(decisions.values()) >= len(base)
    assert decisions["migrated"] > 0 and decisions["override"] > 0
    pol = summary["policies"]
    (plain,) = pol["hash-2"]["failures"]
    (aware,) = pol["hash-2+bulkheads+affinity"]["failures"]
    # After the recovery, hash-2 sends them back to an empty c2; the overrides do not.
    assert aware["failback_reprefill_tokens"] < plain["failback_reprefill_tokens"]


def test_remapped_share_on_add_and_remove_is_about_one_over_n(events_run: tuple) -> None:
    summary, _, _ = events_run
    add, remove = summary["remapped"]
    assert add["event"].startswith("add") and remove["event"].startswith("remove")
    # 6k sessions over 8-9 clusters: binomial sd ~ 3.5% of the mean, so 15% is > 4 sigma.
    assert add["moved_share"] == pytest.approx(1 / 9, rel=0.15)
    assert remove["moved_share"] == pytest.approx(1 / 9, rel=0.15)


def test_bulkheads_shield_short_requests_from_a_long_context_burst() -> None:
    policies = ("hash-2", "hash-2+bulkheads")
    burst = "0.3T,0.15T,0.3/c,150000"
    summary, _, _ = simulate(_options(events=(), bursts=(burst,), policies=policies), base=_base())
    quiet, _, _ = simulate(
        _options(events=(), windows=("0.3T,0.45T",), policies=policies), base=_base()
    )
    window = {n: summary["policies"][n]["window"] for n in policies}
    before = quiet["policies"]["hash-2"]["window"]["short"]["ttft_p99_s"]
    # Without budgets the burst queues in front of short requests.
    assert window["hash-2"]["short"]["ttft_p99_s"] > 3 * before
    # With a long-class budget of one request per cluster, they barely notice...
    assert (
        window["hash-2+bulkheads"]["short"]["ttft_p99_s"]
        < window["hash-2"]["short"]["ttft_p99_s"] / 3
    )
    # ...and the long class is the one answered with 429s.
    assert window["hash-2+bulkheads"]["long"]["rate_429"] > 0.2
    assert window["hash-2+bulkheads"]["short"]["rate_429"] == 0


def test_burst_rates_in_requests_per_cluster_or_fleet_capacity() -> None:
    _, _, prepared = simulate(
        _options(events=(), bursts=("0.1T,20,0.5x,100000", "0.5T,20,2/c,100000"), policies=()),
        base=_base(),
    )
    capacity = sum(c.prefill_tps for c in prepared.scenario.clusters[:8])
    by_capacity, per_cluster = prepared.scenario.traffic.bursts
    assert by_capacity.rate_per_s == pytest.approx(0.5 * capacity / 100_000)
    assert per_cluster.rate_per_s == 16.0
    assert prepared.windows == (by_capacity.window, per_cluster.window)


def test_spill_moves_only_new_sessions_and_they_stay() -> None:
    _summary, runs, prepared = simulate(
        _options(events=(), policies=("hash-2+bulkheads+spill",), spill_wait_s=0.5),
        base=_base(),
    )
    run = runs["hash-2+bulkheads+spill"]
    assert run.spilled_sessions > 0
    traffic = prepared.scenario.traffic
    served_on: dict[int, set[int]] = {}
    for s, c, st in zip(traffic.sessions, run.served_on.tolist(), run.status.tolist(), strict=True):
        if st == SERVED:
            served_on.setdefault(s, set()).add(c)
    # No failures here, so a session that started somewhere never moves.
    assert all(len(clusters) == 1 for clusters in served_on.values())


def test_a_request_over_the_whole_budget_gets_413_without_retries() -> None:
    _summary, runs, _ = simulate(
        _options(
            events=(),
            policies=("hash-2+bulkheads",),
            long_budget=Budget(max_inflight_tokens=120_000),
        ),
        base=_base(),
    )
    run = runs["hash-2+bulkheads"]
    too_large = run.status == 413
    assert too_large.any()
    assert (run.rejections[too_large] == 0).all()


def test_flow_control_serves_more_long_requests_than_429_only() -> None:
    """The same seeded burst (a long budget of one request per cluster): placing new sessions
    on their next candidate with budget and waiting up to the class's maximum serve more long
    requests, with fewer give-ups, than answering every refusal with a 429; nothing leaks and
    every request ends one way."""
    policies = ("hash-2+bulkheads", "hash-2+bulkheads+flow")
    _summary, runs, prepared = simulate(
        _options(policies=policies, events=(), bursts=("0.5T,0.2T,0.6x,150000",)),
        base=_base(),
    )
    traffic = prepared.scenario.traffic
    klass = np.asarray(traffic.t_class)[np.asarray(traffic.templates)]
    long_ = klass == 2
    assert long_.sum() > 20
    only, flow = runs["hash-2+bulkheads"], runs["hash-2+bulkheads+flow"]
    for run in (only, flow):
        assert run.leaked_tickets == 0
        assert np.isin(run.status, [SERVED, 429, 413, 503]).all()
        assert np.isnan(run.ttft[run.status != SERVED]).all()
    served_only = int((only.status[long_] == SERVED).sum())
    served_flow = int((flow.status[long_] == SERVED).sum())
    assert served_flow > served_only, (served_flow, served_only)
    assert (flow.status[long_] == 429).sum() < (only.status[long_] == 429).sum()
    assert flow.spilled_sessions > 0  # new sessions were placed off a full primary

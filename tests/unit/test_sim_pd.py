"""P/D in the fleet simulator (extproc.sim.pd, `extproc simulate --pd`): the processor's own
compiled plan and prefill choice, decode on decode-role clusters only, KV moved over the pair's
link, the prefill pool's budget apart from the decode pool's, and a sweep that is only runs of
the simulator."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from extproc.core.fleet import Budget
from extproc.sim import pd_pools
from extproc.sim.engine import SERVED, PolicyRun
from extproc.sim.model import FleetShape
from extproc.sim.pd import ISLAND_GBPS, PREFILL, parse_layout
from extproc.sim.scenario import Prepared, SimOptions, simulate
from extproc.sim.traffic import base_from_trace, mooncake_like

BASE = base_from_trace(mooncake_like(seed=7, sessions=600, duration_s=300.0))


def _run(**changes: object) -> tuple[dict[str, object], dict[str, PolicyRun], Prepared]:
    options: dict[str, object] = {
        "sessions": 1200,
        "shape": FleetShape(16, spares=0, heterogeneous=False, utilisation=0.5, seed=3),
        "events": (),
        "policies": ("hash-2",),
        "long_budget": Budget(),
        "seed": 5,
        "pd": "8:8",
        "pd_islands": 4,
    }
    options.update(changes)
    return simulate(SimOptions(**options), base=BASE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pd_run() -> tuple[dict[str, object], dict[str, PolicyRun], Prepared]:
    return _run()


def test_decode_runs_on_decode_clusters_and_prefill_in_the_island(
    pd_run: tuple[dict[str, object], dict[str, PolicyRun], Prepared],
) -> None:
    _summary, runs, prepared = pd_run
    run = runs["hash-2"]
    pd = prepared.config.pd
    assert pd is not None
    prefill_ix = {i for i, role in enumerate(pd.roles) if role == PREFILL}
    assert len(prefill_ix) == 8  # 2 per island of 4
    ok = run.status == SERVED
    assert ok.all()
    # No request is served (decoded) on a prefill-role cluster: they are out of the placer.
    assert not set(run.served_on[ok].tolist()) & prefill_ix
    traffic = prepared.scenario.traffic
    klass = np.asarray(traffic.t_class)[np.asarray(traffic.templates)]
    assert run.prefill_tier is not None and run.transfer_s is not None
    disaggregated = np.isin(klass, sorted(pd.disaggregated))
    assert disaggregated.any() and (~disaggregated).any()
    # Short turns stay colocated; every disaggregated one found a prefiller in its island
    # (all prefillers are alive, and the island is tried first).
    assert (run.prefill_tier[~disaggregated] == -2).all()
    assert (run.prefill_tier[disaggregated] == 1).all()
    moved = run.transfer_s[disaggregated]
    assert np.isfinite(moved).all() and (moved >= 0).all()
    # The transfer is the uncached-at-decode tokens' KV over the island's link: bounded by
    # the whole prompt's.
    tokens = np.asarray(traffic.t_input)[np.asarray(traffic.templates)][disaggregated]
    assert (moved <= tokens * pd.plan.kv_bytes_per_token / (ISLAND_GBPS * 1e9) + 1e-9).all()
    assert run.leaked_tickets == 0


def test_a_pd_run_is_deterministic(
    pd_run: tuple[dict[str, object], dict[str, PolicyRun], Prepared],
) -> None:
    again = _run()[0]
    assert again == pd_run[0]


def test_the_prefill_budget_refuses_apart_from_the_decode_budget() -> None:
    """A one-prefill-per-cluster prefill budget under the bulkhead policy: 429s for the
    disaggregated classes only, nothing leaked, short turns untouched."""
    summary, runs, _p = _run(
        policies=("hash-2+bulkheads",),
        pd_prefill_budget=Budget(max_concurrent=1),
        max_retries=0,
    )
    run = runs["hash-2+bulkheads"]
    assert run.leaked_tickets == 0
    classes = summary["policies"]["hash-2+bulkheads"]["classes"]  # type: ignore[index]
    assert classes["short"]["rate_429"] == 0
    assert classes["medium"]["rate_429"] + classes["long"]["rate_429"] > 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8:9", r"P \+ D"),
        ("3:13", "evenly"),
        ("x", "P:D"),
        ("0:16", ">= 1"),
    ],
)
def test_bad_layouts_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_layout(text, 16, 4)


def test_fleet_events_are_refused_in_a_pd_run() -> None:
    with pytest.raises(ValueError, match="no fleet events"):
        _run(events=("fail:c2@0.5T",))


def test_the_ratio_sweep_is_runs_of_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    pd_pools.add_arguments(parser)
    args = parser.parse_args(
        ["--sessions", "600", "--clusters", "16", "--islands", "4", "--ratios", "colocated,8:8"]
    )
    args.trace = None  # not read: the base is given below
    rows = []
    for layout in ("colocated", "8:8"):
        summary, _r, _p = simulate(pd_pools.options(args, layout), base=BASE)
        rows.append(pd_pools.row(layout, summary, "hash-2"))
    assert rows[0].startswith("| colocated |") and rows[0].endswith("| - | - |")
    assert rows[1].startswith("| 8:8 |") and "island" in rows[1]


def test_clusters_of_several_engines_decode_remote_prefills_on_one_of_them() -> None:
    """EngineCluster.serve_remote: the session's engine takes the KV; every request served,
    none decoded on a prefill cluster, and the engines' evictions reach the cluster's count."""
    shape = FleetShape(
        16, spares=0, heterogeneous=False, utilisation=0.5, kv_share=0.05, seed=3, engines=2
    )
    _s, runs, prepared = _run(shape=shape)
    run = runs["hash-2"]
    pd = prepared.config.pd
    assert pd is not None
    ok = run.status == SERVED
    assert ok.all()
    prefill_ix = {i for i, role in enumerate(pd.roles) if role == PREFILL}
    assert not set(run.served_on.tolist()) & prefill_ix
    assert run.prefill_tier is not None and (run.prefill_tier == 1).sum() > 0
    # A small KV share: the decode clusters' engines evict (0 if their count were lost).
    decode_evictions = [e for i, e in enumerate(run.evictions) if i not in prefill_ix]
    assert sum(decode_evictions) > 0

"""The simulator's tenant-flood workload: the processor's tenant keys and fair queue in the
fleet simulator, the traffic with and without the flood, and the comparison's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.bench.fairness_stats import jain
from extproc.cli import main
from extproc.core import tenants as core_tenants
from extproc.core.flow import Fairness, FairQueue, FlowParams
from extproc.sim import flood
from extproc.sim.engine import SERVED, SimConfig, prepare, run_policy
from extproc.sim.tenants import claims_for, tenant_key
from extproc.sim.traffic import Traffic, expand

TOKENS = FlowParams(tenant_header=flood.TENANT_HEADER, fairness=Fairness.TOKENS)


def test_tenant_keys_are_the_processors() -> None:
    assert tenant_key(TOKENS, "steady3") == core_tenants.tenant_key("steady3")
    assert tenant_key(TOKENS, "steady3") != tenant_key(TOKENS, "steady4")
    # No header: the processor's fallback (here the tier; none given: one shared tenant).
    assert tenant_key(TOKENS, "") == tenant_key(FlowParams(), "anything")


def _traffic(shape: flood.FloodShape, requests: list[flood.Arrival]) -> Traffic:
    return expand(flood.base_of(requests, shape, "test"), 1, flood.classes_of(shape))


def test_claims_cost_what_the_fairness_says() -> None:
    shape = flood.FloodShape(clusters=1)
    requests = [
        flood.Arrival(0.0, flood.FLOOD, 200_000, "flood/0"),
        flood.Arrival(1.0, "steady0", 20_000, "steady0/0"),
    ]
    traffic = _traffic(shape, requests)
    assert claims_for(traffic, None) is None
    by_tokens = claims_for(traffic, TOKENS)
    assert by_tokens is not None
    assert [c.service for c in by_tokens] == [200_000.0, 20_000.0]
    assert by_tokens[0].tenant == core_tenants.tenant_key(flood.FLOOD)
    unit = FlowParams(tenant_header=flood.TENANT_HEADER, fairness=Fairness.REQUESTS)
    assert [c.service for c in claims_for(traffic, unit) or []] == [1.0, 1.0]


@pytest.fixture
def charged(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """The output charges made on the simulator's fair queues: (tenant, service)."""
    made: list[tuple[str, float]] = []
    real_charge = FairQueue.charge

    def spy(self: FairQueue[int], tenant: str, service: float, weight: float = 1.0) -> None:
        made.append((tenant, service))
        real_charge(self, tenant, service, weight)

    monkeypatch.setattr(FairQueue, "charge", spy)
    return made


def _one_cluster_run(fairness: Fairness) -> list[float]:
    """A flood request holds the whole budget; two more of the flood's and then one steady
    request wait behind it. Returns the TTFTs."""
    shape = flood.FloodShape(clusters=1, long_budget_tokens=200_000)
    requests = [
        flood.Arrival(0.0, flood.FLOOD, 200_000, "flood/0"),
        flood.Arrival(0.1, flood.FLOOD, 200_000, "flood/1"),
        flood.Arrival(0.2, flood.FLOOD, 200_000, "flood/2"),
        flood.Arrival(0.3, "steady0", 20_000, "steady0/0"),
    ]
    traffic = _traffic(shape, requests)
    classes = flood.classes_of(shape)
    scenario = prepare(traffic, flood.fleet_of(shape), 1, ())
    flow = FlowParams(tenant_header=flood.TENANT_HEADER, fairness=fairness)
    run = run_policy(scenario, SimConfig(classes, flow=flow), flood.POLICY)
    assert run.status.tolist() == [SERVED] * 4 and run.leaked_tickets == 0
    ttft: list[float] = run.ttft.tolist()
    return ttft


def test_tokens_fairness_serves_the_steady_tenant_before_the_floods_backlog(
    charged: list[tuple[str, float]],
) -> None:
    fifo = _one_cluster_run(Fairness.FIFO)
    fifo_charged = list(charged)
    charged.clear()
    fair = _one_cluster_run(Fairness.TOKENS)
    fair_charged = list(charged)
    # FIFO: the steady request waits out both queued flood requests; tokens: one of them.
    assert fifo[3] > fifo[2]
    assert fair[3] < fair[2]
    assert fair[3] < fifo[3]
    # Only requests that waited are charged their output (2 x 200 tokens under tokens
    # fairness); FIFO charges nothing.
    assert {s for _t, s in fifo_charged} <= {0.0}
    flood_key = core_tenants.tenant_key(flood.FLOOD)
    assert (flood_key, 400.0) in fair_charged
    assert len(fair_charged) == 3  # flood/1, flood/2 and the steady one; flood/0 never waited


def test_the_no_flood_run_sees_the_same_steady_and_short_requests() -> None:
    shape = flood.FloodShape(seconds=90.0, clusters=2)
    with_flood = flood.arrivals(shape, "heavy", True, 7)
    without = flood.arrivals(shape, "heavy", False, 7)
    assert [a for a in with_flood if a.tenant != flood.FLOOD] == without
    assert any(a.tenant == flood.FLOOD for a in with_flood)
    assert flood.arrivals(shape, "heavy", True, 7) == with_flood
    assert flood.arrivals(shape, "heavy", True, 8) != with_flood
    steady = {a.tenant for a in without if a.tenant.startswith("steady")}
    assert len(steady) == flood.STEADY


def test_a_small_fleet_run_reports_fairness_figures() -> None:
    shape = flood.FloodShape(seconds=120.0, clusters=1)
    table = list(flood.rows(shape, 0))
    assert [(r["load"], r["order"]) for r in table] == [
        (load, order)
        for load in flood.LOADS
        for order in ("no flood", "fifo", "requests", "tokens")
    ]
    assert all(r["leaked_tickets"] == 0 for r in table)
    by = {(r["load"], r["order"]): r for r in table}
    for load in flood.LOADS:
        assert by[(load, "no flood")]["flood_share"] == 0.0
        assert by[(load, "no flood")]["steady_p99_over_no_flood"] == 1.0
    # Work-conserving: beside light steady tenants the flood takes what they leave, under
    # every order, and the class serves more than without it.
    for order in ("fifo", "requests", "tokens"):
        light = by[("light", order)]
        assert light["flood_share"] > 0.4
        assert light["long_tokens_per_s"] > 1.5 * by[("light", "no flood")]["long_tokens_per_s"]
    assert jain([1.0, 1.0]) == 1.0 and jain([1.0, 0.0]) == 0.5


def test_the_short_class_waits_for_lanes_the_floods_long_class_fills() -> None:
    """The short class has no budget: its TTFT beyond its own prefill is a wait for a lane.
    Beside light steady tenants nothing fills the 8 lanes; with the flood the long class keeps
    its budget full and its waiters enter as room frees, so short requests find every lane
    taken."""
    shape = flood.FloodShape(seconds=120.0, clusters=1)
    base = flood.run_one(shape, "light", False, Fairness.TOKENS, 0)
    out = flood.run_one(shape, "light", True, Fairness.TOKENS, 0)
    quiet, flooded = flood.row(shape, base, base), flood.row(shape, out, base)
    capacity = shape.lanes * shape.lane_prefill_tps
    for r in (quiet, flooded):
        assert r["long_lane_share"] == pytest.approx(r["long_tokens_per_s"] / capacity)
        assert 0.0 <= r["short_waited"] <= 1.0
    assert quiet["short_waited"] < 0.01 < flooded["short_waited"]
    assert flooded["long_lane_share"] > 2 * quiet["long_lane_share"]
    # Every served short request's TTFT is its prefill, plus a wait only when it waited.
    prefill_s = shape.short_tokens / shape.lane_prefill_tps
    over = [t - prefill_s for t in out.ttft["short"]]
    assert min(over) == pytest.approx(0.0, abs=1e-9)
    assert sum(w > flood.LANE_WAIT_S for w in over) == out.short_waited


def test_the_command_prints_the_table_and_writes_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "flood.json"
    code = main(
        [
            "simulate", "--workload", "tenant-flood", "--clusters", "1",
            "--flood-seconds", "65", "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    summary = json.loads(out.read_text())
    assert summary["workload"] == "tenant-flood" and len(summary["rows"]) == 8
    assert summary["shape"]["clusters"] == 1 and summary["shape"]["seconds"] == 65.0
    printed = capsys.readouterr().out
    assert "Jain steady" in printed and "no flood" in printed and "tokens" in printed


def test_the_long_budget_can_also_cap_requests_in_flight(
    capsys: pytest.CaptureFixture[str],
) -> None:
    long = flood.classes_of(flood.FloodShape(long_budget_concurrent=8))[-1]
    assert long.budget.max_concurrent == 8
    assert long.budget.max_inflight_tokens == flood.FloodShape().long_budget_tokens
    assert flood.classes_of(flood.FloodShape())[-1].budget.max_concurrent == 0
    with pytest.raises(SystemExit):
        main(["simulate", "--workload", "tenant-flood", "--flood-long-concurrent", "-1"])
    assert "must be >= 0" in capsys.readouterr().err

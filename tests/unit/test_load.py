"""Load reports from response headers, and the snapshot's notion of fresh signals."""

from __future__ import annotations

import pytest

from extproc.core.load import (
    FLEET_LOAD_HEADER,
    ORCA_HEADER,
    ClusterLoad,
    FleetSnapshot,
    LoadReport,
    parse_fleet_load,
    parse_load_headers,
    parse_orca,
)

# Exactly what the simulated cluster sends (extproc.harness.sim_cluster._response_headers).
SIM_ORCA = (
    "TEXT cpu_utilization=0.0469, mem_utilization=0.9012, named_metrics.kv_cache=0.9012, "
    "named_metrics.queue=12, named_metrics.inflight=3"
)


def test_orca_text_as_the_simulated_cluster_sends_it() -> None:
    assert parse_orca(SIM_ORCA) == LoadReport(
        kv=0.9012, queue=12, inflight=3, cpu=0.0469, source="orca"
    )


def test_orca_kv_falls_back_to_mem_utilization() -> None:
    report = parse_orca("TEXT cpu_utilization=0.5, mem_utilization=0.7")
    assert report is not None
    assert report.kv == 0.7 and report.queue is None and report.inflight is None


def test_orca_kv_cache_wins_over_mem_utilization() -> None:
    report = parse_orca("TEXT mem_utilization=0.2,named_metrics.kv_cache=0.95")
    assert report is not None and report.kv == 0.95


def test_orca_json_form() -> None:
    report = parse_orca(
        'JSON {"cpu_utilization": 0.3, "mem_utilization": 0.4, '
        '"named_metrics": {"kv_cache": 0.88, "queue": 5}, "request_cost": {"x": 1}}'
    )
    assert report == LoadReport(kv=0.88, queue=5, inflight=None, cpu=0.3, source="orca")


def test_orca_unknown_standard_keys_are_ignored_not_fatal() -> None:
    report = parse_orca("TEXT rps_fractional=10, eps=0.1, named_metrics.kv_cache=0.5")
    assert report is not None and report.kv == 0.5


def test_utilisation_above_one_saturates_at_full() -> None:
    report = parse_orca("TEXT mem_utilization=1.7")
    assert report is not None and report.kv == 1.0


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("TEXT mem_utilization=0.5, mem_utilization=0.6", id="repeated-key"),
        pytest.param("TEXT mem_utilization=-0.1", id="negative"),
        pytest.param("TEXT mem_utilization=nan", id="not-finite"),
        pytest.param("TEXT mem_utilization=inf", id="infinite"),
        pytest.param("TEXT mem_utilization", id="pair-without-value"),
        pytest.param("TEXT =0.5", id="pair-without-key"),
        pytest.param("TEXT mem_utilization=lots", id="not-a-number"),
        pytest.param("TEXT cpu_utilization=0.5", id="nothing-placement-uses"),
        pytest.param("BIN CgQIARAB", id="binary-form-belongs-in-the-bin-header"),
        pytest.param("mem_utilization=0.5", id="no-format-word"),
        pytest.param("JSON [1, 2]", id="json-not-an-object"),
        pytest.param("JSON {bad", id="json-malformed"),
        pytest.param('JSON {"mem_utilization": "high"}', id="json-string-value"),
        pytest.param('JSON {"mem_utilization": true}', id="json-bool-value"),
        pytest.param('JSON {"named_metrics": [1]}', id="json-named-not-a-map"),
        pytest.param("", id="empty"),
    ],
)
def test_a_malformed_orca_report_is_rejected_whole(value: str) -> None:
    # Half a report would read as "no pressure" for the half that is missing.
    assert parse_orca(value) is None


def test_fleet_load_header() -> None:
    assert parse_fleet_load("kv=0.87,queue=12,inflight=3") == LoadReport(
        kv=0.87, queue=12, inflight=3, cpu=None, source="fleet"
    )
    assert parse_fleet_load(" kv = 0.5 ") == LoadReport(0.5, None, None, None, "fleet")
    assert parse_fleet_load("queue=4") == LoadReport(None, 4, None, None, "fleet")


@pytest.mark.parametrize(
    "value",
    ["kv=0.5,kv=0.6", "kv=-1", "kv", "kv=x", "other=1", ""],
    ids=["repeated", "negative", "no-value", "not-a-number", "unknown-only", "empty"],
)
def test_a_malformed_fleet_load_header_is_rejected(value: str) -> None:
    assert parse_fleet_load(value) is None


def test_orca_wins_over_the_fallback_header_and_the_fallback_fills_in() -> None:
    both = {ORCA_HEADER: SIM_ORCA, FLEET_LOAD_HEADER: "kv=0.1,queue=0,inflight=0"}
    report = parse_load_headers(both)
    assert report is not None and report.source == "orca" and report.kv == 0.9012
    broken_orca = {ORCA_HEADER: "TEXT garbage", FLEET_LOAD_HEADER: "kv=0.1"}
    report = parse_load_headers(broken_orca)
    assert report is not None and report.source == "fleet" and report.kv == 0.1
    assert parse_load_headers({"content-type": "application/json"}) is None


def test_signals_age_out() -> None:
    load = ClusterLoad(inflight=2, kv=0.9, reported_inflight=7, reported_at=100.0)
    assert load.fresh(105.0, 10.0)
    assert load.kv_pressure(105.0, 10.0) == 0.9
    assert load.load(105.0, 10.0) == 7  # the cluster sees every replica's traffic
    assert not load.fresh(110.5, 10.0)
    assert load.kv_pressure(110.5, 10.0) is None
    assert load.load(110.5, 10.0) == 2  # only this processor's own count is still current


def test_own_inflight_is_a_floor_under_a_stale_looking_report() -> None:
    load = ClusterLoad(inflight=9, reported_inflight=3, reported_at=0.0)
    assert load.load(1.0, 10.0) == 9


def test_a_cluster_missing_from_the_snapshot_is_idle_and_healthy() -> None:
    snap = FleetSnapshot.of({"c1": ClusterLoad(inflight=3)})
    assert snap.get("c1").inflight == 3
    missing = snap.get("c9")
    assert missing.inflight == 0 and missing.healthy and missing.reported_at is None

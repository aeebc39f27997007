"""The main job (`extproc demo`) on a small scale, two models: it must keep telling the truth."""

from __future__ import annotations

from pathlib import Path

from extproc.harness.demo import run_demo


def test_demo_reports_affinity_failover_and_bulkheads(tmp_path: Path) -> None:
    report = run_demo(tmp_path, clusters=3, sessions=12, turns=3, workers=4)
    steady = report["steady"]
    assert isinstance(steady, dict)
    assert steady["requests"] == 36 and steady["ok"] == 36
    assert steady["sessions_on_one_cluster"] == "12/12"
    assert steady["requests_on_predicted_primary"] == "36/36"
    assert 0.3 < float(steady["cache_hit_ratio_after_first_turn"]) < 1.0
    models = report["models"]
    assert isinstance(models, dict)
    assert models["listed"] == ["demo", "demo-large", "demo-small"]
    assert models["requests_on_a_cluster_serving_their_model"] == "36/36"
    assert models["unknown_model_status"] == 404
    failover = report["failover"]
    assert isinstance(failover, dict)
    assert failover["failed_during_outage"] == 0
    moved = failover["requests_of_moved_sessions"]
    assert isinstance(moved, int) and moved > 0
    assert failover["moved_to_pre_assigned_secondary"] == moved
    assert failover["killed"] not in failover["moved_sessions_per_survivor"]  # type: ignore[operator]
    bulkhead = report["bulkhead"]
    assert isinstance(bulkhead, dict)
    assert bulkhead["short"] == {"200": 24}
    assert bulkhead["long"].get("429", 0) > 0 and bulkhead["long"].get("200", 0) > 0  # type: ignore[union-attr]
    assert all(s >= 1 for s in bulkhead["retry_after_s"])  # type: ignore[union-attr]
    assert bulkhead["long_after_burst"] == 200

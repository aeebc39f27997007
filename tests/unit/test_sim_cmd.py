"""``extproc simulate`` from the command line: table, JSON, PNG, progress, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.cli import main
from extproc.sim.cmd import parse_budget, parse_slo
from extproc.sim.events import Kind, parse_event, validate
from tests.support.traces import write_mooncake_trace


def test_simulate_writes_table_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_mooncake_trace(tmp_path / "t.jsonl", sessions=600)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(
        [
            "simulate", "--trace", str(trace), "--clusters", "6", "--sessions", "2000",
            "--burst", "0.2T,0.1T,0.5x,120000", "--jobs", "1",
            "--json", str(out_json), "--png", str(out_png),
        ]
    )  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    assert "hash-2+bulkheads+spill" in captured.out
    # The default policy set shows the processor's default placement.
    assert "product-default" in captured.out
    assert "remapped" in captured.out and "re-prefilled" in captured.out
    assert "simulate [" in captured.err  # the progress bar
    summary = json.loads(out_json.read_text())
    assert set(summary["policies"]) == {
        "round-robin", "least-loaded", "hash-primary", "hash-2", "product-default",
        "hash-2+bulkheads",
        "hash-2+bulkheads+spill", "hash-2+bulkheads+affinity", "hash-2+bulkheads+flow",
    }  # fmt: skip
    assert summary["workload"]["sessions"] >= 2000
    assert summary["windows"] and summary["bursts"][0]["input_tokens"] == 120000
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synthetic_workload_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate", "--workload", "synthetic", "--synthetic-duration", "40",
            "--clusters", "4", "--no-events", "--policies", "round-robin,hash-2",
            "--quiet", "--json", str(tmp_path / "s.json"),
        ]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    pol = summary["policies"]
    assert pol["hash-2"]["hit_ratio"] > pol["round-robin"]["hit_ratio"]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--event", "explode:c1@5"], "event kind"),
        (["--event", "fail:c99@5"], "unknown cluster"),
        (["--event", "recover:c1@5"], "not down"),
        (["--burst", "1,2,3"], "START,DURATION,RATE,TOKENS"),
        (["--window", "5,1"], "END must be after START"),
    ],
)
def test_bad_scripts_are_refused_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    trace = write_mooncake_trace(tmp_path / "t.jsonl", sessions=600)
    code = main(["simulate", "--trace", str(trace), "--clusters", "4", "--quiet", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_unknown_policy_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--trace", "x.jsonl", "--policies", "random"])
    assert exc.value.code == 2
    assert "unknown policies" in capsys.readouterr().err


def test_a_missing_trace_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(tmp_path / "none.jsonl"), "--quiet"]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_budget_slo_and_event_syntax() -> None:
    budget = parse_budget("concurrent=2,inflight=300000,rate=5000.5,burst=10000")
    assert (budget.max_concurrent, budget.max_inflight_tokens) == (2, 300000)
    assert (budget.tokens_per_second, budget.burst_tokens) == (5000.5, 10000)
    assert not parse_budget("none").enforced
    assert parse_slo("short=1.5,long=90") == {"short": 1.5, "long": 90.0}
    event = parse_event("remove:c3@0.5T", period=200.0)
    assert (event.kind, event.cluster, event.time_s) == (Kind.REMOVE, "c3", 100.0)
    with pytest.raises(ValueError, match="already down"):
        validate([parse_event("fail:c1@1", 10), parse_event("fail:c1@2", 10)], ["c1", "c2"], [])
    with pytest.raises(ValueError, match="last cluster"):
        validate([parse_event("remove:c1@1", 10)], ["c1"], [])

"""`extproc chaos`: the per-row bound and the diagnosis of a peak (reliability/chaos_bounds.py)."""

from __future__ import annotations

from pathlib import Path

import orjson

from extproc.reliability.chaos_bounds import (
    LogCursor,
    bound_for,
    diagnose,
    fail_open,
    fail_open_allowed,
    peak_of,
    read_admissions,
)

LIMITS = {"short": 4, "medium": 2, "long": 1}


def test_each_row_gets_the_bound_of_the_mechanisms_its_fault_brings() -> None:
    # The ledger answered every call: no mechanism may admit past a budget.
    assert bound_for("(baseline, no fault)", LIMITS, 2, 2, 0) == (
        {"short": 0, "medium": 0, "long": 0},
        [],
    )
    # Local fallback: two replicas, each a share of max(1, budget // redis.replicas).
    assert bound_for("config reload", LIMITS, 2, 2, 5)[0] == {"short": 4, "medium": 2, "long": 2}
    # redis.replicas left at 1 with two processors: each local share is a whole budget.
    assert bound_for("config reload", LIMITS, 2, 1, 5)[0] == {"short": 8, "medium": 4, "long": 2}
    lost, parts = bound_for("Redis restarted (state lost)", LIMITS, 2, 2, 3)
    assert parts == ["local fallback", "ledger state lost"]
    assert lost == {"short": 8, "medium": 4, "long": 3}
    failover, parts = bound_for("cluster killed", LIMITS, 2, 2, 3)
    assert parts == ["local fallback", "failover"]
    # The secondary's own fallback plus the failing cluster's whole compartment (its budget
    # and its fallback).
    assert failover == {"short": 12, "medium": 6, "long": 5}
    assert bound_for("cluster erroring 503", LIMITS, 2, 2, 0)[0] == LIMITS


def test_the_peak_is_the_most_requests_running_at_one_instant() -> None:
    intervals = [
        ("a", "short", 0.0, 1.0),
        ("b", "short", 0.5, 2.0),
        ("c", "short", 1.0, 3.0),  # starts as "a" ends: not counted together
        ("d", "short", 1.5, 2.5),
        ("e", "medium", 0.0, 9.0),
    ]
    assert peak_of(intervals, "short") == (3, 1.5, ["b", "c", "d"])
    assert peak_of(intervals, "medium") == (1, 0.0, ["e"])
    assert peak_of(intervals, "long") == (0, 0.0, [])


def _line(msg: str, rid: str, ts: float, **extra: object) -> dict[str, object]:
    return {"msg": msg, "request_id": rid, "ts": ts, **extra}


def test_the_diagnosis_says_what_ran_at_the_peak() -> None:
    lines = {
        0: [
            _line("routed", "r1", 100.0, primary="c2", ledger="redis", config_version="v1"),
            _line("routed", "r2", 100.1, primary="c2", ledger="memory", config_version="v1"),
            _line("routed", "r3", 100.1, primary="c1", ledger="redis", config_version="v2"),
            _line("charge moved", "r3", 100.3, to="c2"),
            _line("released", "r2", 100.2),  # before the upstream ended
        ],
        1: [_line("routed", "r4", 100.2, primary="c2", ledger="memory", config_version="v2")],
    }
    admissions = read_admissions(lines)
    assert admissions["r3"].moved_to == "c2" and admissions["r4"].processor == 1
    upstream = {
        "c2": [
            ("r1", "medium", 100.05, 101.0),
            ("r2", "medium", 100.15, 101.0),
            ("r3", "medium", 100.2, 101.0),
            ("r4", "medium", 100.25, 101.0),
            ("r5", "medium", 100.3, 101.0),  # no processor line: failed open
        ],
        "c1": [("r6", "short", 100.0, 100.5)],
    }
    found = diagnose(upstream, admissions, LIMITS, began_wall=99.0)
    assert set(found) == {"medium"}  # short stayed within its budget
    medium = found["medium"]
    assert (medium["cluster"], medium["peak"], medium["at_s"]) == ("c2", 5, 1.3)
    assert medium["admitted_by"] == {"redis": 2, "memory": 2}
    assert medium["admitted_on_another_cluster"] == {"c1": 1}
    assert medium["released_before_the_upstream_ended"] == 1
    assert medium["unknown_to_the_processors"] == 1
    assert medium["config_versions"] == {"v1": 2, "v2": 2}
    assert medium["processors"] == {"0": 3, "1": 1}


def test_the_log_cursor_reads_only_new_complete_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "extproc-0.log"
    cursor = LogCursor(path)
    assert cursor.new_lines() == []  # no file yet
    first = orjson.dumps({"msg": "routed", "request_id": "a"})
    path.write_bytes(b"READY grpc=1 metrics=2\n" + first + b"\n" + first[:10])
    assert [d["request_id"] for d in cursor.new_lines()] == ["a"]
    with path.open("ab") as f:
        f.write(first[10:] + b"\n")
    assert [d["request_id"] for d in cursor.new_lines()] == ["a"]  # the line completed
    assert cursor.new_lines() == []


def test_requests_without_a_class_are_reported_as_fail_open() -> None:
    admissions = read_admissions({0: [_line("routed", "late", 100.5, primary="c1")]})
    upstream = {
        "c1": [("late", "", 101.0, 101.5), ("ok", "short", 101.0, 102.0)],
        "c2": [("never", "", 103.0, 103.1)],
    }
    assert fail_open(upstream, admissions, began_wall=100.0) == {
        "count": 2,
        "first_s": 1.0,
        "last_s": 3.0,
        "by_cluster": {"c1": 1, "c2": 1},
        "decided_too_late": 1,
    }
    assert fail_open({"c1": [("ok", "short", 1.0, 2.0)]}, admissions, 0.0) == {}


def test_fail_open_is_allowed_only_while_a_replica_is_taken_away() -> None:
    assert fail_open_allowed("processor SIGKILL")
    assert fail_open_allowed("processor SIGTERM (rolling restart)")
    assert not fail_open_allowed("config reload: add + remove a cluster")
    assert not fail_open_allowed("client abort storm")

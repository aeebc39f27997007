"""CI's one short pass of the chaos schedule (`extproc chaos`, 2-second faults).

The full run (10-second faults, figures in RELIABILITY.md) is the same command with defaults.
Here: every fault of the schedule is carried out and measured, the fault-free baseline is
clean, traffic recovers after every fault, and no budget is left held after settling.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

FAULTS = 14  # the baseline and thirteen faults
# A hang guard, not a speed bound: the schedule takes ~6 minutes on a quiet machine and several
# times that on a starved one (each processor restart alone took 20 s there).
RUN_LIMIT_S = 2400

pytestmark = pytest.mark.timeout(RUN_LIMIT_S + 60)


def test_one_short_pass_of_the_fault_schedule(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    argv = [sys.executable, "-m", "extproc", "chaos", "--hold-s", "2", "--settle-s", "15"]
    argv += ["--recover-cap-s", "30", "--between-s", "1", "--out", str(out)]
    argv += ["--hit-window-s", "10", "--hit-warmup-s", "10"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_LIMIT_S, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = orjson.loads((out / "chaos.json").read_bytes())["results"]
    assert len(results) == FAULTS, [r["fault"] for r in results]
    baseline = results[0]
    assert baseline["fault"].startswith("(baseline")
    assert baseline["requests"] > 20
    assert baseline["failed"] == 0 and baseline["truncated"] == 0
    if baseline["redis_errors"] == 0:
        # With the shared ledger answering, no class may exceed its budget on any cluster. (A
        # loaded machine can time Redis calls out; replicas then admit on local budgets, which
        # the fault rows measure.)
        assert all(v == 0 for v in baseline["over_admission"].values()), baseline
    for r in results:
        assert r["note"] == "", r
        assert r["requests"] > 0, r
        assert r["recover_s"] is not None, r
        assert r["held_after_settle"] == 0, r
        # Each row is held to the bound of its fault, and a class over its budget is
        # explained by what ran at its peak (which ledger admitted it, on which cluster).
        assert r["verdict"] in ("PASS", "FAIL") and set(r["bound"]) == set(r["over_admission"])
        over = [k for k, v in r["over_admission"].items() if v > 0]
        assert all(k in r["diagnosis"] for k in over), r
    # The restart row measured the prefix-cache hit ratio before and after the restart.
    (restart,) = [r for r in results if "hit ratio" in r["fault"]]
    hits = restart["hit_ratio"]
    assert hits["steady"] and hits["after_restart"] is not None and hits["relative"], hits

"""``extproc simulate --sessions N`` estimates the work up front and refuses what would not fit
(issue: 50,000 copies of a 12k-request trace were OOM-killed at 24 GiB with no warning)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from extproc.cli import main
from extproc.sim.scenario import BYTES_PER_REQUEST, SimOptions, build, check_size
from extproc.sim.traffic import base_from_trace, mooncake_like
from tests.support.traces import write_mooncake_trace


def test_the_issue_case_is_refused_before_any_allocation() -> None:
    options = SimOptions(sessions=50_000 * 4_000, memory_limit_bytes=24 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"over the 24\.0 GiB limit") as err:
        check_size(options, 12_000, 50_000)
    assert "600,000,000 requests" in str(err.value)
    assert "At most" in str(err.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB


def test_a_run_that_fits_is_sized_and_runs() -> None:
    base = base_from_trace(mooncake_like(seed=1, sessions=200, duration_s=300.0))
    options = SimOptions(sessions=400, memory_limit_bytes=1 << 30, policies=("hash-primary",))
    assert check_size(options, len(base), 2) == 2 * len(base)
    prepared = build(options, base)
    assert len(prepared.scenario.traffic) >= 2 * len(base)


def test_the_limit_counts_every_worker() -> None:
    one = SimOptions(sessions=10, memory_limit_bytes=BYTES_PER_REQUEST * 1000, jobs=1)
    four = SimOptions(sessions=10, memory_limit_bytes=BYTES_PER_REQUEST * 1000, jobs=4)
    assert check_size(one, 500, 2) == 1000
    with pytest.raises(ValueError):
        check_size(four, 500, 2)


def test_the_command_refuses_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_mooncake_trace(tmp_path / "t.jsonl", sessions=300)
    code = main(
        [
            "simulate", "--trace", str(trace), "--clusters", "4", "--quiet",
            "--sessions", "100000000", "--memory-limit-gb", "1",
        ]
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "--sessions 100000000 needs" in err and "lower --sessions" in err

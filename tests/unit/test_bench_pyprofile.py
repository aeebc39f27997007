"""`bench profile --python`: the profiler a signal switches, and its per-request table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from extproc.bench import pyprofile
from extproc.bench.profile import Profile, python_table


def _work(n: int) -> int:
    return sum(i * i for i in range(n))


def test_the_first_signal_starts_the_profile_and_the_second_writes_it(tmp_path: Path) -> None:
    out = tmp_path / "p.prof"
    toggle = pyprofile._Toggle(str(out))
    _work(10)  # before: not counted
    toggle(pyprofile.SIGNAL, None)
    for _ in range(4):
        _work(1000)
    toggle(pyprofile.SIGNAL, None)
    _work(10)  # after: not counted
    total, rows = pyprofile.per_request(out, requests=2)
    work = next(r for r in rows if r.function.endswith("(_work)"))
    assert work.calls_per_req == 2.0  # 4 calls over 2 "requests"
    assert work.total_us_per_req > 0
    assert total >= work.self_us_per_req
    assert rows == sorted(rows, key=lambda r: r.self_us_per_req, reverse=True)


def test_a_processor_command_line_is_wrapped_and_others_are_refused(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "extproc", "serve", "--config", "f.yaml"]
    wrapped = pyprofile.wrapped(argv, tmp_path / "x.prof")
    assert wrapped == [
        sys.executable,
        "-m",
        "extproc.bench.pyprofile",
        str(tmp_path / "x.prof"),
        "extproc",
        "serve",
        "--config",
        "f.yaml",
    ]
    with pytest.raises(ValueError):
        pyprofile.wrapped([sys.executable, "-P", "-m", "extproc"], tmp_path / "x.prof")


def test_the_table_lists_each_profiled_set_up() -> None:
    row = pyprofile.Row("pipeline/pipeline.py:1(decide)", 1.0, 12.5, 40.0)
    profiles = [
        Profile("bare", 100, 50.0, 1.0, 600.0, 500.0, python_us_per_req=200.0),
        Profile("extproc", 100, 50.0, 1.0, 900.0, 500.0, python_us_per_req=500.0, functions=[row]),
        Profile("envoy", 100, 50.0, 1.0, None, 150.0),
    ]
    lines = python_table(profiles)
    assert "| bare | 200 | 0 |" in lines
    assert "| extproc | 500 | 1 |" in lines
    assert "| pipeline/pipeline.py:1(decide) | 1.00 | 12.5 | 40.0 |" in lines
    assert not any(line.startswith("| envoy") for line in lines)

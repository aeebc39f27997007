"""`.ci/run` ends a failed run with what failed: every failed gate or tier and every failed test
with its reason, read from make's log and the tiers' JUnit reports (`.ci/failures.py`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "failures.py"

STREAM_REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" tests="3">
<testcase classname="tests.stream.test_a" name="test_passes" time="0.1"/>
<testcase classname="tests.stream.test_a" name="test_fails" time="0.2">
<failure message="AssertionError: assert 3 == 4&#10;second line">trace</failure></testcase>
<testcase classname="tests.stream.test_b" name="test_setup_breaks" time="0.0">
<error message="failed on setup with &quot;OSError: port in use&quot;">trace</error></testcase>
</testsuite></testsuites>
"""

MAKE_LOG = """ruff check extproc tests
All checks passed!
make: *** [Makefile:61: stream] Error 1
make: *** [Makefile:58: typecheck] Error 1
make: Target 'test' not remade because of errors.
"""


def _run(tmp_path: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "make.log"), str(tmp_path / "reports")],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_every_failed_tier_and_test_is_named_with_its_reason(tmp_path: Path) -> None:
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "stream.xml").write_text(STREAM_REPORT)
    (tmp_path / "reports" / "unit.xml").write_text(
        '<testsuites><testsuite name="pytest"><testcase classname="tests.unit.test_c" '
        'name="test_ok"/></testsuite></testsuites>'
    )
    (tmp_path / "make.log").write_text(MAKE_LOG)
    out = _run(tmp_path)
    assert "  stream (Error 1)" in out
    assert "  typecheck (Error 1)" in out
    assert "[stream] FAILED tests.stream.test_a::test_fails - AssertionError: assert 3 == 4" in out
    assert "second line" not in out
    setup = '[stream] ERROR tests.stream.test_b::test_setup_breaks - failed on setup with "OSError'
    assert setup in out
    assert "test_passes" not in out and "test_ok" not in out
    assert "Failed tests (2):" in out


def test_a_gate_failure_without_failed_tests_is_still_named(tmp_path: Path) -> None:
    (tmp_path / "make.log").write_text("make: *** [Makefile:52: lint] Error 1\n")
    out = _run(tmp_path)
    assert "  lint (Error 1)" in out
    assert "Failed tests: none" in out

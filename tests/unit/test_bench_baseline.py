"""`extproc bench overhead --baseline REV` runs the older tree's code, not this one's.

Run from the repository (as the documented commands are), `python -m extproc` puts the working
directory first on sys.path, ahead of PYTHONPATH: the "baseline" set-up then ran this tree. The
bench's interpreter drops the working directory (-P) and checks where extproc comes from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.bench import overhead
from extproc.config import load_runtime

REPO = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "extproc").mkdir(parents=True)
    (tmp_path / "extproc" / "__init__.py").write_text("")
    return tmp_path


def test_the_baseline_interpreter_imports_the_older_tree_from_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    tree = _tree(tmp_path)
    overhead.assert_runs_from(tree, {"PYTHONPATH": str(tree)})


def test_the_check_fails_where_the_working_directory_would_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(overhead, "BASELINE_PYTHON", (overhead.sys.executable,))
    tree = _tree(tmp_path)
    with pytest.raises(RuntimeError, match="not from"):
        overhead.assert_runs_from(tree, {"PYTHONPATH": str(tree)})


def test_the_baseline_runs_the_config_of_the_row_it_is_compared_with(tmp_path: Path) -> None:
    """Compared with the extproc row (the body path) the baseline must read bodies too: with
    the defaults it took the header path and looked ~25 % cheaper than the body path."""
    (tmp_path / "b").mkdir()
    (tmp_path / "h").mkdir()
    body = overhead.Bench(tmp_path / "b", 1.0, "wrk")
    header = overhead.Bench(tmp_path / "h", 1.0, "wrk", baseline_path="header")
    assert load_runtime(body.setup_config(overhead.BASELINE_SETUP)).decide_at_headers is False
    assert load_runtime(body.setup_config("extproc")).decide_at_headers is False
    assert load_runtime(header.setup_config(overhead.BASELINE_SETUP)).decide_at_headers is True


def test_the_baseline_table_pairs_the_baseline_with_its_row() -> None:
    def result(setup: str, cpu: float) -> overhead.WrkResult:
        return overhead.WrkResult(setup, "1KB", 1, 100, 50.0, 1.0, 2.0, 0, cpu, 0, 0.0, 80.0)

    results = [result("extproc", 900.0), result("header", 700.0), result("baseline", 800.0)]
    body = overhead._against_baseline({(r.setup, r.size, r.connections): r for r in results})
    assert "| 800 / 900 |" in body[-1]
    header = overhead._against_baseline(
        {(r.setup, r.size, r.connections): r for r in results}, "header"
    )
    assert "| 800 / 700 |" in header[-1]


def test_the_baseline_processor_is_started_with_that_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only its Envoy: the processor too (it was given the defaults, the header path)."""
    monkeypatch.setattr(overhead, "assert_runs_from", lambda _tree, _env: None)
    (tmp_path / "w").mkdir()
    bench = overhead.Bench(tmp_path / "w", 1.0, "wrk", baseline_src=tmp_path)
    baseline = bench.processor(overhead.BASELINE_SETUP)
    extproc = bench.processor("extproc")
    assert baseline is not None and extproc is not None
    config = baseline.argv[baseline.argv.index("--config") + 1]
    assert load_runtime(Path(config)).decide_at_headers is False
    assert config == extproc.argv[extproc.argv.index("--config") + 1]


def test_a_baseline_from_before_the_header_path_runs_its_defaults(tmp_path: Path) -> None:
    """A revision without ``processor.read_body`` (a044179, issue 11's baseline) forbids the
    unknown key and did not start; its defaults are the body path, its only one."""
    old = _tree(tmp_path / "old")
    (old / "extproc" / "config").mkdir()
    (old / "extproc" / "config" / "schema.py").write_text("class ProcessorConfig: ...\n")
    (tmp_path / "w").mkdir()
    bench = overhead.Bench(tmp_path / "w", 1.0, "wrk", baseline_src=old)
    assert bench.setup_config(overhead.BASELINE_SETUP) == bench.fleet_path
    assert "read_body" not in bench.fleet_path.read_text()
    (tmp_path / "h").mkdir()
    header = overhead.Bench(tmp_path / "h", 1.0, "wrk", baseline_src=old, baseline_path="header")
    with pytest.raises(ValueError, match="no header path"):
        header.setup_config(overhead.BASELINE_SETUP)

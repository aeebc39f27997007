"""`extproc bench overhead --baseline REV` runs the older tree's code, not this one's.

Run from the repository (as the documented commands are), `python -m extproc` puts the working
directory first on sys.path, ahead of PYTHONPATH: the "baseline" set-up then ran this tree. The
bench's interpreter drops the working directory (-P) and checks where extproc comes from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.bench import overhead

REPO = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "extproc").mkdir()
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

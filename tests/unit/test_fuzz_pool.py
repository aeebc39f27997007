"""The fuzz case pool is a function of the seed alone (RELIABILITY.md, defect 6).

The same seed drew different pools in a full CI run and in a run of the one test file, because
Hypothesis also draws literals mined from the source of every non-test module the process has
imported. A module imported between two draws must not change the pool.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from extproc.reliability.fuzz_cmd import draw_pool


def test_a_newly_imported_module_does_not_change_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = draw_pool(20, 2)
    # A local module full of literals a miner picks up: strings, small integers, byte strings.
    # (Without the fix this seed's pool differs from case 7 on; checked against 6.170.17.)
    literals = [f"fuzz-literal-{i}" for i in range(60)] + [str(i) for i in range(60)]
    source = "\n".join(
        [f"S{i} = {s!r}" for i, s in enumerate(literals)]
        + [f"I{i} = {i}" for i in range(60)]
        + [f"B{i} = {('b' * (i % 9 + 1)).encode()!r}" for i in range(60)]
    )
    (tmp_path / "pool_literals.py").write_text(source + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("pool_literals")
    try:
        after = draw_pool(20, 2)
    finally:
        sys.modules.pop(module.__name__, None)
    assert len(before) == 20
    assert after == before


def test_the_seed_chooses_the_pool() -> None:
    assert draw_pool(8, 1) == draw_pool(8, 1)
    assert draw_pool(8, 1) != draw_pool(8, 2)

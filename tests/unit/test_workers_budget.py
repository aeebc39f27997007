"""Several worker processes without a shared ledger cannot enforce one budget: a config error
with a clear message, instead of a 1/N share that refuses requests that fit (issue: a 20k-token
request with a 40k budget and 4 workers got a 413)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from extproc.config.load import parse_config
from extproc.config.runtime import Runtime, compile_runtime
from extproc.ledger.gate import workers_problem


def doc(budget: dict[str, Any] | None, redis_url: str | None = None) -> dict[str, Any]:
    cls: dict[str, Any] = {"name": "short"}
    if budget is not None:
        cls["budget"] = budget
    return {
        "version": 1,
        "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:8001"]}],
        "classes": [cls],
        "redis": {"url": redis_url},
    }


def rt(budget: dict[str, Any] | None, redis_url: str | None = None) -> Runtime:
    return compile_runtime(parse_config(doc(budget, redis_url)))


def test_budgets_with_several_workers_need_redis() -> None:
    budgeted = rt({"max_inflight_tokens": 40_000})
    problem = workers_problem(budgeted, 4)
    assert problem is not None
    assert "processor.workers is 4" in problem and "redis.url" in problem and "short" in problem
    assert workers_problem(budgeted, 1) is None
    assert workers_problem(rt({"max_concurrent": 4}, "redis://127.0.0.1:1/0"), 4) is None
    assert workers_problem(rt(None), 4) is None  # nothing to enforce


def test_serve_refuses_to_start_workers_without_a_shared_ledger(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc({"max_inflight_tokens": 40_000})))
    out = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--config", str(path), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "no redis.url is set" in out.stderr

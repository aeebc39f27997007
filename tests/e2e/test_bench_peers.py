"""`extproc bench peers --smoke`: the bench installs a peer router into its own virtualenv and
runs the processor, that peer and the direct floor on the same simulated engines, so the long
comparison cannot rot unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from extproc.bench.peers import DOC_BEGIN, DOC_END


@pytest.mark.timeout(900)  # about 2 minutes idle, the peer's install included; slower loaded
def test_smoke_runs_every_setup_and_writes_the_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\n{DOC_BEGIN}\nold tables\n{DOC_END}\n\nafter\n")
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    bench = subprocess.Popen(
        [sys.executable, "-m", "extproc", "bench", "peers", "--smoke", "--quiet",
         "--out-dir", str(out), "--doc", str(page)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        _stdout, stderr = bench.communicate(timeout=840)
    finally:
        if bench.poll() is None:
            bench.terminate()  # the bench stops its engines and routers on SIGTERM
            bench.communicate(timeout=60)
    assert bench.returncode == 0, stderr[-3000:]
    summary = orjson.loads((out / "peers.json").read_bytes())
    assert summary["peer_versions"] == {"sglang-router": "0.3.2"}
    rows = {row["setup"]: row for row in summary["runs"]["chat"]}
    assert set(rows) == {"extproc", "smg:cache_aware", "direct"}
    for row in rows.values():
        assert row["requests"] > 0
        assert row["failed"] == 0, row["errors"]
        assert row["probe_p50_s"] is not None  # one connection timed through every set-up
        # Counted by the engines themselves: every request reached one of the two.
        assert sum(row["engine_requests"].values()) >= row["requests"]
    for setup in ("extproc", "smg:cache_aware"):
        assert rows[setup]["hit_ratio"] is not None
        assert rows[setup]["router_cpu_ms_per_request"] > 0  # read from the router's /proc
        assert rows[setup]["router_rss_mb"] > 0
    text = page.read_text()
    assert "old tables" not in text and "smg cache_aware" in text and text.endswith("after\n")

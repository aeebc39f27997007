"""Mooncake-format trace files for the simulator's command-line tests."""

from __future__ import annotations

import json
from pathlib import Path

from extproc.sim.traffic import mooncake_like


def write_mooncake_trace(path: Path, sessions: int, seed: int = 4) -> Path:
    """Write a synthetic trace as Mooncake JSONL (the format `extproc simulate --trace` reads)."""
    trace = mooncake_like(seed=seed, sessions=sessions, duration_s=300.0)
    rows = (
        json.dumps(
            {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        for r in trace.requests
    )
    path.write_text("\n".join(rows) + "\n")
    return path

"""Figures of how fair a run was, shared by ``extproc bench fairness`` and the simulator's
tenant-flood workload: Jain's index of what each tenant was served, and a percentile."""

from __future__ import annotations

import math
from collections.abc import Sequence


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else float("nan")


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile by the nearest-rank rule (NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]

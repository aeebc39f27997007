"""The fairness figures the fairness benches share: Jain's index and a nearest-rank percentile.

``extproc bench fairness`` (the processor's queue on a virtual clock), ``extproc bench routing
--workload tenant-flood`` (through Envoy to simulated clusters) and the fleet simulator report
the same figures, computed by the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one
    takes everything; NaN when every value is 0 (or there are none)."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else float("nan")


def pct(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (the smallest value with at least q % of the values
    at or below it); NaN without values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]

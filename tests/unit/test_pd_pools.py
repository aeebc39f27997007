"""The P/D pool sizing model (extproc.sim.pd_pools): deterministic, and it shows the effects it
is for: short turns off the prefill queue with P/D, long turns starved by too few prefillers."""

from __future__ import annotations

import argparse

from extproc.harness.replay import percentile
from extproc.sim.pd_pools import Layout, add_arguments, simulate


def args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--seconds", "10"])
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def test_ratios_move_the_long_class_and_p_d_shields_short_turns() -> None:
    a = args()
    colocated = simulate(Layout("colocated", 0), a)
    starved = simulate(Layout("1:7", 1), a)
    even = simulate(Layout("4:4", 4), a)
    assert simulate(Layout("4:4", 4), a).ttft == even.ttft  # seeded: the same run twice
    p99 = {
        name: percentile(r.ttft["short"], 99)
        for name, r in (("colocated", colocated), ("even", even))
    }
    assert p99["even"] is not None and p99["colocated"] is not None
    # Short turns never wait behind a long prefill on a P/D decode cluster.
    assert p99["even"] < p99["colocated"]
    long_starved = percentile(starved.ttft["long"], 99)
    long_even = percentile(even.ttft["long"], 99)
    assert long_starved is not None and long_even is not None
    assert long_starved > 2 * long_even

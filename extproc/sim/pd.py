"""Disaggregated prefill/decode in the fleet simulator: roles, topology and the compiled plan.

A P/D run (``extproc simulate --pd P:D``) splits the base clusters into ``islands`` equal
InfiniBand islands; in each, the first clusters take the ``prefill`` role and the others
``decode``, at the ratio asked for (16:48 at 64 clusters and 8 islands: 2 prefill + 6 decode
per island). Every cluster is its own NVLink domain (a rack behind one name), so a prefill and
a decode cluster meet over the island's fabric, or across islands.

Nothing here decides: the fleet is written as the fleet.yaml a user would write (roles,
topology labels and bandwidths, the disaggregated classes with their prefill budgets) and
compiled by the processor's own compiler (``extproc.config.runtime.pd_plan``), so the prefill
choice the engine asks for per request is ``PdPlan.choose``, the call the pipeline makes
(``Pipeline._choose_prefill``), and its prefill budget the class ``PdPlan.prefill_classes``
gives the pipeline's ``_admit_prefill``. The loop (``sim/run.py``, ``sim/prefill.py``) runs
the request: prefill on the prefill cluster's lanes, then the uncached KV over the pair's link
(``Topology.bandwidth`` of their relation), then decode on the decode cluster without touching
its prefill lanes (``ClusterState.serve_remote``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.config.runtime import pd_plan
from extproc.config.schema import FleetConfig
from extproc.core.fleet import Budget, RequestClass
from extproc.core.pd import PdPlan

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
# The fabric of a P/D run, as in `extproc bench pd` (fleet.yaml gbytes_per_s).
NVLINK_GBPS = 900.0
ISLAND_GBPS = 50.0
CROSS_GBPS = 12.5
# The relation of a pair by core.pd tier, for this fleet's two levels.
TIER_NAMES = ("nvlink", "island", "cross")


@dataclass(frozen=True, slots=True)
class PdLayout:
    """What ``--pd`` asks for: prefill clusters per island, islands, disaggregated classes."""

    prefill_per_island: int
    islands: int = 8
    classes: tuple[str, ...] = ("medium", "long")
    prefill_budget: Budget = field(default_factory=Budget)
    kv_bytes_per_token: int = 327_680
    # fleet.yaml disaggregation.min_inflight / saturation_factor: the prefill choice's load
    # rule (core.pd), None: the shipped defaults.
    min_inflight: int | None = None
    saturation_factor: float | None = None

    def roles(self, n_base: int, n_total: int) -> tuple[str, ...]:
        """Per cluster (base clusters first, then spares): its role. Spares decode."""
        per = n_base // self.islands
        return tuple(
            PREFILL if i < n_base and i % per < self.prefill_per_island else DECODE
            for i in range(n_total)
        )

    def island(self, index: int, n_base: int) -> int:
        return index // (n_base // self.islands)


def parse_layout(
    text: str,
    clusters: int,
    islands: int,
    classes: Sequence[str] = ("medium", "long"),
    prefill_budget: Budget | None = None,
) -> PdLayout:
    """``P:D`` (fleet-wide prefill:decode clusters, e.g. ``16:48``): P + D must be the base
    fleet and split evenly over the islands, with at least one decode cluster per island."""
    head, sep, tail = text.partition(":")
    try:
        p, d = int(head), int(tail)
    except ValueError:
        raise ValueError(f"--pd must be P:D (prefill:decode clusters), got {text!r}") from None
    if not sep or p < 1 or d < 1:
        raise ValueError(f"--pd must be P:D with P, D >= 1, got {text!r}")
    if p + d != clusters:
        raise ValueError(f"--pd {text}: P + D = {p + d}, but the fleet has {clusters} clusters")
    if islands < 1 or clusters % islands or p % islands:
        raise ValueError(
            f"--pd {text}: {clusters} clusters and {p} prefill clusters must split evenly "
            f"over {islands} islands"
        )
    return PdLayout(p // islands, islands, tuple(classes), prefill_budget or Budget())


def fleet_document(
    layout: PdLayout,
    names: Sequence[str],
    n_base: int,
    classes: Sequence[RequestClass],
    endpoints: int = 1,
) -> dict[str, Any]:
    """The fleet.yaml of the run (as a mapping): what an operator would write for it.
    ``endpoints`` per cluster: one per prefill lane (a lane is one prefill engine)."""
    roles = layout.roles(n_base, len(names))
    unknown = set(layout.classes) - {c.name for c in classes}
    if unknown:
        raise ValueError(f"--pd-classes: unknown classes {sorted(unknown)}")
    b = layout.prefill_budget
    return {
        "version": 1,
        "clusters": [
            {
                "name": name,
                # One endpoint per prefill lane: the processor counts prefills in flight per
                # engine, and a lane is one engine's prefill queue.
                "endpoints": [f"{name}.sim:{8000 + e}" for e in range(endpoints)],
                "role": role,
                "topology": {"nvlink": f"nvl-{i}", "island": f"ib-{layout.island(i, n_base)}"},
            }
            for i, (name, role) in enumerate(zip(names, roles, strict=True))
        ],
        "topology": {
            "levels": [
                {"name": "nvlink", "gbytes_per_s": NVLINK_GBPS},
                {"name": "island", "gbytes_per_s": ISLAND_GBPS},
            ],
            "cross_gbytes_per_s": CROSS_GBPS,
        },
        "disaggregation": {
            "kv_bytes_per_token": layout.kv_bytes_per_token,
            **({"min_inflight": layout.min_inflight} if layout.min_inflight else {}),
            **({"saturation_factor": layout.saturation_factor} if layout.saturation_factor else {}),
        },
        "classes": [
            {
                "name": c.name,
                **({"max_input_tokens": c.max_input_tokens} if c.max_input_tokens else {}),
                "disaggregated": c.name in layout.classes,
                **(
                    {
                        "prefill_budget": {
                            "max_inflight_tokens": b.max_inflight_tokens,
                            "max_concurrent": b.max_concurrent,
                            "tokens_per_second": b.tokens_per_second,
                            "burst_tokens": b.burst_tokens,
                        }
                    }
                    if c.name in layout.classes
                    else {}
                ),
            }
            for c in classes
        ],
    }


@dataclass(frozen=True, slots=True)
class PdSim:
    """A compiled P/D run: the processor's plan, each cluster's role, and the disaggregated
    classes by index in the run's class tuple."""

    layout: PdLayout
    plan: PdPlan
    roles: tuple[str, ...]
    disaggregated: frozenset[int]

    @property
    def placeable(self) -> tuple[bool, ...]:
        """Clusters the session placer may choose (prefill-role clusters never: as in the
        processor, they are left out of every placer)."""
        return tuple(r != PREFILL for r in self.roles)


def compile_pd(
    layout: PdLayout,
    names: Sequence[str],
    n_base: int,
    classes: Sequence[RequestClass],
    endpoints: int = 1,
) -> PdSim:
    """Validate the run's fleet.yaml and compile it with the processor's compiler."""
    cfg = FleetConfig.model_validate(fleet_document(layout, names, n_base, classes, endpoints))
    plan = pd_plan(cfg, tuple(classes))
    if plan is None:  # pragma: no cover - parse_layout guarantees a disaggregated class
        raise ValueError("--pd: no disaggregated class")
    disaggregated = frozenset(i for i, c in enumerate(classes) if c.name in plan.pools)
    return PdSim(layout, plan, layout.roles(n_base, len(names)), disaggregated)

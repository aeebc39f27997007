"""The Grafana dashboard only queries metrics the processor really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from extproc.ledger.metrics import LedgerMetrics
from extproc.pipeline.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fleet-extproc.json"


def exported_names() -> set[str]:
    registry = CollectorRegistry()
    Metrics(registry)
    LedgerMetrics(registry)
    names: set[str] = set()
    for family in registry.collect():
        names.add(family.name)
        kind = family.type
        if kind == "counter":
            names.add(family.name + "_total")
        if kind == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names


def test_every_dashboard_query_names_an_exported_metric() -> None:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bfleet_[a-z_]+", e)}
    assert used, "the dashboard queries no fleet_* metric"
    missing = used - exported_names()
    assert not missing, f"dashboard uses metrics nobody exports: {sorted(missing)}"


def test_panels_do_not_overlap() -> None:
    doc = json.loads(DASHBOARD.read_text())
    cells: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not (cells & mine), panel["title"]
        cells |= mine

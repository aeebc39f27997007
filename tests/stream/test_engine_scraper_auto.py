"""``engine: auto``: the scraper reads each endpoint's engine from its own /metrics page (here
simulated llama.cpp and SGLang servers), over real HTTP."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from extproc.pipeline.engine_scraper import EngineScraper, ScrapeMetrics, ScrapePlan, ScrapeTarget
from tests.stream.test_engine_scraper import Reports, sample_value, sim

pytestmark = pytest.mark.timeout(30)


async def test_auto_reads_each_endpoints_engine_from_its_page() -> None:
    llama, sglang = await sim("l1", "llamacpp"), await sim("s1", "sglang")
    registry = CollectorRegistry()
    reports = Reports()
    plan = ScrapePlan(
        (
            ScrapeTarget("a", f"{llama.host}:{llama.port}", "auto"),
            ScrapeTarget("b", f"{sglang.host}:{sglang.port}", "auto"),
        ),
        interval_s=0.05,
        max_age_s=2.0,
        timeout_s=1.0,
    )
    scraper = EngineScraper(lambda: plan, reports, ScrapeMetrics(registry))
    try:
        await scraper.scrape_once(plan)
        await scraper.scrape_once(plan)
    finally:
        await llama.close()
        await sglang.close()
        await scraper.close()
    llama_report, _ = reports.latest["a"]
    sglang_report, _ = reports.latest["b"]
    assert llama_report is not None and sglang_report is not None
    assert llama_report.kv is None  # llama.cpp exports no KV-use gauge
    assert sglang_report.kv == 0.0
    for cluster in ("a", "b"):
        assert (
            sample_value(registry, "fleet_engine_scrapes_total", cluster=cluster, outcome="ok") == 2
        )

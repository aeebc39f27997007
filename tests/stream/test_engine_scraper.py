"""The engine scraper over real HTTP against simulated vLLM / SGLang endpoints: reports per
cluster, staleness, failures counted, the prefix-cache hit ratio."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.core.load import LoadReport
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster
from extproc.pipeline.engine_scraper import EngineScraper, ScrapeMetrics, ScrapePlan, ScrapeTarget

pytestmark = pytest.mark.timeout(30)

FAST = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=0.001)


async def sim(name: str, engine: str) -> RunningSimCluster:
    config = SimClusterConfig(name=name, params=FAST, max_output=8, engine=engine)  # type: ignore[arg-type]
    return await start_sim_cluster(config)


def target(cluster: str, running: RunningSimCluster, engine: str) -> ScrapeTarget:
    return ScrapeTarget(cluster, f"{running.host}:{running.port}", engine)


class Reports:
    def __init__(self) -> None:
        self.latest: dict[str, tuple[LoadReport | None, float]] = {}
        # Every report in order: (cluster, report or None for a withdrawal, its time).
        self.history: list[tuple[str, LoadReport | None, float]] = []

    def __call__(self, cluster: str, report: LoadReport | None, at: float) -> None:
        self.latest[cluster] = (report, at)
        self.history.append((cluster, report, at))


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)


def sample_value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_one_round_reports_each_cluster_from_its_engines_names() -> None:
    a1, a2, b1 = await sim("a1", "vllm"), await sim("a2", "vllm"), await sim("b1", "sglang")
    registry = CollectorRegistry()
    reports = Reports()
    plan = ScrapePlan(
        (target("a", a1, "vllm"), target("a", a2, "vllm"), target("b", b1, "sglang")),
        interval_s=0.05,
        max_age_s=2.0,
        timeout_s=1.0,
    )
    scraper = EngineScraper(lambda: plan, reports, ScrapeMetrics(registry))
    try:
        await scraper.scrape_once(plan)
    finally:
        for s in (a1, a2, b1):
            await s.close()
        await scraper.close()
    for cluster in ("a", "b"):
        report, _at = reports.latest[cluster]
        assert report is not None and report.source == "scrape"
        assert (report.queue, report.inflight) == (0, 0)
        assert report.kv == 0.0
    assert sample_value(registry, "fleet_engine_scrapes_total", cluster="a", outcome="ok") == 2
    assert sample_value(registry, "fleet_engine_fresh_endpoints", cluster="a") == 2


async def test_wrong_engine_type_and_dead_endpoint_are_counted_not_reported() -> None:
    live = await sim("x", "sglang")
    registry = CollectorRegistry()
    reports = Reports()
    dead = ScrapeTarget("dead", "127.0.0.1:1", "vllm")
    plan = ScrapePlan((target("wrong", live, "vllm"), dead), 0.05, 2.0, 0.5)
    scraper = EngineScraper(lambda: plan, reports, ScrapeMetrics(registry))
    try:
        await scraper.scrape_once(plan)
    finally:
        await live.close()
        await scraper.close()
    assert reports.latest == {}
    count = sample_value(
        registry, "fleet_engine_scrapes_total", cluster="wrong", outcome="unparsed"
    )
    assert count == 1
    assert (
        sample_value(registry, "fleet_engine_scrapes_total", cluster="dead", outcome="error") == 1
    )


async def test_a_stale_cluster_is_withdrawn_after_max_age() -> None:
    running = await sim("s", "vllm")
    registry = CollectorRegistry()
    reports = Reports()
    plan = ScrapePlan((target("s", running, "vllm"),), 0.02, max_age_s=0.3, timeout_s=0.2)
    scraper = EngineScraper(lambda: plan, reports, ScrapeMetrics(registry))
    task = asyncio.create_task(scraper.run())
    try:
        await until(lambda: "s" in reports.latest)
        report, _ = reports.latest["s"]
        assert report is not None
        await running.close()  # the endpoint goes away: scrapes fail from now on
        await until(lambda: reports.latest["s"][0] is None)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert reports.latest["s"][0] is None, "a stale scrape was still reported"
    # Not before the staleness bound has passed (a single failed scrape is not staleness): on
    # the scraper's own clock, the withdrawal came more than max_age after the sample that
    # dated the last report.
    withdrawn = next(i for i, (_c, r, _at) in enumerate(reports.history) if r is None)
    assert withdrawn > 0 and reports.history[withdrawn - 1][1] is not None
    last_sample_at, withdrawn_at = reports.history[withdrawn - 1][2], reports.history[withdrawn][2]
    assert withdrawn_at - last_sample_at > plan.max_age_s, (last_sample_at, withdrawn_at)
    assert sample_value(registry, "fleet_engine_scrapes_total", cluster="s", outcome="error") >= 1


async def test_prefix_hit_ratio_between_two_scrapes() -> None:
    running = await sim("p", "vllm")
    registry = CollectorRegistry()
    plan = ScrapePlan((target("p", running, "vllm"),), 0.05, 2.0, 1.0)
    scraper = EngineScraper(lambda: plan, Reports(), ScrapeMetrics(registry))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "q" * 8000}]})
    try:
        await scraper.scrape_once(plan)
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(running.url + "/v1/chat/completions", data=io.BytesIO(body)):
                    pass
        await scraper.scrape_once(plan)
    finally:
        await running.close()
        await scraper.close()
    ratio = sample_value(registry, "fleet_engine_prefix_cache_hit_ratio", cluster="p")
    # Two identical ~2000-token prompts: the second hits all but its last partial block.
    assert 0.3 < ratio < 0.5

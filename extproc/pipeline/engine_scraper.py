"""Scrapes every inference endpoint's Prometheus ``/metrics`` for its load, on an interval.

The same idea as the Gateway API Inference Extension's endpoint picker (which scrapes every
50 ms and treats metrics older than 2 s as stale): the load signal then needs no response
header, so load-aware affinity works with engines that send none (SGLang), with streamed
responses (vLLM attaches ORCA reports to non-streaming ones only) and without an extra ext_proc
exchange per request.

One round scrapes all endpoints concurrently, each bounded by ``timeout``; the next round starts
``interval`` after the previous one started (or at once when a round overran). After each round
every cluster's fresh endpoint samples (younger than ``max_age``) are combined into one
:class:`~extproc.core.load.LoadReport` (extproc.core.engine_metrics.cluster_report) and handed
to ``on_report(cluster, report, sampled_at)``; a cluster with no fresh sample gets
``report=None``, so a stale scrape is dropped rather than trusted.

Parsing is in the pure core (extproc.core.engine_metrics); this module only fetches and times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.config.schema import FleetConfig
from extproc.core.engine_metrics import (
    EngineSample,
    cluster_report,
    detect_engine,
    parse_engine_metrics,
    prefix_hit_ratio,
)
from extproc.core.load import LoadReport

log = logging.getLogger("extproc.pipeline.engine_scraper")

# Prometheus text format 0.0.4: what both engines' exporters serve a plain scraper, and what the
# core parser reads (OpenMetrics differs in details such as the counter suffixes).
ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    cluster: str
    endpoint: str  # host:port
    engine: str  # extproc.core.engine_metrics.ENGINE_TYPES, or "auto": read from the page
    path: str = "/metrics"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}{self.path}"


@dataclass(frozen=True, slots=True)
class ScrapePlan:
    targets: tuple[ScrapeTarget, ...]
    interval_s: float
    max_age_s: float
    timeout_s: float


class ScrapeError(Exception):
    """A scrape that produced no page: ``outcome`` labels the metric."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


Fetch = Callable[[ScrapeTarget, float], Awaitable[str]]
OnReport = Callable[[str, LoadReport | None, float], None]


class ScrapeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.scrapes = Counter(
            "fleet_engine_scrapes",
            "Scrapes of the engines' /metrics pages by cluster and outcome: ok, error (connect"
            " failure or timeout), status (not 200), unparsed (none of the engine's load"
            " metrics on the page: wrong engine type, SGLang without --enable-metrics, or"
            " engine: auto and no known engine's names).",
            ["cluster", "outcome"],
            registry=registry,
        )
        self.prefix_hit_ratio = Gauge(
            "fleet_engine_prefix_cache_hit_ratio",
            "Prefix-cache hit ratio the cluster's engines report (vLLM, llama.cpp: token"
            " counters between two scrapes; SGLang: its cache_hit_rate gauge), averaged over"
            " its endpoints.",
            ["cluster"],
            registry=registry,
        )
        self.fresh_endpoints = Gauge(
            "fleet_engine_fresh_endpoints",
            "Endpoints of the cluster whose last scrape is within the staleness bound.",
            ["cluster"],
            registry=registry,
        )


class HttpFetch:
    """GET a metrics page over one keep-alive aiohttp session."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, target: ScrapeTarget, timeout_s: float) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers={"Accept": ACCEPT})
        try:
            async with self._session.get(
                target.url, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                if response.status != 200:
                    raise ScrapeError("status", f"HTTP {response.status}")
                return await response.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ScrapeError("error", repr(exc)) from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class EngineScraper:
    def __init__(
        self,
        plan: Callable[[], ScrapePlan | None],
        on_report: OnReport,
        metrics: ScrapeMetrics,
        clock: Callable[[], float] = time.perf_counter,
        fetch: Fetch | None = None,
    ) -> None:
        """``plan`` is read at every round, so a config reload takes effect on the next one;
        None pauses scraping. ``clock`` must be the time base ``on_report``'s consumer uses."""
        self._plan = plan
        self._on_report = on_report
        self._metrics = metrics
        self._clock = clock
        self._http = HttpFetch() if fetch is None else None
        self._fetch: Fetch = fetch if fetch is not None else self._http  # type: ignore[assignment]
        # Per endpoint: the last good sample and when it was taken.
        self._samples: dict[ScrapeTarget, tuple[EngineSample, float]] = {}
        self._previous: dict[ScrapeTarget, EngineSample] = {}
        self._reported: set[str] = set()
        # engine: auto, per endpoint: the engine its page showed.
        self._detected: dict[ScrapeTarget, str] = {}

    def _engine_of(self, target: ScrapeTarget, text: str) -> str | None:
        if target.engine != "auto":
            return target.engine
        engine = self._detected.get(target) or detect_engine(text)
        if engine is not None:
            self._detected[target] = engine
        return engine

    async def _scrape(self, target: ScrapeTarget, timeout_s: float) -> None:
        try:
            text = await self._fetch(target, timeout_s)
        except ScrapeError as exc:
            self._metrics.scrapes.labels(target.cluster, exc.outcome).inc()
            log.debug("scrape of %s failed: %s", target.url, exc)
            return
        at = self._clock()
        engine = self._engine_of(target, text)
        sample = None if engine is None else parse_engine_metrics(engine, text)
        if sample is None:
            self._detected.pop(target, None)  # another engine may answer there now
            self._metrics.scrapes.labels(target.cluster, "unparsed").inc()
            return
        self._metrics.scrapes.labels(target.cluster, "ok").inc()
        found = self._samples.get(target)
        if found is not None:
            self._previous[target] = found[0]
        self._samples[target] = (sample, at)

    async def scrape_once(self, plan: ScrapePlan) -> None:
        """One round: scrape every target, then report every cluster."""
        await asyncio.gather(*(self._scrape(t, plan.timeout_s) for t in plan.targets))
        now = self._clock()
        wanted = set(plan.targets)
        for gone in [t for t in self._samples if t not in wanted]:
            del self._samples[gone]
            self._previous.pop(gone, None)
            self._detected.pop(gone, None)
        clusters: dict[str, list[ScrapeTarget]] = {}
        for target in plan.targets:
            clusters.setdefault(target.cluster, []).append(target)
        for cluster, targets in clusters.items():
            fresh: list[tuple[ScrapeTarget, EngineSample, float]] = []
            for target in targets:
                found = self._samples.get(target)
                if found is not None and now - found[1] <= plan.max_age_s:
                    fresh.append((target, found[0], found[1]))
            self._metrics.fresh_endpoints.labels(cluster).set(len(fresh))
            report = cluster_report([s for _t, s, _at in fresh])
            if report is None:
                if cluster in self._reported:
                    self._reported.discard(cluster)
                    self._on_report(cluster, None, now)
                continue
            # The oldest sample dates the combined report: it is as fresh as its stalest part.
            self._reported.add(cluster)
            self._on_report(cluster, report, min(at for _t, _s, at in fresh))
            ratios = [
                r
                for t, s, _at in fresh
                if (r := prefix_hit_ratio(self._previous.get(t), s)) is not None
            ]
            if ratios:
                self._metrics.prefix_hit_ratio.labels(cluster).set(sum(ratios) / len(ratios))
        for cluster in [c for c in self._reported if c not in clusters]:
            self._reported.discard(cluster)
            self._on_report(cluster, None, now)

    async def run(self) -> None:
        """Scrape until cancelled."""
        try:
            while True:
                started = self._clock()
                plan = self._plan()
                if plan is None or not plan.targets:
                    await asyncio.sleep(1.0)
                    continue
                try:
                    await self.scrape_once(plan)
                except Exception:
                    # A bug here must not end load awareness for good; the next round retries.
                    log.exception("engine scrape round failed")
                elapsed = self._clock() - started
                await asyncio.sleep(max(0.0, plan.interval_s - elapsed))
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the keep-alive HTTP session (``run`` does this when cancelled)."""
        if self._http is not None:
            await self._http.close()


def plan_of(config: FleetConfig) -> ScrapePlan | None:
    """What fleet.yaml asks to scrape (None: engine_metrics is off). A cluster declared
    ``engine: openai`` has no known metrics page and is not scraped."""
    em = config.engine_metrics
    if not em.enabled:
        return None
    targets = tuple(
        ScrapeTarget(c.name, endpoint, c.engine, c.metrics_path)
        for c in config.clusters
        if c.engine != "openai"
        for endpoint in c.endpoints
    )
    return ScrapePlan(targets, em.interval_ms / 1000, em.max_age_ms / 1000, em.timeout_ms / 1000)

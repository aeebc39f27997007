"""Scrapes the DCGM exporters fleet.yaml names for the engines' GPUs (``clusters[].gpus``,
``gpu_health``) and hands each cluster's verdict to the fleet state.

One round fetches every exporter page once (several engines on one node share its exporter),
each bounded by ``timeout``; the next round starts ``interval`` after the previous one started.
Each engine's verdict comes from the GPUs it runs on (extproc.core.gpu_health.engine_reason);
a cluster's from its engines' (``cluster_reason``) and goes to
``on_verdict(cluster, reason, at, until)``: ``reason`` None means fine, ``at`` is the scrape's
instant on the injected clock (a relief spell is dated from the first hot one), ``until`` when
the verdict stops being trusted (``at`` plus ``max_age``). An engine whose exporter
did not answer this round contributes nothing: its last verdict ages out at ``max_age`` (the
consumer's expiry), so a dead exporter neither pins a cluster as hot nor clears it at once.

Parsing is in the pure core (extproc.core.gpu_health); this module only fetches and times.
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
from extproc.core.gpu_health import (
    GPU_REASONS,
    GpuReason,
    GpuSample,
    GpuThresholds,
    cluster_reason,
    engine_reason,
    parse_dcgm,
)
from extproc.pipeline.engine_scraper import ACCEPT, ScrapeError

log = logging.getLogger("extproc.pipeline.gpu_scraper")


@dataclass(frozen=True, slots=True)
class GpuTarget:
    cluster: str
    endpoint: str  # the engine
    exporter: str  # host:port of its DCGM exporter
    path: str = "/metrics"
    devices: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.exporter}{self.path}"


@dataclass(frozen=True, slots=True)
class GpuPlan:
    targets: tuple[GpuTarget, ...]
    limits: GpuThresholds
    interval_s: float
    max_age_s: float
    timeout_s: float


FetchPage = Callable[[str, float], Awaitable[str]]
OnVerdict = Callable[[str, GpuReason | None, float, float], None]


class GpuMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.scrapes = Counter(
            "fleet_gpu_scrapes",
            "Scrapes of DCGM exporter pages by exporter and outcome: ok, error (connect failure "
            "or timeout), status (not 200), unparsed (no DCGM_FI_DEV_* field of the watched GPUs).",
            ["exporter", "outcome"],
            registry=registry,
        )
        self.hot = Gauge(
            "fleet_gpu_hot",
            "1 while the cluster takes no new sessions because a watched GPU of one of its "
            "engines is over a gpu_health threshold, by reason (gpu_memory, gpu_temperature, "
            "gpu_slowdown).",
            ["cluster", "reason"],
            registry=registry,
        )


class HttpPage:
    """GET a page over one keep-alive aiohttp session."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, url: str, timeout_s: float) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers={"Accept": ACCEPT})
        try:
            async with self._session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s)
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


class GpuScraper:
    def __init__(
        self,
        plan: Callable[[], GpuPlan | None],
        on_verdict: OnVerdict,
        metrics: GpuMetrics,
        clock: Callable[[], float] = time.perf_counter,
        fetch: FetchPage | None = None,
    ) -> None:
        """``plan`` is read at every round (a reload takes effect on the next); None pauses.
        ``clock`` must be the time base ``on_verdict``'s consumer uses."""
        self._plan = plan
        self._on_verdict = on_verdict
        self._metrics = metrics
        self._clock = clock
        self._http = HttpPage() if fetch is None else None
        self._fetch: FetchPage = fetch if fetch is not None else self._http  # type: ignore[assignment]
        self._shown: set[tuple[str, str]] = set()

    async def _page(self, url: str, timeout_s: float) -> dict[str, GpuSample] | None:
        try:
            text = await self._fetch(url, timeout_s)
        except ScrapeError as exc:
            self._metrics.scrapes.labels(url, exc.outcome).inc()
            log.debug("scrape of %s failed: %s", url, exc)
            return None
        samples = parse_dcgm(text)
        self._metrics.scrapes.labels(url, "ok" if samples else "unparsed").inc()
        return samples or None

    async def scrape_once(self, plan: GpuPlan) -> None:
        urls = sorted({t.url for t in plan.targets})
        pages = await asyncio.gather(*(self._page(u, plan.timeout_s) for u in urls))
        by_url = dict(zip(urls, pages, strict=True))
        at = self._clock()
        verdicts: dict[str, list[GpuReason | None]] = {}
        for target in plan.targets:
            page = by_url[target.url]
            if page is None:
                continue  # no news of this engine: its last verdict ages out
            reason = engine_reason(page, target.devices, plan.limits)
            verdicts.setdefault(target.cluster, []).append(reason)
        for cluster, reasons in verdicts.items():
            verdict = cluster_reason(reasons)
            self._on_verdict(cluster, verdict, at, at + plan.max_age_s)
            for reason in GPU_REASONS:
                hot = reason == verdict
                if hot or (cluster, reason) in self._shown:
                    self._metrics.hot.labels(cluster, reason).set(1 if hot else 0)
                    self._shown.add((cluster, reason))

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
                    # A bug here must not end GPU watching for good; the next round retries.
                    log.exception("GPU scrape round failed")
                elapsed = self._clock() - started
                await asyncio.sleep(max(0.0, plan.interval_s - elapsed))
        finally:
            await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


def gpu_plan_of(config: FleetConfig) -> GpuPlan | None:
    """What fleet.yaml asks to watch (None: gpu_health is off)."""
    gh = config.gpu_health
    if not gh.enabled:
        return None
    targets = tuple(
        GpuTarget(c.name, w.endpoint, w.exporter, w.path, tuple(w.devices))
        for c in config.clusters
        for w in c.gpus
    )
    limits = GpuThresholds(gh.memory_fraction, gh.temperature_c, gh.slowdown)
    return GpuPlan(
        targets, limits, gh.interval_ms / 1000, gh.max_age_ms / 1000, gh.timeout_ms / 1000
    )

"""`extproc bench scrape`: what the engine scraper costs the processor per scraped endpoint.

The processor's scraper (extproc.pipeline.engine_scraper, the code ``engine_metrics`` runs)
scrapes N endpoints per round; each endpoint serves a real engine's recorded /metrics page
(``tests/engines/fixtures/<engine>/metrics.txt``, from ``extproc engine-fixtures``) from a fake
exposition server in another process, so the CPU measured is the scraper's alone: HTTP fetch
over keep-alive connections, parsing, the per-cluster reports. Reported per N: CPU time of
this process per endpoint per round (``time.process_time``), of which parsing alone (the page
parsed in a loop), and the wall time of a round.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from extproc.core.engine_metrics import parse_engine_metrics
from extproc.pipeline.engine_scraper import EngineScraper, ScrapeMetrics, ScrapePlan, ScrapeTarget

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "engines" / "fixtures"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoints", default="8,512", help="fleet sizes to measure")
    parser.add_argument("--rounds", type=int, default=20, help="scrape rounds per size")
    parser.add_argument("--engine", default="llamacpp", help="whose recorded page to serve")
    parser.add_argument("--per-cluster", type=int, default=8, help="endpoints per cluster")


async def _measure(targets: tuple[ScrapeTarget, ...], rounds: int) -> tuple[float, float]:
    plan = ScrapePlan(targets, interval_s=0.05, max_age_s=60.0, timeout_s=30.0)
    reports: list[object] = []
    scraper = EngineScraper(
        lambda: plan, lambda *a: reports.append(a), ScrapeMetrics(CollectorRegistry())
    )
    try:
        await scraper.scrape_once(plan)  # connections opened, first samples
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(rounds):
            await scraper.scrape_once(plan)
        return time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await scraper.close()


def _parse_cpu(engine: str, page: str, times: int = 2000) -> float:
    started = time.process_time()
    for _ in range(times):
        parse_engine_metrics(engine, page)
    return (time.process_time() - started) / times


def run(args: argparse.Namespace) -> int:
    page_path = FIXTURES / args.engine / "metrics.txt"
    page = page_path.read_text()
    parse_us = _parse_cpu(args.engine, page) * 1e6
    print(f"page: {page_path.name} of {args.engine}, {len(page)} bytes; parse {parse_us:.1f} us")
    print(f"{'endpoints':>9} {'cpu/endpoint/round':>19} {'of it parsing':>13} {'round wall':>10}")
    for n in (int(x) for x in args.endpoints.split(",")):
        server = subprocess.Popen(
            [sys.executable, "-c", "from extproc.harness.fake_exposition import main; main()",
             str(page_path), str(n)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            ready = server.stdout.readline().split()  # blocks until READY, or EOF if it died
            if not ready or ready[0] != "READY" or len(ready) != n + 1:
                raise RuntimeError(f"the fake exposition server did not start: {ready}")
            ports = [int(p) for p in ready[1:]]
            targets = tuple(
                ScrapeTarget(f"c{i // args.per_cluster}", f"127.0.0.1:{p}", args.engine)
                for i, p in enumerate(ports)
            )
            cpu, wall = asyncio.run(_measure(targets, args.rounds))
        finally:
            server.terminate()
            server.wait(30)
        per = cpu / (args.rounds * n) * 1e6
        print(
            f"{n:>9} {per:>16.0f} us {parse_us / per * 100:>12.0f}% "
            f"{wall / args.rounds * 1000:>7.1f} ms",
            flush=True,
        )
    return 0

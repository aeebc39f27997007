"""A stand-in for many engines' /metrics pages: one process serving a fixed Prometheus page on
N loopback ports (each port one "endpoint"), for measuring the scraper at fleet sizes no
machine here could run as real engines. Started by ``extproc bench scrape`` as a subprocess
(so its CPU is not the scraper's):

    python -c 'from extproc.harness.fake_exposition import main; main()' PAGE COUNT

It binds COUNT ports chosen by the kernel and prints ``READY port port ...`` once all listen.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def serve(page: bytes, count: int) -> None:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for _ in range(count):
        await web.TCPSite(runner, "127.0.0.1", 0).start()
    ports = [str(address[1]) for address in runner.addresses]
    print("READY", *ports, flush=True)
    await asyncio.Event().wait()


def main() -> None:
    page = Path(sys.argv[1]).read_bytes()
    asyncio.run(serve(page, int(sys.argv[2])))

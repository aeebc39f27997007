"""The processor's HTTP side: /metrics, /healthz, /readyz and the explain endpoint.

Bound to the metrics port. /healthz answers while the event loop runs; /readyz reflects real
readiness: a config is loaded, the gRPC server is serving and not draining, and budgets are
either shared through Redis or knowingly degraded to the configured fallback.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Readiness = Callable[[], tuple[bool, dict[str, object]]]
Explainer = Callable[[str, dict[str, str], bytes], Awaitable[dict[str, object]]]


@dataclass
class AdminApp:
    registry: CollectorRegistry
    readiness: Readiness
    explain: Explainer

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        # POST a request body exactly as a client would send it; ?path= names the API
        # (default /v1/chat/completions); request headers are taken from the admin request.
        app.router.add_post("/explain", self._explain)
        return app

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        ready, detail = self.readiness()
        return web.Response(
            body=orjson.dumps({"ready": ready, **detail}),
            status=200 if ready else 503,
            content_type="application/json",
        )

    async def _explain(self, request: web.Request) -> web.Response:
        path = request.query.get("path", "/v1/chat/completions")
        headers = {k.lower(): v for k, v in request.headers.items()}
        body = await request.read()
        result = await self.explain(path, headers, body)
        return web.Response(
            body=orjson.dumps(result, option=orjson.OPT_INDENT_2), content_type="application/json"
        )


async def start_admin(app: AdminApp, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=False)
    await site.start()
    bound: int = runner.addresses[0][1] if runner.addresses else port
    return runner, bound

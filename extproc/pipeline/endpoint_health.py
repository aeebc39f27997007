"""Readiness of individual endpoints, for endpoint-picker mode.

Envoy's override_host policy does not consult health (a dead first choice costs one failed
attempt before the retry), so the picker itself keeps dead endpoints out of its lists: it
probes every endpoint's health path on an interval and answers 503 when none is ready.

A refused connection (nothing listens: the engine is gone) takes an endpoint out at once; a
probe that only failed (a timeout, an error status) takes it out at the second failure in a
row. With sessions sticking to engines a false "not ready" moves every session of the engine
to another one (one re-prefill each): on a loaded machine single 0.5 s timeouts did (observed,
tests/e2e/test_engine_affinity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import aiohttp

log = logging.getLogger("extproc.endpoints")

# Failed probes in a row (not refused connections) before an endpoint counts as not ready.
UNREADY_AFTER = 2


class EndpointHealth:
    def __init__(
        self,
        endpoints: Mapping[str, tuple[str, ...]],
        health_paths: Mapping[str, str],
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
    ) -> None:
        self._targets = self._targets_of(endpoints, health_paths)
        self._interval = interval_s
        self._timeout = timeout_s
        self.ready: frozenset[str] = frozenset()
        # Probes failed in a row per endpoint (reset by a success).
        self._failures: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    @staticmethod
    def _targets_of(
        endpoints: Mapping[str, tuple[str, ...]], health_paths: Mapping[str, str]
    ) -> dict[str, str]:
        return {e: health_paths.get(c, "/health") for c, eps in endpoints.items() for e in eps}

    def update(
        self, endpoints: Mapping[str, tuple[str, ...]], health_paths: Mapping[str, str]
    ) -> None:
        """New endpoint set after a config reload; probed from the next round on."""
        self._targets = self._targets_of(endpoints, health_paths)

    async def _probe(self, endpoint: str, path: str) -> bool | None:
        """True: ready; False: failed; None: refused (nothing listens)."""
        assert self._session is not None
        try:
            async with self._session.get(f"http://{endpoint}{path}") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectorError:
            return None
        except (aiohttp.ClientError, TimeoutError):
            return False

    def _still_ready(self, endpoint: str, result: bool | None) -> bool:
        if result:
            self._failures.pop(endpoint, None)
            return True
        failed = self._failures[endpoint] = self._failures.get(endpoint, 0) + 1
        known = endpoint in self.ready
        return result is False and known and failed < UNREADY_AFTER

    async def probe_all(self) -> None:
        targets = dict(self._targets)
        results = await asyncio.gather(*(self._probe(e, p) for e, p in targets.items()))
        ready = frozenset(
            e for e, result in zip(targets, results, strict=True) if self._still_ready(e, result)
        )
        if ready != self.ready:
            log.info(
                "endpoint readiness changed",
                extra={"ready": sorted(ready), "not_ready": sorted(set(targets) - ready)},
            )
        self.ready = ready

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.probe_all()

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        self._session = aiohttp.ClientSession(timeout=timeout)
        await self.probe_all()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

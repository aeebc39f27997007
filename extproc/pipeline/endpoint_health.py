"""Readiness of individual endpoints, for endpoint-picker mode.

Envoy's override_host policy does not consult health (a dead first choice costs one failed
attempt before the retry), so the picker itself keeps dead endpoints out of its lists: it
probes every endpoint's health path on an interval and answers 503 when none is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import aiohttp

log = logging.getLogger("extproc.endpoints")


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

    async def _probe(self, endpoint: str, path: str) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"http://{endpoint}{path}") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def probe_all(self) -> None:
        targets = dict(self._targets)
        results = await asyncio.gather(*(self._probe(e, p) for e, p in targets.items()))
        ready = frozenset(e for e, ok in zip(targets, results, strict=True) if ok)
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

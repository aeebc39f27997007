"""Model discovery: what each cluster's endpoints list at GET /v1/models.

The poller reads every endpoint's list on an interval (vLLM, SGLang and the simulated cluster
serve OpenAI's list format; vLLM names an adapter's base model in ``parent``) and reports, per
cluster, the union of its endpoints' ids. ``config.runtime.with_discovered_models`` adds them
to fleet.yaml's lists, which stay the floor: an endpoint that is down, slow or answers garbage
takes nothing away, it only adds nothing this round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

import aiohttp
import orjson

from extproc.config.runtime import Discovered

log = logging.getLogger("extproc.models")

Listed = frozenset[tuple[str, str | None]]


def parse_model_list(body: bytes) -> Listed | None:
    """``(id, parent)`` of each entry of an OpenAI model list; None when it is not one."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    out: set[tuple[str, str | None]] = set()
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            continue
        parent = entry.get("parent")
        out.add((entry["id"], parent if isinstance(parent, str) and parent else None))
    return frozenset(out)


class ModelDiscovery:
    def __init__(self, timeout_s: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.failures = 0  # endpoint reads that failed, since start (for tests and logs)
        # Each endpoint's own list at the last poll: where each LoRA adapter is loaded.
        self.by_endpoint: Discovered = {}

    async def _read(self, endpoint: str) -> Listed:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.get(f"http://{endpoint}/v1/models") as resp:
                body = await resp.read()
                listed = parse_model_list(body) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            listed = None
        if listed is None:
            self.failures += 1
            log.warning("model discovery: no model list", extra={"endpoint": endpoint})
            return frozenset()
        return listed

    async def poll(self, endpoints: Mapping[str, Iterable[str]]) -> Discovered:
        """Per cluster, every ``(id, parent)`` any of its endpoints lists."""
        pairs = [(c, e) for c, eps in endpoints.items() for e in eps]
        lists = await asyncio.gather(*(self._read(e) for _, e in pairs))
        found: dict[str, set[tuple[str, str | None]]] = {c: set() for c in endpoints}
        for (cluster, _), listed in zip(pairs, lists, strict=True):
            found[cluster] |= listed
        self.by_endpoint = {e: listed for (_, e), listed in zip(pairs, lists, strict=True)}
        return {c: frozenset(v) for c, v in found.items()}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

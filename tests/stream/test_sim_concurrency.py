"""The simulated cluster counts requests in flight per request class (x-fleet-class)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from extproc.harness.class_concurrency import CLASS_HEADER, ClassConcurrency
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster

pytestmark = pytest.mark.timeout(20)

# 16 output tokens at 50 tokens/s: about 0.3 s each, long enough to overlap on a busy machine.
PARAMS = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=1.0)


@pytest.fixture
async def sim() -> AsyncIterator[RunningSimCluster]:
    running = await start_sim_cluster(SimClusterConfig(name="c1", params=PARAMS, max_output=16))
    try:
        yield running
    finally:
        await running.close()


def _body(i: int, stream: bool) -> bytes:
    msg = {"role": "user", "content": f"count me {i}"}
    return orjson.dumps({"model": "m", "messages": [msg], "stream": stream})


async def _post(http: aiohttp.ClientSession, url: str, i: int, klass: str | None) -> int:
    headers = {"content-type": "application/json"}
    if klass is not None:
        headers[CLASS_HEADER] = klass
    async with http.post(url, data=_body(i, stream=i % 2 == 0), headers=headers) as resp:
        await resp.read()
        return resp.status


async def test_peaks_per_class_cover_the_whole_stream(sim: RunningSimCluster) -> None:
    url = f"{sim.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        statuses = await asyncio.gather(
            *(_post(http, url, i, "short") for i in range(5)),
            *(_post(http, url, i, "long") for i in range(5, 7)),
            _post(http, url, 7, None),
        )
        assert statuses == [200] * 8
        async with http.get(f"{sim.url}/admin/concurrency") as resp:
            snap = await resp.json()
    # All eight were in flight together (each lasts tens of ms, all sent at once).
    assert snap["peak"] == {"short": 5, "long": 2, "": 1}
    assert snap["total"] == {"short": 5, "long": 2, "": 1}
    assert snap["inflight"] == {"short": 0, "long": 0, "": 0}


async def test_sequential_requests_never_overlap(sim: RunningSimCluster) -> None:
    url = f"{sim.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            assert await _post(http, url, i, "short") == 200
        # Each request is kept with its id and times (what `extproc chaos` diagnoses peaks
        # with): four, one after the other.
        async with http.get(f"{sim.url}/admin/requests", params={"since": "0"}) as resp:
            kept = (await resp.json())["requests"]
        assert [k[1] for k in kept] == ["short"] * 4
        assert all(k[2] <= k[3] for k in kept)
        assert all(a[3] <= b[2] for a, b in itertools.pairwise(kept))
        async with http.get(f"{sim.url}/admin/requests", params={"since": "1e12"}) as resp:
            assert (await resp.json())["requests"] == []
        async with http.get(f"{sim.url}/admin/concurrency") as resp:
            assert (await resp.json())["peak"] == {"short": 1}
        async with http.delete(f"{sim.url}/admin/concurrency") as resp:
            assert (await resp.json()) == {"inflight": {"short": 0}, "peak": {}, "total": {}}


def test_reset_keeps_what_is_in_flight() -> None:
    counts = ClassConcurrency()
    with counts.track("a"):
        with counts.track("a"):
            pass
        counts.reset_peaks()
        assert counts.snapshot() == {"inflight": {"a": 1}, "peak": {"a": 1}, "total": {}}
    assert counts.inflight == {"a": 0}

"""Load-aware spill driven only by the engines' own /metrics, through a real Envoy.

The simulated clusters play vLLM or SGLang (``--engine``): no x-fleet-load, no unrequested ORCA
header (SGLang: none at all), and the processor is told not to read load from response headers
(``affinity.load_from_response_headers: false``). A streamed request (no ORCA report even from
vLLM) holds ~90% of c2's KV; the processor sees that only by scraping c2's /metrics, and new
sessions whose hash primary is c2 are placed elsewhere.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

from extproc.config import Runtime, load_runtime
from extproc.harness.launch import Client, FleetStack, wait_until
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.test_load_aware import CHAT, KV_CAPACITY, PRESSURED, body, hog, metric, sessions_on

SIM_ARGS = (
    "--time-scale", "1",
    "--prefill-tps", "2000000",
    "--decode-tps", "1000",
    "--kv-capacity-tokens", str(KV_CAPACITY),
    "--max-output", "100000",
)  # fmt: skip
AFFINITY = {
    "enabled": True,
    "kv_pressure_threshold": 0.85,
    "load_from_response_headers": False,
    "signal_max_age_s": 30,
}


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def scraped_fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetStack]:
    engine = request.param
    stack = FleetStack(
        tmp_path_factory.mktemp(f"scraped-{engine}"),
        clusters=3,
        sim_args=(*SIM_ARGS, "--engine", engine),
        cluster_fields={"engine": engine},
        fleet_overrides={
            "affinity": AFFINITY,
            "engine_metrics": {"enabled": True, "interval_ms": 50, "max_age_ms": 2000},
        },
    )
    with stack:
        yield stack


def hog_session(runtime: Runtime) -> str:
    return sessions_on(runtime, PRESSURED, 1, "hog")[0]


def test_spill_from_scraped_metrics_alone(
    scraped_fleet: FleetStack, make_client: MakeClient
) -> None:
    stack = scraped_fleet
    runtime = load_runtime(stack.fleet_path)
    wait_until(
        lambda: metric(stack, "fleet_engine_scrapes_total", cluster=PRESSURED, outcome="ok") > 0,
        20,
        "first scrape",
    )
    # A session whose hash primary is the cluster to pressure (no load seen yet: it lands there).
    hog_sid = hog_session(runtime)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hogging = pool.submit(hog, stack.listener_port, hog_sid)
        wait_until(
            lambda: metric(stack, "fleet_cluster_kv_usage", cluster=PRESSURED) > 0.85,
            20,
            f"scraped KV pressure on {PRESSURED}\n{dump_logs(stack)}",
        )
        client: Client = make_client(stack.listener_port)
        sids = sessions_on(runtime, PRESSURED, 8, "new")
        served = []
        for sid in sids:
            status, hdrs, data = client.post_json(CHAT, body(sid, 0), {"x-session-id": sid})
            assert status == 200, data[:300]
            served.append(hdrs["x-served-by"])
        status, _ = hogging.result(timeout=60)
    assert status == 200
    assert PRESSURED not in served, (served, dump_logs(stack))
    assert metric(stack, "fleet_route_decisions_total", kind="spilled") >= len(sids)
    # No load report came from response headers: every report was a scrape.
    assert metric(stack, "fleet_load_reports_total", source="orca") == 0
    assert metric(stack, "fleet_load_reports_total", source="fleet") == 0
    assert metric(stack, "fleet_load_reports_total", source="scrape") > 0

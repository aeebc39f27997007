"""GPU health with the product default (load-aware affinity off), through a real Envoy and
``extproc serve``: a hot cluster takes no new sessions, and once it has stayed hot for
``gpu_health.move_after_ms`` (counted from the scraper's first hot verdict) its least active
session moves while its most active one stays.

The DCGM exporter is the page server of tests/e2e/test_gpu_health.py (the recorded page in
``tests/fixtures/dcgm``, on 127.0.0.1): c1's engine runs on GPU 1, which the page shows at
97.7 % memory and 88 °C.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extproc.config import load_runtime
from extproc.explain import explain_remote
from extproc.harness.launch import LOOPBACK, wait_until
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.test_gpu_health import HOT_PAGE, Exporter, GpuStack, cooled
from tests.e2e.test_load_aware import CHAT, body, metric, sessions_on


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    running = Exporter(cooled(HOT_PAGE))
    yield running
    running.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, exporter: Exporter) -> Iterator[GpuStack]:
    gpu_stack = GpuStack(
        tmp_path_factory.mktemp("gpu-relief"),
        clusters=2,
        exporter=exporter.address,
        fleet_overrides={
            # Affinity off (the product default); no share bound: only GPU health moves
            # sessions here.
            "affinity": {"enabled": False, "balance_factor": 0},
            "gpu_health": {
                "enabled": True,
                "interval_ms": 100,
                "max_age_ms": 5000,
                "move_after_ms": 1000,
                "move_fraction": 0.5,
            },
        },
    )
    with gpu_stack:
        yield gpu_stack


def _served(stack: GpuStack, make_client: MakeClient, sid: str, turn: int) -> str:
    status, hdrs, data = make_client(stack.listener_port).post_json(
        CHAT, body(sid, turn), {"x-session-id": sid}
    )
    assert status == 200, data[:300]
    return hdrs["x-served-by"]


def _explained(stack: GpuStack, sid: str, turn: int) -> dict[str, object]:
    admin = f"http://{LOOPBACK}:{stack.metrics_ports[0]}"
    return explain_remote(admin, CHAT, {"x-session-id": sid}, body(sid, turn))


def test_with_affinity_off_a_hot_cluster_sheds_its_least_active_session_first(
    stack: GpuStack, exporter: Exporter, make_client: MakeClient
) -> None:
    runtime = load_runtime(stack.fleet_path)
    assert not runtime.affinity.enabled
    quiet, busy, new = (sessions_on(runtime, "c1", 1, tag)[0] for tag in ("quiet", "busy", "new"))
    wait_until(lambda: exporter.scrapes > 0, 30, "the processor to scrape the exporter")
    # Both start on their hash primary while c1 is cool; busy keeps talking, quiet does not.
    assert _served(stack, make_client, quiet, 0) == "c1"
    for turn in range(4):
        assert _served(stack, make_client, busy, turn) == "c1"

    exporter.page = HOT_PAGE
    wait_until(
        lambda: metric(stack, "fleet_gpu_hot", cluster="c1", reason="gpu_memory") == 1.0,
        30,
        "c1 marked hot",
        interval=0.1,
    )
    # A new session whose hash primary is c1 starts on c2, as off an unhealthy cluster.
    assert _served(stack, make_client, new, 0) == "c2", dump_logs(stack)
    assert metric(stack, "fleet_migrations_total", reason="gpu_memory") == 0

    # move_after_ms after the scraper's first hot verdict, with no request of c1's sessions in
    # between (explain records nothing), a round marks half of c1's two sessions, the least
    # active: quiet.
    wait_until(
        lambda: _explained(stack, quiet, 1).get("kind") == "migrated",
        30,
        "the quiet session to be picked to leave c1",
        interval=0.1,
    )
    assert _explained(stack, busy, 4).get("kind") == "primary"
    assert _served(stack, make_client, busy, 4) == "c1"
    assert _served(stack, make_client, quiet, 1) == "c2", dump_logs(stack)
    assert metric(stack, "fleet_migrations_total", reason="gpu_memory") == 1
    # The most active keeps its cache, round after round (a round never takes the last one).
    assert _served(stack, make_client, busy, 5) == "c1"
    assert _served(stack, make_client, quiet, 2) == "c2"  # it follows its move

    exporter.page = cooled(HOT_PAGE)
    wait_until(
        lambda: metric(stack, "fleet_gpu_hot", cluster="c1", reason="gpu_memory") == 0.0,
        30,
        "c1 no longer hot",
        interval=0.1,
    )
    assert _served(stack, make_client, busy, 6) == "c1"
    assert metric(stack, "fleet_migrations_total", reason="gpu_memory") == 1

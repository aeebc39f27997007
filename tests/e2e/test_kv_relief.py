"""KV relief with the product default (load-aware affinity off), through a real Envoy and
``extproc serve``, from the engines' own /metrics: a cluster whose scraped KV use reaches
``affinity.kv_migrate_threshold`` (0.97) takes no new sessions, explain names it hot with the
reason ``kv_cache``, and once it has stayed hot for ``gpu_health.move_after_ms`` (counted from
the first scrape that found it so) its least active session moves while its most active one
stays.

The simulated clusters play vLLM (``vllm:kv_cache_usage_perc``). One streamed request holds
98 % of c1's KV (a 40K-token prompt and 58K output tokens, decoding at 200 tokens/s: minutes)
until the test has seen what it checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from extproc.config import load_runtime
from extproc.explain import explain_remote
from extproc.harness.launch import LOOPBACK, FleetStack, wait_until
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.test_load_aware import CHAT, body, metric, sessions_on

KV_CAPACITY = 100_000
HOT = "c1"
SIM_ARGS = (
    "--time-scale", "1",
    "--prefill-tps", "2000000",
    "--decode-tps", "200",
    "--kv-capacity-tokens", str(KV_CAPACITY),
    "--max-output", "100000",
    "--engine", "vllm",
)  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    running = FleetStack(
        tmp_path_factory.mktemp("kv-relief"),
        clusters=2,
        sim_args=SIM_ARGS,
        cluster_fields={"engine": "vllm"},
        fleet_overrides={
            # Affinity off (the product default); no share bound: only KV relief moves
            # sessions here.
            "affinity": {"enabled": False, "balance_factor": 0},
            "engine_metrics": {"enabled": True, "interval_ms": 100, "max_age_ms": 5000},
            "gpu_health": {"move_after_ms": 1000, "move_fraction": 0.5},
        },
    )
    with running:
        yield running


def _served(stack: FleetStack, make_client: MakeClient, sid: str, turn: int) -> str:
    status, hdrs, data = make_client(stack.listener_port).post_json(
        CHAT, body(sid, turn), {"x-session-id": sid}
    )
    assert status == 200, data[:300]
    return hdrs["x-served-by"]


def _explained(stack: FleetStack, sid: str, turn: int) -> dict[str, Any]:
    admin = f"http://{LOOPBACK}:{stack.metrics_ports[0]}"
    return explain_remote(admin, CHAT, {"x-session-id": sid}, body(sid, turn))


def _hog(stack: FleetStack, sid: str) -> Any:
    """A stream that holds 98 % of its cluster's KV, open once its first chunk arrived."""
    client = openai.OpenAI(api_key="k", base_url=f"{stack.url}/v1", max_retries=0, timeout=600)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "abcd" * 40_000}],
        max_tokens=58_000,
        stream=True,
        extra_headers={"x-session-id": sid},
    )
    next(iter(stream))
    return stream


def test_a_cluster_at_the_kv_migrate_threshold_takes_no_new_sessions_and_sheds_its_quietest(
    stack: FleetStack, make_client: MakeClient
) -> None:
    runtime = load_runtime(stack.fleet_path)
    assert not runtime.affinity.enabled and runtime.kv_relief_at == 0.97
    quiet, busy, new, hog = (sessions_on(runtime, HOT, 1, tag)[0] for tag in ("q", "b", "n", "h"))
    wait_until(
        lambda: metric(stack, "fleet_engine_scrapes_total", cluster=HOT, outcome="ok") > 0,
        30,
        "the first scrape of c1",
    )
    # While c1 is cool every session starts on its hash primary; busy keeps talking.
    assert _served(stack, make_client, quiet, 0) == HOT
    for turn in range(4):
        assert _served(stack, make_client, busy, turn) == HOT

    stream = _hog(stack, hog)
    try:
        wait_until(
            lambda: metric(stack, "fleet_cluster_kv_usage", cluster=HOT) >= 0.97,
            30,
            f"c1's scraped KV use at the migrate threshold\n{dump_logs(stack)}",
            interval=0.1,
        )
        explained = _explained(stack, new, 0)
        assert explained["hot"] == {HOT: "kv_cache"}, explained
        assert (explained["kind"], explained["primary"]) == ("spilled", "c2"), explained
        assert _served(stack, make_client, new, 0) == "c2", dump_logs(stack)
        assert metric(stack, "fleet_migrations_total", reason="kv_cache") == 0

        # move_after_ms after the first hot scrape, with no request of c1's sessions in between
        # (explain records nothing), a round marks the least active: quiet.
        wait_until(
            lambda: _explained(stack, quiet, 1).get("kind") == "migrated",
            30,
            "the quiet session to be picked to leave c1",
            interval=0.1,
        )
        assert _explained(stack, busy, 4).get("kind") == "primary"
        assert _served(stack, make_client, busy, 4) == HOT  # its cache is there
        assert _served(stack, make_client, quiet, 1) == "c2", dump_logs(stack)
        assert metric(stack, "fleet_migrations_total", reason="kv_cache") == 1
        assert _served(stack, make_client, quiet, 2) == "c2"  # it follows its move
        assert metric(stack, "fleet_cluster_kv_usage", cluster=HOT) >= 0.97  # still hot
    finally:
        stream.close()

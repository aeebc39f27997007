"""The simulated P/D roles over real HTTP: llm-d's sidecar sequence on the decode side, vLLM's
KV-producer answer on the prefill side, transfer cost by topology relation."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from extproc.core.pd import Topology
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster
from extproc.harness.sim_pd import (
    PREFILLED_BY,
    SIM_RELATION_HEADER,
    SIM_TRANSFER_HEADER,
    PdSimCluster,
    PdSimConfig,
    prefill_body,
)
from extproc.names import PREFILLER_HEADER

pytestmark = pytest.mark.timeout(20)

PARAMS = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=0.001)
TOPO = Topology(("nvlink", "island"), (900e9, 50e9), 12.5e9)
KV = 327_680
NEAR = ("nvl-a", "ib-1")
FAR = ("nvl-c", "ib-2")


async def start(name: str, role: Any, labels: Any, peers: dict[str, Any]) -> RunningSimCluster:
    config = SimClusterConfig(name=name, params=PARAMS, max_output=8)
    cluster = PdSimCluster(config, PdSimConfig(role, labels, peers, TOPO, KV))
    return await start_sim_cluster(config, cluster=cluster)


@pytest.fixture
async def fleet() -> AsyncIterator[dict[str, RunningSimCluster]]:
    near = await start("p-near", "prefill", NEAR, {})
    far = await start("p-far", "prefill", FAR, {})
    peers = {f"{s.host}:{s.port}": labels for s, labels in ((near, NEAR), (far, FAR))}
    decode = await start("d1", "decode", NEAR, peers)
    sims = {"near": near, "far": far, "decode": decode}
    try:
        yield sims
    finally:
        for sim in sims.values():
            await sim.close()
        assert isinstance(decode.cluster, PdSimCluster)
        await decode.cluster.close_client()


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=io.BytesIO(orjson.dumps(body)), headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.read()


def addr(sim: RunningSimCluster) -> str:
    return f"{sim.host}:{sim.port}"


def test_the_prefill_request_is_llm_ds_nixl_v2_body() -> None:
    body = chat("x", stream=True, stream_options={"include_usage": True}, max_tokens=50)
    sent = prefill_body("openai-chat", body)
    assert sent["stream"] is False and "stream_options" not in sent
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
    assert sent["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert body["stream"] is True  # the original is untouched (restored for decode)
    completions = prefill_body("openai-completions", {"prompt": "x", "max_tokens": 9})
    assert completions["max_tokens"] == 1 and "max_completion_tokens" not in completions


async def test_the_prefiller_answers_kv_transfer_params(
    fleet: dict[str, RunningSimCluster],
) -> None:
    near = fleet["near"]
    status, _, raw = await post(
        f"{near.url}/v1/chat/completions",
        prefill_body("openai-chat", chat("word " * 4000)),
        {"x-request-id": "r1"},
    )
    assert status == 200
    params = orjson.loads(raw)["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"] == "r1"
    assert f"{params['remote_host']}:{params['remote_port']}" == addr(near)
    assert len(params["remote_block_ids"]) >= 1 and params["tp_size"] == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_runs_the_prefill_round_trip_and_pays_the_transfer(
    fleet: dict[str, RunningSimCluster], stream: bool
) -> None:
    decode = fleet["decode"]
    url = f"{decode.url}/v1/chat/completions"
    seen: dict[str, tuple[str, float]] = {}
    for key in ("near", "far"):
        prompt = f"{key} " + "token " * 4000
        status, headers, raw = await post(
            url,
            chat(prompt, stream=stream),
            {PREFILLER_HEADER: addr(fleet[key]), "x-request-id": key},
        )
        assert status == 200, raw
        assert headers["x-served-by"] == "d1"
        assert headers[PREFILLED_BY] == fleet[key].name
        seen[key] = (headers[SIM_RELATION_HEADER], float(headers[SIM_TRANSFER_HEADER]))
        if stream:
            assert raw.rstrip().endswith(b"data: [DONE]")
        else:
            assert orjson.loads(raw)["choices"][0]["message"]["content"]
    assert seen["near"][0] == "nvlink" and seen["far"][0] == "cross"
    # ~5,000 tokens x 327,680 B: ~1.8 ms over NVLink (900 GB/s), ~130 ms across (12.5 GB/s).
    assert seen["far"][1] / seen["near"][1] == pytest.approx(900 / 12.5, rel=0.01)
    assert 100 < seen["far"][1] < 200
    # Each prefiller ran one prefill (a one-token generation), decode one generation per request.
    for key in ("near", "far"):
        assert sum(fleet[key].cluster.executions.values()) == 1
    assert dict(decode.cluster.executions) == {"near": 1, "far": 1}


async def test_a_second_turn_transfers_only_what_decode_lacks(
    fleet: dict[str, RunningSimCluster],
) -> None:
    url = f"{fleet['decode'].url}/v1/chat/completions"
    far = {PREFILLER_HEADER: addr(fleet["far"])}
    history = "history " * 6000
    _, first, _ = await post(url, chat(history), far)
    _, second, _ = await post(url, chat(history + " and one more question"), far)
    assert float(second[SIM_TRANSFER_HEADER]) < float(first[SIM_TRANSFER_HEADER]) / 10


async def test_an_unreachable_prefiller_falls_back_to_decode_only_with_one_generation(
    fleet: dict[str, RunningSimCluster],
) -> None:
    # llm-d's sidecar (shouldFallbackToDecode, since llm-d-inference-scheduler PR #652): a
    # prefill failure that is not a client error sends the original request to the local
    # engine, which prefills it itself. (Before #652 the client got the proxy's empty 502.)
    dead = fleet["far"]
    await dead.close()
    status, headers, raw = await post(
        f"{fleet['decode'].url}/v1/chat/completions",
        chat("hello"),
        {PREFILLER_HEADER: addr(dead), "x-request-id": "lost"},
    )
    assert status == 200, raw
    assert headers["x-served-by"] == "d1" and PREFILLED_BY not in headers
    assert orjson.loads(raw)["choices"][0]["message"]["content"]
    assert fleet["decode"].cluster.executions["lost"] == 1


async def fault(sim: RunningSimCluster, payload: dict[str, Any]) -> None:
    status, _, raw = await post(f"{sim.url}/admin/fault", payload)
    assert status == 200, raw


@pytest.mark.parametrize("code", [500, 503])
async def test_a_prefiller_server_error_falls_back_to_decode_only(
    fleet: dict[str, RunningSimCluster], code: int
) -> None:
    await fault(fleet["near"], {"mode": "error", "status": code})
    status, headers, _ = await post(
        f"{fleet['decode'].url}/v1/chat/completions",
        chat("hello"),
        {PREFILLER_HEADER: addr(fleet["near"]), "x-request-id": f"e{code}"},
    )
    assert status == 200 and PREFILLED_BY not in headers
    assert fleet["decode"].cluster.executions[f"e{code}"] == 1


async def test_a_prefiller_client_error_is_passed_back_and_nothing_generated(
    fleet: dict[str, RunningSimCluster],
) -> None:
    await fault(fleet["near"], {"mode": "error", "status": 429})
    status, headers, raw = await post(
        f"{fleet['decode'].url}/v1/chat/completions",
        chat("hello"),
        {PREFILLER_HEADER: addr(fleet["near"]), "x-request-id": "refused"},
    )
    assert status == 429 and orjson.loads(raw)["error"]["code"] == 429
    assert headers[PREFILLED_BY] == "p-near"
    assert fleet["decode"].cluster.executions["refused"] == 0


async def test_without_the_header_decode_prefills_itself(
    fleet: dict[str, RunningSimCluster],
) -> None:
    status, headers, _ = await post(f"{fleet['decode'].url}/v1/chat/completions", chat("hi"))
    assert status == 200 and PREFILLED_BY not in headers
    # Anthropic messages are not disaggregated by the sidecar: passed to the engine as they are.
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status, headers, _ = await post(
        f"{fleet['decode'].url}/v1/messages", body, {PREFILLER_HEADER: addr(fleet["near"])}
    )
    assert status == 200 and PREFILLED_BY not in headers


def sglang(body: dict[str, Any], prefill: RunningSimCluster, room: int) -> dict[str, Any]:
    # What SGLang's router (and the processor in disaggregation.protocol "sglang") sends both.
    fields = {
        "bootstrap_host": prefill.host,
        "bootstrap_port": prefill.port,
        "bootstrap_room": room,
    }
    return {**body, **fields}


@pytest.mark.parametrize("stream", [False, True])
async def test_sglangs_two_halves_meet_in_the_bootstrap_room(
    fleet: dict[str, RunningSimCluster], stream: bool
) -> None:
    decode, far = fleet["decode"], fleet["far"]
    sent = sglang(chat("far " + "token " * 4000, stream=stream), far, 77)
    path = "/v1/chat/completions"
    # Both at once, as the router (or Envoy's mirror) sends them; the decode half may arrive
    # first and waits in the room.
    (status, headers, raw), (p_status, _, p_raw) = await asyncio.gather(
        post(decode.url + path, sent, {"x-request-id": "pair"}),
        post(far.url + path, sent, {"x-request-id": "pair"}),
    )
    assert status == 200 and p_status == 200, (raw, p_raw)
    assert headers["x-served-by"] == "d1" and headers[PREFILLED_BY] == "p-far"
    assert headers[SIM_RELATION_HEADER] == "cross"
    assert float(headers[SIM_TRANSFER_HEADER]) > 100  # ~5,000 tokens across islands
    # One prefill (a one-token answer, dropped by the router) and one generation.
    assert dict(far.cluster.executions) == {"pair": 1}
    assert dict(decode.cluster.executions) == {"pair": 1}
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]")


async def test_sglang_decode_without_its_prefill_fails_before_generating(
    fleet: dict[str, RunningSimCluster],
) -> None:
    dead = fleet["far"]
    await dead.close()
    status, _, raw = await post(
        f"{fleet['decode'].url}/v1/chat/completions",
        sglang(chat("hello"), dead, 5),
        {"x-request-id": "orphan"},
    )
    assert status == 500 and b"KV transfer" in raw
    assert fleet["decode"].cluster.executions["orphan"] == 0

"""SGLang's P/D protocol (disaggregation.protocol "sglang"): the bootstrap fields SGLang's
router injects, the processor's body rewrite and mirror header, and the rendered mirror."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import orjson
import pytest

from extproc.config import compile_runtime, parse_config
from extproc.core.pd import ROOM_MASK, bootstrap_batch, bootstrap_fields
from extproc.names import PREFILL_MIRROR_HEADER, PREFILLER_HEADER, prefill_mirror_cluster
from extproc.pipeline.outcomes import Routed
from extproc.protocol import responses
from extproc.render.envoy import render_bootstrap
from tests.unit.test_pd import chat, pd_config, pipeline_of

LONG = "word " * 2000  # the long (disaggregated) class


def sglang_config(**disaggregation: Any) -> dict[str, Any]:
    cfg = pd_config()
    cfg["disaggregation"] = {"protocol": "sglang", **disaggregation}
    cfg["clusters"][2]["bootstrap_port"] = 8998  # p1; p2 leaves it to the server (null)
    return cfg


def test_bootstrap_fields_are_the_routers_single_and_batch_forms() -> None:
    single = bootstrap_fields("10.0.0.7:30000", 8998, [(1 << 64) - 1], None)
    assert single == {
        "bootstrap_host": "10.0.0.7",
        "bootstrap_port": 8998,
        "bootstrap_room": ROOM_MASK,  # [0, 2^63): i64-safe for SGLang's Python side
    }
    batch = bootstrap_fields("[::1]:30000", None, [5, 6, 7], 3)
    assert batch == {
        "bootstrap_host": ["::1"] * 3,
        "bootstrap_port": [None] * 3,
        "bootstrap_room": [5, 6, 7],
    }


@pytest.mark.parametrize(
    ("body", "size"),
    [
        ({"messages": [], "n": 3}, 3),
        ({"messages": [], "n": 1}, None),
        ({"prompt": "x"}, None),
        ({"prompt": ["a", "b"]}, 2),
        ({"prompt": [1, 2, 3]}, None),  # one tokenised prompt
        ({"prompt": [[1], [2]]}, 2),
        ({"text": ["a", "b", "c"]}, 3),
        ({"input_ids": [[1, 2], [3]]}, 2),
    ],
)
def test_batch_size_as_the_router_counts_it(body: dict[str, Any], size: int | None) -> None:
    assert bootstrap_batch(body) == size


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        bootstrap_batch({"prompt": []})


def test_the_pipeline_writes_the_bootstrap_fields_for_the_chosen_prefiller() -> None:
    pipe = pipeline_of(sglang_config())
    rooms = itertools.count(41)
    pipe._rooms = lambda: next(rooms)
    assert pipe.wants_request_body()
    runtime = pipe.runtime
    assert not runtime.decide_at_headers  # the body must reach the processor

    async def run() -> None:
        seen = set()
        for i in range(12):
            headers, body = chat(LONG, f"s{i}")
            out = await pipe.decide(headers, body, 0.0)
            assert isinstance(out, Routed) and out.prefill is not None
            endpoint = out.prefill.endpoint
            assert endpoint is not None
            mirror = pipe.bootstrap_body(out, body)
            assert mirror is not None
            cluster, rewritten = mirror
            assert cluster == prefill_mirror_cluster(endpoint.address)
            sent = orjson.loads(rewritten)
            # The client's request, unchanged, plus the three fields.
            assert {k: v for k, v in sent.items() if not k.startswith("bootstrap_")} == (
                orjson.loads(body)
            )
            assert sent["bootstrap_host"] == endpoint.address.rsplit(":", 1)[0]
            assert sent["bootstrap_port"] == (8998 if endpoint.cluster == "p1" else None)
            seen.add(sent["bootstrap_room"])
            await pipe.release(out.hold)
        assert seen == set(range(41, 53))  # a fresh room per request
        short_headers, short_body = chat("hi", "short")
        short = await pipe.decide(short_headers, short_body, 0.0)
        assert isinstance(short, Routed) and pipe.bootstrap_body(short, short_body) is None

    asyncio.run(run())


def test_llm_d_protocol_keeps_the_body() -> None:
    pipe = pipeline_of(pd_config())
    assert not pipe.wants_request_body()

    async def run() -> None:
        headers, body = chat(LONG, "s1")
        out = await pipe.decide(headers, body, 0.0)
        assert isinstance(out, Routed) and out.prefill is not None
        assert pipe.bootstrap_body(out, body) is None

    asyncio.run(run())


def test_the_answer_replaces_the_body_and_names_the_mirror() -> None:
    pipe = pipeline_of(sglang_config())

    async def run() -> None:
        headers, body = chat(LONG, "s1")
        out = await pipe.decide(headers, body, 0.0)
        assert isinstance(out, Routed)
        mirror = pipe.bootstrap_body(out, body)
        assert mirror is not None
        answer = responses.RouteAnswers().route(out.route, out.facts, mirror=mirror)
        common = answer.request_body.response
        assert common.body_mutation.body == mirror[1]
        sets = {
            h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
        }
        assert sets[PREFILL_MIRROR_HEADER] == mirror[0]
        assert sets["content-length"] == str(len(mirror[1]))
        assert PREFILLER_HEADER not in sets
        picked = responses.endpoint_response(
            out.route, out.facts, ("127.0.0.1:8001",), mirror=mirror
        )
        assert picked.request_body.response.body_mutation.body == mirror[1]

    asyncio.run(run())


def test_envoy_mirrors_to_one_cluster_per_prefill_endpoint() -> None:
    runtime = compile_runtime(parse_config(sglang_config(), "t.yaml"))
    bootstrap = render_bootstrap(runtime)
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    mirrors = {n: c for n, c in clusters.items() if n.startswith("prefill-mirror-")}
    addresses = {"127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8201"}
    assert set(mirrors) == {prefill_mirror_cluster(a) for a in addresses}
    for name, cluster in mirrors.items():
        (only,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        port = only["endpoint"]["address"]["socket_address"]["port_value"]
        assert name == prefill_mirror_cluster(f"127.0.0.1:{port}")
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    for route in routes:
        assert route["route"]["request_mirror_policies"] == [
            {"cluster_header": PREFILL_MIRROR_HEADER, "disable_shadow_host_suffix_append": True}
        ]
    assert PREFILL_MIRROR_HEADER in hcm["route_config"]["internal_only_headers"]
    # llm-d's protocol renders neither.
    plain = render_bootstrap(compile_runtime(parse_config(pd_config(), "t.yaml")))
    names = [c["name"] for c in plain["static_resources"]["clusters"]]
    assert not [n for n in names if n.startswith("prefill-mirror-")]
    plain_hcm = plain["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for route in plain_hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]:
        assert "request_mirror_policies" not in route["route"]

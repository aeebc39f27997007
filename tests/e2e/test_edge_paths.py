"""The edge through a real Envoy: every spelling of an inference path is placed and budgeted like
the canonical path, and headers only a trusted hop may set (tier, x-envoy-*) are ignored when a
client sends them.

Before path normalisation, ``POST /v1/chat/%63ompletions`` was served 200 on the fallback route
(no placement, no budget) while ``/v1/chat/completions`` answered 429: the engines decode the
path and serve it as chat completions.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import LOOPBACK, FleetStack, wait_until
from extproc.render.envoy import FALLBACK_CLUSTER
from tests.e2e.conftest import dump_logs
from tests.e2e.predict import PURE_HASH, placement_for
from tests.support.flow import NO_PLACEMENT, refused_at_once

CHAT = "/v1/chat/completions"
SESSION = {"x-session-id": "edge-paths-session"}
TIER_HEADER = "x-tier"
# "gold" is tier-only and unbudgeted; everyone else shares "chat", one request in flight per
# cluster, so a single long stream fills the session's primary.
CLASSES: list[dict[str, Any]] = [
    {"name": "gold", "tiers": ["gold"]},
    {"name": "chat", "budget": {"max_concurrent": 1}},
]
# Real time (time-scale 1): a 64-token stream at 10 tokens/s holds its budget for ~6 s.
SIM_ARGS = ("--time-scale", "1", "--decode-tps", "10", "--prefill-tps", "200000")

# (path as sent, what the engine serves it as). Envoy normalises the first group to the
# canonical path before the processor and the engine see it; the last two reach the engine as
# sent (the processor still places and budgets them; the engine answers 404, or with Starlette
# a 307 to the canonical path).
VARIANTS: list[tuple[str, int]] = [
    (CHAT, 200),
    ("/v1/chat/%63ompletions", 200),
    ("/v1/chat/%63%6Fmpletions", 200),
    ("/v1//chat/completions", 200),
    ("//v1/chat/completions", 200),
    ("/v1/chat/./completions", 200),
    ("/v1/x/../chat/completions", 200),
    ("/v1/chat%2Fcompletions", 200),
    ("/v1/chat%2fcompletions", 200),
    ("/v1/chat/completions?api-version=1", 200),
    ("/v1/chat/completions/", 404),
    ("/V1/Chat/Completions", 404),
]


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("edge"),
        clusters=3,
        sim_args=SIM_ARGS,
        fleet_overrides={
            "classes": refused_at_once(CLASSES),
            "flow": NO_PLACEMENT,
            "session": {"tier_header": TIER_HEADER},
            # Pure hashing predicts first turns (no balance spills): tests path spellings.
            "affinity": PURE_HASH,
        },
    )
    with stack:
        yield stack


def _body(max_tokens: int, stream: bool = False) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "one spelling or another"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    )


def _post(
    stack: FleetStack, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, stack.listener_port, timeout=60)
    try:
        # http.client sends the path byte for byte: no client-side normalisation.
        conn.request(
            "POST", path, body, {"content-type": "application/json", **SESSION, **(headers or {})}
        )
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _upstream_counts(stack: FleetStack) -> dict[str, int]:
    names = [*stack.sim_specs, FALLBACK_CLUSTER]
    return {n: stack.envoy_stat(f"cluster.{n}.upstream_rq_total") for n in names}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {n: after[n] - before[n] for n in before if after[n] != before[n]}


def test_every_path_spelling_is_placed_like_the_canonical_path(edge: FleetStack) -> None:
    primary = placement_for(load_runtime(edge.fleet_path), CHAT, _body(1), SESSION).primary
    table = []
    for path, engine_status in VARIANTS:
        before = _upstream_counts(edge)
        status, headers, data = _post(edge, path, _body(1))
        delta = _delta(before, _upstream_counts(edge))
        table.append((path, status, delta))
        assert status == engine_status, (path, status, data[:200], dump_logs(edge))
        # Exactly one upstream request, on the session's primary; none on the fallback route.
        assert delta == {primary: 1}, (path, delta)
        if status == 200:
            assert headers["x-served-by"] == primary
    print("\npath variant | status | upstream requests")
    for path, status, delta in table:
        print(f"{path} | {status} | {delta}")


def test_every_path_spelling_gets_the_same_429_when_the_class_is_full(edge: FleetStack) -> None:
    holder: dict[str, Any] = {}
    started = threading.Event()
    release = threading.Event()

    def hold() -> None:
        # A long stream on the canonical path holds the primary's only "chat" slot.
        conn = http.client.HTTPConnection(LOOPBACK, edge.listener_port, timeout=60)
        try:
            conn.request(
                "POST",
                CHAT,
                _body(64, stream=True),
                {"content-type": "application/json", **SESSION},
            )
            resp = conn.getresponse()
            holder["status"] = resp.status
            started.set()
            release.wait(30)
            holder["body"] = resp.read()
        finally:
            conn.close()
            started.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        assert started.wait(30) and holder.get("status") == 200, (holder, dump_logs(edge))
        before = _upstream_counts(edge)
        canonical = _post(edge, CHAT, _body(1))
        assert canonical[0] == 429, (canonical[0], canonical[2][:300])
        expected = {k: canonical[1][k] for k in ("x-fleet-class", "ratelimit-policy")}
        for path, _engine_status in VARIANTS[1:]:
            status, headers, data = _post(edge, path, _body(1))
            assert status == 429, (path, status, data[:300], dump_logs(edge))
            assert {k: headers[k] for k in expected} == expected, path
            assert orjson.loads(data)["error"]["code"] == "rate_limit_exceeded"
        # A client claiming a tier it was not given gets no way around the full class either.
        status, headers, _ = _post(edge, CHAT, _body(1), {TIER_HEADER: "gold"})
        assert (status, headers["x-fleet-class"]) == (429, "chat")
        # None of the rejected requests reached an upstream, on any route.
        assert _delta(before, _upstream_counts(edge)) == {}
    finally:
        release.set()
        thread.join(60)
    assert b"[DONE]" in holder.get("body", b"")


def test_spoofed_tier_header_is_stripped_before_the_processor(edge: FleetStack) -> None:
    # With the class free, a spoofed tier is still not believed: the processor files the request
    # under "chat" (the access log shows the class header the processor set on the request).
    log_path = edge.workdir / "access.log"
    marked = f"{CHAT}?marker=spoofed-tier"
    status, _headers, data = _post(edge, marked, _body(1), {TIER_HEADER: "gold"})
    assert status == 200, data[:200]

    def logged() -> list[dict[str, Any]]:
        lines = log_path.read_bytes().splitlines()
        entries = [orjson.loads(line) for line in lines if line.startswith(b"{")]
        return [e for e in entries if e["path"] == marked]

    # Envoy flushes the access log about once a second.
    wait_until(lambda: len(logged()) >= 1, 10, "the access log line")
    assert [entry["class"] for entry in logged()] == ["chat"]


def test_client_cannot_set_envoy_control_headers(edge: FleetStack) -> None:
    # Envoy must not honour client-sent x-envoy-* control headers: honoured, they would let a
    # client shorten the route timeout or add retries that run a generation twice. A guard: the
    # request would answer 504 in well under a millisecond if the timeout header were honoured.
    status, _headers, data = _post(
        edge,
        CHAT,
        _body(8),
        {
            "x-envoy-upstream-rq-timeout-ms": "1",
            "x-envoy-upstream-rq-per-try-timeout-ms": "1",
            "x-envoy-retry-on": "5xx,reset",
            "x-envoy-max-retries": "5",
        },
    )
    assert status == 200, data[:300]
    assert orjson.loads(data)["choices"][0]["message"]["content"]

"""Timers through a real Envoy: with the defaults no timer ends a healthy generation, however
long it prefills or streams; a timeout the operator configures is honoured.

Small values stand in for long ones: the request-receive timers are set to 1 s (they bound only
receiving the request) and the generations last several seconds, with seconds of silence
before the first byte (a long prefill) and, unstreamed, until the last.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest
import yaml

from extproc.harness.launch import LOOPBACK, FleetStack, wait_until
from tests.e2e.conftest import dump_logs

CHAT = "/v1/chat/completions"
# Real time: prefill 200 tokens/s (a ~400-token prompt waits ~2 s for its first byte), then
# 10 tokens/s (64 tokens: ~6.4 s).
SIM_ARGS = ("--time-scale", "1", "--prefill-tps", "200", "--decode-tps", "10")


def _body(prompt_chars: int, stream: bool, salt: str) -> bytes:
    # A distinct prompt per request: a prefix-cache hit would skip the slow prefill.
    text = (salt + " ") + "x" * prompt_chars
    return orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 64,
            "stream": stream,
        }
    )


def _send(port: int, body: bytes) -> dict[str, Any]:
    """One request; the response read to its end, or to where it was cut."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=60)
    try:
        conn.request("POST", CHAT, body, {"content-type": "application/json"})
        resp = conn.getresponse()
        chunks: list[bytes] = []
        complete = True
        try:
            while chunk := resp.read1(65536):
                chunks.append(chunk)
        except (http.client.IncompleteRead, ConnectionError):
            complete = False
        return {
            "status": resp.status,
            "body": b"".join(chunks),
            "complete": complete,
            "seconds": time.monotonic() - started,
        }
    finally:
        conn.close()


def _stack(tmp: Any, **overrides: dict[str, Any]) -> FleetStack:
    return FleetStack(tmp, clusters=1, sim_args=SIM_ARGS, fleet_overrides=overrides)


@pytest.fixture(scope="module")
def defaults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    # Response phases on (usage inspection): the ext_proc stream then lives as long as the
    # response, longer than the ext_proc gRPC service's 5 s timeout.
    stack = _stack(
        tmp_path_factory.mktemp("timers-default"),
        listener={"request_receive_timeout_s": 1, "request_headers_timeout_s": 1},
        processor={"inspect_usage": True},
    )
    with stack:
        yield stack


def test_default_timers_never_end_a_generation(defaults: FleetStack) -> None:
    bootstrap = yaml.safe_load(defaults.envoy_path.read_text())
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm = hcm["typed_config"]
    assert hcm["stream_idle_timeout"] == "0s"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert {r["route"]["timeout"] for r in routes} == {"0s"}
    assert all("per_try_timeout" not in r["route"]["retry_policy"] for r in routes)
    with ThreadPoolExecutor(2) as pool:
        # ~2 s of prefill silence then ~6.4 s of tokens; and the same unstreamed: ~8 s silent.
        streamed = pool.submit(_send, defaults.listener_port, _body(1600, True, "s"))
        whole = pool.submit(_send, defaults.listener_port, _body(1600, False, "w"))
        s, w = streamed.result(), whole.result()
    assert s["status"] == 200 and s["complete"], (s, dump_logs(defaults))
    assert s["body"].rstrip().endswith(b"data: [DONE]")
    assert s["seconds"] > 6, s["seconds"]  # longer than every small timer in play here
    assert w["status"] == 200 and w["complete"], (w, dump_logs(defaults))
    assert orjson.loads(w["body"])["choices"][0]["finish_reason"] == "length"
    assert w["seconds"] > 6, w["seconds"]


@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = _stack(
        tmp_path_factory.mktemp("timers-operator"),
        listener={"route_timeout_s": 3, "per_try_timeout_s": 1},
    )
    with stack:
        yield stack


def _ends(stack: FleetStack, count: int) -> list[tuple[str, str]]:
    """How each request ended, from Envoy's access log: (flags, response code details)."""
    path = stack.workdir / "access.log"

    def entries() -> list[dict[str, Any]]:
        lines = path.read_bytes().splitlines()
        return [orjson.loads(line) for line in lines if line.startswith(b"{")]

    # Envoy flushes the access log about once a second.
    wait_until(lambda: len(entries()) >= count, 60, f"{count} access log lines")
    return sorted((e["flags"], e["details"]) for e in entries())


def test_operator_timeouts_are_honoured(operator: FleetStack) -> None:
    with ThreadPoolExecutor(3) as pool:
        # Streamed, first byte at once: the 1 s per-try timeout no longer applies once the
        # response has begun; the 3 s route timeout cuts the stream mid-way.
        streamed = pool.submit(_send, operator.listener_port, _body(8, True, "s"))
        # Unstreamed: no response byte within the 1 s per-try timeout -> 504, not retried.
        whole = pool.submit(_send, operator.listener_port, _body(8, False, "w"))
        # A short one finishes well inside both.
        short = pool.submit(
            _send,
            operator.listener_port,
            orjson.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            ),
        )
        s, w, q = streamed.result(), whole.result(), short.result()
    assert q["status"] == 200 and q["complete"], q
    assert s["status"] == 200 and not s["complete"], s
    assert b"[DONE]" not in s["body"] and s["body"].startswith(b"data: ")
    # Envoy's own answer (rendered as a JSON error by the local reply config).
    assert w["status"] == 504 and b"upstream request timeout" in w["body"], w
    # UT (upstream request timeout) for both cut requests, and which timer it was (Envoy's
    # response code details), not how long they took: the per-try timer ended the unstreamed
    # one; the route timer ended the stream, on which the per-try timer no longer ran.
    assert orjson.loads(w["body"])["error"]["code"] == "upstream_per_try_timeout", w
    assert _ends(operator, 3) == [
        ("-", "via_upstream"),
        ("UT", "response_timeout"),
        ("UT", "upstream_per_try_timeout"),
    ]


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = _stack(tmp_path_factory.mktemp("timers-idle"), listener={"stream_idle_timeout_s": 1.5})
    with stack:
        yield stack


def test_operator_stream_idle_timeout_ends_only_silent_requests(idle: FleetStack) -> None:
    with ThreadPoolExecutor(2) as pool:
        # Tokens every ~0.1 s for ~6.4 s: never idle for 1.5 s, so it completes.
        streamed = pool.submit(_send, idle.listener_port, _body(8, True, "s"))
        # Unstreamed: silent until the end -> ended after 1.5 s of silence (Envoy answers 504
        # "stream timeout" once the request was fully received; flag SI).
        whole = pool.submit(_send, idle.listener_port, _body(8, False, "w"))
        s, w = streamed.result(), whole.result()
    assert s["status"] == 200 and s["complete"], s
    assert s["body"].rstrip().endswith(b"data: [DONE]")
    assert s["seconds"] > 3, s["seconds"]  # longer than the idle timer: it was in play
    # Ended by the idle timer (flag SI), whatever the machine's speed.
    assert w["status"] == 504 and b"stream timeout" in w["body"], w
    assert [flags for flags, _ in _ends(idle, 2)] == ["-", "SI"]

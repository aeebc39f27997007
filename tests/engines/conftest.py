"""Fixtures of the real-engine tier: llama.cpp servers (xllamacpp, ``make engine-deps``) behind
a real Envoy and a real ``extproc serve``, driven with the real OpenAI SDK.

Engines start once per module (a fixture of each test file), on 127.0.0.1 at free ports; the
tiny random-weight model is written once into ``.engines/cache`` (gitignored) and reused.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest

from extproc.harness.launch import http_get
from extproc.harness.real_engines import llamacpp
from extproc.harness.real_engines.base import ENGINES_DIR
from extproc.harness.real_engines.fleet import RealFleet

TINY = "tiny"
# Enough for a multi-turn conversation of the tests in every slot: n_ctx is divided among
# the slots.
TINY_SPEC_CTX = 8192


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return llamacpp.tiny_model(ENGINES_DIR / "cache")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    return llamacpp.smollm2_model()


def llamacpp_fleet(
    workdir: Path,
    spec: llamacpp.LlamaCppSpec,
    clusters: int = 2,
    engines: int = 2,
    specs_by_cluster: Mapping[str, llamacpp.LlamaCppSpec] | None = None,
    **stack_options: Any,
) -> RealFleet:
    """``clusters`` x ``engines`` llama.cpp servers (``spec``, or the cluster's own from
    ``specs_by_cluster``), named c1-e1 … as the stack names them."""
    layout = {}
    for i in range(1, clusters + 1):
        cluster = f"c{i}"
        cluster_spec = (specs_by_cluster or {}).get(cluster, spec)
        layout[cluster] = [
            llamacpp.LlamaCppEngine(f"{cluster}-e{j}", workdir / "engines", cluster_spec)
            for j in range(1, engines + 1)
        ]
    stack_options.setdefault("cluster_fields", {"engine": "llamacpp"})
    return RealFleet(workdir, layout, llamacpp.START_TIMEOUT_S, **stack_options)


def tiny_spec(model: Path, **fields: Any) -> llamacpp.LlamaCppSpec:
    return replace(llamacpp.LlamaCppSpec(model, TINY, n_ctx=TINY_SPEC_CTX), **fields)


@pytest.fixture
def openai_client() -> Iterator[Callable[[RealFleet], openai.OpenAI]]:
    """The real OpenAI SDK pointed at a fleet's Envoy; no SDK retries (a retried request
    could generate twice and would hide a failure)."""
    made: list[openai.OpenAI] = []

    def make(fleet: RealFleet) -> openai.OpenAI:
        assert fleet.stack is not None
        client = openai.OpenAI(
            base_url=fleet.stack.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def engine_counter(fleet: RealFleet, name: str) -> float:
    """The sum over every engine of one unlabelled llama.cpp metric (e.g. a token counter)."""
    total = 0.0
    for engine in fleet.engines:
        total += metric_value(engine.metrics_text(), name)
    return total


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on the page")


def processor_sum(fleet: RealFleet, name: str, **labels: str) -> float:
    assert fleet.stack is not None
    want = set(labels.items())
    samples = fleet.stack.processor_metrics()
    return sum(v for (n, got), v in samples.items() if n == name and want <= set(got))


def engine_models(fleet: RealFleet, name: str) -> bytes:
    status, body = http_get(fleet.engine(name).port, "/v1/models", timeout=5)
    assert status == 200
    return body


T = TypeVar("T")


def counters(fleet: RealFleet, name: str) -> dict[str, float]:
    """One llama.cpp counter of every live engine, by stack name."""
    out = {}
    for cluster in fleet.clusters:
        for engine_name in fleet.names(cluster):
            engine = fleet.engine(engine_name)
            if engine.alive:
                out[engine_name] = metric_value(engine.metrics_text(), name)
    return out


def prompts_seen(fleet: RealFleet) -> dict[str, float]:
    """Prompt tokens every live engine took in (evaluated + reused): moves on the engine that
    starts a request, and only there."""
    evaluated = counters(fleet, "llamacpp:prompt_tokens_total")
    cached = counters(fleet, "llamacpp:prompt_tokens_cached_total")
    return {n: evaluated[n] + cached.get(n, 0.0) for n in evaluated}


def served(fleet: RealFleet, call: Callable[[], T]) -> tuple[T, str]:
    """Run one request and name the engine that took it, from the engines' own prompt-token
    counters (sequential traffic only): exactly one engine's count must have moved."""
    before = prompts_seen(fleet)
    result = call()
    after = prompts_seen(fleet)
    moved = [n for n, v in after.items() if v != before.get(n, 0.0)]
    assert len(moved) == 1, (before, after)
    return result, moved[0]


class StreamHog:
    """Long streamed chat requests sent straight to one engine (not through Envoy), each read
    by its own thread until ``close``, which drops the connections (the engine cancels them)."""

    def __init__(self, port: int, count: int, max_tokens: int, model: str = TINY) -> None:
        self._stop = threading.Event()
        self._conns: list[http.client.HTTPConnection] = []
        self.chunks = [0] * count
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "Tell a very long story."}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        )
        for _ in range(count):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            self._conns.append(conn)
        self._threads = [
            threading.Thread(target=self._read, args=(i, c), daemon=True)
            for i, c in enumerate(self._conns)
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, index: int, conn: http.client.HTTPConnection) -> None:
        try:
            response = conn.getresponse()
            while not self._stop.is_set():
                if not response.readline():
                    return
                self.chunks[index] += 1
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            return  # the connection was dropped by close() mid-read

    def close(self) -> None:
        self._stop.set()
        for conn in self._conns:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        for thread in self._threads:
            thread.join(30)

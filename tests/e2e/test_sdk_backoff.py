"""The official ``openai`` and ``anthropic`` Python SDKs, with their default retry settings, as
clients of a real Envoy + processor: a burst over a class's budget is answered with 429s whose
hints the SDKs obey (before each retry they sleep exactly ``retry-after-ms``, not their own
backoff) and every call succeeds once the burst has drained. A wait too long for an SDK to
sleep through is answered with ``x-should-retry: false``: the SDK raises without sleeping
instead of retrying blindly. What the SDKs sleep is recorded from their own ``time.sleep``
call (which still sleeps), not timed: a loaded machine cannot change it.
"""

from __future__ import annotations

import itertools
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import anthropic
import anthropic._base_client
import openai
import openai._base_client
import pytest

from extproc.harness.launch import FleetStack
from tests.e2e.conftest import dump_logs
from tests.support.flow import NO_PLACEMENT, refused_at_once

# One cluster, so the whole burst lands on one budget; each request holds its slot ~0.5 s
# (8 output tokens at 16 tokens/s).
SIM_ARGS = ("--time-scale", "1", "--prefill-tps", "200000", "--decode-tps", "16")
CLASSES: list[dict[str, Any]] = [
    {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 2}},
    # 8000 tokens drain the bucket; the next such request waits > 60 s for the refill.
    {"name": "long", "budget": {"tokens_per_second": 100, "burst_tokens": 10_000}},
]
BURST = 5


@dataclass
class Exchange:
    method: str
    status: int = 0
    headers: dict[str, str] | None = None
    # What the SDK slept after this exchange's response (None: it did not sleep).
    slept_after: float | None = None


class Wire:
    """Every HTTP exchange an SDK made, via httpx event hooks on the SDK's default client, and
    every sleep of the SDK's retry loop, in order, per call. An SDK makes a call's requests and
    sleeps on the calling thread, so a sleep belongs to the thread's last request."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_call: dict[str, list[Exchange]] = {}
        self.sleeps: dict[str, list[float]] = {}
        self._current = threading.local()

    def request(self, request: Any) -> None:
        call = request.headers.get("x-test-call", "?")
        self._current.call = call
        with self.lock:
            self.by_call.setdefault(call, []).append(Exchange(request.method))

    def response(self, response: Any) -> None:
        call = response.request.headers.get("x-test-call", "?")
        with self.lock:
            last = self.by_call[call][-1]
            last.status = response.status_code
            last.headers = {k.lower(): v for k, v in response.headers.items()}

    def slept(self, seconds: float) -> None:
        call = getattr(self._current, "call", "?")
        with self.lock:
            self.sleeps.setdefault(call, []).append(seconds)
            exchanges = self.by_call.get(call)
            if exchanges:
                exchanges[-1].slept_after = seconds

    def hooks(self) -> dict[str, list[Any]]:
        return {"request": [self.request], "response": [self.response]}


def record_sdk_sleeps(monkeypatch: pytest.MonkeyPatch, wire: Wire) -> None:
    """The SDKs' retry loops call ``time.sleep`` of their ``_base_client`` module: that module's
    ``time`` is replaced by one whose ``sleep`` tells ``wire`` and then really sleeps."""

    def sleep(seconds: float) -> None:
        wire.slept(seconds)
        time.sleep(seconds)

    for module in (openai._base_client, anthropic._base_client):
        assert module.time is time, module  # the SDK still sleeps through this module's time
        recording = types.ModuleType("time")
        recording.__dict__.update(vars(time))
        recording.sleep = sleep
        monkeypatch.setattr(module, "time", recording)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with FleetStack(
        tmp_path_factory.mktemp("sdk"),
        clusters=1,
        sim_args=SIM_ARGS,
        fleet_overrides={"classes": refused_at_once(CLASSES), "flow": NO_PLACEMENT},
        processor_args=("--seed", "11"),
    ) as running:
        yield running


def openai_client(stack: FleetStack, wire: Wire) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="test",
        base_url=f"{stack.url}/v1",
        http_client=openai.DefaultHttpxClient(event_hooks=wire.hooks()),
    )


def anthropic_client(stack: FleetStack, wire: Wire) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="test",
        base_url=stack.url,
        http_client=anthropic.DefaultHttpxClient(event_hooks=wire.hooks()),
    )


def check_backoff(wire: Wire, stack: FleetStack) -> int:
    """Before every retry the SDK slept exactly the hint of the 429 before it; every call
    ended 200, after as many sleeps as retries. Returns how many 429s were obeyed."""
    obeyed = 0
    for call, exchanges in wire.by_call.items():
        assert exchanges[-1].status == 200, (call, [e.status for e in exchanges], dump_logs(stack))
        assert exchanges[-1].slept_after is None, call
        assert len(wire.sleeps.get(call, [])) == len(exchanges) - 1, (call, wire.sleeps)
        for before, _after in itertools.pairwise(exchanges):
            assert before.status == 429 and before.headers is not None
            hint_s = int(before.headers["retry-after-ms"]) / 1000
            assert int(before.headers["retry-after"]) * 1000 == int(
                before.headers["retry-after-ms"]
            )
            assert hint_s <= 60 and "x-should-retry" not in before.headers
            # The SDK slept the hint, not its own jittered 0.5-8 s backoff (what it sleeps
            # without a hint it honours).
            assert before.slept_after == pytest.approx(hint_s), (call, hint_s, before.slept_after)
            obeyed += 1
    return obeyed


def burst(call: Callable[[int], str]) -> list[str]:
    with ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(call, range(BURST)))


def test_openai_sdk_backs_off_on_our_hints_and_succeeds(
    stack: FleetStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = Wire()
    record_sdk_sleeps(monkeypatch, wire)
    with openai_client(stack, wire) as client:

        def call(i: int) -> str:
            out = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"burst question {i}"}],
                max_tokens=8,
                extra_headers={"x-test-call": f"openai-{i}"},
            )
            return out.choices[0].message.content or ""

        answers = burst(call)
    assert all(answers)
    assert check_backoff(wire, stack) >= 1, "the burst never exceeded the budget"


def test_anthropic_sdk_backs_off_on_our_hints_and_succeeds(
    stack: FleetStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = Wire()
    record_sdk_sleeps(monkeypatch, wire)
    with anthropic_client(stack, wire) as client:

        def call(i: int) -> str:
            out = client.messages.create(
                model="m",
                max_tokens=8,
                messages=[{"role": "user", "content": f"anthropic burst {i}"}],
                extra_headers={"x-test-call": f"anthropic-{i}"},
            )
            block = out.content[0]
            return block.text if block.type == "text" else ""

        answers = burst(call)
    assert all(answers)
    assert check_backoff(wire, stack) >= 1, "the burst never exceeded the budget"
    rejected = [
        e.headers
        for exchanges in wire.by_call.values()
        for e in exchanges
        if e.status == 429 and e.headers is not None
    ]
    for headers in rejected:
        assert int(headers["anthropic-ratelimit-requests-limit"]) == 2
        assert int(headers["anthropic-ratelimit-requests-remaining"]) == 0
        reset = datetime.fromisoformat(headers["anthropic-ratelimit-requests-reset"])
        assert reset.tzinfo is not None


def test_a_wait_beyond_what_sdks_sleep_is_not_retried(
    stack: FleetStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = Wire()
    record_sdk_sleeps(monkeypatch, wire)
    big = "tool output line. " * 1800  # about 8000 estimated input tokens: the long class
    with openai_client(stack, wire) as client:

        def ask(call: str) -> Any:
            return client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": big + call}],
                max_tokens=8,
                extra_headers={"x-test-call": call},
            )

        ask("drain")  # takes 8000 of the 10000-token bucket
        with pytest.raises(openai.RateLimitError) as raised:
            ask("refused")
    assert wire.sleeps.get("refused", []) == [], "the SDK slept instead of raising"
    assert len(wire.by_call["refused"]) == 1, "the SDK retried a wait it cannot sleep through"
    headers = raised.value.response.headers
    wait_s = int(headers["retry-after"])
    assert wait_s > 60
    assert headers["x-should-retry"] == "false"
    assert int(headers["retry-after-ms"]) == wait_s * 1000
    assert int(headers["x-fleet-retry-after-ms"]) == wait_s * 1000
    assert f"retry after {wait_s}s" in raised.value.message

"""Real vLLM (CPU build) behind a real Envoy and ``extproc serve``, driven with the OpenAI SDK.

Two engines, one per cluster (c1, c2), each serving the tiny random llama as ``tiny`` and under
a name of its own (``tiny-c1`` / ``tiny-c2``), started once for the module (about a minute each
on an idle machine, several when loaded). The processor scrapes their /metrics (load-aware
affinity on) and reads usage from their responses. The tests run in file order; the last one
kills c1's engine and starts it again.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.bench.real_affinity import compare
from extproc.config import Runtime, load_runtime
from extproc.explain import explain_remote
from extproc.harness.launch import LOOPBACK, wait_until
from extproc.harness.real_engines import vllm
from extproc.harness.real_engines.base import ENGINES_DIR
from extproc.harness.real_engines.fleet import RealFleet
from tests.e2e.predict import placement_for
from tests.engines.conftest import processor_sum

MakeOpenAI = Callable[[RealFleet], openai.OpenAI]
CHAT = "/v1/chat/completions"
TINY = "tiny"
MAX_NUM_SEQS = 4
# Two of vLLM's 128-token prefix-cache blocks and more: a repeat of it hits the cache.
SHARED = "You are a terse assistant for the fleet tests. " * 40
# vLLM's sampling extension: generate exactly max_tokens (the random model emits EOS at random).
FIXED = {"ignore_eos": True, "temperature": 0}
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    model = vllm.tiny_model(ENGINES_DIR / "cache")
    workdir = tmp_path_factory.mktemp("vllm")
    layout = {
        name: [
            vllm.VllmEngine(
                f"{name}-e1",
                workdir / "engines",
                vllm.VllmSpec(model, (TINY, f"tiny-{name}"), max_num_seqs=MAX_NUM_SEQS),
            )
        ]
        for name in ("c1", "c2")
    }
    real = RealFleet(
        workdir,
        layout,
        vllm.START_TIMEOUT_S,
        cluster_fields={"engine": "vllm"},
        # Listed: the fleet is model-aware; discovery adds each engine's own name.
        cluster_models={"c1": [TINY], "c2": [TINY]},
        fleet_overrides={
            "processor": {"inspect_usage": True},
            "engine_metrics": {"enabled": True, "interval_ms": 200, "max_age_ms": 5000},
            # No share bound: only the engines' own load moves new sessions here.
            "affinity": {
                "enabled": True,
                "balance_factor": 0,
                "load_from_response_headers": False,
                "signal_max_age_s": 30,
            },
            "model_routing": {"discovery": True, "discovery_interval_s": 1},
            "classes": [{"name": "all", "budget": {"max_concurrent": 64}}],
        },
    )
    with real:
        yield real


# -- helpers ----------------------------------------------------------------------------------


def samples(fleet: RealFleet, cluster: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = fleet.clusters[cluster][0].metrics_text()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                labels = tuple(
                    sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name"))
                )
                out[(s.name, labels)] = s.value
    return out


def vllm_value(fleet: RealFleet, cluster: str, name: str, **labels: str) -> float:
    return samples(fleet, cluster).get((name, tuple(sorted(labels.items()))), 0.0)


def vllm_total(fleet: RealFleet, name: str, **labels: str) -> float:
    return sum(vllm_value(fleet, c, name, **labels) for c in fleet.clusters)


def finished(fleet: RealFleet, cluster: str) -> float:
    """Requests the engine finished, for any reason."""
    return sum(
        v for (n, _l), v in samples(fleet, cluster).items() if n == "vllm:request_success_total"
    )


def runtime_of(fleet: RealFleet) -> Runtime:
    assert fleet.stack is not None
    return load_runtime(fleet.stack.fleet_path)


def sessions_on(runtime: Runtime, primary: str, count: int, tag: str) -> list[str]:
    """Session ids (x-session-id) whose hash primary for model ``tiny`` is ``primary``."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        sid = f"{tag}-{i}"
        i += 1
        doc = {"model": TINY, "messages": [{"role": "user", "content": "which?"}]}
        placed = placement_for(runtime, CHAT, orjson.dumps(doc), {"x-session-id": sid})
        if placed.primary == primary:
            found.append(sid)
    return found


def chat(
    client: openai.OpenAI, sid: str, text: str, max_tokens: int = 4, model: str = TINY
) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        extra_headers={"x-session-id": sid},
        extra_body=FIXED,
    )


# -- 1. the API and the cost metrics ----------------------------------------------------------


def test_chat_and_completions_with_usage_that_matches_vllm_s_counters(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)

    def ours() -> tuple[float, float, float]:
        return (
            processor_sum(fleet, "fleet_upstream_input_tokens_total", cache="hit"),
            processor_sum(fleet, "fleet_upstream_input_tokens_total", cache="miss"),
            processor_sum(fleet, "fleet_upstream_output_tokens_total"),
        )

    def theirs() -> tuple[float, float, float]:
        hits = vllm_total(fleet, "vllm:prefix_cache_hits_total")
        prompt = vllm_total(fleet, "vllm:prompt_tokens_total")
        return hits, prompt - hits, vllm_total(fleet, "vllm:generation_tokens_total")

    ours_before, theirs_before = ours(), theirs()
    hit = miss = out = 0
    for turn in range(2):
        question = f"{SHARED} Question {turn}: what is the fleet?"
        done = chat(client, "vllm-api", question)
        assert done.choices[0].message.content
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        cached = done.usage.prompt_tokens_details.cached_tokens or 0
        hit, miss, out = (
            hit + cached,
            miss + done.usage.prompt_tokens - cached,
            out + done.usage.completion_tokens,
        )

        chunks = list(
            client.chat.completions.create(
                model=TINY,
                messages=[{"role": "user", "content": question}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-session-id": "vllm-api"},
                extra_body=FIXED,
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        assert cached > 0  # the same prompt a moment ago: vLLM's prefix cache
        hit, miss, out = (
            hit + cached,
            miss + usage.prompt_tokens - cached,
            out + usage.completion_tokens,
        )

        for stream in (False, True):
            prompt = f"{SHARED} Complete {turn}:"
            if stream:
                events = list(
                    client.completions.create(
                        model=TINY, prompt=prompt, max_tokens=3, stream=True,
                        stream_options={"include_usage": True},
                        extra_headers={"x-session-id": "vllm-completion"}, extra_body=FIXED,
                    )
                )  # fmt: skip
                assert "".join(e.choices[0].text for e in events if e.choices)
                cusage = events[-1].usage
            else:
                completion = client.completions.create(
                    model=TINY, prompt=prompt, max_tokens=3,
                    extra_headers={"x-session-id": "vllm-completion"}, extra_body=FIXED,
                )  # fmt: skip
                assert completion.choices[0].text
                cusage = completion.usage
            assert cusage is not None and cusage.prompt_tokens_details is not None
            cached = cusage.prompt_tokens_details.cached_tokens or 0
            hit, miss, out = (
                hit + cached,
                miss + cusage.prompt_tokens - cached,
                out + cusage.completion_tokens,
            )
    assert hit > 0

    def delta(now: tuple[float, ...], before: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(a - b for a, b in zip(now, before, strict=True))

    wait_until(lambda: delta(ours(), ours_before) == (hit, miss, out), 30, "usage counted")
    # vLLM's own counters: the cached tokens are its prefix-cache hits, token for token.
    assert delta(theirs(), theirs_before) == (hit, miss, out)
    assert processor_sum(fleet, "fleet_usage_missing_responses_total") == 0


# -- 2. model discovery -----------------------------------------------------------------------


def test_models_discovered_from_vllm_s_own_list(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    assert fleet.stack is not None
    admin = f"http://{LOOPBACK}:{fleet.stack.metrics_ports[0]}"

    def routes(model: str) -> object:
        doc = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        return explain_remote(admin, CHAT, {"x-session-id": "m"}, orjson.dumps(doc)).get("primary")

    wait_until(lambda: routes("tiny-c2") == "c2", 60, "discovery of tiny-c2 on c2")
    for name in ("c1", "c2"):
        before = finished(fleet, name)
        done = chat(client, f"model-{name}", "which engine?", model=f"tiny-{name}")
        # vLLM names its first served model in every answer, whichever name was asked for.
        assert done.model == TINY
        wait_until(lambda n=name, b=before: finished(fleet, n) == b + 1, 30, f"{name} served it")
    with pytest.raises(openai.NotFoundError) as caught:
        chat(client, "model-none", "nobody serves this", model="no-such-model")
    assert "no-such-model" in str(caught.value)


# -- 3. a client that goes away ---------------------------------------------------------------


def test_a_client_disconnect_mid_stream_aborts_the_generation_and_frees_the_budget(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    runtime = runtime_of(fleet)
    sid = sessions_on(runtime, "c1", 1, "vllm-abort")[0]
    finished_before = finished(fleet, "c1")
    tokens_before = vllm_value(fleet, "c1", "vllm:generation_tokens_total")
    stream = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "count to a million"}],
        max_tokens=3000,
        stream=True,
        extra_headers={"x-session-id": sid},
        extra_body=FIXED,
    )
    for got, _chunk in enumerate(stream, 1):
        if got == 3:
            break
    held = processor_sum(fleet, "fleet_budget_inflight_requests", cluster="c1")
    assert held == 1  # the stream holds its budget while it runs
    assert vllm_value(fleet, "c1", "vllm:num_requests_running") == 1
    stream.close()
    wait_until(
        lambda: vllm_value(fleet, "c1", "vllm:num_requests_running") == 0,
        120,
        "vLLM to stop running the request",
    )
    generated = vllm_value(fleet, "c1", "vllm:generation_tokens_total") - tokens_before
    assert 3 <= generated < 3000  # it stopped generating: far from the 3,000 asked for
    # vLLM counts a client's abort nowhere: not as a finished request of any reason (its
    # finished_reason="abort" series is for aborts of its own).
    assert finished(fleet, "c1") == finished_before
    wait_until(
        lambda: processor_sum(fleet, "fleet_budget_inflight_requests", cluster="c1") == 0,
        30,
        "the budget to be given back",
    )


# -- 4. at its sequence limit it queues -------------------------------------------------------


def test_at_max_num_seqs_vllm_queues_and_is_not_ejected(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    assert fleet.stack is not None
    client = openai_client(fleet)
    sid = sessions_on(runtime_of(fleet), "c1", 1, "vllm-queue")[0]
    before = {c: finished(fleet, c) for c in fleet.clusters}
    ejections = fleet.stack.envoy_stat("cluster.c1.outlier_detection.ejections_enforced_total")
    count = 2 * MAX_NUM_SEQS
    waiting_seen = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if vllm_value(fleet, "c1", "vllm:num_requests_waiting") > 0:
                waiting_seen.set()
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            done = list(
                pool.map(
                    lambda i: chat(client, sid, f"{SHARED} job {i}", max_tokens=64), range(count)
                )
            )
    finally:
        stop.set()
        watcher.join(5)
    assert all(d.usage is not None and d.usage.completion_tokens == 64 for d in done)
    assert waiting_seen.is_set()  # more than max_num_seqs: vLLM queued the rest
    wait_until(lambda: finished(fleet, "c1") == before["c1"] + count, 30, "c1 to finish them")
    # Each ran exactly once, all on the session's cluster; Envoy ejected nothing.
    assert finished(fleet, "c2") == before["c2"]
    assert (
        fleet.stack.envoy_stat("cluster.c1.outlier_detection.ejections_enforced_total") == ejections
    )


# -- 5. a backlog moves new sessions, keeps old ones -------------------------------------------


def route_kinds(fleet: RealFleet) -> Counter[str]:
    """The processor's routing decisions so far, by kind (primary, spilled, migrated, ...)."""
    assert fleet.stack is not None
    kinds: Counter[str] = Counter()
    for (name, labels), value in fleet.stack.processor_metrics().items():
        if name == "fleet_route_decisions_total":
            kinds[dict(labels)["kind"]] += int(value)
    return kinds


def placed_kind(fleet: RealFleet, sid: str) -> tuple[object, object]:
    """Where the running processor would place a turn of ``sid`` now, and by which rule."""
    assert fleet.stack is not None
    admin = f"http://{LOOPBACK}:{fleet.stack.metrics_ports[0]}"
    doc = {"model": TINY, "messages": [{"role": "user", "content": "where?"}], "max_tokens": 1}
    got = explain_remote(admin, CHAT, {"x-session-id": sid}, orjson.dumps(doc))
    return got.get("kind"), got.get("primary")


def envoy_moved_off(fleet: RealFleet, cluster: str) -> int:
    """Envoy's own reasons to send a request routed to ``cluster`` elsewhere: failed health
    checks (a busy engine's /health past its timeout) and connect failures (retried on the
    secondary, since the engine never saw the request)."""
    assert fleet.stack is not None
    stats = ("health_check.failure", "upstream_cx_connect_fail", "upstream_cx_connect_timeout")
    return sum(fleet.stack.envoy_stat(f"cluster.{cluster}.{s}") for s in stats)


def test_a_backlog_moves_new_sessions_and_keeps_old_ones(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    runtime = runtime_of(fleet)
    old, new = sessions_on(runtime, "c1", 2, "vllm-backlog")
    # The earlier tests' load on c1 must have left the processor's view first, or the old
    # session's first turn spills to c2 and its later turns follow it there.
    wait_until(
        lambda: placed_kind(fleet, old) == ("primary", "c1"), 120, "c1 idle for a new session"
    )
    decided = route_kinds(fleet)
    chat(client, old, "an old conversation")  # seen: an existing session from now on
    assert route_kinds(fleet) - decided == Counter(primary=1)
    engine = openai.OpenAI(
        base_url=f"{fleet.clusters['c1'][0].url}/v1", api_key="unused", max_retries=0, timeout=600
    )
    count = 3 * MAX_NUM_SEQS
    try:
        with concurrent.futures.ThreadPoolExecutor(count + 2) as pool:
            # The backlog: sent straight to c1's engine, as another router's traffic would be.
            backlog = [
                pool.submit(
                    engine.chat.completions.create,
                    model=TINY,
                    messages=[{"role": "user", "content": f"backlog {i}"}],
                    max_tokens=200,
                    extra_body=FIXED,
                )
                for i in range(count)
            ]
            wait_until(
                lambda: processor_sum(fleet, "fleet_cluster_queue_depth", cluster="c1") > 0,
                120,
                "the processor to see c1's queue in its /metrics",
                interval=0.1,
            )
            before = {c: finished(fleet, c) for c in fleet.clusters}
            moved = chat(client, new, "a new conversation")
            assert moved.usage is not None
            # The new session started on c2: c1 is saturated (its queue, from its /metrics).
            assert finished(fleet, "c2") == before["c2"] + 1
            decided = route_kinds(fleet)
            envoy_before = envoy_moved_off(fleet, "c1")
            kept = pool.submit(chat, client, old, "the old conversation goes on")
            kept_done = kept.result(timeout=600)
            assert kept_done.usage is not None
            # The processor kept the old session on its primary, busy as it is: no migration.
            assert route_kinds(fleet) - decided == Counter(primary=1)
            for f in backlog:
                f.result(timeout=600)
        # And c1 served it, unless Envoy itself moved it (a busy engine's health check timed
        # out, or a connect did, on a starved machine): the processor does not see that.
        if finished(fleet, "c2") != before["c2"] + 1:
            assert finished(fleet, "c2") == before["c2"] + 2
            assert envoy_moved_off(fleet, "c1") > envoy_before
    finally:
        engine.close()


# -- 6. prefix affinity pays ------------------------------------------------------------------


def test_prefix_affinity_caches_more_than_round_robin_on_the_same_engines(
    fleet: RealFleet, tmp_path: Path
) -> None:
    """A short run of ``extproc bench real-affinity`` (the full one is in docs/real-engines.md):
    conversations without a session id, each arm with its own Envoy over the same engines."""
    ports = {c: [e.port for e in engines] for c, engines in fleet.clusters.items()}
    rr, ours = compare(ports, tmp_path, TINY, conversations=3, turns=3, max_tokens=4)
    assert (rr.arm, ours.arm) == ("round_robin", "extproc")
    assert rr.requests == ours.requests == 9
    # Round robin sends a conversation's next turn to the other engine: only the shared system
    # prompt is cached there. The processor keeps the conversation where its history is.
    assert ours.cached_ratio > rr.cached_ratio, (rr, ours)
    assert ours.evaluated_prompt_tokens < rr.evaluated_prompt_tokens, (rr, ours)
    # The ideal (one infinite cache over the arm's own trace, tokenized by the engine) bounds
    # round robin's, and the processor comes closer to it.
    assert 0 < rr.cached_ratio <= rr.ideal_cached_ratio, rr
    assert rr.ideal_cached_ratio - rr.cached_ratio > ours.ideal_cached_ratio - ours.cached_ratio


# -- 7. SIGKILL ---------------------------------------------------------------------------------


def test_sigkill_of_an_engine_fails_no_request_and_its_sessions_come_back(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    sessions = sessions_on(runtime_of(fleet), "c1", 3, "vllm-kill")
    fresh = sessions_on(runtime_of(fleet), "c1", 200, "vllm-back")
    for sid in sessions:
        chat(client, sid, "before")
    c2_before = finished(fleet, "c2")
    fleet.clusters["c1"][0].kill()
    failed = 0
    for turn in range(3):
        for sid in sessions:
            try:
                done = chat(client, sid, f"while c1 is down {turn}")
                assert done.choices[0].message.content is not None
            except openai.APIError:
                failed += 1
    assert failed == 0
    wait_until(lambda: finished(fleet, "c2") == c2_before + 9, 30, "c2 to serve c1's sessions")
    fleet.clusters["c1"][0].restart(vllm.START_TIMEOUT_S)
    assert fleet.stack is not None
    fleet.stack.wait_healthy(["c1"], timeout=120)

    # New c1 sessions start there again (those that moved keep their new cache on c2), once
    # Envoy and the processor take the restarted engine back.
    def lands_on_c1() -> bool:
        sid = fresh.pop()
        back = finished(fleet, "c1")
        chat(client, sid, "after the restart")
        return finished(fleet, "c1") == back + 1

    wait_until(lands_on_c1, 300, "a new c1 session served by c1", interval=2.0)

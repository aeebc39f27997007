"""`extproc bench real-affinity`: does prefix affinity pay on a real engine? The processor
against Envoy's round robin, side by side over the same real vLLM engines.

Two vLLM engines (CPU build, the tiny random llama; ``make engine-deps``), one per cluster, are
started once. Each arm puts its own Envoy in front of them (``extproc``: Envoy + the processor;
``round_robin``: Envoy alone over every engine) and runs the same multi-turn conversations with
no session id: a shared system prompt, a first user message of each conversation's own, every
turn appending the reply and a new question, sent one request at a time, turn by turn across
the conversations. Use an odd number of conversations: with an even one, round robin over two
engines sends every turn of a conversation to the same engine (request i goes to engine i mod
2), which is affinity by accident. Each turn adds more than one of vLLM's 128-token cache blocks
(the question and ``--max-tokens`` of reply), so a history is worth caching. Each arm's
conversations carry their own salt at the start, so no arm reuses another's cache.

Per arm: the engines' own prefix-cache hit ratio over the arm (``vllm:prefix_cache_hits_total``
/ ``vllm:prefix_cache_queries_total`` deltas), the prompt tokens they evaluated (the prefill
compute actually spent: queries minus hits) and the time to the first streamed token, p50 and
p99, as the client saw it. The figures are ratios of one run on one machine; rerun to compare.

Beside each arm, the *ideal* hit ratio of its own trace: one engine with an infinite prefix cache
serving the arm's requests in the order they were sent. It needs no other engine run: each
request's prompt is tokenized by the running engine (vLLM's ``/tokenize``, the same chat
template), and the cache is replayed as vLLM's keeps it (:func:`ideal_hits`): full blocks of
``block_size`` tokens (from ``vllm:cache_config_info``) chained from the prompt's start, a hit
never covering the prompt's last token. Only prompt blocks are held: the blocks of a reply count
when a later prompt repeats them, which it does here (each turn's prompt carries the previous
reply), but vLLM also keeps the reply's own generated blocks, which a later prompt hits only
when its tokenization of the reply is the same ids; an engine can so score a little above this
ideal.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from extproc.harness.launch import LOOPBACK, FleetStack, http_get

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

ARMS = ("round_robin", "extproc")
SYSTEM = "You are the fleet's assistant. Answer briefly and cite the routing manual. " * 24
FIXED = {"ignore_eos": True, "temperature": 0}
FOLLOW_UP = "Then say what happens to the session when its primary cluster is gone. " * 8


@dataclass(frozen=True, slots=True)
class ArmResult:
    arm: str
    requests: int
    cached_ratio: float
    evaluated_prompt_tokens: float
    ttft_p50_s: float
    ttft_p99_s: float
    # One infinite cache serving the arm's requests in order (see the module docstring).
    ideal_cached_ratio: float = 0.0


def ideal_hits(prompts: Sequence[Sequence[int]], block_size: int) -> tuple[int, int]:
    """(hits, queries) of one infinite prefix cache serving ``prompts`` (token ids) in order, as
    vLLM counts them: a prompt queries all its tokens and hits its leading full blocks already
    cached (a block is its tokens and every token before it), at most the blocks before its
    last token (that one is always computed); then every full block of it is cached."""
    cached: set[tuple[int, ...]] = set()
    hits = queries = 0
    for prompt in prompts:
        queries += len(prompt)
        blocks = [tuple(prompt[: (i + 1) * block_size]) for i in range(len(prompt) // block_size)]
        usable = max(0, len(prompt) - 1) // block_size
        hit = 0
        while hit < usable and blocks[hit] in cached:
            hit += 1
        hits += hit * block_size
        cached.update(blocks)
    return hits, queries


def _block_size(port: int) -> int:
    _status, body = http_get(port, "/metrics", timeout=10.0)
    for line in body.decode().splitlines():
        if line.startswith("vllm:cache_config_info{"):
            for label in line[line.index("{") + 1 : line.rindex("}")].split(","):
                name, _eq, value = label.partition("=")
                if name.strip() == "block_size":
                    return int(value.strip().strip('"'))
    raise RuntimeError("vllm:cache_config_info names no block_size")


def _tokens(port: int, model: str, messages: Sequence[Mapping[str, str]]) -> list[int]:
    payload = {"model": model, "messages": list(messages), "add_generation_prompt": True}
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=60.0)
    try:
        conn.request("POST", "/tokenize", json.dumps(payload), {"content-type": "application/json"})
        response = conn.getresponse()
        status, body = response.status, response.read()
    finally:
        conn.close()
    if status != 200:
        raise RuntimeError(f"/tokenize answered {status}: {body[:200]!r}")
    tokens = json.loads(body)["tokens"]
    return [int(t) for t in tokens]


def _counter(port: int, name: str) -> float:
    _status, body = http_get(port, "/metrics", timeout=10.0)
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _counters(ports: Sequence[int]) -> tuple[float, float]:
    hits = sum(_counter(p, "vllm:prefix_cache_hits_total") for p in ports)
    queries = sum(_counter(p, "vllm:prefix_cache_queries_total") for p in ports)
    return hits, queries


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def run_arm(
    arm: str,
    engines: Mapping[str, Sequence[int]],
    workdir: Path,
    model: str,
    conversations: int,
    turns: int,
    max_tokens: int,
) -> ArmResult:
    """One arm over running engines (cluster -> engine ports): its own Envoy (and processor)."""
    import openai

    stack = FleetStack(
        workdir / arm,
        mode=arm,  # type: ignore[arg-type]
        external_engines=engines,
        cluster_fields={"engine": "vllm"},
        access_log=False,
    )
    ports = [p for group in engines.values() for p in group]
    ttfts: list[float] = []
    sent: list[list[dict[str, str]]] = []  # every request's messages, in the order sent
    with stack:
        client = openai.OpenAI(
            base_url=f"http://{LOOPBACK}:{stack.listener_port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=600,
        )
        try:
            hits0, queries0 = _counters(ports)
            history: list[list[dict[str, str]]] = [
                [
                    {"role": "system", "content": f"[{arm}] {SYSTEM}"},
                    {"role": "user", "content": f"Conversation {c}: where does session {c} go?"},
                ]
                for c in range(conversations)
            ]
            for turn in range(turns):
                for messages in history:
                    sent.append(list(messages))
                    started = time.perf_counter()
                    first: float | None = None
                    text = []
                    stream = client.chat.completions.create(
                        model=model,
                        messages=cast("list[ChatCompletionMessageParam]", messages),
                        max_tokens=max_tokens,
                        stream=True,
                        extra_body=FIXED,
                    )
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            if first is None:
                                first = time.perf_counter() - started
                            text.append(chunk.choices[0].delta.content)
                    ttfts.append(first if first is not None else time.perf_counter() - started)
                    messages.append({"role": "assistant", "content": "".join(text)})
                    messages.append({"role": "user", "content": f"{FOLLOW_UP} (turn {turn})"})
            hits1, queries1 = _counters(ports)
        finally:
            client.close()
    ideal, asked = ideal_hits([_tokens(ports[0], model, m) for m in sent], _block_size(ports[0]))
    hits, queries = hits1 - hits0, queries1 - queries0
    return ArmResult(
        arm=arm,
        requests=len(ttfts),
        cached_ratio=hits / queries if queries else 0.0,
        evaluated_prompt_tokens=queries - hits,
        ttft_p50_s=statistics.median(ttfts),
        ttft_p99_s=_percentile(ttfts, 0.99),
        ideal_cached_ratio=ideal / asked if asked else 0.0,
    )


def compare(
    engines: Mapping[str, Sequence[int]],
    workdir: Path,
    model: str = "tiny",
    conversations: int = 7,
    turns: int = 4,
    max_tokens: int = 32,
    arms: Sequence[str] = ARMS,
) -> list[ArmResult]:
    return [run_arm(arm, engines, workdir, model, conversations, turns, max_tokens) for arm in arms]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--conversations",
        type=int,
        default=7,
        help="keep it odd: with an even number, round robin over two engines is sticky by accident",
    )
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each engine's")
    parser.add_argument("--workdir", type=Path, default=Path("out/bench-real-affinity"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--arms",
        default=",".join(ARMS),
        help="the arms in the order they run (comma-separated; rerun reversed to see order)",
    )


def run(args: argparse.Namespace) -> int:
    """Start two engines, run both arms over them, print the table."""
    from extproc.harness.real_engines import vllm
    from extproc.harness.real_engines.base import ENGINES_DIR, running

    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}: choose from {list(ARMS)}")
    model = vllm.tiny_model(ENGINES_DIR / "cache")
    workdir: Path = args.workdir
    engines = [
        vllm.VllmEngine(
            f"{c}-e1", workdir / "engines", vllm.VllmSpec(model, max_num_seqs=args.max_num_seqs)
        )
        for c in ("c1", "c2")
    ]
    started = time.perf_counter()
    with running(engines, vllm.START_TIMEOUT_S):
        ready_s = time.perf_counter() - started
        ports = {f"c{i}": [e.port] for i, e in enumerate(engines, 1)}
        results = compare(
            ports, workdir, "tiny", args.conversations, args.turns, args.max_tokens, arms
        )
    print(f"2 vLLM engines ready in {ready_s:.0f} s")
    print(
        f"{'arm':<12} {'requests':>8} {'cached':>7} {'ideal':>6} {'of ideal':>8}"
        f" {'evaluated':>10} {'ttft p50':>9} {'p99':>7}"
    )
    for r in results:
        share = r.cached_ratio / r.ideal_cached_ratio if r.ideal_cached_ratio else 0.0
        print(
            f"{r.arm:<12} {r.requests:>8} {r.cached_ratio:>7.3f} {r.ideal_cached_ratio:>6.3f}"
            f" {share:>7.2f}x {r.evaluated_prompt_tokens:>10.0f}"
            f" {r.ttft_p50_s:>8.3f}s {r.ttft_p99_s:>6.3f}s"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0

"""`extproc bench engines`: prefix affinity on real engines, side by side in one run.

The same multi-turn conversations, without a session id, go to the same kind of real engines
(llama.cpp's server, the tiny random model, ``make engine-deps``) through three set-ups, each
on freshly started engines (empty caches):

1. ``extproc``: Envoy + this processor, ``--clusters`` x ``--engines`` engines (the prefix key
   keeps a conversation's turns on one engine);
2. ``round_robin``: Envoy alone, round robin over the same engines;
3. ``ideal``: one engine with a slot per conversation, its context sized to fit them all
   (nothing is ever evicted: the most any placement could reuse), behind the same Envoy.

Three conversation shapes: ``system`` (a shared system prompt), ``opening`` (the shared opening
in the first user message), ``none`` (nothing shared). Reported per set-up and shape, from the
engines' own counters (``llamacpp:prompt_tokens_total`` = evaluated, ``_cached_total`` =
reused): the cached ratio, the evaluated prompt tokens (the compute spent), and TTFT p50 / p99
as the client saw it (streamed). Each ``--cache-ram-mib`` value is a separate run of all three
(0: no host-RAM prompt cache, as on a GPU engine; 8192: llama.cpp's default).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from extproc.harness.real_engines import llamacpp
from extproc.harness.real_engines.base import ENGINES_DIR
from extproc.harness.real_engines.fleet import RealFleet
from extproc.harness.replay import percentile

SHAPES = ("system", "opening", "none")
SETUPS = ("extproc", "round_robin", "ideal")
ALIAS = "tiny"
_WORDS = [
    "fleet",
    "cluster",
    "engine",
    "prefix",
    "cache",
    "session",
    "token",
    "budget",
    "envoy",
    "route",
    "slot",
    "decode",
    "prefill",
    "metric",
    "scrape",
    "health",
    "affinity",
    "queue",
    "backlog",
    "failover",
    "stream",
    "usage",
    "model",
    "request",
]


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 10
    turns: int = 5
    shared_words: int = 600  # the shared system prompt / opening
    turn_words: int = 60  # each user turn
    output_tokens: int = 16
    concurrency: int = 4  # conversations in flight at once
    seed: int = 1


@dataclass
class Result:
    setup: str
    shape: str
    cache_ram_mib: int
    requests: int = 0
    failed: int = 0
    evaluated: float = 0.0
    cached: float = 0.0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def cached_ratio(self) -> float:
        total = self.evaluated + self.cached
        return self.cached / total if total else 0.0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "ttft_s"}
        out["cached_ratio"] = round(self.cached_ratio, 4)
        out["ttft_p50_s"] = percentile(self.ttft_s, 50)
        out["ttft_p99_s"] = percentile(self.ttft_s, 99)
        return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def conversations(shape: str, w: Workload) -> list[tuple[str | None, list[str]]]:
    """Per conversation: its system prompt (None: none) and its user turns."""
    rng = random.Random(f"{w.seed}-{shape}")
    shared = "Shared context. " + _text(rng, w.shared_words)
    out: list[tuple[str | None, list[str]]] = []
    for i in range(w.conversations):
        turns = [f"Conversation {i}, turn {t}: " + _text(rng, w.turn_words) for t in range(w.turns)]
        if shape == "system":
            out.append((shared, turns))
        elif shape == "opening":
            out.append((None, [shared + " " + turns[0], *turns[1:]]))
        else:
            own = f"Context of conversation {i}. " + _text(rng, w.shared_words)
            out.append((own, turns))
    return out


def _engine_totals(fleet: RealFleet) -> tuple[float, float]:
    evaluated = cached = 0.0
    for engine in fleet.engines:
        for line in engine.metrics_text().splitlines():
            if line.startswith("llamacpp:prompt_tokens_total "):
                evaluated += float(line.split()[1])
            elif line.startswith("llamacpp:prompt_tokens_cached_total "):
                cached += float(line.split()[1])
    return evaluated, cached


def _converse(
    client: Any,
    system: str | None,
    turns: Sequence[str],
    w: Workload,
    result: Result,
    lock: threading.Lock,
) -> None:
    import openai

    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        started = time.perf_counter()
        first: float | None = None
        reply: list[str] = []
        try:
            stream = client.chat.completions.create(
                model=ALIAS,
                messages=messages,
                max_tokens=w.output_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    reply.append(chunk.choices[0].delta.content)
        except openai.APIError:
            with lock:
                result.requests += 1
                result.failed += 1
            return
        with lock:
            result.requests += 1
            if first is not None:
                result.ttft_s.append(first - started)
        messages.append({"role": "assistant", "content": "".join(reply)})


def drive(fleet: RealFleet, shape: str, w: Workload, result: Result) -> None:
    """Every conversation of the shape, ``w.concurrency`` at a time, each turn after the last."""
    import openai

    assert fleet.stack is not None
    client = openai.OpenAI(
        base_url=fleet.stack.url + "/v1", api_key="unused", max_retries=0, timeout=600
    )
    todo = list(conversations(shape, w))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                system, turns = todo.pop(0)
            _converse(client, system, turns, w, result, lock)

    before = _engine_totals(fleet)
    threads = [threading.Thread(target=worker) for _ in range(w.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close()
    after = _engine_totals(fleet)
    result.evaluated, result.cached = after[0] - before[0], after[1] - before[1]


def _fleet(
    setup: str, workdir: Path, model: Path, w: Workload, args: argparse.Namespace, cache: int
) -> RealFleet:
    per_slot = args.slot_ctx
    if setup == "ideal":
        spec = llamacpp.LlamaCppSpec(
            model, ALIAS, n_ctx=per_slot * w.conversations, slots=w.conversations,
            threads=args.threads, cache_ram_mib=cache,
        )  # fmt: skip
        layout = {"c1": [llamacpp.LlamaCppEngine("ideal", workdir, spec)]}
    else:
        spec = llamacpp.LlamaCppSpec(
            model, ALIAS, n_ctx=per_slot * args.slots, slots=args.slots, threads=args.threads,
            cache_ram_mib=cache,
        )  # fmt: skip
        layout = {
            f"c{i}": [
                llamacpp.LlamaCppEngine(f"c{i}-e{j}", workdir, spec)
                for j in range(1, args.engines + 1)
            ]
            for i in range(1, args.clusters + 1)
        }
    mode = "extproc" if setup == "extproc" else "round_robin"
    return RealFleet(
        workdir,
        layout,
        llamacpp.START_TIMEOUT_S,
        mode=mode,
        cluster_fields={"engine": "llamacpp"},
        # One request per exchange; placement needs the body (no session id).
        fleet_overrides={"processor": {"message_timeout_ms": 30000}},
    )


def run_setup(
    setup: str, shape: str, cache: int, w: Workload, args: argparse.Namespace, model: Path
) -> Result:
    workdir = Path(args.workdir) / f"{setup}-{shape}-cache{cache}"
    result = Result(setup, shape, cache)
    with _fleet(setup, workdir, model, w, args, cache) as fleet:
        drive(fleet, shape, w, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Workload()
    parser.add_argument("--shapes", default=",".join(SHAPES), help="system,opening,none")
    parser.add_argument("--setups", default=",".join(SETUPS), help="extproc,round_robin,ideal")
    parser.add_argument(
        "--cache-ram-mib", default=f"0,{llamacpp.DEFAULT_CACHE_RAM_MIB}",
        help="llama.cpp's host-RAM prompt cache per run (0: off)",
    )  # fmt: skip
    parser.add_argument("--conversations", type=int, default=d.conversations)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument("--shared-words", type=int, default=d.shared_words)
    parser.add_argument("--turn-words", type=int, default=d.turn_words)
    parser.add_argument("--output-tokens", type=int, default=d.output_tokens)
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--engines", type=int, default=2, help="engines per cluster")
    parser.add_argument("--slots", type=int, default=2, help="slots per engine")
    parser.add_argument("--slot-ctx", type=int, default=4096, help="context tokens per slot")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per engine")
    parser.add_argument("--workdir", default=str(ENGINES_DIR / "bench"))
    parser.add_argument("--json", default="", help="write every result here")


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(
        conversations=args.conversations, turns=args.turns, shared_words=args.shared_words,
        turn_words=args.turn_words, output_tokens=args.output_tokens,
        concurrency=args.concurrency,
    )  # fmt: skip


def _table(results: Sequence[Result]) -> str:
    head = f"{'cache_ram':>9} {'shape':8} {'setup':12} {'cached':>7} {'evaluated':>9} "
    head += f"{'ttft p50':>9} {'ttft p99':>9} {'failed':>6}"
    lines = [head]
    for r in results:
        s = r.summary()
        lines.append(
            f"{r.cache_ram_mib:>9} {r.shape:8} {r.setup:12} {s['cached_ratio']:>7.3f} "
            f"{r.evaluated:>9.0f} {s['ttft_p50_s'] or 0:>9.3f} {s['ttft_p99_s'] or 0:>9.3f} "
            f"{r.failed:>6}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    w = workload_of(args)
    model = llamacpp.tiny_model(ENGINES_DIR / "cache")
    results: list[Result] = []
    started = time.monotonic()
    for cache in (int(c) for c in args.cache_ram_mib.split(",") if c):
        for shape in args.shapes.split(","):
            for setup in args.setups.split(","):
                results.append(run_setup(setup, shape, cache, w, args, model))
                print(_table(results[-1:]).splitlines()[-1], flush=True)
    print(_table(results))
    print(f"wall time {time.monotonic() - started:.0f} s")
    if args.json:
        doc = {"workload": asdict(w), "results": [r.summary() for r in results]}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(r.failed for r in results) else 0

"""`extproc bench skew`: a skewed fleet — a few hot prefixes and one slow cluster — routed by
pure consistent hashing and by load-aware affinity, side by side in one run.

The workload (seeded, open loop):

- *hot prefixes*: ``len(--hot-rates)`` viral openings (a shared ~2K-token system prompt and an
  identical first message, then each user's own details), arriving as Poisson streams at the
  given rates with no session header: every request of one opening has the same prefix key,
  so pure hashing sends all of it to one cluster;
- *chat sessions*: multi-turn conversations behind a few shared system prompts, half of them
  naming themselves in ``x-session-id``; each turn extends the last one's prompt.

One cluster is slow: after the fleet starts the bench puts it in the simulated cluster's
``slow`` fault mode (``POST /admin/fault {"mode": "slow", "factor": F}``: prefill and decode
take F times longer). By default it is the hash primary of the hottest prefix — the case where
pure hashing hurts most.

Both set-ups run the same requests at the same instants on a fresh fleet (new clusters: empty
caches), with Envoy + extproc; only ``affinity.enabled`` differs (which also makes Envoy send
response headers, where the clusters' load reports travel). Reported per set-up: TTFT p50/p99
(all, hot, chat), the token-weighted prefix-cache hit ratio, the share of requests the slow
cluster served, chat-session stickiness, errors, and the processor's routing decisions by kind.
Latencies are wall-clock milliseconds as the client saw them; with ``--speedup S`` the clusters
run S times faster than real time, so multiply by S for simulated time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc.config import compile_runtime, parse_config
from extproc.core.facts import RequestFacts, parse_request
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.launch import Client, FleetStack
from extproc.harness.prompts import API_PATHS, CHARS_PER_TOKEN, ApiKind, TextSynth
from extproc.harness.replay import ReplayOptions, ReplayResult, percentile, run_replay, write_json
from extproc.harness.workload import ReplayRequest

SETUPS = ("pure", "load_aware")
LABELS = {"pure": "pure consistent hashing", "load_aware": "load-aware affinity"}
KINDS = ("primary", "spilled", "migrated", "hot_spread", "override")
# The processor's load-aware settings for set-up 2: the schema's defaults, except what a
# one-minute run needs to see (hot keys found within a few seconds).
LOAD_AWARE = {
    "enabled": True,
    "hot_key_min_requests": 10,
    "hot_key_half_life_s": 10,
}
SECTION = "## Skew"


# -- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SkewConfig:
    seed: int = 0
    duration_s: float = 60.0
    hot_rates: tuple[float, ...] = (8.0, 4.0, 2.0)
    hot_system_tokens: int = 2000
    hot_question_chars: int = 1200  # > the prefix key's 1024 first-message characters
    hot_detail_tokens: tuple[int, int] = (300, 700)
    chat_sessions_per_s: float = 0.8
    chat_turns: tuple[int, int] = (3, 6)
    chat_think_s: float = 3.0
    chat_system_prompts: int = 3
    chat_system_tokens: int = 1000
    chat_user_tokens: tuple[int, int] = (50, 300)
    output_tokens: tuple[int, int] = (16, 48)
    session_header_share: float = 0.5

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or not self.hot_rates or any(r <= 0 for r in self.hot_rates):
            raise ValueError("duration and every hot rate must be > 0")
        if self.chat_sessions_per_s < 0:
            raise ValueError("chat rate must be >= 0")


def _poisson(rng: random.Random, rate: float, end: float) -> list[float]:
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < end:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _tokens(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)


def skew_workload(cfg: SkewConfig) -> list[ReplayRequest]:
    rng = random.Random(f"skew:{cfg.seed}")
    synth = TextSynth(cfg.seed)
    api: ApiKind = "openai-chat"
    out: list[ReplayRequest] = []

    def emit(at: float, messages: list[dict[str, str]], kind: str, sid: str, header: bool) -> int:
        max_tokens = rng.randint(*cfg.output_tokens)
        body = {
            "model": "sim",
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chars = sum(len(m["content"]) for m in messages)
        out.append(
            ReplayRequest(at, api, API_PATHS[api], body, sid, header, kind, _tokens(chars), True,
                          max_tokens)
        )  # fmt: skip
        return max_tokens

    for h, rate in enumerate(cfg.hot_rates):
        system = f"[viral app {h}] " + synth.text(f"hot:{h}:system", cfg.hot_system_tokens * 4)
        question = f"[viral question {h}] " + synth.text(f"hot:{h}:q", cfg.hot_question_chars)
        for n, at in enumerate(_poisson(rng, rate, cfg.duration_s)):
            detail = synth.text(f"hot:{h}:{n}", rng.randint(*cfg.hot_detail_tokens) * 4)
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{question}\n\nMy details: {detail}"},
            ]
            emit(at, messages, "hot", f"hot-{h}-{n}", False)

    systems = [
        synth.text(f"chat:system:{i}", cfg.chat_system_tokens * 4)
        for i in range(cfg.chat_system_prompts)
    ]
    for n, start in enumerate(_poisson(rng, cfg.chat_sessions_per_s, cfg.duration_s)):
        sid = f"chat-{n}"
        header = rng.random() < cfg.session_header_share
        messages = [{"role": "system", "content": systems[rng.randrange(len(systems))]}]
        at = start
        for turn in range(rng.randint(*cfg.chat_turns)):
            if at >= cfg.duration_s:
                break
            text = synth.text(f"{sid}:u:{turn}", rng.randint(*cfg.chat_user_tokens) * 4)
            # The session id leads the first message: sessions sharing a system prompt still
            # get distinct prefix keys.
            content = f"[{sid}] {text}" if turn == 0 else text
            messages = [*messages, {"role": "user", "content": content}]
            reply_tokens = emit(at, messages, "chat", sid, header)
            reply = synth.text(f"{sid}:a:{turn}", reply_tokens * 4)
            messages = [*messages, {"role": "assistant", "content": reply}]
            at += rng.expovariate(1.0 / cfg.chat_think_s)
    return sorted(out, key=lambda r: r.arrival_s)


# -- one set-up -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fleet:
    clusters: int
    slow_cluster: str
    slow_factor: float
    params: ClusterParams
    max_output: int

    def sim_args(self) -> tuple[str, ...]:
        p = self.params
        return (
            "--kv-capacity-tokens", str(p.kv_capacity_tokens),
            "--prefill-tps", f"{p.prefill_tps:g}",
            "--decode-tps", f"{p.decode_tps:g}",
            "--max-concurrency", str(p.max_concurrency),
            "--time-scale", f"{p.time_scale:g}",
            "--max-output", str(self.max_output),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class SetupRun:
    setup: str
    result: ReplayResult
    kinds: dict[str, float]
    migrations: float


def _run(main: Coroutine[Any, Any, ReplayResult]) -> ReplayResult:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def hash_primary(clusters: int, request: ReplayRequest) -> str:
    """Where pure hashing puts ``request`` in a FleetStack of ``clusters`` clusters (named
    c1..cN, equal weights, default classes: the hash does not depend on ports)."""
    doc = {
        "version": 1,
        "clusters": [
            {"name": f"c{i}", "endpoints": [f"127.0.0.1:{i}"]} for i in range(1, clusters + 1)
        ],
    }
    runtime = compile_runtime(parse_config(doc))
    headers = {"content-type": "application/json"}
    if request.send_session_header and request.session_id:
        headers["x-session-id"] = request.session_id
    body = orjson.dumps(request.materialize())
    facts = parse_request(request.path, headers, body, runtime.key_rules, runtime.parse_limits)
    if not isinstance(facts, RequestFacts):
        raise ValueError(f"the workload's request does not parse: {facts}")
    return runtime.policy.route(facts).placement.primary


def _processor_kinds(stack: FleetStack) -> tuple[dict[str, float], float]:
    samples = stack.processor_metrics()
    kinds = {
        kind: samples.get(("fleet_route_decisions_total", (("kind", kind),)), 0.0) for kind in KINDS
    }
    migrations = sum(
        v for (name, _labels), v in samples.items() if name == "fleet_migrations_total"
    )
    return kinds, migrations


def run_setup(
    setup: str,
    requests: Sequence[ReplayRequest],
    fleet: Fleet,
    options: ReplayOptions,
    workdir: Path,
) -> SetupRun:
    overrides: dict[str, Any] = {"affinity": LOAD_AWARE} if setup == "load_aware" else {}

    def make_stack() -> FleetStack:
        return FleetStack(
            workdir,
            clusters=fleet.clusters,
            sim_args=fleet.sim_args(),
            fleet_overrides=overrides,
            processor_args=("--log-level", "warning", "--seed", "0"),
            access_log=False,
        )

    stack = make_stack()
    stack.start()  # FleetStack retries once with fresh ports on a start failure
    try:
        admin = Client(stack.sim_specs[fleet.slow_cluster].port)
        try:
            fault = orjson.dumps({"mode": "slow", "factor": fleet.slow_factor})
            status, _hdrs, data = admin.post_json("/admin/fault", fault)
        finally:
            admin.close()
        if status != 200:
            raise RuntimeError(f"cannot slow {fleet.slow_cluster} down: {status} {data!r}")
        result = _run(run_replay(requests, stack.url, options))
        kinds, migrations = _processor_kinds(stack)
    finally:
        stack.stop()
    return SetupRun(setup, result, kinds, migrations)


# -- the report -----------------------------------------------------------------------------------


def _ttfts(result: ReplayResult, kind: str | None = None) -> list[float]:
    return [
        o.ttft_s
        for o in result.outcomes
        if o.outcome == "2xx" and o.ttft_s is not None and (kind is None or o.kind == kind)
    ]


def _sticky(result: ReplayResult) -> tuple[int, int]:
    """(chat sessions with >= 2 served requests, of which served by one cluster only)."""
    where: dict[str, set[str]] = defaultdict(set)
    counts: Counter[str] = Counter()
    for o in result.outcomes:
        if o.outcome == "2xx" and o.kind == "chat" and o.session_id and o.served_by:
            where[o.session_id].add(o.served_by)
            counts[o.session_id] += 1
    multi = [s for s, n in counts.items() if n >= 2]
    return len(multi), sum(1 for s in multi if len(where[s]) == 1)


def setup_report(run: SetupRun, fleet: Fleet) -> dict[str, Any]:
    result = run.result
    ok = [o for o in result.outcomes if o.outcome == "2xx"]
    multi, sticky = _sticky(result)
    return {
        "label": LABELS[run.setup],
        "sent": len(result.outcomes),
        "ok": len(ok),
        "outcomes": dict(Counter(o.outcome for o in result.outcomes)),
        "ttft_p50_s": percentile(_ttfts(result), 50),
        "ttft_p99_s": percentile(_ttfts(result), 99),
        "hot_ttft_p99_s": percentile(_ttfts(result, "hot"), 99),
        "chat_ttft_p99_s": percentile(_ttfts(result, "chat"), 99),
        "hit_ratio": result.hit_ratio,
        "slow_share": (
            sum(1 for o in ok if o.served_by == fleet.slow_cluster) / len(ok) if ok else None
        ),
        "clusters": result.clusters,
        "chat_sessions_multi": multi,
        "chat_sessions_on_one_cluster": sticky,
        "route_kinds": run.kinds,
        "migrations": run.migrations,
        "wall_s": result.wall_s,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(reports: Mapping[str, dict[str, Any]], description: str, fleet: Fleet) -> str:
    p = fleet.params
    lines = [
        f"workload: {description}",
        f"fleet: {fleet.clusters} simulated clusters (prefill {p.prefill_tps:g} tok/s, decode "
        f"{p.decode_tps:g} tok/s/request, {p.max_concurrency} slots, KV "
        f"{p.kv_capacity_tokens / 1e6:g}M tokens); {fleet.slow_cluster} slowed "
        f"{fleet.slow_factor:g}x; clusters run {1 / p.time_scale:g}x real time",
        "",
        "| set-up | 2xx / sent | TTFT p50 ms | TTFT p99 ms | hot p99 ms | chat p99 ms "
        "| hit ratio | served by slow cluster | chat sessions on one cluster |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports.values():
        lines.append(
            f"| {r['label']} | {r['ok']} / {r['sent']} | {_ms(r['ttft_p50_s'])} "
            f"| {_ms(r['ttft_p99_s'])} | {_ms(r['hot_ttft_p99_s'])} | {_ms(r['chat_ttft_p99_s'])}"
            f" | {_num(r['hit_ratio'])} | {_num(r['slow_share'], 2)} "
            f"| {r['chat_sessions_on_one_cluster']} / {r['chat_sessions_multi']} |"
        )
    lines += ["", "routing decisions (processor metrics) and requests per cluster (2xx):", ""]
    for r in reports.values():
        kinds = ", ".join(f"{k} {int(v)}" for k, v in r["route_kinds"].items() if v)
        spread = ", ".join(f"{name} {n}" for name, n in r["clusters"].items())
        lines.append(
            f"- {r['label']}: {kinds}; migrations {int(r['migrations'])}; clusters: {spread}; "
            f"outcomes {r['outcomes']}"
        )
    return "\n".join(lines)


def update_markdown(path: Path, command: str, table: str) -> None:
    """Replace (or append) this bench's section of BENCHMARKS.md, leaving the rest alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = (
        f"{SECTION}\n\n"
        "A few hot prefixes and one slow cluster, through Envoy + extproc twice: pure consistent "
        "hashing vs load-aware affinity (`affinity.enabled`). Measured with:\n\n"
        f"```\n{command}\n```\n\n{table}\n"
    ).split("\n")
    lines = text.rstrip("\n").split("\n")
    if SECTION not in lines:
        path.write_text("\n".join([*lines, "", *section]))
        return
    start = lines.index(SECTION)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), None)
    rest = [] if end is None else lines[end:]
    path.write_text("\n".join([*lines[:start], *section, *rest]) + ("\n" if rest else ""))


# -- CLI ------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, default=60.0, help="workload seconds")
    parser.add_argument(
        "--hot-rates", default="8,4,2", help="requests/s of each hot prefix (comma-separated)"
    )
    parser.add_argument("--chat-rate", type=float, default=0.8, help="chat sessions per s")
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--slow-factor", type=float, default=4.0)
    parser.add_argument(
        "--slow-cluster",
        default="auto",
        help="cluster to slow down (default: the hash primary of the hottest prefix)",
    )
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="clusters and arrivals run this much faster"
    )
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    parser.add_argument("--out-dir", type=Path, default=Path("out/bench/skew"))
    parser.add_argument(
        "--markdown", type=Path, default=None, help="write the table into this file's ## Skew"
    )
    parser.add_argument("--quiet", action="store_true")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        setups = [s.strip() for s in args.setups.split(",") if s.strip()]
        unknown = [s for s in setups if s not in SETUPS]
        if unknown:
            raise ValueError(f"unknown set-ups {unknown}; choose from {list(SETUPS)}")
        cfg = SkewConfig(
            seed=args.seed,
            duration_s=args.duration,
            hot_rates=tuple(float(r) for r in args.hot_rates.split(",")),
            chat_sessions_per_s=args.chat_rate,
        )
        if args.clusters < 2 or not args.slow_factor > 0 or not args.speedup > 0:
            raise ValueError("need >= 2 clusters, slow factor > 0 and speedup > 0")
        params = ClusterParams(time_scale=1.0 / args.speedup)
        requests = skew_workload(cfg)
        options = ReplayOptions(
            speedup=args.speedup,
            timeout_s=args.timeout,
            progress=None if args.quiet else _progress,
            progress_interval_s=10.0,
        )
    except ValueError as exc:
        print(f"extproc bench skew: {exc}", file=sys.stderr)
        return 2

    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = Counter(r.kind for r in requests)
    description = (
        f"seed {cfg.seed}, {cfg.duration_s:g} s: {kinds['hot']} hot-prefix requests "
        f"({len(cfg.hot_rates)} prefixes at {', '.join(f'{r:g}' for r in cfg.hot_rates)} req/s),"
        f" {kinds['chat']} chat turns ({cfg.chat_sessions_per_s:g} sessions/s)"
    )
    print(f"workload: {description}", file=sys.stderr)
    slow = args.slow_cluster
    if slow == "auto":
        hottest = next(r for r in requests if r.session_id == "hot-0-0")
        slow = hash_primary(args.clusters, hottest)
    fleet = Fleet(args.clusters, slow, args.slow_factor, params, max(cfg.output_tokens))
    runs: dict[str, SetupRun] = {}
    started = time.monotonic()
    for setup in setups:
        print(f"== {LABELS[setup]} ==", file=sys.stderr, flush=True)
        workdir = out_dir / "logs" / setup
        for old in workdir.glob("*.log"):
            old.unlink()  # Proc appends to its log: start each run with a clean one
        runs[setup] = run_setup(setup, requests, fleet, options, workdir)
        write_json(runs[setup].result, out_dir / f"{setup}.json")
    reports = {s: setup_report(r, fleet) for s, r in runs.items()}
    table = format_report(reports, description, fleet)
    print(table)
    command = shlex.join(["extproc", *sys.argv[1:]])
    (out_dir / "summary.json").write_bytes(
        orjson.dumps(
            {
                "command": command,
                "config": asdict(cfg),
                "slow_cluster": slow,
                "slow_factor": args.slow_factor,
                "load_aware_settings": LOAD_AWARE,
                "setups": reports,
                "wall_s": time.monotonic() - started,
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    if args.markdown is not None:
        update_markdown(args.markdown, command, table)
        print(f"\nwritten: {args.markdown} ({SECTION})")
    print(f"written: {out_dir}/summary.json and per-request results")
    return 0

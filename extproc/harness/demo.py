"""`extproc demo`: the main job. A whole fleet on loopback with the embedded (in-memory) default.

Starts simulated inference clusters serving two models, the processor and a real Envoy; sends
multi-turn sessions of both models over the OpenAI and Anthropic APIs; shows each model's
requests on its own clusters, the fleet's /v1/models and an unknown model's 404; kills one
cluster mid-traffic and brings it back; prints which cluster served what, the affinity
achieved, the cache hits it bought, and what failover cost; writes the same as JSON.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from extproc.config import Runtime, load_runtime
from extproc.explain import explain_remote
from extproc.harness.launch import Client, FleetStack

SYSTEM_PROMPTS = (
    "You are a careful coding assistant. Answer with working code and short explanations. ",
    "You are a support agent for an online store. Be brief and polite. ",
    "You summarise documents for busy readers, in plain words. ",
)


@dataclass
class Turn:
    session: int
    turn: int
    api: str
    model: str
    status: int
    served_by: str
    primary: str
    secondary: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    phase: str = ""


# Two models: the large one on the first half of the clusters (at least two), the small one on
# the rest; "demo" is an alias of the large one.
LARGE, SMALL = "demo-large", "demo-small"


def demo_models(names: list[str]) -> dict[str, list[str | dict[str, object]]]:
    large: dict[str, object] = {"name": LARGE, "aliases": ["demo"]}
    if len(names) == 1:
        return {names[0]: [large, SMALL]}
    split = max(2, (len(names) + 1) // 2) if len(names) > 2 else 1
    return {n: [large] if i < split else [SMALL] for i, n in enumerate(names)}


@dataclass
class Session:
    index: int
    api: str  # "chat" or "messages"
    system: str
    header: bool
    model: str = LARGE
    messages: list[dict[str, str]] = field(default_factory=list)

    def next_body(self, turn: int) -> tuple[str, bytes, dict[str, str]]:
        question = f"Session {self.index}, question {turn}: " + "please explain it in detail. " * 40
        self.messages.append({"role": "user", "content": question})
        headers = {"x-session-id": f"demo-{self.index}"} if self.header else {}
        if self.api == "messages":
            doc = {
                "model": self.model,
                "system": self.system * 30,
                "messages": self.messages,
                "max_tokens": 8,
            }
            return "/v1/messages", orjson.dumps(doc), headers
        msgs = [{"role": "system", "content": self.system * 30}, *self.messages]
        return (
            "/v1/chat/completions",
            orjson.dumps({"model": self.model, "messages": msgs, "max_tokens": 8}),
            headers,
        )

    def answered(self, turn: int) -> None:
        self.messages.append({"role": "assistant", "content": f"answer {turn}"})


def _usage(api: str, data: bytes) -> tuple[int, int]:
    try:
        usage = orjson.loads(data).get("usage", {})
    except orjson.JSONDecodeError:
        return 0, 0
    if api == "messages":
        cached = int(usage.get("cache_read_input_tokens", 0))
        return int(usage.get("input_tokens", 0)) + cached, cached
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens", 0))


class Demo:
    def __init__(self, stack: FleetStack, sessions: int, workers: int) -> None:
        self.stack = stack
        self.runtime: Runtime = load_runtime(stack.fleet_path)
        self.sessions = [
            Session(
                i,
                "messages" if i % 3 == 2 else "chat",
                SYSTEM_PROMPTS[i % 3],
                header=i % 2 == 0,
                model=SMALL if i % 4 >= 2 else LARGE,
            )
            for i in range(sessions)
        ]
        self.workers = workers
        self.turns: list[Turn] = []
        # Each session's (primary, secondary) as the processor placed it while the fleet was whole.
        self.placed: dict[int, tuple[str, str]] = {}

    def _predict(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[str, str]:
        """The live processor's own answer (its admin /explain, which changes nothing): a fresh
        copy of the config would not know the shared openings the processor's chain sketch has
        learnt, nor its affinity state, and would predict other keys for those sessions."""
        admin = f"http://127.0.0.1:{self.stack.metrics_ports[0]}"
        answer = explain_remote(admin, path, {"content-type": "application/json", **headers}, body)
        primary, secondary = str(answer["primary"]), answer.get("secondary")
        return primary, str(secondary) if secondary else primary

    def _one_turn(self, session: Session, turn: int, phase: str, client: Client) -> Turn:
        path, body, headers = session.next_body(turn)
        status, hdrs, data = client.post_json(path, body, headers)
        # Asked after the turn: a conversation's key is fixed by its first turn (its opening may
        # become common while other first turns run, and this one keeps the key it started
        # with), so the processor's answer now is the one its later turns get. Outage and
        # recovery turns are judged against the placement the session had while the fleet was
        # whole: that is the pre-assigned secondary the failover must use.
        if phase == "steady" or session.index not in self.placed:
            self.placed[session.index] = self._predict(path, body, headers)
        primary, secondary = self.placed[session.index]
        session.answered(turn)
        prompt, cached = _usage(session.api, data) if status == 200 else (0, 0)
        return Turn(
            session.index,
            turn,
            session.api,
            session.model,
            status,
            hdrs.get("x-served-by", "-"),
            primary,
            secondary,
            prompt,
            cached,
            phase,
        )

    def run_turn(self, turn: int, phase: str) -> list[Turn]:
        def worker(chunk: list[Session]) -> list[Turn]:
            client = Client(self.stack.listener_port)
            try:
                return [self._one_turn(s, turn, phase, client) for s in chunk]
            finally:
                client.close()

        chunks = [self.sessions[i :: self.workers] for i in range(self.workers)]
        with ThreadPoolExecutor(self.workers) as pool:
            results = [t for part in pool.map(worker, chunks) for t in part]
        self.turns.extend(results)
        return results


def _hit_ratio(turns: Iterable[Turn]) -> float:
    turns = list(turns)
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# The embedded default's bulkheads: a short class that is never starved, and a long class
# that may hold at most two requests (and 600K tokens) on each cluster at once.
DEMO_CLASSES: list[dict[str, object]] = [
    {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 256}},
    {"name": "medium", "max_input_tokens": 100_000, "budget": {"max_concurrent": 64}},
    # The bulkhead phase shows the 429 and its hints: refused at once, not after flow
    # control's default wait (tests/e2e/test_flow.py shows the waiting).
    {
        "name": "long",
        "budget": {"max_inflight_tokens": 600_000, "max_concurrent": 2},
        "wait": {"max_wait_s": 0},
    },
]


def _post_once(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    client = Client(port)
    try:
        return client.post_json(path, body)
    finally:
        client.close()


def bulkhead_phase(stack: FleetStack, longs: int = 24, shorts: int = 24) -> dict[str, object]:
    """A burst of 200K-token agentic requests while interactive requests keep arriving."""
    print(f"\n== bulkhead: {longs} long-context (200K-token) requests at once + {shorts} short ==")
    context = "tool output: build log line, nothing to see here. " * (200_000 * 4 // 50)

    def long_body(i: int) -> bytes:
        msgs = [{"role": "user", "content": f"agent {i}: {context}"}]
        return orjson.dumps({"model": "demo", "messages": msgs, "max_tokens": 8})

    def short_body(i: int) -> bytes:
        msgs = [{"role": "user", "content": f"quick question {i}"}]
        return orjson.dumps({"model": "demo", "messages": msgs, "max_tokens": 8})

    port = stack.listener_port
    path = "/v1/chat/completions"
    with ThreadPoolExecutor(longs + shorts) as pool:
        long_f = [pool.submit(_post_once, port, path, long_body(i)) for i in range(longs)]
        short_f = [pool.submit(_post_once, port, path, short_body(i)) for i in range(shorts)]
        long_r = [f.result() for f in long_f]
        short_r = [f.result() for f in short_f]
    long_status = collections.Counter(s for s, _, _ in long_r)
    short_status = collections.Counter(s for s, _, _ in short_r)
    retry_after = sorted(int(h["retry-after"]) for s, h, _ in long_r if s == 429)
    sample = next((h for s, h, _ in long_r if s == 429), {})
    span = f"{retry_after[0]}..{retry_after[-1]} s" if retry_after else "-"
    print(f"long class:  {dict(long_status)}  (429s carry retry-after {span})")
    print(f"short class: {dict(short_status)}")
    if sample:
        keys = (
            "retry-after",
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            "ratelimit-policy",
            "ratelimit",
            "x-fleet-class",
        )
        print("a 429's headers: " + "; ".join(f"{k}: {sample[k]}" for k in keys if k in sample))
    after = _post_once(port, path, long_body(999))[0]
    print(f"after the burst drained, a long request gets: {after}")
    return {
        "long": {str(k): v for k, v in long_status.items()},
        "short": {str(k): v for k, v in short_status.items()},
        "retry_after_s": retry_after,
        "long_after_burst": after,
    }


def models_phase(stack: FleetStack, steady: list[Turn]) -> dict[str, object]:
    """What the fleet says about its models, and where each model's requests ran."""
    print("\n== models: two models on separate clusters ==")
    serving = {
        name: {m if isinstance(m, str) else str(m["name"]) for m in models}
        for name, models in stack.cluster_models.items()
    }
    client = Client(stack.listener_port)
    try:
        status, _, data = client.request("GET", "/v1/models")
        listed = [m["id"] for m in orjson.loads(data)["data"]] if status == 200 else []
        unknown_body = orjson.dumps(
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
        )
        unknown, _, unknown_data = client.post_json("/v1/chat/completions", unknown_body)
    finally:
        client.close()
    rows = [["model", "clusters", "requests", "on a cluster serving it"]]
    right = 0
    for model in (LARGE, SMALL):
        turns = [t for t in steady if t.model == model]
        ok = sum(1 for t in turns if model in serving.get(t.served_by, set()))
        right += ok
        where = ",".join(n for n, m in serving.items() if model in m)
        rows.append([model, where, str(len(turns)), f"{ok}/{len(turns)}"])
    print(_table(rows))
    print(f"GET /v1/models (answered by the processor): {listed}")
    print(f"a request for an unknown model: {unknown} {unknown_data.decode()[:120]}")
    return {
        "listed": listed,
        "requests_on_a_cluster_serving_their_model": f"{right}/{len(steady)}",
        "unknown_model_status": unknown,
    }


def run_demo(
    workdir: Path, clusters: int, sessions: int, turns: int, workers: int
) -> dict[str, object]:
    report: dict[str, object] = {}
    stack = FleetStack(
        workdir,
        clusters=clusters,
        sim_args=("--time-scale", "0.01"),
        fleet_overrides={"classes": DEMO_CLASSES},
        cluster_models=demo_models([f"c{i}" for i in range(1, clusters + 1)]),
    )
    t0 = time.monotonic()
    with stack:
        print(
            f"fleet up in {time.monotonic() - t0:.1f}s: Envoy :{stack.listener_port} -> "
            f"extproc :{stack.grpc_port} -> {', '.join(stack.sim_specs)}"
        )
        demo = Demo(stack, sessions, workers)
        for turn in range(turns):
            demo.run_turn(turn, "steady")
        steady = [t for t in demo.turns if t.phase == "steady"]
        per_session: dict[int, set[str]] = collections.defaultdict(set)
        for t in steady:
            per_session[t.session].add(t.served_by)
        sticky = sum(1 for s in per_session.values() if len(s) == 1)
        on_primary = sum(1 for t in steady if t.served_by == t.primary)
        load = collections.Counter(t.served_by for t in steady if t.turn == 0)
        report["steady"] = {
            "requests": len(steady),
            "ok": sum(1 for t in steady if t.status == 200),
            "sessions_on_one_cluster": f"{sticky}/{len(per_session)}",
            "requests_on_predicted_primary": f"{on_primary}/{len(steady)}",
            "sessions_per_cluster": dict(sorted(load.items())),
            "cache_hit_ratio_after_first_turn": round(
                _hit_ratio(t for t in steady if t.turn > 0), 3
            ),
        }
        print("\n== steady traffic:", sessions, "sessions x", turns, "turns (chat + anthropic) ==")
        rows = [["cluster", "sessions (primary)", "requests served"]]
        served = collections.Counter(t.served_by for t in steady)
        for name in stack.sim_specs:
            rows.append([name, str(load.get(name, 0)), str(served.get(name, 0))])
        print(_table(rows))
        print(
            f"sessions that stayed on one cluster: {sticky}/{len(per_session)};"
            f" requests on their predicted primary: {on_primary}/{len(steady)}"
        )
        hit_ratio = _hit_ratio(t for t in steady if t.turn > 0)
        print(f"prefix-cache hit ratio after turn 1: {hit_ratio:.1%}")
        report["models"] = models_phase(stack, steady)

        victim = next(iter(stack.sim_specs))
        print(f"\n== failover: SIGKILL {victim}, then two more turns of every session ==")
        # No warning to Envoy: the first requests find out by connection failure and are retried
        # on their secondary; the health check then takes the cluster out of rotation. Wait
        # until the process is gone: a request the dying engine had already taken is not
        # retried (it could run twice), and no turn is in flight at this point.
        stack.sims[victim].kill()
        outage = demo.run_turn(turns, "outage") + demo.run_turn(turns + 1, "outage")
        hit = [t for t in outage if t.primary == victim]
        failed = [t for t in outage if t.status != 200]
        to_secondary = sum(1 for t in hit if t.served_by == t.secondary)
        spread = collections.Counter(t.served_by for t in hit)
        print(
            f"requests: {len(outage)}, failed: {len(failed)}; requests of sessions with primary"
            f" {victim}: {len(hit)}, served by their pre-assigned secondary: {to_secondary}"
        )
        print(f"where {victim}'s sessions went: {dict(sorted(spread.items()))}")
        stack.restart_sim(victim)
        stack.wait_healthy([victim])
        deadline = time.monotonic() + 10
        back: list[Turn] = []
        turn = turns + 2
        while time.monotonic() < deadline:
            back = demo.run_turn(turn, "recovered")
            turn += 1
            if all(t.served_by == t.primary for t in back):
                break
            time.sleep(0.3)
        returned = sum(1 for t in back if t.primary == victim and t.served_by == victim)
        moved = sum(1 for t in back if t.primary == victim)
        print(f"{victim} restarted: its sessions back on it: {returned}/{moved}")
        report["failover"] = {
            "killed": victim,
            "requests_during_outage": len(outage),
            "failed_during_outage": len(failed),
            "requests_of_moved_sessions": len(hit),
            "moved_to_pre_assigned_secondary": to_secondary,
            "moved_sessions_per_survivor": dict(sorted(spread.items())),
            "sessions_back_on_primary_after_recovery": returned,
        }
        report["bulkhead"] = bulkhead_phase(stack)
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    report["turns"] = [asdict(t) for t in demo.turns]
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--workers", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--out", default="out/demo", help="where the report and logs go")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=out))
    report = run_demo(workdir, args.clusters, args.sessions, args.turns, args.workers)
    path = out / "report.json"
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"\nreport: {path}  (process logs and Envoy access log: {workdir})")
    failover, bulkhead = report["failover"], report["bulkhead"]
    ok = isinstance(failover, dict) and failover["failed_during_outage"] == 0
    if not ok:
        print("demo: requests failed during failover", file=sys.stderr)
    if not (isinstance(bulkhead, dict) and set(bulkhead["short"]) == {"200"}):
        print("demo: short requests were not all admitted during the burst", file=sys.stderr)
        ok = False
    return 0 if ok else 1

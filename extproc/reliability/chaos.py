"""`extproc chaos`: a scripted fault schedule against a local fleet under steady traffic.

The fleet: Envoy, two processor replicas sharing budgets through Redis (reached through a
loopback TCP proxy this run starts, so it can slow or partition the path), simulated clusters,
and steady synthetic traffic (extproc/reliability/traffic.py). Each fault in the schedule:

1. reset the upstreams' per-class concurrency peaks; note the time;
2. inject the fault, hold it ``--hold-s``; heal it;
3. wait until traffic recovers: the first 2-second window after healing with no failed or
   truncated answer (capped at ``--recover-cap-s``);
4. pause the traffic, let in-flight requests finish, wait for the replicas' held budget to
   reach zero (up to ``--settle-s``); record what is still held; resume.

Per fault it reports client-visible failures (4xx other than 429, 5xx, transport errors,
timeouts), 429s, truncated streams, requests that reached an upstream with no class (a
processor failing open), the maximum over-admission per class counted at the upstreams (peak
concurrent requests of a class on one cluster minus that class's ``max_concurrent``), the
budget still held after settling, and the time to recover. Each row is held to the
over-admission bound that applies to its fault (extproc/reliability/chaos_bounds.py) and marked
PASS or FAIL; for a class that went over its budget, the row's diagnosis says what the requests
running at the peak were (which ledger admitted them, under which config version, on which
cluster, whether the processor had already released them). The processors run with debug logs
for that (one line per admission and release). Output: a table and JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from extproc.harness.launch import (
    LOOPBACK,
    START_TIMEOUT_S,
    FleetStack,
    http_get,
    wait_until,
)
from extproc.reliability import probes
from extproc.reliability.chaos_bounds import (
    Interval,
    LogCursor,
    bound_for,
    diagnose,
    explain,
    fail_open,
    fail_open_allowed,
    read_admissions,
)
from extproc.reliability.redis_proc import RedisProc
from extproc.reliability.restart_hits import Conversations
from extproc.reliability.tcp_proxy import TcpProxy
from extproc.reliability.traffic import FAILURES, SteadyLoad, TrafficOptions
from extproc.render.envoy_dynamic import write_atomically

# Tight budgets, so steady traffic presses against them and over-admission would show.
# Refused at once (no flow-control wait, no placement elsewhere), so the faults meet the
# budget's own accounting and nothing else.
NO_WAIT: dict[str, Any] = {"max_wait_s": 0}
CLASSES: list[dict[str, Any]] = [
    {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 4}, "wait": NO_WAIT},
    {
        "name": "medium",
        "max_input_tokens": 100000,
        "budget": {"max_concurrent": 2},
        "wait": NO_WAIT,
    },
    {"name": "long", "budget": {"max_concurrent": 1}, "wait": NO_WAIT},
]
# The drain delay the harness gives each of several replicas (FleetStack.start_processor).
REPLICA_DRAIN_DELAY_S = 3.5
ERRORS = "fleet_ledger_redis_errors_total"
RESTART_HITS_FAULT = "processor restart: prefix-cache hit ratio"
# The restart row passes when the hit ratio in the first window after the restart is at least
# this share of the steady window's.
RESTART_HIT_FLOOR = 0.9
LIMITS = {c["name"]: c["budget"]["max_concurrent"] for c in CLASSES}


@dataclass
class FaultResult:
    fault: str
    requests: int = 0
    ok: int = 0
    failed: int = 0
    rejected_429: int = 0
    truncated: int = 0
    aborted: int = 0
    unclassed_at_upstream: int = 0
    over_admission: dict[str, int] = field(default_factory=dict)
    held_after_settle: float = 0.0
    # Ledger calls that failed or timed out (replicas then admit on local budgets).
    redis_errors: int = 0
    recover_s: float | None = None
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    # The over-admission bound per class for this fault, the mechanisms it is made of, and
    # PASS (over-admission within it, nothing held after settling, no request fail-open
    # unless the fault takes a processor replica away) or FAIL.
    bound: dict[str, int] = field(default_factory=dict)
    bound_from: list[str] = field(default_factory=list)
    verdict: str = ""
    # Per class over its budget: what the requests running at the worst peak were.
    diagnosis: dict[str, Any] = field(default_factory=dict)
    # The restart row: prefix-cache hit ratio of prompt-keyed conversations in the steady
    # window before the restart and in the first window after it, and their ratio.
    hit_ratio: dict[str, Any] = field(default_factory=dict)
    note: str = ""


Action = Callable[[], Awaitable[None]]


@dataclass
class Fault:
    name: str
    inject: Action
    heal: Action


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.redis = RedisProc(self.out / "redis.log")
        self.proxy = TcpProxy(LOOPBACK, self.redis.port, delay_s=args.redis_delay_s)
        self.stack: FleetStack | None = None
        self.load: SteadyLoad | None = None
        self.results: list[FaultResult] = []
        # Concurrency figures of clusters removed during the current fault.
        self._gone_peaks: list[dict[str, Any]] = []
        # What the upstreams of clusters removed during the current fault saw, per request.
        self._gone_requests: dict[str, list[Interval]] = {}
        # The processors' debug lines, read as the run goes: request id -> its admission.
        self._cursors: dict[int, LogCursor] = {}
        self._admissions: dict[str, Any] = {}
        # The restart row's conversations and figures (see _restart_hits_fault).
        self._conversations: tuple[Conversations, asyncio.Event, asyncio.Task[None]] | None = None
        self._hits: dict[str, Any] = {}
        self._restart_began = 0.0

    # ----- the fleet ------------------------------------------------------------------------
    def fleet(self) -> FleetStack:
        assert self.stack is not None
        return self.stack

    async def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.redis.start)
        await self.proxy.start()
        self.stack = FleetStack(
            self.out / "fleet",
            clusters=3,
            processors=2,
            dynamic_cds=True,
            sim_args=("--time-scale", str(self.args.time_scale)),
            # Debug lines: one per admission and release, for the diagnosis of a peak.
            processor_args=("--grace", str(self.args.grace_s), "--log-level", "debug"),
            fleet_overrides={
                "classes": CLASSES,
                "flow": {"place_new_sessions": False},
                "redis": {
                    "url": f"redis://{LOOPBACK}:{self.proxy.port}/0",
                    "on_unavailable": "local",
                    "timeout_ms": 50,
                    "lease_ttl_s": 30,
                    # Two replicas: each one's local share is half a budget (RELIABILITY.md).
                    "replicas": self.args.ledger_replicas,
                },
            },
            access_log=False,
        )
        await asyncio.to_thread(self.stack.start)

    async def stop(self) -> None:
        if self.stack is not None:
            await asyncio.to_thread(self.stack.stop)
        await self.proxy.close()
        await asyncio.to_thread(self.redis.stop)

    # ----- faults ---------------------------------------------------------------------------
    async def _restart_processor(self, index: int) -> None:
        await asyncio.to_thread(self.fleet().start_processor, index)

    async def _sigterm_and_restart(self, index: int) -> None:
        proc = self.fleet().procs[index]
        proc.signal(signal.SIGTERM)
        # The drain takes up to its delay plus --grace for open streams; a starved machine adds
        # its own slowness on top (a hang guard, not a bound of the drain).
        limit = REPLICA_DRAIN_DELAY_S + self.args.grace_s + START_TIMEOUT_S
        await asyncio.to_thread(lambda: proc.popen.wait(limit) if proc.popen else None)
        await self._restart_processor(index)

    async def _sim_fault(self, name: str, payload: dict[str, Any]) -> None:
        port = self.fleet().sim_specs[name].port

        def post() -> None:
            conn = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
            try:
                conn.request("POST", "/admin/fault", orjson.dumps(payload))
                conn.getresponse().read()
            finally:
                conn.close()

        await asyncio.to_thread(post)

    async def _add_cluster(self) -> None:
        await asyncio.to_thread(self.fleet().add_cluster, "c9")

    async def _remove_cluster(self) -> None:
        stack = self.fleet()
        spec = stack.sim_specs.pop("c9")
        cfg = yaml.safe_dump(stack.fleet_config(), sort_keys=False)
        await asyncio.to_thread(write_atomically, stack.fleet_path, cfg)
        # The processors drop it from placement at once and from Envoy's CDS after settling;
        # requests already sent there finish first.
        await asyncio.sleep(6)
        # Its figures count for this fault: read them before it goes.
        snap = await asyncio.to_thread(http_get, spec.port, "/admin/concurrency", 5)
        self._gone_peaks.append(orjson.loads(snap[1]))
        seen = await asyncio.to_thread(http_get, spec.port, "/admin/requests", 5)
        self._gone_requests[spec.name] = [tuple(r) for r in orjson.loads(seen[1])["requests"]]
        proc = stack.sims.pop(spec.name)
        await asyncio.to_thread(proc.stop)

    def _restart_hits_fault(self) -> Fault:
        """Prompt-keyed conversations run; after a warm-up, the steady window; then both
        processors are restarted one after the other (a deploy); then the first window after
        the restart began. PASS needs the hit ratio after >= RESTART_HIT_FLOOR x steady."""
        window = self.args.hit_window_s

        async def inject() -> None:
            conv = Conversations(self.fleet().url, seed=self.args.seed)
            stop = asyncio.Event()
            self._conversations = (conv, stop, asyncio.create_task(conv.run(stop)))
            await asyncio.sleep(self.args.hit_warmup_s)
            steady_from = time.monotonic()
            await asyncio.sleep(window)
            self._hits = {"steady_window": (steady_from, time.monotonic())}
            self._restart_began = time.monotonic()
            await self._sigterm_and_restart(0)
            await self._sigterm_and_restart(1)

        async def heal() -> None:
            assert self._conversations is not None
            conv, stop, task = self._conversations
            began = self._restart_began
            await asyncio.sleep(max(0.0, began + window - time.monotonic()))
            stop.set()
            await task
            steady, n_steady = conv.ratio(*self._hits.pop("steady_window"))
            after, n_after = conv.ratio(began, began + window)
            relative = None if not steady or after is None else after / steady
            self._hits = {
                "steady": steady,
                "after_restart": after,
                "relative": relative,
                "answers": [n_steady, n_after],
                "failed": conv.failed,
                "window_s": window,
            }
            self._conversations = None

        return Fault(RESTART_HITS_FAULT, inject, heal)

    def schedule(self) -> list[Fault]:
        async def nothing() -> None:
            return None

        def sync(fn: Callable[[], object]) -> Action:
            async def run() -> None:
                await asyncio.to_thread(fn)

            return run

        def set_abort(share: float) -> Action:
            async def run() -> None:
                assert self.load is not None
                self.load.abort_share = share

            return run

        def proxy_mode(mode: Any) -> Action:
            async def run() -> None:
                self.proxy.set_mode(mode)

            return run

        f = self.fleet
        faults = [
            Fault("(baseline, no fault)", nothing, nothing),
            Fault(
                "processor SIGKILL",
                sync(lambda: f().procs[0].kill()),
                lambda: self._restart_processor(0),
            ),
            Fault(
                "processor SIGTERM (rolling restart)",
                lambda: self._sigterm_and_restart(0),
                lambda: self._sigterm_and_restart(1),
            ),
            Fault("Redis killed", sync(self.redis.kill), sync(self.redis.start)),
            Fault("Redis hung (SIGSTOP)", sync(self.redis.pause), sync(self.redis.resume)),
            Fault("Redis slowed", proxy_mode("delay"), proxy_mode("pass")),
            Fault(
                "Redis restarted (state lost)",
                sync(self.redis.restart),
                nothing,
            ),
            Fault("processor-Redis partition", proxy_mode("blackhole"), proxy_mode("pass")),
            Fault(
                "cluster killed",
                sync(lambda: f().sims["c1"].kill()),
                sync(lambda: f().restart_sim("c1")),
            ),
            Fault(
                "cluster slowed",
                lambda: self._sim_fault("c2", {"mode": "slow", "factor": 5}),
                lambda: self._sim_fault("c2", {"mode": "none"}),
            ),
            Fault(
                "cluster erroring 503",
                lambda: self._sim_fault("c3", {"mode": "error", "status": 503}),
                lambda: self._sim_fault("c3", {"mode": "none"}),
            ),
            Fault("config reload: add + remove a cluster", self._add_cluster, self._remove_cluster),
            Fault("client abort storm", set_abort(0.5), set_abort(0.0)),
            self._restart_hits_fault(),
        ]
        if self.args.only:
            wanted = [w.strip().lower() for w in self.args.only.split(",")]
            faults = [x for x in faults if any(w in x.name.lower() for w in wanted)]
        return faults

    # ----- measurement ----------------------------------------------------------------------
    def _concurrency(self, reset: bool) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, spec in list(self.fleet().sim_specs.items()):
            proc = self.fleet().sims.get(name)
            if proc is None or not proc.alive:
                continue
            try:
                if reset:
                    conn = http.client.HTTPConnection(LOOPBACK, spec.port, timeout=5)
                    try:
                        conn.request("DELETE", "/admin/concurrency")
                        out[name] = orjson.loads(conn.getresponse().read())
                    finally:
                        conn.close()
                else:
                    out[name] = orjson.loads(http_get(spec.port, "/admin/concurrency", 5)[1])
            except OSError:
                continue  # a cluster down right now has no figures to give
        return out

    def _upstream_requests(self, since: float) -> dict[str, list[Interval]]:
        """What each live upstream saw per request since ``since`` (wall clock)."""
        out: dict[str, list[Interval]] = dict(self._gone_requests)
        for name, spec in list(self.fleet().sim_specs.items()):
            proc = self.fleet().sims.get(name)
            if proc is None or not proc.alive:
                continue
            try:
                _status, body = http_get(spec.port, f"/admin/requests?since={since}", 10)
            except OSError:
                continue
            out[name] = [
                (str(r[0]), str(r[1]), float(r[2]), float(r[3]))
                for r in orjson.loads(body)["requests"]
            ]
        return out

    def _read_admissions(self) -> None:
        """Fold the processors' new debug lines into the admissions seen so far."""
        lines = {}
        for i, proc in enumerate(self.fleet().procs):
            cursor = self._cursors.setdefault(i, LogCursor(proc.log_path))
            lines[i] = cursor.new_lines()
        for rid, seen in read_admissions(lines).items():
            old = self._admissions.get(rid)
            if old is not None and seen.released_at is None:
                seen.released_at = old.released_at
            self._admissions[rid] = seen
        fresh = {a.routed_at for a in self._admissions.values()}
        if len(self._admissions) > 200_000 and fresh:
            horizon = sorted(fresh)[-100_000]
            self._admissions = {k: v for k, v in self._admissions.items() if v.routed_at >= horizon}

    def _counter(self, name: str) -> list[float]:
        values = []
        for i, proc in enumerate(self.fleet().procs):
            try:
                scraped = probes.scrape(self.fleet().metrics_ports[i]) if proc.alive else {}
            except OSError:
                scraped = {}
            values.append(probes.total(scraped, name))
        return values

    def _held(self) -> float:
        total = 0.0
        for i, proc in enumerate(self.fleet().procs):
            if not proc.alive:
                continue
            try:
                total += probes.total(
                    probes.scrape(self.fleet().metrics_ports[i]), "fleet_budget_inflight_requests"
                )
            except OSError:
                continue
        return total

    async def _recovered_after(self, healed_at: float) -> float | None:
        """Seconds from healing to the last failed or truncated answer after it (0 when none),
        once a clean 2-second window shows the fleet is serving again; None when no clean
        window came within the cap."""
        assert self.load is not None
        load = self.load
        deadline = healed_at + self.args.recover_cap_s
        window = 2.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if now - healed_at < window:
                continue
            counts = load.counts(now - window, now)
            bad = sum(counts[k] for k in FAILURES) + counts["truncated"]
            if bad == 0 and counts["ok"] > 0:
                bad_kinds = (*FAILURES, "truncated")
                last_bad = max(
                    (
                        o.finished
                        for o in load.outcomes
                        if o.finished >= healed_at and o.kind in bad_kinds
                    ),
                    default=healed_at,
                )
                return round(last_bad - healed_at, 2)
        return None

    async def run_fault(self, fault: Fault) -> FaultResult:
        assert self.load is not None
        load = self.load
        # Before the peaks restart: every request the peaks can count ends after this.
        began_wall = time.time()
        await asyncio.to_thread(self._concurrency, True)
        self._gone_peaks = []
        self._gone_requests = {}
        errors_before = await asyncio.to_thread(self._counter, ERRORS)
        began = time.monotonic()
        await fault.inject()
        await asyncio.sleep(self.args.hold_s)
        healed = time.monotonic()
        await fault.heal()
        recover = await self._recovered_after(healed)
        # Settle: stop sending, let what is in flight finish, then read the held budget.
        load.paused = True
        await asyncio.to_thread(
            wait_until, lambda: load.in_flight == 0, self.args.settle_s + 60, "traffic to drain"
        )
        ended = time.monotonic()
        peaks = await asyncio.to_thread(self._concurrency, False)
        upstream = await asyncio.to_thread(self._upstream_requests, began_wall)
        held = self._held()
        deadline = time.monotonic() + self.args.settle_s
        while held and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            held = await asyncio.to_thread(self._held)
        counts = load.counts(began, ended + 0.001)
        errors_after = await asyncio.to_thread(self._counter, ERRORS)
        # A restarted replica starts its counters from zero: count what it shows since.
        redis_errors = int(
            sum(
                after - before if after >= before else after
                for before, after in zip(errors_before, errors_after, strict=True)
            )
        )
        await asyncio.to_thread(self._read_admissions)
        over: dict[str, int] = {}
        unclassed = 0
        for snap in [*peaks.values(), *self._gone_peaks]:
            for klass, peak in snap.get("peak", {}).items():
                if klass in LIMITS:
                    over[klass] = max(over.get(klass, 0), max(0, int(peak) - LIMITS[klass]))
            unclassed += int(snap.get("total", {}).get("", 0))
        result = FaultResult(
            fault=fault.name,
            requests=sum(counts.values()),
            ok=counts["ok"],
            failed=sum(counts[k] for k in FAILURES),
            rejected_429=counts["rejected"],
            truncated=counts["truncated"],
            aborted=counts["aborted"],
            unclassed_at_upstream=unclassed,
            over_admission={k: over.get(k, 0) for k in LIMITS},
            held_after_settle=held,
            redis_errors=redis_errors,
            recover_s=recover,
            failures_by_kind={k: counts[k] for k in FAILURES if counts[k]},
        )
        result.bound, result.bound_from = bound_for(
            fault.name, LIMITS, len(self.fleet().procs), self.args.ledger_replicas, redis_errors
        )
        within = all(result.over_admission[k] <= result.bound[k] for k in LIMITS)
        bypassed = unclassed > 0 and not fail_open_allowed(fault.name)
        result.verdict = "PASS" if within and held == 0 and not bypassed else "FAIL"
        if fault.name == RESTART_HITS_FAULT:
            result.hit_ratio, self._hits = self._hits, {}
            relative = result.hit_ratio.get("relative")
            if relative is None or relative < RESTART_HIT_FLOOR:
                result.verdict = "FAIL"
        result.diagnosis = diagnose(upstream, self._admissions, LIMITS, began_wall)
        opened = fail_open(upstream, self._admissions, began_wall)
        if opened:
            result.diagnosis["fail_open"] = opened
        load.paused = False
        await asyncio.sleep(self.args.between_s)
        return result

    async def run(self) -> list[FaultResult]:
        await self.start()
        try:
            self.load = SteadyLoad(
                self.fleet().url,
                TrafficOptions(
                    rate_per_s=self.args.rate,
                    concurrency=512,
                    sessions=400,
                    stream_share=0.7,
                    medium_share=0.15,
                    max_tokens=16,
                    timeout_s=120,
                    seed=self.args.seed,
                ),
            )
            stop = asyncio.Event()
            runner = asyncio.create_task(self.load.run(stop))
            await asyncio.sleep(self.args.between_s)
            for fault in self.schedule():
                print(f"chaos: {fault.name} ...", flush=True)
                try:
                    result = await self.run_fault(fault)
                except (OSError, TimeoutError, RuntimeError) as exc:
                    # The runner could not carry out this step (e.g. a replica did not come
                    # back): record it and go on, the schedule's other faults still count.
                    self.load.paused = False
                    result = FaultResult(fault=fault.name, note=f"runner error: {exc}"[:300])
                print("  " + row(result), flush=True)
                self.results.append(result)
            stop.set()
            await runner
        finally:
            await self.stop()
        return self.results


HEADER = (
    f"{'fault':<40} {'reqs':>6} {'failed':>6} {'429':>5} {'trunc':>5} {'unclassed':>9} "
    f"{'over s/m/l':>10} {'bound s/m/l':>11} {'redis err':>9} {'held':>5} {'recover s':>9}"
    "  verdict"
)


def row(r: FaultResult) -> str:
    over = "/".join(str(r.over_admission.get(k, 0)) for k in LIMITS) if r.over_admission else "-"
    bound = "/".join(str(r.bound.get(k, 0)) for k in LIMITS) if r.bound else "-"
    recover = "-" if r.recover_s is None else f"{r.recover_s:.2f}"
    line = (
        f"{r.fault:<40} {r.requests:>6} {r.failed:>6} {r.rejected_429:>5} {r.truncated:>5} "
        f"{r.unclassed_at_upstream:>9} {over:>10} {bound:>11} {r.redis_errors:>9} "
        f"{r.held_after_settle:>5g} {recover:>9}  {r.verdict or '-'}"
    )
    if r.hit_ratio:
        h = r.hit_ratio
        line += (
            f"\n      hit ratio: steady {_pct(h.get('steady'))}, first {h.get('window_s'):g} s "
            f"after the restart {_pct(h.get('after_restart'))} "
            f"(x{h['relative']:.3f} of steady; answers {h.get('answers')})"
            if h.get("relative") is not None
            else f"\n      hit ratio: not measured ({h})"
        )
    if r.note:
        line += f"  [{r.note}]"
    if r.diagnosis:
        line += "\n      peak: " + explain(r.diagnosis)
    return line


def _pct(value: object) -> str:
    return f"{value:.1%}" if isinstance(value, float) else "-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hit-window-s",
        type=float,
        default=60.0,
        help="restart row: the steady window and the window after the restart",
    )
    parser.add_argument(
        "--hit-warmup-s", type=float, default=30.0, help="restart row: conversations before"
    )
    parser.add_argument("--hold-s", type=float, default=10.0, help="how long each fault lasts")
    parser.add_argument("--rate", type=float, default=25.0, help="requests per second")
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--recover-cap-s", type=float, default=45.0)
    parser.add_argument("--between-s", type=float, default=3.0)
    parser.add_argument("--grace-s", type=float, default=30.0, help="processor drain grace")
    parser.add_argument("--time-scale", type=float, default=0.5, help="simulated cluster speed")
    parser.add_argument("--redis-delay-s", type=float, default=0.2, help="slowed Redis delay")
    parser.add_argument("--only", default="", help="comma-separated fault name filters")
    parser.add_argument("--out", default="out/chaos")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--ledger-replicas",
        type=int,
        default=2,
        help="redis.replicas (the local share is budget / this while Redis is unreachable)",
    )


def run(args: argparse.Namespace) -> int:
    chaos = Chaos(args)
    results = asyncio.run(chaos.run())
    print(HEADER)
    for r in results:
        print(row(r))
    report = {
        "command": (
            f"extproc chaos --hold-s {args.hold_s:g} --rate {args.rate:g}"
            + (f" --only {args.only}" if args.only else "")
            + (f" --ledger-replicas {args.ledger_replicas}" if args.ledger_replicas != 2 else "")
        ),
        "limits_max_concurrent": LIMITS,
        "ledger_replicas": args.ledger_replicas,
        "results": [asdict(r) for r in results],
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "chaos.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"chaos: JSON in {Path(args.out) / 'chaos.json'}")
    failing = [r.fault for r in results if r.verdict != "PASS"]
    print(
        f"chaos: {len(results) - len(failing)} of {len(results)} rows PASS"
        + (f"; FAIL: {', '.join(failing)}" if failing else "")
    )
    # The exit status says whether the run could measure (no runner error); the verdicts say
    # whether each row held its bound (a loaded machine times ledger calls out, which the
    # bound accounts for: see chaos_bounds).
    return 1 if any(r.note for r in results) else 0

"""``extproc bench routing --workload tenant-flood``: one tenant's flood inside the long class,
through a real Envoy, the processor and simulated clusters, one fairness policy per arm.

The same requests, replayed open-loop at the same instants, go through Envoy + the processor
once per arm, each on a fresh fleet (new simulated clusters, a new processor): ``no_flood``
(the same requests without the flood, ``flow.fairness: tokens``), then the flood with
``flow.fairness`` = ``fifo``, ``requests`` (unit cost) and ``tokens``.

The fleet: two simulated clusters, ``c1`` for the short and medium classes and ``c2`` for the
long class (its own pool, as ``extproc bench routing`` configures it). The long class has a
budget of in-flight tokens on ``c2`` and lets over-budget requests wait (``max_wait_s``,
``max_queue``); the short class has a budget of its own on ``c1``.

The traffic: 20 steady tenants, each sending long requests at a fixed period (a random phase,
jittered), together half of ``c2``'s prefill rate; one flooding tenant sending much larger long
requests as a Poisson stream of several times ``c2``'s prefill rate; short requests of the
steady tenants (Poisson) beside them. Every request carries its tenant's API key
(``authorization: Bearer sk-<tenant>``); the edge names the tenant: a Lua filter ahead of
ext_proc sets the trusted ``flow.tenant_header`` (``x-tenant``) from the key, after Envoy has
stripped any client copy of it (``internal_only_headers``), as docs/fairness.md describes.

Reported per arm (requests arriving after the warm-up): Jain's index of the served input tokens
among the steady tenants and over the steady tenants and the flood; the flood's share of the
long class's served tokens and the long tokens served per second against ``c2``'s prefill rate
(work-conserving: the flood takes what the steady tenants leave); the steady tenants' long
TTFT p50/p99 beside the no-flood arm's; the short class's TTFT p99 beside the no-flood arm's;
429s, errors, an account of every request, and the processor's own count of how each wait
ended (``fleet_flow_waits``: admitted, timeout, too_long, overflow). Times are wall-clock
milliseconds; the clusters run ``speedup`` times faster than real time, and the class's
``max_wait_s`` is divided by the same factor.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from random import Random
from typing import Any

import orjson
import yaml

from extproc.bench.fairness_stats import jain, pct
from extproc.bench.routing import SimProfile, Target, _progress, _run, format_targets
from extproc.harness.launch import FleetStack
from extproc.harness.prompts import API_PATHS, CHARS_PER_TOKEN, TextSynth
from extproc.harness.replay import ClassBounds, ReplayOptions, ReplayResult, run_replay, write_json
from extproc.harness.workload import ReplayRequest

STEADY = 20
FLOOD = "flood"
TENANT_HEADER = "x-tenant"
WORKLOAD = "tenant-flood"
# The request kinds (RequestOutcome.kind): which part of the traffic a request is.
STEADY_KIND, FLOOD_KIND, SHORT_KIND = "steady", "flood", "short"
TARGET_JAIN_STEADY = 0.95
TARGET_SHORT_RATIO = 1.1
# "<|user|>" + content + "\n": how the simulated cluster frames a chat message
# (prompts.canonical_prompt), so a request's input_tokens is what the cluster counts.
USER_FRAMING_CHARS = len("<|user|>\n")
# short < 1,024 input tokens, medium < 8,192, long the rest.
FLOOD_BOUNDS = ClassBounds(1024, 8192)


@dataclass(frozen=True, slots=True)
class FloodShape:
    """The traffic and the long class, in simulated seconds and tokens."""

    seconds: float = 200.0
    warmup_s: float = 20.0
    steady_tokens: int = 10_000
    flood_tokens: int = 80_000
    short_tokens: int = 400
    # The steady tenants together ask this share of the long cluster's prefill rate.
    steady_share: float = 0.5
    flood_rate: float = 1.0  # requests/s: 4x the long cluster's prefill rate at 80,000 tokens
    short_rate: float = 2.0
    output_tokens: int = 64
    long_budget_tokens: int = 120_000  # one flood request and four steady ones in flight
    max_wait_s: float = 20.0
    max_queue: int = 64
    jitter: float = 0.2  # a steady request's offset from its period, as a fraction of it
    bounds: ClassBounds = FLOOD_BOUNDS

    def steady_period_s(self, prefill_tps: float) -> float:
        """Seconds between two requests of one steady tenant."""
        total_rate = self.steady_share * prefill_tps / self.steady_tokens
        return STEADY / total_rate


@dataclass(frozen=True, slots=True)
class TenantWorkload:
    """Arrival-ordered requests and, index for index, each request's tenant."""

    shape: FloodShape
    requests: tuple[ReplayRequest, ...]
    tenants: tuple[str, ...]
    description: str

    def without_flood(self) -> TenantWorkload:
        kept = [i for i, t in enumerate(self.tenants) if t != FLOOD]
        return replace(
            self,
            requests=tuple(self.requests[i] for i in kept),
            tenants=tuple(self.tenants[i] for i in kept),
            description=self.description + " (the flood left out)",
        )


def steady_tenants() -> list[str]:
    return [f"steady{i:02d}" for i in range(STEADY)]


def _body(synth: TextSynth, key: str, tokens: int, output: int) -> dict[str, Any]:
    text = synth.text(key, tokens * CHARS_PER_TOKEN - USER_FRAMING_CHARS)
    return {
        "model": "sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": output,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(frozen=True, slots=True)
class _Arrival:
    at: float
    tenant: str
    kind: str
    tokens: int


def _arrivals(shape: FloodShape, prefill_tps: float, rng: Random) -> list[_Arrival]:
    out: list[_Arrival] = []
    period = shape.steady_period_s(prefill_tps)
    for tenant in steady_tenants():
        start = rng.uniform(0.0, period)
        for k in range(math.ceil(shape.seconds / period) + 1):
            at = start + k * period + rng.uniform(-shape.jitter, shape.jitter) * period
            if 0.0 <= at < shape.seconds:
                out.append(_Arrival(at, tenant, STEADY_KIND, shape.steady_tokens))
    out += [_Arrival(t, FLOOD, FLOOD_KIND, shape.flood_tokens) for t in _poisson(shape, rng)]
    for t in _poisson(shape, rng, shape.short_rate):
        out.append(_Arrival(t, rng.choice(steady_tenants()), SHORT_KIND, shape.short_tokens))
    return sorted(out, key=lambda a: a.at)


def _poisson(shape: FloodShape, rng: Random, rate: float | None = None) -> list[float]:
    rate = shape.flood_rate if rate is None else rate
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < shape.seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def tenant_flood_workload(shape: FloodShape, prefill_tps: float, seed: int) -> TenantWorkload:
    """The flood beside the steady tenants and the short class; deterministic for a seed."""
    rng = Random(f"tenant-flood:{seed}")
    synth = TextSynth(seed)
    requests: list[ReplayRequest] = []
    tenants: list[str] = []
    for n, arrival in enumerate(_arrivals(shape, prefill_tps, rng)):
        requests.append(
            ReplayRequest(
                arrival_s=arrival.at,
                api="openai-chat",
                path=API_PATHS["openai-chat"],
                # Built when the arm runs (run_arm): the flood's prompts are 320 KB each.
                body=partial(
                    _body, synth, f"{arrival.tenant}:{n}", arrival.tokens, shape.output_tokens
                ),
                session_id=None,
                send_session_header=False,
                kind=arrival.kind,
                input_tokens=arrival.tokens,
                stream=True,
                max_tokens=shape.output_tokens,
                headers=(("authorization", f"Bearer sk-{arrival.tenant}"),),
            )
        )
        tenants.append(arrival.tenant)
    kinds = Counter(r.kind for r in requests)
    period = shape.steady_period_s(prefill_tps)
    description = (
        f"tenant flood, {shape.seconds:g} s, seed {seed}: {STEADY} steady tenants x "
        f"{shape.steady_tokens:,}-token long requests every {period:.0f} s "
        f"({kinds[STEADY_KIND]}), a flood of {shape.flood_tokens:,}-token long requests at "
        f"{shape.flood_rate:g}/s ({kinds[FLOOD_KIND]}), {shape.short_tokens}-token short "
        f"requests at {shape.short_rate:g}/s ({kinds[SHORT_KIND]})"
    )
    return TenantWorkload(shape, tuple(requests), tuple(tenants), description)


# -- the fleet ----------------------------------------------------------------------------------

# The edge's tenant: a stand-in for authentication (every sk- key is valid and names its
# tenant). Envoy has already stripped a client's x-tenant (internal_only_headers).
EDGE_TENANT_LUA = f"""
function envoy_on_request(request)
  local key = request:headers():get("authorization")
  if key ~= nil and string.sub(key, 1, 10) == "Bearer sk-" then
    request:headers():replace("{TENANT_HEADER}", string.sub(key, 11))
  end
end
"""


def edge_tenant_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": EDGE_TENANT_LUA},
        },
    }


def with_edge_tenant(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The rendered bootstrap with the edge's tenant filter first in every HTTP filter chain
    (ahead of ext_proc, after the header strip)."""
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                hcm = network_filter["typed_config"]
                if "http_filters" in hcm:
                    hcm["http_filters"] = [edge_tenant_filter(), *hcm["http_filters"]]
    return bootstrap


class EdgeTenantStack(FleetStack):
    """A FleetStack whose Envoy names each request's tenant at the edge."""

    def write_configs(self) -> None:
        super().write_configs()
        bootstrap = yaml.safe_load(self.envoy_path.read_text())
        self.envoy_path.write_text(yaml.safe_dump(with_edge_tenant(bootstrap), sort_keys=False))


def flood_classes(shape: FloodShape, profile: SimProfile) -> list[dict[str, Any]]:
    """short and medium on c1, long on c2 with a budget of in-flight tokens and a wait; the
    wait in wall seconds (the clusters run 1/time_scale times real time)."""
    return [
        {
            "name": "short",
            "max_input_tokens": shape.bounds.short_below,
            "eligible": ["c1"],
            "budget": {"max_concurrent": profile.max_concurrency},
        },
        {
            "name": "medium",
            "max_input_tokens": shape.bounds.long_from,
            "eligible": ["c1"],
            "budget": {"max_inflight_tokens": profile.kv_capacity_tokens // 2},
        },
        {
            "name": "long",
            "eligible": ["c2"],
            "budget": {"max_inflight_tokens": shape.long_budget_tokens},
            "wait": {
                "max_wait_s": shape.max_wait_s * profile.time_scale,
                "max_queue": shape.max_queue,
            },
        },
    ]


# -- the arms -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    fairness: str  # flow.fairness
    flood: bool


ARMS: tuple[Arm, ...] = (
    Arm("no_flood", "tokens", flood=False),
    Arm("fifo", "fifo", flood=True),
    Arm("requests", "requests", flood=True),
    Arm("tokens", "tokens", flood=True),
)
BASELINE = "no_flood"


def parse_arms(text: str | None) -> list[Arm]:
    if not text:
        return list(ARMS)
    names = {arm.name: arm for arm in ARMS}
    chosen = []
    for item in (part.strip() for part in text.split(",")):
        if item not in names:
            raise ValueError(f"unknown arm {item!r}; choose from {', '.join(names)}")
        chosen.append(names[item])
    return chosen


@dataclass(frozen=True, slots=True)
class RunContext:
    """What every arm shares."""

    profile: SimProfile
    options: ReplayOptions
    classes: list[dict[str, Any]]
    out_dir: Path
    message_timeout_ms: int | None


@dataclass(frozen=True, slots=True)
class ArmRun:
    arm: Arm
    workload: TenantWorkload
    result: ReplayResult
    envoy_requests: int
    fail_open: int
    waits: dict[str, float]  # fleet_flow_waits of the long class, by result
    wait_seconds: dict[str, float]  # fleet_flow_wait_seconds of the long class: sum, count


def _overrides(arm: Arm, ctx: RunContext) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "classes": ctx.classes,
        "flow": {"tenant_header": TENANT_HEADER, "fairness": arm.fairness},
    }
    if ctx.message_timeout_ms is not None:
        overrides["processor"] = {"message_timeout_ms": ctx.message_timeout_ms}
    return overrides


def _long_waits(stack: FleetStack) -> tuple[dict[str, float], dict[str, float]]:
    waits: dict[str, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    for (name, labels), value in stack.processor_metrics(0).items():
        label = dict(labels)
        if label.get("request_class") != "long":
            continue
        if name == "fleet_flow_waits_total":
            waits[label["result"]] += value
        elif name in ("fleet_flow_wait_seconds_sum", "fleet_flow_wait_seconds_count"):
            seconds[name.rsplit("_", 1)[1]] += value
    return dict(waits), dict(seconds)


def run_arm(arm: Arm, workload: TenantWorkload, ctx: RunContext) -> ArmRun:
    if not arm.flood:
        workload = workload.without_flood()
    workdir = ctx.out_dir / "logs" / f"{WORKLOAD}-{arm.name}"
    for old in workdir.glob("*.log"):
        old.unlink()  # Proc appends to its log: start each run with a clean one
    stack = EdgeTenantStack(
        workdir,
        clusters=ctx.profile.clusters,
        sim_start_timeout_s=90.0,
        sim_args=ctx.profile.sim_args(),
        fleet_overrides=_overrides(arm, ctx),
        processor_args=("--log-level", "warning", "--seed", "0"),
        access_log=False,
    )
    # Every prompt built before the replay starts: building a flood prompt takes the client's
    # event loop ~15 ms, which would delay reading the short requests' first tokens.
    requests = [replace(r, body=r.materialize()) for r in workload.requests]
    stack.start()
    try:
        result = _run(run_replay(requests, stack.url, ctx.options))
        envoy_requests = stack.envoy_stat("http.ingress.downstream_rq_total")
        fail_open = stack.envoy_stat("http.ingress.ext_proc.failure_mode_allowed")
        waits, seconds = _long_waits(stack)
    finally:
        stack.stop()
    return ArmRun(arm, workload, result, envoy_requests, fail_open, waits, seconds)


# -- the report ---------------------------------------------------------------------------------


def _account(result: ReplayResult, kinds: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per kind of request (and "all"): requests and their outcomes."""
    out: dict[str, dict[str, int]] = {}
    for kind in [*kinds, "all"]:
        chosen = [o for o in result.outcomes if kind in ("all", o.kind)]
        counts = Counter(o.outcome for o in chosen)
        out[kind] = {
            "requests": len(chosen),
            "2xx": counts["2xx"],
            "429": counts["429"],
            "429_with_retry_after": sum(1 for o in chosen if o.outcome == "429" and o.retry_after),
            "other": len(chosen) - counts["2xx"] - counts["429"],
        }
    return out


def served_tokens(run: ArmRun) -> dict[str, float]:
    """Input tokens served (2xx) per tenant, long class only, of requests arriving after the
    warm-up; every steady tenant (and the flood, when it ran) has an entry."""
    shape = run.workload.shape
    served: dict[str, float] = dict.fromkeys(steady_tenants(), 0.0)
    if run.arm.flood:
        served[FLOOD] = 0.0
    for o in run.result.outcomes:
        request = run.workload.requests[o.index]
        if o.outcome == "2xx" and o.kind != SHORT_KIND and request.arrival_s >= shape.warmup_s:
            served[run.workload.tenants[o.index]] += request.input_tokens
    return served


def _ttfts(run: ArmRun, kind: str) -> list[float]:
    warmup = run.workload.shape.warmup_s
    return [
        o.ttft_s
        for o in run.result.outcomes
        if o.kind == kind
        and o.outcome == "2xx"
        and o.ttft_s is not None
        and run.workload.requests[o.index].arrival_s >= warmup
    ]


def long_busy(run: ArmRun, prefill_tps: float, speedup: float) -> float:
    """Input tokens of long requests whose first token came inside [warm-up, end) (their
    prefill done then), over what the long cluster could prefill in that window."""
    shape = run.workload.shape
    origin = run.workload.requests[0].arrival_s if run.workload.requests else 0.0
    prefilled = 0
    for o in run.result.outcomes:
        if o.outcome != "2xx" or o.kind == SHORT_KIND or o.ttft_s is None:
            continue
        first_token = origin + (o.sent_s + o.ttft_s) * speedup
        if shape.warmup_s <= first_token < shape.seconds:
            prefilled += run.workload.requests[o.index].input_tokens
    return prefilled / (prefill_tps * (shape.seconds - shape.warmup_s))


def _nan_none(value: float) -> float | None:
    return None if math.isnan(value) else value


def arm_report(run: ArmRun, ctx: RunContext) -> dict[str, Any]:
    served = served_tokens(run)
    steady = [served[t] for t in steady_tenants()]
    long_total = sum(served.values())
    steady_ttft, short_ttft = _ttfts(run, STEADY_KIND), _ttfts(run, SHORT_KIND)
    account = _account(run.result, (STEADY_KIND, FLOOD_KIND, SHORT_KIND))
    sent_steady = account[STEADY_KIND]["requests"]
    return {
        "arm": run.arm.name,
        "fairness": run.arm.fairness,
        "flood": run.arm.flood,
        "account": account,
        "outcomes_recorded": len(run.result.outcomes),
        "requests": len(run.workload.requests),
        "skipped": run.result.skipped,
        "envoy_downstream_requests": run.envoy_requests,
        "ext_proc_fail_open": run.fail_open,
        "jain_steady": _nan_none(jain(steady)),
        "jain_all": _nan_none(jain(list(served.values()))),
        "flood_share": served.get(FLOOD, 0.0) / long_total if long_total else None,
        "long_busy": long_busy(run, ctx.profile.prefill_tps, ctx.options.speedup),
        "steady_429_share": account[STEADY_KIND]["429"] / sent_steady if sent_steady else None,
        "steady_ttft_p50_s": _nan_none(pct(steady_ttft, 50)),
        "steady_ttft_p99_s": _nan_none(pct(steady_ttft, 99)),
        "short_ttft_p50_s": _nan_none(pct(short_ttft, 50)),
        "short_ttft_p99_s": _nan_none(pct(short_ttft, 99)),
        "long_waits": run.waits,
        "long_wait_seconds": run.wait_seconds,
        "served_tokens": served,
        "wall_s": run.result.wall_s,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def add_baseline_ratios(reports: Mapping[str, dict[str, Any]]) -> None:
    """Each arm's steady long TTFT p99 and short TTFT p99 over the no-flood arm's."""
    base = reports.get(BASELINE)
    for report in reports.values():
        for part in ("steady", "short"):
            key = f"{part}_ttft_p99_s"
            ratio = _ratio(report[key], base[key]) if base is not None else None
            report[f"{part}_ttft_p99_vs_no_flood"] = ratio


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _account_table(reports: Mapping[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| arm | requests | 2xx | 429 (with retry-after) | other | steady 2xx / sent | flood "
        "2xx / sent | short 2xx / sent | Envoy saw | fail-open |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports.values():
        a = r["account"]
        kinds = " | ".join(
            f"{a[k]['2xx']} / {a[k]['requests']}" for k in (STEADY_KIND, FLOOD_KIND, SHORT_KIND)
        )
        lines.append(
            f"| {r['arm']} | {a['all']['requests']} | {a['all']['2xx']} | {a['all']['429']} "
            f"({a['all']['429_with_retry_after']}) | {a['all']['other']} | {kinds} "
            f"| {r['envoy_downstream_requests']} | {r['ext_proc_fail_open']} |"
        )
    return lines


def _fairness_table(reports: Mapping[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| arm | Jain steady | Jain all | flood share | long busy | steady 429 "
        "| steady TTFT p50 ms | steady TTFT p99 ms | p99 / no flood | short TTFT p99 ms "
        "| short p99 / no flood |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports.values():
        lines.append(
            f"| {r['arm']} | {_num(r['jain_steady'])} | {_num(r['jain_all'])} "
            f"| {_num(r['flood_share'], 2)} | {_num(r['long_busy'], 2)} "
            f"| {_num(r['steady_429_share'], 2)} | {_ms(r['steady_ttft_p50_s'])} "
            f"| {_ms(r['steady_ttft_p99_s'])} | {_num(r['steady_ttft_p99_vs_no_flood'], 2)} "
            f"| {_ms(r['short_ttft_p99_s'])} | {_num(r['short_ttft_p99_vs_no_flood'], 2)} |"
        )
    return lines


def _waits_table(reports: Mapping[str, dict[str, Any]]) -> list[str]:
    results = ("admitted", "timeout", "too_long", "overflow", "cancelled", "tenant_limit")
    lines = [
        "| arm | " + " | ".join(results) + " | mean wait ms |",
        "|---|" + "---|" * (len(results) + 1),
    ]
    for r in reports.values():
        waits, seconds = r["long_waits"], r["long_wait_seconds"]
        mean = _ratio(seconds.get("sum"), seconds.get("count"))
        cells = " | ".join(f"{waits.get(k, 0):.0f}" for k in results)
        lines.append(f"| {r['arm']} | {cells} | {_ms(mean)} |")
    return lines


def format_report(
    reports: Mapping[str, dict[str, Any]], workload: TenantWorkload, ctx: RunContext
) -> str:
    profile = ctx.profile
    speedup = 1.0 / profile.time_scale
    lines = [
        f"workload: {workload.description}",
        f"fleet: 2 simulated clusters (c1: short, medium; c2: long), prefill "
        f"{profile.prefill_tps:g} tok/s, decode {profile.decode_tps:g} tok/s/request, "
        f"{profile.max_concurrency} slots; simulated time runs {speedup:g}x real; long budget "
        f"{workload.shape.long_budget_tokens:,} tokens in flight, max_wait "
        f"{workload.shape.max_wait_s:g} simulated s, max_queue {workload.shape.max_queue}; "
        f"the tenant from {TENANT_HEADER}, set at the edge",
        f"figures over requests arriving after {workload.shape.warmup_s:g} simulated s; TTFT in "
        f"wall ms (x{speedup:g} for simulated ms)",
        "",
        *_account_table(reports),
        "",
        *_fairness_table(reports),
        "",
        "Jain: of the input tokens served per tenant in the long class (steady: the 20 steady "
        "tenants; all: with the flood); long busy: tokens whose prefill ended in the window over "
        "what c2 could prefill in it",
        "",
        "how the long class's waits ended (the processor's fleet_flow_waits):",
        "",
        *_waits_table(reports),
    ]
    return "\n".join(lines)


def targets(reports: Mapping[str, dict[str, Any]]) -> list[Target]:
    out: list[Target] = []
    tokens = reports.get("tokens")
    if tokens is not None:
        jain_steady = tokens["jain_steady"]
        out.append(
            Target(
                f"tokens: Jain's index among the steady tenants >= {TARGET_JAIN_STEADY:g}",
                _num(jain_steady),
                None if jain_steady is None else jain_steady >= TARGET_JAIN_STEADY,
            )
        )
        short = tokens["short_ttft_p99_vs_no_flood"]
        out.append(
            Target(
                f"tokens: short TTFT p99 <= {TARGET_SHORT_RATIO:g} x the no-flood arm's",
                f"{_num(short, 2)} x",
                None if short is None else short <= TARGET_SHORT_RATIO,
            )
        )
    unaccounted = {
        name: r["requests"] - r["outcomes_recorded"] - r["skipped"] for name, r in reports.items()
    }
    lost = {
        name: r["account"]["all"]["other"]
        + r["account"]["all"]["429"]
        - r["account"]["all"]["429_with_retry_after"]
        for name, r in reports.items()
    }
    out.append(
        Target(
            "every request has one outcome; none failed (no error, transport failure, timeout "
            "or 429 without retry-after)",
            ", ".join(f"{n}: lost {lost[n]}, unaccounted {unaccounted[n]}" for n in reports),
            all(v == 0 for v in lost.values()) and all(v == 0 for v in unaccounted.values()),
        )
    )
    return out


# -- CLI ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tenant-flood workload (--workload tenant-flood)")
    group.add_argument(
        "--arms",
        default=None,
        help="comma-separated subset of " + ",".join(a.name for a in ARMS) + " (default: all)",
    )
    group.add_argument(
        "--flood-seconds",
        type=float,
        default=FloodShape().seconds,
        help="simulated seconds of traffic",
    )


def _context(args: argparse.Namespace, shape: FloodShape, speedup: float) -> RunContext:
    profile = SimProfile(
        clusters=2,
        kv_capacity_tokens=args.kv_capacity_tokens or 2_000_000,
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        max_concurrency=args.max_concurrency,
        time_scale=1.0 / speedup,
        max_output=args.max_output,
    )
    options = ReplayOptions(
        speedup=speedup,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        retry_429=args.retry_429,
        class_bounds=shape.bounds,
        progress=None if args.quiet else _progress,
        progress_interval_s=10.0,
    )
    classes = flood_classes(shape, profile)
    return RunContext(profile, options, classes, args.out_dir, args.message_timeout_ms)


def run(args: argparse.Namespace, default_speedup: float) -> int:
    try:
        arms = parse_arms(args.arms)
        shape = FloodShape(seconds=args.flood_seconds)
        if not shape.warmup_s < shape.seconds:
            raise ValueError(f"--flood-seconds must exceed the warm-up ({shape.warmup_s:g} s)")
        ctx = _context(args, shape, args.speedup or default_speedup)
        workload = tenant_flood_workload(shape, args.prefill_tps, args.seed)
    except ValueError as exc:
        print(f"extproc bench routing: {exc}", file=sys.stderr)
        return 2
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"workload: {workload.description}", file=sys.stderr)
    reports: dict[str, dict[str, Any]] = {}
    for arm in arms:
        print(f"== {arm.name} (flow.fairness {arm.fairness}) ==", file=sys.stderr, flush=True)
        done = run_arm(arm, workload, ctx)
        write_json(done.result, ctx.out_dir / f"{WORKLOAD}-{arm.name}.json")
        reports[arm.name] = arm_report(done, ctx)
    add_baseline_ratios(reports)
    found = targets(reports)
    print(format_report(reports, workload, ctx))
    print("\ntargets:\n" + format_targets(found))
    summary = ctx.out_dir / f"{WORKLOAD}.json"
    summary.write_bytes(
        orjson.dumps(
            {
                "command": shlex.join(["extproc", *sys.argv[1:]]),
                "workload": workload.description,
                "shape": asdict(shape),
                "profile": asdict(ctx.profile),
                "extproc_classes": ctx.classes,
                "arms": reports,
                "targets": [asdict(t) for t in found],
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    print(f"\nwritten: {summary}, per-request results in {ctx.out_dir}/")
    unaccounted = any(
        r["outcomes_recorded"] + r["skipped"] != r["requests"] for r in reports.values()
    )
    return 1 if unaccounted else 0

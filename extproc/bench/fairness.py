"""``extproc bench fairness``: one tenant's flood inside a class, FIFO vs fair shares.

A deterministic discrete-event run on a virtual clock over the processor's own queue and
ledger: :class:`extproc.core.flow.FairQueue` orders the waiters (the same code the processor's
queues use), :class:`extproc.ledger.memory.MemoryLedger` holds the class budget, the waiting
discipline is the processor's (only the head reserves; a waiter leaves at its class's
``max_wait_s`` with a 429; a full queue refuses at once), and per-tenant limits are
:class:`extproc.ledger.tenant_limits.TenantLimits`. What it does not model: the engine itself
(a request holds its budget for its prefill plus decode time at fixed rates) and the network.

One cluster. The long class (a budget of in-flight tokens) carries a flooding tenant (a closed
loop of large requests, always more than the class holds) and 20 steady tenants (Poisson
arrivals of smaller requests); the short class, with a budget of its own, carries interactive
requests. Two loads of the steady tenants: ``light`` (together they ask less than the class
holds: the flood should get the rest, fair queueing being work-conserving) and ``heavy`` (each
asks more than its fair share: everyone is backlogged and the policy decides the shares).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from random import Random

from extproc.bench.fairness_stats import jain, pct
from extproc.core.admission import Demand, Ticket
from extproc.core.fleet import Budget
from extproc.core.flow import Fairness, FairQueue, FlowParams, TenantLimit
from extproc.ledger.memory import MemoryLedger
from extproc.ledger.tenant_limits import TenantLimits, TenantSlot

STEADY = 20
FLOOD = "flood"


@dataclass(frozen=True, slots=True)
class Shape:
    """The run's traffic and capacity (the command's flags)."""

    seconds: float = 600.0
    warmup_s: float = 60.0
    long_budget_tokens: int = 1_000_000
    short_concurrent: int = 16
    max_wait_s: float = 30.0
    max_queue: int = 64
    flood_tokens: int = 200_000
    flood_outstanding: int = 32
    steady_tokens: int = 20_000
    short_tokens: int = 500
    short_rate: float = 4.0
    output_tokens: int = 200
    prefill_tps: float = 50_000.0
    decode_tps: float = 50.0

    def service_s(self, tokens: int) -> tuple[float, float]:
        """(prefill, whole) seconds a request of ``tokens`` holds its budget."""
        prefill = tokens / self.prefill_tps
        return prefill, prefill + self.output_tokens / self.decode_tps

    def steady_rate(self, load: str) -> float:
        """Requests/s per steady tenant: together 30 % of the long class (light), or each
        twice its 1/21 share (heavy)."""
        hold = self.steady_tokens * self.service_s(self.steady_tokens)[1]
        capacity = self.long_budget_tokens / hold  # requests/s the class could serve of them
        if load == "light":
            return 0.3 * capacity / STEADY
        return 2.0 * capacity / (STEADY + 1)


@dataclass(slots=True)
class _Request:
    tenant: str
    cls: str
    tokens: int
    arrived: float
    seq: int = -1
    slot: TenantSlot | None = None


@dataclass(slots=True)
class Outcome:
    served: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    asked: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    busy_token_s: float = 0.0


class _Run:
    """One policy over one load: the event loop and the waiting discipline."""

    def __init__(self, shape: Shape, flow: FlowParams, load: str, flood: bool, seed: int) -> None:
        self.shape, self.flow, self.load, self.flood = shape, flow, load, flood
        self.rng = Random(seed)
        self.now = 0.0
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.order = itertools.count()
        self.ledger = MemoryLedger(lambda: self.now)
        self.limits = TenantLimits(lambda: self.now)
        self.queue: FairQueue[_Request] = FairQueue()
        self.out = Outcome()
        long_budget = Budget(max_inflight_tokens=shape.long_budget_tokens)
        short_budget = Budget(max_concurrent=shape.short_concurrent)
        self.budgets = {"long": long_budget, "short": short_budget}

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.order), action))

    def measured(self) -> bool:
        return self.now >= self.shape.warmup_s

    def run(self) -> Outcome:
        if self.flood:
            for _ in range(self.shape.flood_outstanding):
                self.at(0.0, lambda: self.arrive(FLOOD, "long", self.shape.flood_tokens))
        rate = self.shape.steady_rate(self.load)
        for i in range(STEADY):
            self.at(self.rng.expovariate(rate), self._steady(f"steady{i}", rate))
        self.at(self.rng.expovariate(self.shape.short_rate), self._short())
        while self.events and self.events[0][0] <= self.shape.seconds:
            self.now, _, action = heapq.heappop(self.events)
            action()
        return self.out

    def _steady(self, tenant: str, rate: float) -> Callable[[], None]:
        def fire() -> None:
            self.arrive(tenant, "long", self.shape.steady_tokens)
            self.at(self.now + self.rng.expovariate(rate), fire)

        return fire

    def _short(self) -> Callable[[], None]:
        def fire() -> None:
            self.arrive("interactive", "short", self.shape.short_tokens)
            self.at(self.now + self.rng.expovariate(self.shape.short_rate), fire)

        return fire

    def demand(self, req: _Request) -> Demand:
        budget = self.budgets[req.cls]
        return Demand("c1", req.cls, req.tokens, budget, budget.resolved())

    def arrive(self, tenant: str, cls: str, tokens: int) -> None:
        req = _Request(tenant, cls, tokens, self.now)
        if self.measured():
            self.out.asked[tenant] += 1
        limit = self.flow.limit_for(tenant)
        if limit.enabled:
            slot = self.limits.take(tenant, tokens, limit)
            if not isinstance(slot, TenantSlot):
                return self.refuse(req)
            req.slot = slot
        if cls == "long" and len(self.queue):
            return self.join(req)  # others wait: behind them, as the processor does
        answer = self.ledger.reserve_now(self.demand(req))
        if answer.granted and answer.ticket is not None:
            return self.start(req, answer.ticket)
        if cls == "short":
            return self.refuse(req)
        self.join(req)

    def join(self, req: _Request) -> None:
        if len(self.queue) >= self.shape.max_queue:
            return self.refuse(req)
        claim = self.flow.claim(req.tenant, None, req.tokens)
        req.seq = self.queue.push(req, req.tenant, claim.weight, req.tokens, service=claim.service)
        seq = req.seq
        self.at(self.now + self.shape.max_wait_s, lambda: self.timeout(req, seq))

    def timeout(self, req: _Request, seq: int) -> None:
        if self.queue.remove(seq):
            self.refuse(req)
            self.drain()

    def refuse(self, req: _Request) -> None:
        if req.slot is not None:
            self.limits.give(req.slot)
        if self.measured():
            self.out.refused[req.tenant] += 1
        if req.tenant == FLOOD:  # a closed loop: the flood sends another at once
            self.at(self.now + 1.0, lambda: self.arrive(FLOOD, "long", self.shape.flood_tokens))

    def start(self, req: _Request, ticket: Ticket) -> None:
        prefill, whole = self.shape.service_s(req.tokens)
        if self.measured():
            self.out.ttft[f"{req.cls}:{'flood' if req.tenant == FLOOD else 'steady'}"].append(
                self.now - req.arrived + prefill
            )
            self.out.served[req.tenant] += req.tokens
            if req.cls == "long":
                self.out.busy_token_s += req.tokens * whole
        self.at(self.now + whole, lambda: self.finish(req, ticket))

    def finish(self, req: _Request, ticket: Ticket) -> None:
        self.ledger.release_now(ticket)
        if req.slot is not None:
            self.limits.give(req.slot)
        if req.cls == "long":
            self.queue.charge(req.tenant, self.flow.output_service(self.shape.output_tokens))
        if req.tenant == FLOOD:
            self.arrive(FLOOD, "long", self.shape.flood_tokens)
        self.drain()

    def drain(self) -> None:
        while (head := self.queue.head()) is not None:
            answer = self.ledger.reserve_now(self.demand(head))
            if not answer.granted or answer.ticket is None:
                return
            self.queue.pop()
            self.start(head, answer.ticket)


POLICIES: dict[str, FlowParams] = {
    "fifo": FlowParams(fairness=Fairness.FIFO),
    "requests": FlowParams(fairness=Fairness.REQUESTS),
    "tokens": FlowParams(fairness=Fairness.TOKENS),
    "tokens + flood limit": FlowParams(
        fairness=Fairness.TOKENS,
        tenant_limits={FLOOD: TenantLimit(max_concurrent=8)},
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=600.0, help="virtual seconds")
    parser.add_argument("--seed", type=int, default=1)


def rows(shape: Shape, seed: int) -> Iterator[list[str]]:
    for load in ("light", "heavy"):
        base = _Run(shape, POLICIES["tokens"], load, flood=False, seed=seed).run()
        base_short = pct(base.ttft["short:steady"], 99)
        base_long = pct(base.ttft["long:steady"], 99)
        yield [load, "no flood", *_cells(shape, base, base_short, base_long)]
        for name, flow in POLICIES.items():
            out = _Run(shape, flow, load, flood=True, seed=seed).run()
            yield [load, name, *_cells(shape, out, base_short, base_long)]


def _cells(shape: Shape, out: Outcome, base_short: float, base_long: float) -> list[str]:
    steady = [out.served.get(f"steady{i}", 0.0) for i in range(STEADY)]
    everyone = [*steady, out.served.get(FLOOD, 0.0)] if out.asked.get(FLOOD) else steady
    long_total = sum(everyone)
    window = shape.seconds - shape.warmup_s
    util = out.busy_token_s / (shape.long_budget_tokens * window)
    asked = sum(out.asked.get(f"steady{i}", 0) for i in range(STEADY))
    refused = sum(out.refused.get(f"steady{i}", 0) for i in range(STEADY))
    ttft = out.ttft["long:steady"]
    short = pct(out.ttft["short:steady"], 99)
    return [
        f"{jain(steady):.3f}",
        f"{jain(everyone):.3f}",
        f"{out.served.get(FLOOD, 0.0) / long_total:.2f}" if long_total else "-",
        f"{util:.2f}",
        f"{refused / asked:.2f}" if asked else "-",
        f"{pct(ttft, 50):.2f}",
        f"{pct(ttft, 99):.2f}",
        f"{pct(ttft, 99) / base_long:.2f}" if base_long > 0 else "-",
        f"{short / base_short:.2f}" if base_short > 0 else "-",
    ]


HEADER = [
    "steady load",
    "policy",
    "Jain steady",
    "Jain all",
    "flood share",
    "long util",
    "steady 429",
    "steady TTFT p50 s",
    "steady TTFT p99 s",
    "p99 / no flood",
    "short p99 / no flood",
]


def run(args: argparse.Namespace) -> int:
    shape = Shape(seconds=args.seconds)
    table = [HEADER, *rows(shape, args.seed)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    print(
        f"one tenant's flood ({shape.flood_outstanding} x {shape.flood_tokens:,}-token requests "
        f"outstanding) beside {STEADY} steady tenants ({shape.steady_tokens:,} tokens) in the "
        f"long class (budget {shape.long_budget_tokens:,} tokens in flight, max_wait "
        f"{shape.max_wait_s:g} s, max_queue {shape.max_queue}); {args.seconds:g} virtual s, "
        f"seed {args.seed}"
    )
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    return 0

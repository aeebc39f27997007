"""Open-loop replay: send every request at its arrival time, measure what comes back.

Open loop means a request is sent when its time comes whether or not earlier ones have
finished, as real users do; a closed loop (send the next when one finishes) hides queueing
because a slow server slows its own load down. The only brake is a concurrency cap, and every
request it holds back is counted as delayed so a report shows when the generator, not the
system under test, was the bottleneck.

Every request sent ends in exactly one ``RequestOutcome``: 2xx, 429, 413, other 4xx, 5xx,
transport error or timeout. Requests cut off by ``max_requests`` or ``duration_s`` are counted
as skipped, never sent.

From Python: ``result = await run_replay(requests, "http://127.0.0.1:10000", ReplayOptions())``
then ``format_table(result)``, ``result.summary()``, ``plot_report(result, path)`` or
``plot_comparison({"round-robin": a, "extproc": b}, path)``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import aiohttp
import orjson

from extproc.harness.workload import ReplayRequest

log = logging.getLogger(__name__)

OutcomeKind = Literal["2xx", "429", "413", "4xx", "5xx", "transport", "timeout"]
OUTCOME_KINDS: tuple[OutcomeKind, ...] = get_args(OutcomeKind)
CLASSES: tuple[str, ...] = ("short", "medium", "long")

SESSION_HEADER = "x-session-id"
SERVED_BY = "x-served-by"
ANTHROPIC_VERSION = "2023-06-01"


@dataclass(frozen=True, slots=True)
class ClassBounds:
    """short < ``short_below`` <= medium < ``long_from`` <= long (input tokens)."""

    short_below: int = 2048
    long_from: int = 100_000

    def __post_init__(self) -> None:
        if not 0 < self.short_below <= self.long_from:
            raise ValueError(f"class bounds must satisfy 0 < short <= long: {self}")

    def classify(self, input_tokens: int) -> str:
        if input_tokens < self.short_below:
            return "short"
        return "medium" if input_tokens < self.long_from else "long"

    @classmethod
    def parse(cls, text: str) -> ClassBounds:
        parts = text.split(",")
        if len(parts) != 2:
            raise ValueError(f"class bounds must be SHORT,LONG (e.g. 2048,100000), got {text!r}")
        return cls(int(parts[0]), int(parts[1]))


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    speedup: float = 1.0
    max_requests: int | None = None
    duration_s: float | None = None  # stop sending after this many (wall) seconds
    concurrency: int = 1024
    timeout_s: float = 300.0  # per attempt
    retry_429: bool = False
    max_retries: int = 3
    max_retry_after_s: float = 30.0
    class_bounds: ClassBounds = field(default_factory=ClassBounds)
    # Burst windows in the requests' own time (before speedup), for in/out-of-burst TTFT.
    burst_windows: tuple[tuple[float, float], ...] = ()
    session_header: str = SESSION_HEADER
    headers: Mapping[str, str] = field(default_factory=dict)
    progress: Callable[[str], None] | None = None
    progress_interval_s: float = 2.0
    # More front doors beside the replay's target: request i goes to the (i mod n)-th of
    # [target, *more_targets] (a client balancing over router replicas, or over engines).
    more_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError("speedup must be > 0")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError("timeout must be > 0")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError("max_requests must be >= 0")


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    index: int  # position in the arrival-ordered input
    kind: str  # the generator's label: chat, rag, agent, burst, trace
    klass: str  # short / medium / long
    outcome: OutcomeKind
    status: int | None
    scheduled_s: float  # planned send time, seconds after the replay started
    sent_s: float  # actual send time of the first attempt
    ttft_s: float | None  # streams: first SSE data line; otherwise the full response
    latency_s: float | None  # until the response was complete (or failed)
    prompt_tokens: int | None
    cached_tokens: int | None
    served_by: str | None
    retries: int
    delayed: bool  # held back by the concurrency cap
    in_burst: bool
    session_id: str | None
    input_tokens: int
    error: str | None = None
    # The retry-after header of the last attempt (a 429 without one gives a client no hint).
    retry_after: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _hit_ratio(outcomes: Sequence[RequestOutcome]) -> float | None:
    prompt = sum(o.prompt_tokens or 0 for o in outcomes if o.outcome == "2xx")
    cached = sum(o.cached_tokens or 0 for o in outcomes if o.outcome == "2xx")
    return cached / prompt if prompt else None


def _group_stats(outcomes: Sequence[RequestOutcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.outcome == "2xx"]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.latency_s for o in ok if o.latency_s is not None]
    counts = Counter(o.outcome for o in outcomes)
    return {
        "count": len(outcomes),
        "outcomes": {kind: counts.get(kind, 0) for kind in OUTCOME_KINDS},
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "hit_ratio": _hit_ratio(outcomes),
    }


@dataclass(frozen=True, slots=True)
class ReplayResult:
    target: str
    outcomes: tuple[RequestOutcome, ...]
    skipped: int  # requests not sent because of max_requests / duration_s
    wall_s: float
    settings: Mapping[str, Any] = field(default_factory=dict)

    def by_class(self, klass: str) -> list[RequestOutcome]:
        return [o for o in self.outcomes if o.klass == klass]

    def ttfts(self, klass: str | None = None, in_burst: bool | None = None) -> list[float]:
        """TTFTs of successful requests, optionally of one class / inside or outside bursts."""
        return [
            o.ttft_s
            for o in self.outcomes
            if o.outcome == "2xx"
            and o.ttft_s is not None
            and (klass is None or o.klass == klass)
            and (in_burst is None or o.in_burst == in_burst)
        ]

    @property
    def hit_ratio(self) -> float | None:
        """Token-weighted prefix-cache hit ratio over successful responses."""
        return _hit_ratio(self.outcomes)

    @property
    def clusters(self) -> dict[str, int]:
        """Successful requests per cluster, from ``x-served-by``."""
        counts = Counter(o.served_by for o in self.outcomes if o.outcome == "2xx" and o.served_by)
        return dict(sorted(counts.items()))

    def summary(self) -> dict[str, Any]:
        short_in = self.ttfts("short", in_burst=True)
        short_out = self.ttfts("short", in_burst=False)
        return {
            "target": self.target,
            "sent": len(self.outcomes),
            "skipped": self.skipped,
            "wall_s": self.wall_s,
            "delayed": sum(o.delayed for o in self.outcomes),
            "max_send_lag_s": max((o.sent_s - o.scheduled_s for o in self.outcomes), default=0.0),
            "retries": sum(o.retries for o in self.outcomes),
            "all": _group_stats(self.outcomes),
            "classes": {klass: _group_stats(self.by_class(klass)) for klass in CLASSES},
            "clusters": self.clusters,
            "burst": {
                "short_in_burst": len(short_in),
                "short_outside_burst": len(short_out),
                "short_ttft_p99_in_burst_s": percentile(short_in, 99),
                "short_ttft_p99_outside_burst_s": percentile(short_out, 99),
                "short_ttft_p50_in_burst_s": percentile(short_in, 50),
                "short_ttft_p50_outside_burst_s": percentile(short_out, 50),
            },
            "settings": dict(self.settings),
        }

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [asdict(o) for o in self.outcomes]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReplayResult:
        """Rebuild a result written by ``write_json`` (e.g. to plot saved runs together)."""
        summary = data["summary"]
        return cls(
            target=summary["target"],
            outcomes=tuple(RequestOutcome(**row) for row in data["requests"]),
            skipped=summary["skipped"],
            wall_s=summary["wall_s"],
            settings=summary.get("settings", {}),
        )


# -- one request --------------------------------------------------------------------------


@dataclass(slots=True)
class _Attempt:
    outcome: OutcomeKind
    status: int | None = None
    ttft_at: float | None = None
    done_at: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    served_by: str | None = None
    retry_after: str | None = None
    error: str | None = None


def _status_outcome(status: int) -> OutcomeKind:
    if 200 <= status < 300:
        return "2xx"
    if status == 429:
        return "429"
    if status == 413:
        return "413"
    if 400 <= status < 500:
        return "4xx"
    if 500 <= status < 600:
        return "5xx"
    return "transport"


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _usage_tokens(usage: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, cached tokens) from an OpenAI or Anthropic usage object."""
    if "input_tokens_details" in usage:  # OpenAI Responses API
        details = usage.get("input_tokens_details")
        cached = _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        return _int_or_none(usage.get("input_tokens")), cached or 0
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        return _int_or_none(usage.get("prompt_tokens")), cached or 0
    # Anthropic: input_tokens excludes cache reads and cache writes.
    parts = [
        _int_or_none(usage.get(name))
        for name in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    ]
    if parts[0] is None:
        return None, None
    return sum(p or 0 for p in parts), parts[1] or 0


def _parse_retry_after(value: str | None, cap: float) -> float:
    if value is None:
        return min(1.0, cap)
    try:
        seconds = float(value)
    except ValueError:
        return min(1.0, cap)  # an HTTP-date: not worth parsing for a load generator
    return min(max(seconds, 0.0), cap)


class _Runner:
    def __init__(
        self,
        requests: Sequence[ReplayRequest],
        target: str,
        options: ReplayOptions,
        clock: Callable[[], float],
    ) -> None:
        self.requests = requests
        self.target = target.rstrip("/")
        self.targets = [self.target, *(t.rstrip("/") for t in options.more_targets)]
        self.options = options
        self.clock = clock
        self.outcomes: list[RequestOutcome | None] = [None] * len(requests)
        self.sent = 0
        self.done = 0
        self.delayed = 0
        self.counts: Counter[str] = Counter()
        self.start = 0.0

    def headers_for(self, request: ReplayRequest) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            **self.options.headers,
            **dict(request.headers),
        }
        if request.api == "anthropic-messages":
            headers.setdefault("anthropic-version", ANTHROPIC_VERSION)
        if request.send_session_header and request.session_id:
            headers[self.options.session_header] = request.session_id
        return headers

    async def attempt(
        self,
        session: aiohttp.ClientSession,
        request: ReplayRequest,
        payload: bytes,
        target: str | None = None,
    ) -> _Attempt:
        url = (target or self.target) + request.path
        try:
            # A fresh BytesIO per attempt: aiohttp streams it (raw bytes over 1 MiB, common
            # for long-context prompts, trigger a ResourceWarning) and still sends a
            # Content-Length, and a retry must not find it already consumed.
            stream = io.BytesIO(payload)
            async with session.post(url, data=stream, headers=self.headers_for(request)) as resp:
                result = _Attempt(
                    outcome=_status_outcome(resp.status),
                    status=resp.status,
                    served_by=resp.headers.get(SERVED_BY),
                    retry_after=resp.headers.get("retry-after"),
                )
                if result.outcome != "2xx":
                    await resp.read()
                    result.done_at = self.clock()
                    result.ttft_at = result.done_at
                    return result
                if request.stream:
                    await self.read_stream(resp, result)
                else:
                    body = await resp.read()
                    result.done_at = self.clock()
                    result.ttft_at = result.done_at
                    parsed = orjson.loads(body)
                    usage = parsed.get("usage") if isinstance(parsed, dict) else None
                    if isinstance(usage, dict):
                        result.prompt_tokens, result.cached_tokens = _usage_tokens(usage)
                return result
        except TimeoutError:
            return _Attempt("timeout", error="timeout", done_at=self.clock())
        except orjson.JSONDecodeError:
            return _Attempt("transport", error="invalid JSON response body", done_at=self.clock())
        except (aiohttp.ClientError, OSError) as exc:
            return _Attempt("transport", error=type(exc).__name__, done_at=self.clock())

    async def read_stream(self, resp: aiohttp.ClientResponse, result: _Attempt) -> None:
        complete = False
        usage: dict[str, Any] = {}
        event_name = b""
        async for line in resp.content:
            if line.startswith(b"event:"):
                event_name = line[6:].strip()
                continue
            if not line.startswith(b"data:"):
                continue
            if result.ttft_at is None:
                result.ttft_at = self.clock()
            data = line[5:].strip()
            # OpenAI streams end with "data: [DONE]", Anthropic ones with a message_stop event,
            # Responses API ones with response.completed / response.incomplete (usage inside).
            if data == b"[DONE]" or event_name == b"message_stop":
                complete = True
                continue
            if event_name in (b"response.completed", b"response.incomplete"):
                complete = True
            # Only events that carry usage are worth decoding; the rest are token deltas.
            if b'"usage"' not in data:
                continue
            event = orjson.loads(data)
            if not isinstance(event, dict):
                continue
            found = event.get("usage")
            message = event.get("message") or event.get("response")
            if found is None and isinstance(message, dict):
                found = message.get("usage")  # Anthropic message_start, Responses events
            if isinstance(found, dict):
                usage.update(found)
        result.done_at = self.clock()
        if not complete:
            # A 200 whose stream stops without its terminator is a broken response.
            result.outcome = "transport"
            result.error = "stream ended before its terminator"
            return
        if usage:
            result.prompt_tokens, result.cached_tokens = _usage_tokens(usage)

    async def one(
        self,
        session: aiohttp.ClientSession,
        index: int,
        request: ReplayRequest,
        payload: bytes,
        scheduled: float,
        delayed: bool,
        semaphore: asyncio.Semaphore,
    ) -> None:
        options = self.options
        sent = self.clock()
        retries = 0
        try:
            while True:
                target = self.targets[index % len(self.targets)]
                result = await self.attempt(session, request, payload, target)
                if result.outcome != "429" or not options.retry_429:
                    break
                if retries >= options.max_retries:
                    break
                retries += 1
                await asyncio.sleep(
                    _parse_retry_after(result.retry_after, options.max_retry_after_s)
                )
        except Exception as exc:
            # A bug here must not lose the request: record it, and say loudly that it happened.
            log.exception("replay: request %d failed inside the replayer", index)
            result = _Attempt("transport", error=f"replayer error: {type(exc).__name__}")
            result.done_at = self.clock()
        finally:
            semaphore.release()
        self.record(index, request, result, scheduled, sent, delayed, retries)

    def record(
        self,
        index: int,
        request: ReplayRequest,
        result: _Attempt,
        scheduled: float,
        sent: float,
        delayed: bool,
        retries: int,
    ) -> None:
        windows = self.options.burst_windows
        outcome = RequestOutcome(
            index=index,
            kind=request.kind,
            klass=self.options.class_bounds.classify(request.input_tokens),
            outcome=result.outcome,
            status=result.status,
            scheduled_s=scheduled,
            sent_s=sent - self.start,
            ttft_s=None if result.ttft_at is None else result.ttft_at - sent,
            latency_s=None if result.done_at is None else result.done_at - sent,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            served_by=result.served_by,
            retries=retries,
            delayed=delayed,
            in_burst=any(start <= request.arrival_s < end for start, end in windows),
            session_id=request.session_id,
            input_tokens=request.input_tokens,
            error=result.error,
            retry_after=result.retry_after,
        )
        if self.outcomes[index] is not None:
            raise RuntimeError(f"request {index} recorded twice")
        self.outcomes[index] = outcome
        self.done += 1
        self.counts[result.outcome] += 1

    async def progress(self) -> None:
        report = self.options.progress
        if report is None:
            return
        while True:
            await asyncio.sleep(self.options.progress_interval_s)
            report(self.progress_line())

    def progress_line(self) -> str:
        errors = sum(n for kind, n in self.counts.items() if kind != "2xx")
        return (
            f"replay {self.clock() - self.start:7.1f}s  sent {self.sent}/{len(self.requests)}"
            f"  done {self.done}  inflight {self.sent - self.done}"
            f"  2xx {self.counts['2xx']}  errors {errors}  delayed {self.delayed}"
        )

    async def run(self) -> list[RequestOutcome]:
        options = self.options
        semaphore = asyncio.Semaphore(options.concurrency)
        origin = self.requests[0].arrival_s if self.requests else 0.0
        connector = aiohttp.TCPConnector(limit=options.concurrency)
        timeout = aiohttp.ClientTimeout(total=options.timeout_s)
        tasks: list[asyncio.Task[None]] = []
        self.start = self.clock()
        progress = asyncio.create_task(self.progress())
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                for index, request in enumerate(self.requests):
                    # Build the body before its send time: prompt synthesis then costs idle
                    # time instead of delaying the send.
                    payload = orjson.dumps(request.materialize())
                    scheduled = (request.arrival_s - origin) / options.speedup
                    delay = self.start + scheduled - self.clock()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    delayed = semaphore.locked()
                    if delayed:
                        self.delayed += 1
                    await semaphore.acquire()
                    self.sent += 1
                    tasks.append(
                        asyncio.create_task(
                            self.one(
                                session, index, request, payload, scheduled, delayed, semaphore
                            )
                        )
                    )
                await asyncio.gather(*tasks)
        finally:
            progress.cancel()
            await asyncio.gather(progress, return_exceptions=True)
        missing = [i for i, outcome in enumerate(self.outcomes) if outcome is None]
        if missing:
            raise RuntimeError(f"requests without an outcome: {missing[:10]}")
        return [outcome for outcome in self.outcomes if outcome is not None]


def select_requests(
    requests: Sequence[ReplayRequest], options: ReplayOptions
) -> tuple[list[ReplayRequest], int]:
    """Arrival-ordered requests within the caps, and how many were cut off."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    selected = ordered
    if ordered and options.duration_s is not None:
        origin = ordered[0].arrival_s
        limit = options.duration_s * options.speedup
        selected = [r for r in ordered if r.arrival_s - origin <= limit]
    if options.max_requests is not None:
        selected = selected[: options.max_requests]
    return selected, len(ordered) - len(selected)


async def run_replay(
    requests: Sequence[ReplayRequest],
    target: str,
    options: ReplayOptions | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> ReplayResult:
    """Replay ``requests`` open-loop against ``target`` (e.g. ``http://127.0.0.1:10000``)."""
    opts = options if options is not None else ReplayOptions()
    selected, skipped = select_requests(requests, opts)
    runner = _Runner(selected, target, opts, clock)
    started = clock()
    outcomes = await runner.run()
    return ReplayResult(
        target=target,
        outcomes=tuple(outcomes),
        skipped=skipped,
        wall_s=clock() - started,
        settings={
            "speedup": opts.speedup,
            "concurrency": opts.concurrency,
            "timeout_s": opts.timeout_s,
            "retry_429": opts.retry_429,
            "max_retries": opts.max_retries,
            "class_bounds": [opts.class_bounds.short_below, opts.class_bounds.long_from],
            "burst_windows": [list(w) for w in opts.burst_windows],
        },
    )


# -- reporting ----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(result: ReplayResult) -> str:
    summary = result.summary()
    head = (
        f"{'class':<7}{'sent':>7}{'2xx':>7}{'429':>6}{'413':>6}{'4xx':>6}{'5xx':>6}"
        f"{'transp':>7}{'tmout':>6}{'ttft50':>9}{'ttft95':>9}{'ttft99':>9}"
        f"{'e2e50':>9}{'e2e99':>9}{'hit':>7}"
    )
    lines = [f"replay against {result.target}: times in ms", head, "-" * len(head)]
    rows = [(klass, summary["classes"][klass]) for klass in CLASSES] + [("all", summary["all"])]
    for name, stats in rows:
        counts = stats["outcomes"]
        lines.append(
            f"{name:<7}{stats['count']:>7}{counts['2xx']:>7}{counts['429']:>6}{counts['413']:>6}"
            f"{counts['4xx']:>6}{counts['5xx']:>6}{counts['transport']:>7}{counts['timeout']:>6}"
            f"{_ms(stats['ttft_p50_s']):>9}{_ms(stats['ttft_p95_s']):>9}"
            f"{_ms(stats['ttft_p99_s']):>9}{_ms(stats['e2e_p50_s']):>9}"
            f"{_ms(stats['e2e_p99_s']):>9}{_ratio(stats['hit_ratio']):>7}"
        )
    clusters = ", ".join(f"{name}={n}" for name, n in summary["clusters"].items()) or "-"
    burst = summary["burst"]
    lines += [
        f"clusters (2xx): {clusters}",
        f"hit ratio (token-weighted): {_ratio(summary['all']['hit_ratio'])}",
        f"short TTFT p99 in burst: {_ms(burst['short_ttft_p99_in_burst_s'])} ms "
        f"(n={burst['short_in_burst']}), outside: {_ms(burst['short_ttft_p99_outside_burst_s'])}"
        f" ms (n={burst['short_outside_burst']})",
        f"sent {summary['sent']}, skipped {summary['skipped']}, delayed by the concurrency cap "
        f"{summary['delayed']}, retries {summary['retries']}, wall {summary['wall_s']:.1f}s",
    ]
    return "\n".join(lines)


def write_json(result: ReplayResult, path: str | Path) -> None:
    Path(path).write_bytes(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2))


def read_json(path: str | Path) -> ReplayResult:
    data = orjson.loads(Path(path).read_bytes())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a replay result")
    return ReplayResult.from_json(data)


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    n = len(ordered)
    ax.step([v * 1000 for v in ordered], [(i + 1) / n for i in range(n)], where="post", label=label)


def _new_figure(rows: int, cols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    # Figure + Agg canvas directly, not pyplot: no global figure registry, no backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(rows, cols, squeeze=False)


def plot_report(result: ReplayResult, path: str | Path) -> None:
    """TTFT CDF per class, hit ratio per class, requests per cluster."""
    figure, axes = _new_figure(1, 3, (15, 4.5))
    ax = axes[0][0]
    for klass in CLASSES:
        values = result.ttfts(klass)
        _cdf(ax, values, f"{klass} (n={len(values)})")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF by class")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")

    ax = axes[0][1]
    names = [*CLASSES, "all"]
    ratios = [_hit_ratio(result.by_class(k)) for k in CLASSES] + [result.hit_ratio]
    ax.bar(names, [r or 0.0 for r in ratios], color="tab:green")
    ax.set(ylim=(0, 1), ylabel="cached / prompt tokens", title="prefix-cache hit ratio")

    ax = axes[0][2]
    clusters = result.clusters
    ax.bar(list(clusters), list(clusters.values()), color="tab:blue")
    ax.set(ylabel="2xx requests", title="requests per cluster (x-served-by)")
    figure.savefig(str(path), dpi=110)


def plot_comparison(results: Mapping[str, ReplayResult], path: str | Path) -> None:
    """Several runs side by side: short TTFT CDF, p99 TTFT per class, hit ratio, burst effect."""
    figure, axes = _new_figure(2, 2, (13, 9))
    labels = list(results)
    width = 0.8 / max(1, len(labels))

    ax = axes[0][0]
    for label, result in results.items():
        _cdf(ax, result.ttfts("short"), label)
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="short-class TTFT CDF")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")

    ax = axes[0][1]
    for i, (label, result) in enumerate(results.items()):
        p99 = [percentile(result.ttfts(klass), 99) for klass in CLASSES]
        xs = [c + i * width for c in range(len(CLASSES))]
        ax.bar(xs, [(v or 0.0) * 1000 for v in p99], width, label=label)
    ax.set_xticks([c + width * (len(labels) - 1) / 2 for c in range(len(CLASSES))], CLASSES)
    ax.set(ylabel="TTFT p99 (ms)", title="TTFT p99 by class")
    ax.legend()

    ax = axes[1][0]
    ax.bar(labels, [r.hit_ratio or 0.0 for r in results.values()], color="tab:green")
    ax.set(ylim=(0, 1), ylabel="cached / prompt tokens", title="prefix-cache hit ratio")

    ax = axes[1][1]
    groups = ("outside burst", "in burst")
    for i, (label, result) in enumerate(results.items()):
        values = [
            percentile(result.ttfts("short", in_burst=False), 99),
            percentile(result.ttfts("short", in_burst=True), 99),
        ]
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [(v or 0.0) * 1000 for v in values], width, label=label)
    ax.set_xticks([g + width * (len(labels) - 1) / 2 for g in range(len(groups))], groups)
    ax.set(ylabel="short TTFT p99 (ms)", title="short requests during long-context bursts")
    ax.legend()
    figure.savefig(str(path), dpi=110)

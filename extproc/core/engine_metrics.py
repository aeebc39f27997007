"""Load read from the inference engines' own Prometheus ``/metrics`` pages. Pure: text in,
numbers out; the scraper (extproc.pipeline.engine_scraper) does the fetching and the timing.

The names are the engines' current ones, as their exporters print them (Prometheus text format
0.0.4, what ``prometheus_client`` serves to a scraper that does not ask for OpenMetrics):

- vLLM (v1 engine, ``vllm/v1/metrics/loggers.py``; series labelled ``model_name``, ``engine``):
  ``vllm:kv_cache_usage_perc`` (0..1), ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, and the token counters ``vllm:prefix_cache_queries`` /
  ``vllm:prefix_cache_hits``, printed with the ``_total`` suffix of a counter. The older
  ``vllm:gpu_cache_usage_perc`` was removed in 0.12 and is not read.
- llama.cpp's server (``llama-server --metrics``; ``tools/server/server-context.cpp``; no
  labels, one model per server), read from the running server (``docs/real-engines.md``):
  ``llamacpp:requests_deferred`` (requests waiting for a slot), ``llamacpp:requests_processing``
  (requests in a slot), ``llamacpp:n_busy_slots_per_decode`` (the average of busy slots per
  decode call), and the token counters ``llamacpp:prompt_tokens_total`` (prompt tokens
  *evaluated*, the cached ones excluded) and ``llamacpp:prompt_tokens_cached_total`` (reused
  from a slot's KV or the host-RAM prompt cache). It exports no KV-use gauge.
- SGLang (``--enable-metrics``; ``python/sglang/srt/metrics/collector.py``; labelled
  ``model_name`` and, in newer releases, the parallel ranks): ``sglang:token_usage`` (0..1, the
  KV pool in use), ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``,
  ``sglang:cache_hit_rate`` (a gauge, 0..1).

An engine serving several models or data-parallel ranks prints one series per label set: counts
are summed, utilisations averaged (each rank has its own KV pool). A series whose value is not a
finite, non-negative number is skipped; a page with none of the load names yields None (e.g.
SGLang started without ``--enable-metrics``, or a vLLM too old for the current names).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from extproc.core.load import LoadReport

EngineType = Literal["vllm", "sglang", "llamacpp"]
ENGINE_TYPES: tuple[str, ...] = get_args(EngineType)


@dataclass(frozen=True, slots=True)
class MetricNames:
    kv: str | None
    waiting: str
    running: str
    prefix_queries: str | None = None  # cumulative token counters (vLLM)
    prefix_hits: str | None = None
    # Cumulative prompt tokens evaluated, i.e. looked up and missed (llama.cpp): the lookups
    # are these plus prefix_hits.
    prefix_evaluated: str | None = None
    hit_rate: str | None = None  # a ready-made ratio gauge (SGLang)
    busy_slots: str | None = None  # average busy slots per decode step (llama.cpp)


NAMES: dict[str, MetricNames] = {
    "vllm": MetricNames(
        kv="vllm:kv_cache_usage_perc",
        waiting="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        prefix_queries="vllm:prefix_cache_queries_total",
        prefix_hits="vllm:prefix_cache_hits_total",
    ),
    "sglang": MetricNames(
        kv="sglang:token_usage",
        waiting="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        hit_rate="sglang:cache_hit_rate",
    ),
    "llamacpp": MetricNames(
        kv=None,
        waiting="llamacpp:requests_deferred",
        running="llamacpp:requests_processing",
        prefix_hits="llamacpp:prompt_tokens_cached_total",
        prefix_evaluated="llamacpp:prompt_tokens_total",
        busy_slots="llamacpp:n_busy_slots_per_decode",
    ),
}
# Every engine's metric names share its prefix: a page shows which engine printed it.
_PREFIXES = {"vllm": "vllm:", "sglang": "sglang:", "llamacpp": "llamacpp:"}


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape of one endpoint; a field is None when the page did not carry it."""

    kv: float | None
    waiting: int | None
    running: int | None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    hit_rate: float | None = None
    busy_slots: float | None = None


def detect_engine(text: str) -> str | None:
    """The engine whose load names are on a /metrics page (None: none of them are), for a
    cluster declared ``engine: auto``."""
    for engine, names in NAMES.items():
        prefix = _PREFIXES[engine]
        if prefix in text and series_values(text, names.waiting):
            return engine
    return None


def _value(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _end_of_labels(text: str, start: int) -> int:
    """Index just past the ``}`` closing the label set that opens at ``start``; label values
    may hold escaped quotes, commas, spaces and braces. -1 when the set never closes."""
    i = start + 1
    in_value = False
    n = len(text)
    while i < n:
        c = text[i]
        if in_value:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                in_value = False
        elif c == '"':
            in_value = True
        elif c == "}":
            return i + 1
        elif c == "\n":
            return -1
        i += 1
    return -1


def _line_start(text: str, name: str, frm: int) -> int:
    pos = text.find("\n" + name, frm)
    return -1 if pos == -1 else pos + 1


def series_values(text: str, name: str) -> list[float]:
    """The values of every series of metric ``name`` on a Prometheus text page.

    Scans for the name at line starts only (a C-speed ``find``), so a page of large histograms
    costs little; ``name{`` and ``name `` match, ``name_suffix`` does not.
    """
    values: list[float] = []
    start = 0 if text.startswith(name) else _line_start(text, name, 0)
    while start != -1:
        after = start + len(name)
        nxt = text[after : after + 1]
        if nxt == "{":
            after = _end_of_labels(text, after)
        elif nxt not in (" ", "\t"):
            after = -1  # a longer name sharing this prefix
        if after != -1:
            eol = text.find("\n", after)
            fields = text[after : eol if eol != -1 else len(text)].split()
            # The value, then an optional timestamp.
            value = _value(fields[0]) if fields else None
            if value is not None:
                values.append(value)
        start = _line_start(text, name, start + len(name))
    return values


def _sum(values: Sequence[float]) -> float | None:
    return sum(values) if values else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def parse_engine_metrics(engine: str, text: str) -> EngineSample | None:
    """One endpoint's load from its /metrics page, read with ``engine``'s names."""
    names = NAMES[engine]
    kv = _mean(series_values(text, names.kv)) if names.kv else None
    waiting = _int(_sum(series_values(text, names.waiting)))
    running = _int(_sum(series_values(text, names.running)))
    if kv is None and waiting is None and running is None:
        return None
    queries = _sum(series_values(text, names.prefix_queries)) if names.prefix_queries else None
    hits = _sum(series_values(text, names.prefix_hits)) if names.prefix_hits else None
    if names.prefix_evaluated:
        evaluated = _sum(series_values(text, names.prefix_evaluated))
        queries = None if evaluated is None or hits is None else evaluated + hits
    rate = _mean(series_values(text, names.hit_rate)) if names.hit_rate else None
    busy = _mean(series_values(text, names.busy_slots)) if names.busy_slots else None
    return EngineSample(
        kv=None if kv is None else min(1.0, kv),
        waiting=waiting,
        running=running,
        prefix_queries=queries,
        prefix_hits=hits,
        hit_rate=None if rate is None else min(1.0, rate),
        busy_slots=busy,
    )


def cluster_report(samples: Sequence[EngineSample]) -> LoadReport | None:
    """A cluster's load from its endpoints' fresh samples: queue and in-flight counts summed,
    KV utilisation averaged over the endpoints that reported it (a stale or unreachable
    endpoint is left out by the caller; it takes no new traffic either)."""
    if not samples:
        return None
    kv = _mean([s.kv for s in samples if s.kv is not None])
    waiting = [s.waiting for s in samples if s.waiting is not None]
    inflight = [
        (s.waiting or 0) + (s.running or 0)
        for s in samples
        if s.waiting is not None or s.running is not None
    ]
    return LoadReport(
        kv=kv,
        queue=sum(waiting) if waiting else None,
        inflight=sum(inflight) if inflight else None,
        cpu=None,
        source="scrape",
    )


def prefix_hit_ratio(previous: EngineSample | None, current: EngineSample) -> float | None:
    """Prefix-cache hit ratio since the previous scrape: vLLM's and llama.cpp's counters'
    deltas (None when
    nothing was looked up, or the counters went back, i.e. the engine restarted); SGLang's own
    gauge otherwise."""
    if current.hit_rate is not None:
        return current.hit_rate
    if (
        previous is None
        or current.prefix_queries is None
        or current.prefix_hits is None
        or previous.prefix_queries is None
        or previous.prefix_hits is None
    ):
        return None
    queries = current.prefix_queries - previous.prefix_queries
    hits = current.prefix_hits - previous.prefix_hits
    if queries <= 0 or hits < 0:
        return None
    return min(1.0, hits / queries)

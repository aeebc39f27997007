"""Cluster load signals: the load reports clusters return, and the fleet snapshot placement reads.

Two report formats arrive in inference response headers (the simulated cluster sends both):

- ORCA ``endpoint-load-metrics``, the format Envoy itself understands for load reports. Its
  native-HTTP ``TEXT`` form is comma-separated ``key=value`` pairs, e.g.
  ``TEXT cpu_utilization=0.31, mem_utilization=0.87, named_metrics.kv_cache=0.87,
  named_metrics.queue=12, named_metrics.inflight=3``; the ``JSON`` form is the same
  OrcaLoadReport as a JSON object (``{"cpu_utilization": 0.31, "named_metrics": {...}}``).
  As in Envoy's parser, a malformed pair, a repeated key or a negative or non-finite value
  invalidates the whole report: half a report is worse than none, because a missing KV figure
  would read as "no pressure".
- ``x-fleet-load: kv=0.87,queue=12,inflight=3``, the simple fallback for servers that cannot
  speak ORCA (any subset of the three keys).

KV pressure is ``named_metrics.kv_cache`` (or vLLM's ``named_metrics.kv_cache_usage_perc``)
when present (what an inference engine means by memory pressure: its KV blocks), else
``mem_utilization``; the queue is ``named_metrics.queue`` or vLLM's
``named_metrics.num_requests_waiting``. When both headers are present ORCA wins. The processor
asks for ORCA reports with the ``endpoint-load-metrics-format: TEXT`` request header (vLLM
sends none otherwise, and none on streamed responses: scraping covers those).

No clock reads: a :class:`FleetSnapshot` carries the instant of each cluster's last report and
the policy compares it with the ``now`` it is given, so signals age out without a timer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import orjson

ORCA_HEADER = "endpoint-load-metrics"
FLEET_LOAD_HEADER = "x-fleet-load"
LOAD_HEADERS = (ORCA_HEADER, FLEET_LOAD_HEADER)

# "scrape": read from the engines' /metrics pages (extproc.core.engine_metrics).
ReportSource = Literal["orca", "fleet", "scrape"]
# The request header that asks vLLM (and other ORCA-aware servers) for an endpoint-load-metrics
# response header, and the format asked for. vLLM answers only non-streaming responses.
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_FORMAT = "TEXT"

# ORCA's named metrics the processor reads (the simulated cluster's names; vLLM-style servers
# behind an ORCA-emitting sidecar can be configured to use the same).
_KV_NAMED = "kv_cache"
_QUEUE_NAMED = "queue"
_INFLIGHT_NAMED = "inflight"
# vLLM's ORCA report (vllm/entrypoints/serve/utils/orca_metrics.py) names its two metrics after
# its Prometheus gauges: ``TEXT named_metrics.kv_cache_usage_perc=0.4,
# named_metrics.num_requests_waiting=3.0``. It carries no running count.
_VLLM_KV_NAMED = "kv_cache_usage_perc"
_VLLM_WAITING_NAMED = "num_requests_waiting"
_VLLM_RUNNING_NAMED = "num_requests_running"
# x-fleet-load's short keys, as the ORCA named metrics they stand for.
_FLEET_KEYS = (("kv", _KV_NAMED), ("queue", _QUEUE_NAMED), ("inflight", _INFLIGHT_NAMED))


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One cluster's own account of its load; a field is None when the report did not say."""

    kv: float | None  # KV-cache (or memory) utilisation, 0..1
    queue: int | None  # requests waiting for prefill
    inflight: int | None  # requests queued or running
    cpu: float | None
    source: ReportSource


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return value


def _unit(value: float | None) -> float | None:
    # Utilisations above 1 happen (ORCA allows them for cpu); pressure saturates at "full".
    return None if value is None else min(1.0, value)


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def _from_metrics(
    standard: Mapping[str, float], named: Mapping[str, float], source: ReportSource
) -> LoadReport | None:
    kv = named.get(_KV_NAMED, named.get(_VLLM_KV_NAMED, standard.get("mem_utilization")))
    queue = named.get(_QUEUE_NAMED, named.get(_VLLM_WAITING_NAMED))
    inflight = named.get(_INFLIGHT_NAMED)
    running = named.get(_VLLM_RUNNING_NAMED)
    if inflight is None and running is not None:
        inflight = running + (queue or 0.0)
    report = LoadReport(
        kv=_unit(kv),
        queue=_count(queue),
        inflight=_count(inflight),
        cpu=standard.get("cpu_utilization"),
        source=source,
    )
    if report.kv is None and report.queue is None and report.inflight is None:
        return None  # nothing placement could use
    return report


def _orca_text(body: str) -> LoadReport | None:
    standard: dict[str, float] = {}
    named: dict[str, float] = {}
    seen: set[str] = set()
    for pair in body.split(","):
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            return None
        value = _number(raw.strip())
        if value is None or key in seen:
            return None
        seen.add(key)
        if key.startswith("named_metrics."):
            named[key.removeprefix("named_metrics.")] = value
        else:
            # Unknown standard keys (rps_fractional, eps, utilization.*, request_cost.*) are
            # valid ORCA; placement has no use for them.
            standard[key] = value
    return _from_metrics(standard, named, "orca")


def _orca_json(body: str) -> LoadReport | None:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    standard: dict[str, float] = {}
    named: dict[str, float] = {}
    for key, raw in doc.items():
        if key == "named_metrics":
            if not isinstance(raw, dict):
                return None
            for name, inner in raw.items():
                value = _json_number(inner)
                if value is None:
                    return None
                named[str(name)] = value
            continue
        if isinstance(raw, dict):
            continue  # request_cost / utilization maps: valid, unused
        value = _json_number(raw)
        if value is None:
            return None
        standard[str(key)] = value
    return _from_metrics(standard, named, "orca")


def _json_number(raw: object) -> float | None:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return None
    value = float(raw)
    return value if math.isfinite(value) and value >= 0 else None


def parse_orca(value: str) -> LoadReport | None:
    """An ``endpoint-load-metrics`` header value (``TEXT ...`` or ``JSON {...}``)."""
    fmt, _, body = value.strip().partition(" ")
    if fmt == "TEXT":
        return _orca_text(body)
    if fmt == "JSON":
        return _orca_json(body)
    return None  # BIN travels in endpoint-load-metrics-bin; anything else is not ORCA


def parse_fleet_load(value: str) -> LoadReport | None:
    """An ``x-fleet-load`` header value: ``kv=0.87,queue=12,inflight=3`` (any subset)."""
    fields: dict[str, float] = {}
    for pair in value.split(","):
        key, sep, raw = pair.partition("=")
        key = key.strip()
        number = _number(raw.strip())
        if not sep or number is None or key in fields:
            return None
        fields[key] = number
    named = {name: fields[short] for short, name in _FLEET_KEYS if short in fields}
    return _from_metrics({}, named, "fleet")


def parse_load_headers(headers: Mapping[str, str]) -> LoadReport | None:
    """The load report in a response's headers (lower-cased names): ORCA first, then ours."""
    orca = headers.get(ORCA_HEADER)
    if orca:
        report = parse_orca(orca)
        if report is not None:
            return report
    fleet = headers.get(FLEET_LOAD_HEADER)
    return parse_fleet_load(fleet) if fleet else None


@dataclass(frozen=True, slots=True)
class ClusterLoad:
    """What the shell knows about one cluster at one instant."""

    # Requests this processor has routed there and not seen finish: always current.
    inflight: int = 0
    # From the cluster's last load report (None when it never reported).
    kv: float | None = None
    queue: int | None = None
    reported_inflight: int | None = None
    reported_at: float | None = None
    # False while the shell has evidence the cluster is failing (e.g. Envoy failed over).
    healthy: bool = True
    # Requests this processor placed there recently: a count decayed with a half-life
    # (affinity.balance_half_life_s); 0 unless bounded-load placement is on.
    recent: float = 0.0
    # Why its GPUs should take no new sessions (extproc.core.gpu_health), while fresh; None
    # when they are fine or not watched.
    gpu: str | None = None

    def fresh(self, now: float, max_age_s: float) -> bool:
        return self.reported_at is not None and now - self.reported_at <= max_age_s

    def load(self, now: float, max_age_s: float) -> int:
        """Requests in flight: the cluster's own count when fresh (it sees every replica's
        traffic), never less than what this processor alone has sent there."""
        reported = self.reported_inflight if self.fresh(now, max_age_s) else None
        return self.inflight if reported is None else max(self.inflight, reported)

    def kv_pressure(self, now: float, max_age_s: float) -> float | None:
        """KV utilisation, or None when unknown or too old to trust."""
        return self.kv if self.fresh(now, max_age_s) else None


IDLE = ClusterLoad()


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    clusters: Mapping[str, ClusterLoad]

    @classmethod
    def of(cls, clusters: Mapping[str, ClusterLoad]) -> FleetSnapshot:
        return cls(MappingProxyType(dict(clusters)))

    def get(self, name: str) -> ClusterLoad:
        return self.clusters.get(name, IDLE)


EMPTY_SNAPSHOT = FleetSnapshot(MappingProxyType({}))

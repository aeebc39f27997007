"""What the reliability runs read from a running processor: /proc and its /metrics.

RSS and open file descriptors come from /proc (Linux), the rest from the processor's own
Prometheus endpoint: asyncio task count, event-loop lag, budget held and the decision latency
histogram (p99 computed from bucket deltas between two scrapes, so each sample is the p99 of
its own interval, not of the whole run).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.harness.launch import http_get

Samples = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far (/proc/<pid>/stat, Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        # Fields after the command name, which is in parentheses and may hold spaces.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(port: int, timeout: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    _status, body = http_get(port, "/metrics", timeout)
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _labels), v in samples.items() if n == name)


def value(samples: Samples, name: str) -> float | None:
    found = [v for (n, _labels), v in samples.items() if n == name]
    return found[0] if found else None


def buckets(samples: Samples, name: str) -> dict[float, float]:
    """Cumulative histogram buckets: upper bound -> count."""
    out: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n == f"{name}_bucket":
            le = dict(labels).get("le", "")
            out[math.inf if le == "+Inf" else float(le)] = out.get(float(le), 0.0) + v
    return out


def interval_quantile(
    before: Mapping[float, float], after: Mapping[float, float], q: float
) -> float | None:
    """The q-quantile of the observations between two scrapes, as the bucket upper bound that
    holds it (the histogram's resolution); None when nothing was observed."""
    bounds = sorted(after)
    deltas = [after[b] - before.get(b, 0.0) for b in bounds]
    if not deltas or deltas[-1] <= 0:
        return None
    wanted = q * deltas[-1]
    for bound, count in zip(bounds, deltas, strict=True):
        if count >= wanted:
            return bound
    return bounds[-1]


@dataclass(frozen=True, slots=True)
class ProcessorProbe:
    pid: int
    metrics_port: int

    def held_requests(self) -> float:
        return total(scrape(self.metrics_port), "fleet_budget_inflight_requests")

"""GPU health read from NVIDIA's DCGM exporter (``dcgm-exporter``), per engine. Pure: text in,
verdicts out; extproc.pipeline.gpu_scraper fetches the pages and times them.

The exporter prints one series per GPU, labelled ``gpu`` (the index), ``UUID``, ``device``,
``modelName``, ``Hostname`` (and ``container`` / ``namespace`` / ``pod`` on Kubernetes), in the
Prometheus text format. The fields read, as its counters file names them:

- ``DCGM_FI_DEV_GPU_TEMP``: GPU temperature (°C);
- ``DCGM_FI_DEV_FB_USED`` / ``DCGM_FI_DEV_FB_FREE``: framebuffer memory used and free (MiB);
  their ratio is the memory fraction in use;
- ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` (DCGM 3.3's name for ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS``,
  read too): the bitmask of why the clocks are held down. The exporter's default counters file
  does not list it: add ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS, gauge, ...`` to the exporter's
  counters to have it. Only the thermal and hardware-slowdown bits count (the GPU is being
  slowed, not idle or power-capped by policy).

An engine over a threshold (memory fraction, temperature, a slowdown bit) is *hot*: its cluster
takes no new session (extproc.core.affinity, with affinity on or off), and the sessions it
holds stay (their caches are there) unless it stays hot, when its least active ones move first
(extproc.core.relief), or it fails, or its KV use is critical.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

TEMP = "DCGM_FI_DEV_GPU_TEMP"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
CLOCK_EVENTS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
CLOCK_THROTTLE = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"  # the name before DCGM 3.3
FIELDS = (TEMP, FB_USED, FB_FREE, CLOCK_EVENTS, CLOCK_THROTTLE)

# NVML's clocks-event reasons (nvmlClocksEventReason*): the bits that mean a slowdown.
HW_SLOWDOWN = 0x8
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
SLOWDOWN_BITS = HW_SLOWDOWN | SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN

GpuReason = Literal["gpu_memory", "gpu_temperature", "gpu_slowdown"]
GPU_REASONS: tuple[GpuReason, ...] = ("gpu_memory", "gpu_temperature", "gpu_slowdown")


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU on one exporter page; a field is None when the page did not carry it."""

    gpu: str
    temp_c: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    clock_events: int | None = None

    @property
    def memory_fraction(self) -> float | None:
        if self.fb_used_mib is None or self.fb_free_mib is None:
            return None
        total = self.fb_used_mib + self.fb_free_mib
        return self.fb_used_mib / total if total > 0 else None


@dataclass(frozen=True, slots=True)
class GpuThresholds:
    """Compiled from fleet.yaml's ``gpu_health``."""

    memory_fraction: float = 0.95
    temperature_c: float = 85.0
    slowdown: bool = True


def _labels(text: str) -> dict[str, str] | None:
    """The label set of a sample line (``text`` starts after the ``{``); None when malformed."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " ,":
            i += 1
        if i < n and text[i] == "}":
            return out
        eq = text.find("=", i)
        if eq == -1 or eq + 1 >= n or text[eq + 1] != '"':
            return None
        name = text[i:eq].strip()
        j, value = eq + 2, []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                j += 1
                value.append({"n": "\n"}.get(text[j], text[j]))
            else:
                value.append(text[j])
            j += 1
        if j >= n:
            return None
        out[name] = "".join(value)
        i = j + 1
    return None


def _sample(line: str) -> tuple[str, dict[str, str], float] | None:
    brace = line.find("{")
    if brace == -1:
        name, _, rest = line.partition(" ")
        labels: dict[str, str] | None = {}
    else:
        name = line[:brace]
        labels = _labels(line[brace + 1 :])
        end = line.rfind("}")
        rest = line[end + 1 :] if end != -1 else ""
    fields = rest.split()
    if labels is None or not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return name, labels, value


def parse_dcgm(text: str) -> dict[str, GpuSample]:
    """Every GPU on a DCGM exporter page, by its ``gpu`` label (the index)."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("DCGM_FI_DEV_"):
            continue
        parsed = _sample(line)
        if parsed is None:
            continue
        name, labels, value = parsed
        if name not in FIELDS:
            continue
        gpu = labels.get("gpu", "")
        found.setdefault(gpu, {})[name] = value
    out: dict[str, GpuSample] = {}
    for gpu, fields in found.items():
        events = fields.get(CLOCK_EVENTS, fields.get(CLOCK_THROTTLE))
        out[gpu] = GpuSample(
            gpu=gpu,
            temp_c=fields.get(TEMP),
            fb_used_mib=fields.get(FB_USED),
            fb_free_mib=fields.get(FB_FREE),
            clock_events=None if events is None else int(events),
        )
    return out


def gpu_reason(sample: GpuSample, limits: GpuThresholds) -> GpuReason | None:
    """Why this GPU should take no new sessions (memory first: an out-of-memory fails
    requests, heat slows them), or None."""
    fraction = sample.memory_fraction
    if fraction is not None and fraction >= limits.memory_fraction:
        return "gpu_memory"
    if sample.temp_c is not None and sample.temp_c >= limits.temperature_c:
        return "gpu_temperature"
    if limits.slowdown and sample.clock_events is not None and sample.clock_events & SLOWDOWN_BITS:
        return "gpu_slowdown"
    return None


def engine_reason(
    samples: Mapping[str, GpuSample], devices: Collection[str], limits: GpuThresholds
) -> GpuReason | None:
    """An engine's verdict over the GPUs it runs on (``devices``: their ``gpu`` labels; empty:
    every GPU on the page). One hot GPU is enough: a tensor-parallel engine runs at the pace of
    its slowest GPU and fails with its fullest."""
    chosen = [s for g, s in samples.items() if not devices or g in devices]
    for reason in GPU_REASONS:
        if any(gpu_reason(s, limits) == reason for s in chosen):
            return reason
    return None


def cluster_reason(reasons: Sequence[GpuReason | None]) -> GpuReason | None:
    """A cluster's verdict from its watched engines' fresh ones: hot when any engine is (the
    processor places sessions on clusters; a new session could land on that engine)."""
    for reason in GPU_REASONS:
        if reason in reasons:
            return reason
    return None

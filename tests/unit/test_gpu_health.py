"""GPU health from a DCGM exporter page (extproc.core.gpu_health) and what placement makes of
it (extproc.core.affinity): a hot engine's cluster takes no new session, keeps the ones it
holds, and is no failover target while another is fine."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.config import ConfigError, parse_config
from extproc.core.affinity import AffinityParams, SessionView, place
from extproc.core.gpu_health import (
    GpuSample,
    GpuThresholds,
    cluster_reason,
    engine_reason,
    gpu_reason,
    parse_dcgm,
)
from extproc.core.keys import KeySource
from extproc.core.load import ClusterLoad, FleetSnapshot
from extproc.core.placement import Placement
from extproc.pipeline.fleet_state import LoadTable

PAGE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "dcgm" / "two-gpus-one-hot.txt"
).read_text()
LIMITS = GpuThresholds(memory_fraction=0.95, temperature_c=85.0, slowdown=True)


def test_the_exporter_page_is_read_per_gpu() -> None:
    gpus = parse_dcgm(PAGE)
    assert set(gpus) == {"0", "1"}
    cool, hot = gpus["0"], gpus["1"]
    assert (cool.temp_c, cool.fb_used_mib, cool.fb_free_mib, cool.clock_events) == (
        52.0,
        71187.0,
        9830.0,
        0,
    )
    assert hot.temp_c == 88.0 and hot.clock_events == 0x60
    assert hot.memory_fraction == pytest.approx(79174 / (79174 + 1843))


def test_the_older_throttle_reasons_field_is_read_too() -> None:
    page = 'DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="3",UUID="GPU-x"} 64\n'
    assert parse_dcgm(page)["3"].clock_events == 64


def test_malformed_and_negative_lines_are_skipped() -> None:
    page = (
        'DCGM_FI_DEV_GPU_TEMP{gpu="0" 70\n'  # the label set never closes
        'DCGM_FI_DEV_GPU_TEMP{gpu="1"} -5\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="2"} nan\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="3",modelName="a \\"quoted\\" name"} 61\n'
    )
    assert {g: s.temp_c for g, s in parse_dcgm(page).items()} == {"3": 61.0}


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        (GpuSample("0", temp_c=70, fb_used_mib=50, fb_free_mib=50, clock_events=0), None),
        (GpuSample("0", temp_c=70, fb_used_mib=96, fb_free_mib=4), "gpu_memory"),
        (GpuSample("0", temp_c=85), "gpu_temperature"),
        (GpuSample("0", temp_c=60, clock_events=0x40), "gpu_slowdown"),  # hw thermal
        (GpuSample("0", temp_c=60, clock_events=0x1), None),  # idle: not a slowdown
        (GpuSample("0", temp_c=60, clock_events=0x4), None),  # power cap by policy
        (GpuSample("0", temp_c=99, fb_used_mib=99, fb_free_mib=1), "gpu_memory"),  # memory first
    ],
)
def test_thresholds(sample: GpuSample, reason: str | None) -> None:
    assert gpu_reason(sample, LIMITS) == reason


def test_slowdown_bits_can_be_ignored() -> None:
    limits = GpuThresholds(slowdown=False)
    assert gpu_reason(GpuSample("0", temp_c=60, clock_events=0x40), limits) is None


def test_an_engine_is_judged_by_its_own_gpus() -> None:
    gpus = parse_dcgm(PAGE)
    assert engine_reason(gpus, ["0"], LIMITS) is None
    assert engine_reason(gpus, ["1"], LIMITS) == "gpu_memory"
    assert engine_reason(gpus, [], LIMITS) == "gpu_memory"  # every GPU on the page
    assert engine_reason(gpus, ["7"], LIMITS) is None  # not on the page: nothing known
    assert cluster_reason([None, "gpu_temperature"]) == "gpu_temperature"
    assert cluster_reason([None, None]) is None


PARAMS = AffinityParams(enabled=True)
RANKED = ("c1", "c2", "c3")


def test_a_hot_cluster_takes_no_new_session_and_keeps_the_ones_it_holds() -> None:
    snapshot = FleetSnapshot.of({"c1": ClusterLoad(gpu="gpu_temperature")})
    new = place(KeySource.HEADER, RANKED, snapshot, SessionView(seen=False), 100.0, PARAMS)
    assert new.kind == "spilled" and new.placement == Placement("c2", "c3")
    held = place(KeySource.HEADER, RANKED, snapshot, SessionView(seen=True), 100.0, PARAMS)
    assert held.kind == "primary" and held.placement == Placement("c1", "c2")
    # And as a secondary: the session on c2 fails over to c3, not to the hot c1.
    other = place(
        KeySource.HEADER, ("c2", "c1", "c3"), snapshot, SessionView(seen=False), 100.0, PARAMS
    )
    assert other.placement == Placement("c2", "c3")


def test_the_load_table_trusts_a_verdict_until_it_expires() -> None:
    table = LoadTable()
    table.record_gpu("c1", "gpu_memory", at=50.0, until=110.0)
    assert table.cluster("c1", 100.0).gpu == "gpu_memory"
    assert table.cluster("c1", 110.0).gpu is None  # stale: dropped, not trusted
    table.record_gpu("c1", "gpu_memory", at=70.0, until=130.0)
    table.record_gpu("c1", None, at=70.0, until=130.0)  # cooled down
    assert table.cluster("c1", 120.0).gpu is None


def _config(gpus: list[dict[str, object]]) -> dict[str, object]:
    return {
        "version": 1,
        "gpu_health": {"enabled": True, "temperature_c": 80},
        "clusters": [{"name": "c1", "endpoints": ["10.0.0.1:8000"], "gpus": gpus}],
    }


def test_fleet_yaml_names_each_engine_s_exporter() -> None:
    cfg = parse_config(
        _config([{"endpoint": "10.0.0.1:8000", "exporter": "10.0.0.1:9400", "devices": ["1"]}])
    )
    assert cfg.gpu_health.temperature_c == 80
    assert cfg.clusters[0].gpus[0].devices == ["1"]
    with pytest.raises(ConfigError, match=r"clusters\[0\]\.gpus\[0\]\.endpoint"):
        parse_config(_config([{"endpoint": "10.0.0.9:8000", "exporter": "10.0.0.1:9400"}]))

"""Client aborts during upload, prefill and mid-stream through a real Envoy, two processor
replicas and a shared redis-server (issue 13): nothing leaked, nothing over-admitted at the
upstreams, no completed request lost. A bounded run of `extproc abort-storm` (the full run is
1,200 requests; RELIABILITY.md)."""

from __future__ import annotations

from pathlib import Path

from extproc.reliability.abort_storm import LIMITS, StormOptions, run_storm


def test_abort_storm_leaks_nothing_and_admits_nothing_past_budget(tmp_path: Path) -> None:
    result = run_storm(StormOptions(requests=400, out=str(tmp_path)))
    assert sum(result.kinds.values()) == 400
    # What the storm is for, checked first so that a thin stage below cannot hide it.
    assert result.lost == 0, result.outcomes
    assert result.leaked_gauges == 0
    assert result.leaked_redis == {"count": 0.0, "tokens": 0.0, "leases": 0.0}
    assert result.upstream_inflight_after == 0
    # Everything settled (upstreams idle, gauges and Redis at 0) within the storm's generous
    # cap. A lease no one released is not reaped after the storm (only a reserve on its
    # compartment reaps, and none comes): it would keep Redis from settling. How long settling
    # took is a figure (settled_after_s), not a verdict.
    assert result.settled_after_s is not None, result.leaked_redis
    for klass, over in result.max_over_admission.items():
        assert over <= result.bound(klass), (klass, over, result.redis_errors)
    # Every stage was hit: aborts before the decision, during prefill and mid-stream. A
    # prefill- or stream-kind request the budget refuses at once gets its 429 before it can
    # be abandoned, so how many reach each stage varies from run to run (29-76 of 100 prefill
    # aborts seen; 4 of 100 stream aborts in one clean-clone CI run, where 181 of 400 got 429s).
    assert result.outcomes.get("aborted_upload", 0) == 100, result.outcomes
    assert result.outcomes.get("aborted_prefill", 0) >= 10, result.outcomes
    assert result.outcomes.get("aborted_stream", 0) >= 1, result.outcomes
    assert result.outcomes.get("ok", 0) >= 5, result.outcomes
    # The budgets were pressed: some class reached its limit at an upstream.
    assert any(result.upstream_peak[k] >= LIMITS[k] for k in LIMITS), result.upstream_peak

"""Clusters over gRPC xDS (issue 17): Envoy gets its clusters from the processor's CDS stream;
a cluster added to and removed from fleet.yaml under traffic reaches Envoy after the processor's
reload (Envoy acknowledges the new set), with no failed request. How long that took is printed,
not asserted: a figure of a loaded machine is not a verdict."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

import orjson
import pytest
import yaml

from extproc.harness.launch import Client, FleetStack, http_get, wait_until
from extproc.render.envoy_dynamic import write_atomically
from tests.e2e.conftest import dump_logs

CHAT = "/v1/chat/completions"


@pytest.fixture
def xds_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(tmp_path_factory.mktemp("xds"), clusters=2, xds_cds=True)
    with stack:
        yield stack


def envoy_clusters(stack: FleetStack) -> set[str]:
    _status, body = http_get(stack.admin_port, "/clusters")
    return {line.split("::")[0] for line in body.decode().splitlines() if "::" in line}


class Traffic:
    """Sequential requests over fresh sessions from two threads until stopped."""

    def __init__(self, stack: FleetStack) -> None:
        self.stack = stack
        self.statuses: Counter[int] = Counter()
        self.served: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(t,)) for t in range(2)]
        self._lock = threading.Lock()

    def _run(self, thread: int) -> None:
        client = Client(self.stack.listener_port)
        i = 0
        try:
            while not self._stop.is_set():
                i += 1
                sid = f"xds-{thread}-{i}"
                body = orjson.dumps(
                    {"model": "m", "messages": [{"role": "user", "content": sid}], "max_tokens": 2}
                )
                status, headers, data = client.post_json(CHAT, body, {"x-session-id": sid})
                with self._lock:
                    self.statuses[status] += 1
                    self.served[headers.get("x-served-by", "")] += 1
                    if status != 200:
                        self.failures.append(f"{status} {data[:200]!r}")
        finally:
            client.close()

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


# How long a step may take before the test calls it hung: generous, for a starved machine.
HANG_S = 60.0
ACKS = ("fleet_xds_responses_total", (("result", "ack"),))


def reload_and_time(stack: FleetStack, until: object, what: str) -> float:
    """SIGHUP the processor (reload now, not at the next poll) and time ``until`` (a figure)."""
    started = time.monotonic()
    stack.procs[0].signal(signal.SIGHUP)
    wait_until(until, HANG_S, what, interval=0.01)
    return time.monotonic() - started


def test_cluster_added_and_removed_under_traffic(xds_stack: FleetStack) -> None:
    stack = xds_stack
    assert {"c1", "c2", "c1__c2", "c2__c1", "all_clusters"} <= envoy_clusters(stack)
    with Traffic(stack) as traffic:
        wait_until(lambda: sum(traffic.statuses.values()) >= 20, 30, "traffic")
        acks_before = stack.processor_metrics().get(ACKS, 0)
        stack.add_cluster("c3")  # fleet.yaml now names c3 (its sim is up)
        added = reload_and_time(
            stack,
            lambda: {"c3", "c1__c3", "c3__c2"} <= envoy_clusters(stack),
            "c3 and its aggregates in Envoy",
        )
        # The processor names c3 once Envoy has it (after cds_settle_s) and its health check
        # passed: new sessions then reach it.
        wait_until(lambda: traffic.served["c3"] >= 5, HANG_S, "traffic on c3", interval=0.1)
        # Envoy took the new cluster set from the processor's CDS stream (it acknowledged it).
        assert stack.processor_metrics().get(ACKS, 0) > acks_before
        spec = stack.sim_specs.pop("c3")
        write_atomically(stack.fleet_path, yaml.safe_dump(stack.fleet_config(), sort_keys=False))
        # Removal is staged: the processor stops naming c3, then (cds_settle_s later) Envoy
        # drops it; timed from the SIGHUP, so the figure includes that settle time.
        removed = reload_and_time(
            stack, lambda: "c3" not in envoy_clusters(stack), "c3 gone from Envoy"
        )
        served_c3 = traffic.served["c3"]
        time.sleep(1.0)
        assert traffic.served["c3"] == served_c3  # nothing sent there after removal
    stack.sims["c3"].stop()
    stack.sim_specs["c3"] = spec  # keep the stack's bookkeeping whole for stop()
    total = sum(traffic.statuses.values())
    print(f"xds: c3 in Envoy {added:.3f}s after the reload, gone {removed:.3f}s; {total} requests")
    assert traffic.statuses == {200: total}, (traffic.failures[:5], dump_logs(stack))
    nacks = stack.processor_metrics().get(("fleet_xds_responses_total", (("result", "nack"),)), 0)
    assert nacks == 0
    # SIGTERM: the replica drains and exits by itself; Envoy's CDS stream, which never ends on
    # its own, does not hold it (a kill after the timeout would give -9).
    assert stack.procs[0].stop(timeout=30) == 0, dump_logs(stack)


@pytest.fixture
def xds_pool_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("xds-pool"),
        clusters=3,
        xds_cds=True,
        fleet_overrides={"processor": {"mode": "endpoint_picker"}},
    )
    with stack:
        yield stack


def pool_hosts(stack: FleetStack) -> set[str]:
    return {addr for cluster, addr in stack.host_health() if cluster == "all_clusters"}


def test_the_pool_gets_its_endpoints_by_eds_and_a_reload_changes_only_them(
    xds_pool_stack: FleetStack,
) -> None:
    """Issue 21: the pool cluster is created once (CDS) and a fleet change reaches Envoy as a
    new endpoint list (EDS); the cluster is never replaced, so its hosts stay."""
    stack = xds_pool_stack
    cds_updates = "cluster_manager.cds.update_success"

    def counter(name: str) -> int:
        _status, body = http_get(stack.admin_port, f"/stats?filter=^{name}$")
        return int(body.decode().split(": ")[1])

    start_hosts = pool_hosts(stack)
    assert envoy_clusters(stack) == {"all_clusters", "extproc"}
    assert len(start_hosts) == 3
    created = counter("cluster_manager.cluster_added")
    with Traffic(stack) as traffic:
        wait_until(lambda: sum(traffic.statuses.values()) >= 20, 30, "traffic")
        cds_before = counter(cds_updates)
        stack.add_cluster("c4")
        c4 = f"127.0.0.1:{stack.sim_specs['c4'].port}"
        added = reload_and_time(stack, lambda: c4 in pool_hosts(stack), "c4 in the pool")
        wait_until(lambda: traffic.served["c4"] >= 5, HANG_S, "traffic on c4", interval=0.1)
        # Envoy acknowledged new cluster sets (union, final), but none replaced the pool.
        assert counter(cds_updates) >= cds_before
        assert counter("cluster_manager.cluster_added") == created
        assert counter("cluster_manager.cluster_modified") == 0
        assert pool_hosts(stack) == start_hosts | {c4}
    total = sum(traffic.statuses.values())
    print(f"xds pool: c4 in Envoy's pool {added:.3f}s after the reload; {total} requests")
    assert traffic.statuses == {200: total}, (traffic.failures[:5], dump_logs(stack))
    metrics = stack.processor_metrics()
    for family in ("fleet_xds_responses_total", "fleet_eds_responses_total"):
        assert metrics.get((family, (("result", "nack"),)), 0) == 0, family
    # The first set and the union (the final set follows cds_settle_s after the switch).
    assert metrics.get(("fleet_eds_responses_total", (("result", "ack"),)), 0) >= 2

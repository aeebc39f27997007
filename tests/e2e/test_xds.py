"""Clusters over gRPC xDS (issue 17): Envoy gets its clusters from the processor's CDS stream;
a cluster added to and removed from fleet.yaml under traffic reaches Envoy within a second of
the processor's reload, with no failed request."""

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


def reload_and_time(stack: FleetStack, until: object, what: str) -> float:
    """SIGHUP the processor (reload now, not at the next poll) and time ``until``."""
    started = time.monotonic()
    stack.procs[0].signal(signal.SIGHUP)
    wait_until(until, 10, what, interval=0.01)
    return time.monotonic() - started


def test_cluster_added_and_removed_under_traffic(xds_stack: FleetStack) -> None:
    stack = xds_stack
    assert {"c1", "c2", "c1__c2", "c2__c1", "all_clusters"} <= envoy_clusters(stack)
    with Traffic(stack) as traffic:
        wait_until(lambda: sum(traffic.statuses.values()) >= 20, 30, "traffic")
        stack.add_cluster("c3")  # fleet.yaml now names c3 (its sim is up)
        added = reload_and_time(
            stack,
            lambda: {"c3", "c1__c3", "c3__c2"} <= envoy_clusters(stack),
            "c3 and its aggregates in Envoy",
        )
        # The processor names c3 once Envoy has it (after cds_settle_s) and its health check
        # passed: new sessions then reach it.
        wait_until(lambda: traffic.served["c3"] >= 5, 30, "traffic on c3", interval=0.1)
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
    assert added < 1.0, added
    nacks = stack.processor_metrics().get(("fleet_xds_responses_total", (("result", "nack"),)), 0)
    assert nacks == 0
    # SIGTERM: the replica drains and exits by itself; Envoy's CDS stream, which never ends on
    # its own, does not hold it (a kill after the timeout would give -9).
    assert stack.procs[0].stop(timeout=30) == 0, dump_logs(stack)

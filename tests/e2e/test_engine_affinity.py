"""Engine stickiness inside a cluster (issue 22), through a real Envoy: 2 clusters of 3
simulated engines, each engine its own process with its own KV cache.

Route mode (the pair aggregates): each cluster ring-hashes its engines on the processor's
x-fleet-engine-key. Endpoint-picker mode: the processor names the engine itself.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import Client, FleetStack, SimSpec, wait_until
from extproc.harness.sim_cluster import SERVED_BY, SERVED_BY_ENGINE
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.predict import PURE_HASH, placement_for

CHAT = "/v1/chat/completions"
# Enough sessions per engine (~75) that the spread bound tests the hashing, not chance.
SESSIONS = 450
TURNS = 6
STICKY_SESSIONS = 40


def _body(text: str) -> bytes:
    doc = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return orjson.dumps(doc)


def _send(stack: FleetStack, client: Client, sid: str) -> tuple[str, str]:
    status, hdrs, data = client.post_json(CHAT, _body(f"turn of {sid}"), {"x-session-id": sid})
    assert status == 200, (status, data[:300], dump_logs(stack))
    return hdrs[SERVED_BY], hdrs[SERVED_BY_ENGINE]


def _engines_of(stack: FleetStack, client: Client, sids: list[str]) -> dict[str, str]:
    return {sid: _send(stack, client, sid)[1] for sid in sids}


def _cds_quiet(stack: FleetStack) -> None:
    """Wait until Envoy's CDS update count has been still for 2 s and every engine is healthy."""
    counts: list[int] = []

    def quiet() -> bool:
        counts.append(stack.envoy_stat("cluster_manager.cds.update_success"))
        return len(counts) >= 3 and counts[-1] == counts[-3]

    wait_until(quiet, 30, "Envoy's CDS updates to settle", interval=1.0)
    stack.wait_healthy(list(stack.cluster_endpoints()))


def _settle(stack: FleetStack, client: Client) -> None:
    """Wait until Envoy routes steadily: observed on 1.40, for ~0.1 s after every host is
    reported healthy, an aggregate still sent a few requests to its secondary (no retry, no
    flag), as if its primary's ring were not built yet on the worker. Two passes in a row of
    probe sessions all served by their primary cluster on the same engines."""
    # With dynamic CDS the processor rewrites Envoy's clusters after it starts; a cluster whose
    # definition changed is recreated, and until its hosts pass their first health check the
    # hash table spans only some engines: every session moved at once for a moment (observed
    # ~1.5 s after start). Wait until the CDS update count has been still for 2 s.
    _cds_quiet(stack)
    runtime = load_runtime(stack.fleet_path)
    probes = [f"probe-{i}" for i in range(12)]
    primary = {
        sid: placement_for(runtime, CHAT, _body(f"turn of {sid}"), {"x-session-id": sid}).primary
        for sid in probes
    }
    last: list[dict[str, str]] = []

    def steady() -> bool:
        served = {sid: _send(stack, client, sid) for sid in probes}
        ok = all(cluster == primary[sid] for sid, (cluster, _) in served.items())
        engines = {sid: engine for sid, (_, engine) in served.items()}
        stable = ok and bool(last) and last[-1] == engines
        last.append(engines if ok else {})
        return stable

    wait_until(steady, 20, "steady routing", interval=0.1)


def _spread(engine_of: dict[str, str], stack: FleetStack) -> dict[str, float]:
    """max/mean of sessions per engine, per cluster."""
    per_engine = collections.Counter(engine_of.values())
    out = {}
    for cluster in ("c1", "c2"):
        counts = [per_engine.get(e, 0) for e in stack.engines_of(cluster)]
        out[cluster] = max(counts) / (sum(counts) / len(counts))
    return out


@pytest.fixture
def engines3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    # dynamic_cds: the processor rewrites Envoy's clusters on reload (an engine added).
    # inspect_usage: the processor reads each response and counts it, its usage and cost by
    # the engine Envoy names (upstream.address).
    stack = FleetStack(
        tmp_path_factory.mktemp("engines3"),
        clusters=2,
        engines=3,
        dynamic_cds=True,
        # Pure hashing predicts first turns (no balance spills): tests engine stickiness.
        fleet_overrides={"processor": {"inspect_usage": True}, "affinity": PURE_HASH},
    )
    with stack:
        yield stack


def test_route_mode_sessions_stick_to_one_engine_spread_fail_over_and_grow(
    engines3: FleetStack, make_client: MakeClient
) -> None:
    stack = engines3
    client = make_client(stack.listener_port)
    _settle(stack, client)

    # A session's turns land on one engine.
    counted_before = _per_engine(stack)
    turns: dict[str, list[str]] = collections.defaultdict(list)
    for _turn in range(TURNS):
        for i in range(STICKY_SESSIONS):
            turns[f"alice-{i}"].append(_send(stack, client, f"alice-{i}")[1])
    on_modal = sum(collections.Counter(t).most_common(1)[0][1] for t in turns.values())
    assert on_modal / (TURNS * STICKY_SESSIONS) >= 0.99, turns
    # The processor counted each of those requests, and its usage and cost, on the engine
    # that answered it (Envoy's Maglev chose the engine; Envoy told the processor which).
    answered = collections.Counter(e for t in turns.values() for e in t)
    expected = {stack.engine_address(e): n for e, n in answered.items()}

    def counted() -> dict[str, dict[str, float]]:
        now = _per_engine(stack)
        return {
            name: {a: v - counted_before[name].get(a, 0.0) for a, v in per.items()}
            for name, per in now.items()
        }

    wait_until(
        lambda: {a: v for a, v in counted()["requests"].items() if v} == expected,
        10,
        f"per-engine counts {counted()} to reach {expected}",
        interval=0.2,
    )
    deltas = counted()
    for address, n in expected.items():
        # The simulated engine answers max_tokens (2) output tokens.
        assert deltas["output_tokens"][address] == 2 * n, (address, deltas)
        assert deltas["cost"][address] > 0, (address, deltas)

    # Sessions spread over a cluster's engines.
    sids = [f"s-{i}" for i in range(SESSIONS)]
    before = _engines_of(stack, client, sids)
    assert set(before.values()) == {e for c in ("c1", "c2") for e in stack.engines_of(c)}
    spread = _spread(before, stack)
    assert max(spread.values()) <= 1.3, (spread, collections.Counter(before.values()))

    # An engine killed under sequential traffic: no request fails; once Envoy's health checks
    # exclude it, each of its sessions lands on ONE other engine of the same cluster.
    victim = stack.engines_of("c1")[0]
    its_sessions = [sid for sid, e in before.items() if e == victim]
    assert its_sessions
    stack.sims[victim].kill()
    during = [_send(stack, client, sid) for sid in its_sessions]  # all 200 (asserted in _send)
    stack.wait_healthy([victim], healthy=False)
    after: dict[str, set[str]] = collections.defaultdict(set)
    moved_others: set[str] = set()
    for _ in range(2):
        for sid in sids:
            _cluster, engine = _send(stack, client, sid)
            after[sid].add(engine)
            if sid not in its_sessions and engine != before[sid]:
                moved_others.add(sid)
    # Maglev's disruption is near-minimal, not zero: rebuilding the table without the victim
    # may move an entry or two of other sessions (1 of 450 seen in a CI run). Any more than
    # 1 % would be sessions sprayed by the failure.
    others = len(sids) - len(its_sessions)
    assert len(moved_others) <= max(2, others // 100), sorted(moved_others)
    for sid in its_sessions:
        assert len(after[sid]) == 1, (sid, after[sid])
        (new,) = after[sid]
        assert new != victim and new in stack.engines_of("c1"), (sid, new)
    taken_by = collections.Counter(next(iter(after[sid])) for sid in its_sessions)
    assert len(taken_by) == 2, taken_by  # spread over the other two, each session on one
    assert len(during) == len(its_sessions)

    # An engine added: ≈ 1/M of the cluster's sessions move, all of them to the new engine.
    stack.restart_sim(victim)
    stack.wait_healthy([victim])

    def back() -> bool:
        return all(_send(stack, client, sid)[1] == victim for sid in its_sessions[:5])

    wait_until(back, 15, "the restarted engine to get its sessions back", interval=0.3)
    c1_sessions = [sid for sid, e in before.items() if e in stack.engines_of("c1")]
    settled = _engines_of(stack, client, c1_sessions)
    assert settled == {sid: before[sid] for sid in c1_sessions}
    added = stack.add_engine("c1")
    stack.wait_healthy([added], timeout=30)
    # The reload rewrites Envoy's clusters (a CDS update recreates cluster c1, possibly in two
    # steps): measure once c1 has its 4 healthy engines and routing is the same twice running.
    wait_until(
        lambda: stack.envoy_stat("cluster.c1.membership_healthy") == 4, 30, "4 engines in c1"
    )
    _cds_quiet(stack)
    probes = c1_sessions[:30]
    seen: list[dict[str, str]] = []

    def steady() -> bool:
        seen.append(_engines_of(stack, client, probes))
        return len(seen) >= 2 and seen[-1] == seen[-2]

    wait_until(steady, 30, "steady routing after the reload", interval=0.5)
    grown = _engines_of(stack, client, c1_sessions)
    moved = {sid: e for sid, e in grown.items() if e != settled[sid]}
    # Maglev's table is nearly, not exactly, minimal-disruption: a few entries of the old
    # engines can shift when one is added (0 of 300 and 2 of 225 sessions in two runs).
    to_new = sum(1 for e in moved.values() if e == added)
    assert to_new >= 0.95 * len(moved), collections.Counter(moved.values())
    share = len(moved) / len(c1_sessions)
    assert 0.12 <= share <= 0.40, (share, len(c1_sessions))  # ≈ 1/4

    # Every engine of c1 killed: its sessions fail over to their secondary, c2, without a
    # failed request, and stick there too: c2's Maglev hashes the same engine key, so each
    # session lands on one engine of c2, turn after turn, and they spread over c2's engines.
    for engine in stack.engines_of("c1"):
        stack.sims[engine].kill()
    failed_over: dict[str, list[str]] = collections.defaultdict(list)
    for _turn in range(3):
        for sid in c1_sessions:
            cluster, engine = _send(stack, client, sid)  # 200 (asserted in _send)
            assert cluster == "c2", (sid, cluster)
            failed_over[sid].append(engine)
    stack.wait_healthy(stack.engines_of("c1"), healthy=False)
    for sid in c1_sessions:
        cluster, engine = _send(stack, client, sid)
        assert cluster == "c2", (sid, cluster)
        failed_over[sid].append(engine)
    on_one = sum(collections.Counter(t).most_common(1)[0][1] for t in failed_over.values())
    assert on_one / sum(map(len, failed_over.values())) >= 0.99, failed_over
    on_secondary = collections.Counter(t[-1] for t in failed_over.values())
    assert set(on_secondary) == set(stack.engines_of("c2")), on_secondary
    mean = len(c1_sessions) / len(on_secondary)
    assert max(on_secondary.values()) / mean <= 1.3, on_secondary


def _per_engine(stack: FleetStack) -> dict[str, dict[str, float]]:
    """The processor's per-engine counters, by engine address: served requests, output tokens,
    cost (every model label summed)."""
    names = {
        "requests": "fleet_engine_served_requests_total",
        "output_tokens": "fleet_engine_output_tokens_total",
        "cost": "fleet_engine_token_cost_dollars_total",
    }
    out: dict[str, dict[str, float]] = {key: collections.Counter() for key in names}
    for (name, labels), value in stack.processor_metrics().items():
        for key, wanted in names.items():
            if name == wanted:
                out[key][dict(labels)["engine"]] += value
    return out


@pytest.fixture
def picker3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("picker3"),
        clusters=2,
        engines=3,
        # Pure hashing predicts first turns (no balance spills): tests engine stickiness.
        fleet_overrides={"processor": {"mode": "endpoint_picker"}, "affinity": PURE_HASH},
    )
    with stack:
        yield stack


def test_picker_mode_sessions_stick_and_an_engine_down_moves_each_to_one_engine(
    picker3: FleetStack, make_client: MakeClient
) -> None:
    stack = picker3
    client = make_client(stack.listener_port)
    _settle(stack, client)
    sids = [f"p-{i}" for i in range(SESSIONS)]
    before = _engines_of(stack, client, sids)
    again = _engines_of(stack, client, sids)
    assert again == before
    spread = _spread(before, stack)
    assert max(spread.values()) <= 1.3, (spread, collections.Counter(before.values()))

    victim = stack.engines_of("c2")[1]
    its_sessions = [sid for sid, e in before.items() if e == victim]
    stack.sims[victim].kill()
    # Through the outage nothing fails. Until the picker's probes notice, Envoy tries the dead
    # engine and retries on the next endpoint of the list (the secondary's engine); after, the
    # picker names the session's runner-up engine in the primary: wait for two equal passes.
    deadline = time.monotonic() + 20
    passes: list[dict[str, str]] = []
    while True:
        passes.append({sid: _send(stack, client, sid)[1] for sid in its_sessions})
        last = passes[-1]
        steady = len(passes) >= 2 and last == passes[-2]
        if steady and all(e in stack.engines_of("c2") and e != victim for e in last.values()):
            break
        assert time.monotonic() < deadline, passes[-1]
        time.sleep(0.2)
    now = passes[-1]
    for _ in range(2):
        for sid in sids:
            engine = _send(stack, client, sid)[1]
            if sid in its_sessions:
                assert engine == now[sid] and engine in stack.engines_of("c2"), (sid, engine)
            else:
                assert engine == before[sid], (sid, before[sid], engine)
    assert len(set(now.values())) == 2, collections.Counter(now.values())


@pytest.fixture(params=["endpoint_picker", "route"])
def lora_fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetStack]:
    # Two clusters of two engines serving "m"; "sql-lora" is a declared adapter of "m" that
    # no engine has loaded at start. Model discovery reads every engine's /v1/models. In route
    # mode the processor names the adapter's engines to each pair cluster's override_host
    # (Maglev on the engine key for every other request); in endpoint-picker mode it names
    # every request's engine.
    stack = FleetStack(
        tmp_path_factory.mktemp(f"lora-{request.param}"),
        clusters=2,
        engines=2,
        cluster_models={"c1": ["m"], "c2": ["m"]},
        fleet_overrides={
            "processor": {"mode": request.param},
            "models": [{"name": "sql-lora", "base": "m"}],
            "model_routing": {"discovery": True, "discovery_interval_s": 0.5},
            # Pure hashing predicts first turns (no balance spills): tests an adapter's engines.
            "affinity": PURE_HASH,
        },
    )
    with stack:
        yield stack


def _load_adapter(stack: FleetStack, engine: str) -> None:
    """``engine`` loads sql-lora: its model list names it from now on, as vLLM's does."""
    spec = stack.sim_specs[engine]
    stack.sim_specs[engine] = SimSpec(
        engine, spec.port, (*spec.args[:-1], "m,sql-lora"), cluster=spec.cluster
    )
    stack.restart_sim(engine)
    # Back in Envoy's health checks, or the pair's Maglev (every other request) leaves it out
    # for a while (seen at load 20: no base-model session on it).
    stack.wait_healthy([engine])


def test_an_adapters_sessions_go_to_the_engines_it_is_loaded_on_and_fail_over(
    lora_fleet: FleetStack, make_client: MakeClient
) -> None:
    stack = lora_fleet
    client = make_client(stack.listener_port)
    loaded = "c2-e2"
    _load_adapter(stack, loaded)

    def lora(sid: str) -> tuple[int, str]:
        doc = {"model": "sql-lora", "messages": [{"role": "user", "content": sid}], "max_tokens": 2}
        status, hdrs, _ = client.post_json(CHAT, orjson.dumps(doc), {"x-session-id": sid})
        return status, hdrs.get(SERVED_BY_ENGINE, "")

    probes = [f"probe-{i}" for i in range(6)]
    wait_until(
        lambda: all(lora(sid) == (200, loaded) for sid in probes),
        30,
        f"discovery of the adapter on {loaded}:\n{dump_logs(stack)}",
        interval=0.3,
    )
    # Every session of the adapter, turn after turn, on the engine it is loaded on; the base
    # model's sessions still spread over all four engines.
    sids = [f"l-{i}" for i in range(20)]
    for _turn in range(2):
        for sid in sids:
            assert lora(sid) == (200, loaded)
    base = collections.Counter(_send(stack, client, f"b-{i}")[1] for i in range(40))
    assert len(base) == 4, base

    # c1's first engine loads it too: the adapter's sessions spread over its two loaded
    # engines (the clusters' rendezvous), each session on one of them turn after turn.
    _load_adapter(stack, "c1-e1")
    both = {loaded, "c1-e1"}

    def spread() -> bool:
        return {lora(sid)[1] for sid in sids} == both

    wait_until(spread, 30, f"discovery of the adapter on c1-e1:\n{dump_logs(stack)}", 0.3)
    engine_of = {sid: lora(sid)[1] for sid in sids}
    assert all(lora(sid) == (200, engine_of[sid]) for sid in sids), engine_of
    if load_runtime(stack.fleet_path).endpoint_picker:
        # Not checked here: the picker's prober may find c2-e2 not ready before discovery
        # drops it from c2's list; until then c2 stays the adapter's loaded cluster and the
        # picker names c2-e1, which has no adapter (a 404 was seen once in five runs).
        return
    # Route mode (no prober here: engines are named among those discovery reached). Its
    # engine in c2 killed under sequential traffic: Envoy tries the named c2-e2, the
    # connection is refused, and the retry goes to the session's secondary (c1) and the engine
    # named for it there, c1-e1 (an engine without the adapter would answer 404): no request
    # fails, before or after discovery drops the dead engine.
    stack.sims[loaded].kill()
    served: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        for sid in sids:
            status, engine = lora(sid)
            assert status == 200, (sid, status, dump_logs(stack))
            served[engine] += 1
    assert set(served) == {"c1-e1"}, served

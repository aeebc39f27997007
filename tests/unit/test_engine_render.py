"""Engine stickiness as rendered for Envoy (route mode) and the key the processor sends for it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.core.endpoints import engine_key
from extproc.names import ENGINE_KEY_HEADER, FLEET_HEADERS
from extproc.render.envoy import EnvoyOptions, render_bootstrap
from tests.unit.test_render_envoy import validate


def runtime(engines: dict[str, Any] | None = None, mode: str = "route") -> Runtime:
    doc: dict[str, Any] = {
        "version": 1,
        "processor": {"mode": mode},
        "clusters": [
            {"name": f"c{i}", "endpoints": [f"127.0.0.1:{18200 + 3 * i + j}" for j in range(3)]}
            for i in range(3)
        ],
    }
    if engines is not None:
        doc["engines"] = engines
    return compile_runtime(parse_config(doc))


def clusters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


def routes(config: dict[str, Any]) -> list[dict[str, Any]]:
    listener = config["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return list(hcm["route_config"]["virtual_hosts"][0]["routes"])


def test_sticky_engines_hash_each_cluster_on_the_engine_key(tmp_path: Path) -> None:
    config = render_bootstrap(runtime(), EnvoyOptions(mode="extproc"))
    by_name = clusters(config)
    for name in ("c0", "c1", "c2"):
        cluster = by_name[name]
        assert cluster["lb_policy"] == "MAGLEV"
        balance = cluster["common_lb_config"]["consistent_hashing_lb_config"]
        assert balance["hash_balance_factor"] == 125
        policy = cluster["load_assignment"]["policy"]
        assert policy["overprovisioning_factor"] >= 100 * 1000
    # The aggregates and the fallback (processor down: nothing to hash on) are not hashed. The
    # fallback balances round robin when no engine is named (since issue 23 as override_host's
    # fallback policy, for an adapter's named engines; test below).
    fallback_lb = by_name["all_clusters"]["load_balancing_policy"]["policies"][0]
    override = fallback_lb["typed_extension_config"]["typed_config"]
    rr = override["fallback_policy"]["policies"][0]["typed_extension_config"]["name"]
    assert rr == "envoy.load_balancing_policies.round_robin"
    assert by_name["c0__c1"]["lb_policy"] == "CLUSTER_PROVIDED"
    _named, by_header, fallback = routes(config)
    assert by_header["route"]["hash_policy"] == [{"header": {"header_name": ENGINE_KEY_HEADER}}]
    assert "hash_policy" not in fallback["route"]
    assert ENGINE_KEY_HEADER in FLEET_HEADERS  # internal_only: a client cannot pick its engine
    validate(config, tmp_path)


def test_route_mode_routes_named_adapter_engines_to_the_cluster_of_every_endpoint(
    tmp_path: Path,
) -> None:
    # Issue 23: a LoRA adapter's request with its engines named goes to all_clusters, whose
    # override_host tries them in order (the pair aggregates do not pass the names on); the
    # pairs and their Maglev are unchanged for every other request.
    config = render_bootstrap(runtime(), EnvoyOptions(mode="extproc"))
    named, by_header, _fallback = routes(config)
    assert named["match"]["headers"] == [
        {"name": "x-fleet-route", "string_match": {"exact": "all_clusters"}}
    ]
    assert named["route"]["cluster"] == "all_clusters"
    retry = named["route"]["retry_policy"]
    assert "retry_priority" not in retry and retry["num_retries"] == 1
    assert by_header["route"]["cluster_header"] == "x-fleet-route"
    every = clusters(config)["all_clusters"]
    assert "lb_policy" not in every
    (policy,) = every["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]
    assert override["name"] == "envoy.load_balancing_policies.override_host"
    fallback_policy = override["typed_config"]["fallback_policy"]["policies"][0]
    assert fallback_policy["typed_extension_config"]["name"].endswith(".round_robin")
    assert clusters(config)["c0"]["lb_policy"] == "MAGLEV"
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (ext_proc,) = [f for f in hcm["typed_config"]["http_filters"] if "ext_proc" in f["name"]]
    namespaces = ext_proc["typed_config"]["metadata_options"]["receiving_namespaces"]
    assert namespaces == {"untyped": ["envoy.lb"]}
    validate(config, tmp_path)
    # Engines not sticky: nothing is named, nothing changes.
    spread = render_bootstrap(runtime({"affinity": "round_robin"}), EnvoyOptions(mode="extproc"))
    assert len(routes(spread)) == 2
    assert clusters(spread)["all_clusters"]["lb_policy"] == "ROUND_ROBIN"


def test_balance_factor_off_and_round_robin_render_as_said(tmp_path: Path) -> None:
    unbounded = render_bootstrap(
        runtime({"balance_factor": None, "envoy_policy": "ring_hash"}), EnvoyOptions(mode="extproc")
    )
    assert clusters(unbounded)["c0"]["lb_policy"] == "RING_HASH"
    assert "consistent_hashing_lb_config" not in clusters(unbounded)["c0"]["common_lb_config"]
    validate(unbounded, tmp_path)
    spread = render_bootstrap(runtime({"affinity": "round_robin"}), EnvoyOptions(mode="extproc"))
    assert clusters(spread)["c0"]["lb_policy"] == "ROUND_ROBIN"
    assert "hash_policy" not in routes(spread)[0]["route"]


def test_baseline_modes_and_the_picker_keep_their_own_balancing() -> None:
    for mode in ("round_robin", "ring_hash"):
        config = render_bootstrap(runtime(), EnvoyOptions(mode=mode))  # type: ignore[arg-type]
        assert clusters(config)["c0"]["lb_policy"] == "ROUND_ROBIN"
    picker = render_bootstrap(runtime(mode="endpoint_picker"), EnvoyOptions(mode="extproc"))
    assert "c0" not in clusters(picker) or clusters(picker)["c0"]["lb_policy"] == "ROUND_ROBIN"


def test_engine_key_is_stable_without_a_secret_and_keyed_with_one() -> None:
    digest = hashlib.blake2b(b"alice", digest_size=16).digest()
    other = hashlib.blake2b(b"bob", digest_size=16).digest()
    # No configured secret: the same on every replica and after every restart (no process
    # state goes in), 16 bits.
    assert engine_key(digest) == engine_key(digest)
    assert len(engine_key(digest)) == 4
    assert engine_key(digest) != engine_key(other)
    # A configured secret keys it like the label; a different secret, a different key.
    assert engine_key(digest, b"s1") == engine_key(digest, b"s1")
    assert engine_key(digest, b"s1") != engine_key(digest, b"s2")
    assert len(engine_key(digest, b"s1")) == 16


def test_runtime_keys_the_engine_key_only_with_a_shared_secret(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.delenv("FLEET_SESSION_SECRET", raising=False)
    assert runtime().engines.key_secret == b""  # per-process label secret: not shared
    secret = tmp_path / "secret"
    secret.write_text("fleet-secret\n")
    doc: dict[str, Any] = {
        "version": 1,
        "session": {"label_secret_file": str(secret)},
        "clusters": [{"name": "c0", "endpoints": ["127.0.0.1:9"]}],
    }
    assert compile_runtime(parse_config(doc)).engines.key_secret == b"fleet-secret"

"""fleet.yaml: the canonical file loads; every error names the path of the bad field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.config import ConfigError, compile_runtime, load_config, load_runtime, parse_config
from extproc.config.schema import RESERVED_CLUSTER_NAMES
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.keys import KeySource
from extproc.render.envoy import EXTPROC_CLUSTER, FALLBACK_CLUSTER

ROOT = Path(__file__).resolve().parents[2]
CANONICAL = ROOT / "compose" / "fleet.yaml"


def base() -> dict[str, Any]:
    """A small valid config; each error case breaks exactly one thing in it."""
    return {
        "version": 1,
        "clusters": [
            {"name": "c1", "endpoints": ["127.0.0.1:8001"]},
            {"name": "c2", "endpoints": ["127.0.0.1:8002"], "weight": 2},
            {"name": "c3", "endpoints": ["127.0.0.1:8003", "127.0.0.1:8013"]},
        ],
        "classes": [
            {"name": "short", "max_input_tokens": 2048, "eligible": ["c1", "c2"]},
            {"name": "long"},
        ],
    }


def problems_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "test.yaml")
    assert str(info.value).startswith("test.yaml: invalid fleet config")
    return info.value.problems


def test_the_canonical_config_loads() -> None:
    cfg, raw = load_config(CANONICAL)
    assert raw == CANONICAL.read_bytes()
    assert [c.name for c in cfg.clusters] == ["c1", "c2", "c3"]
    assert [c.name for c in cfg.classes] == ["short", "medium", "long"]
    runtime = load_runtime(CANONICAL)
    assert runtime.cluster_names == ("c1", "c2", "c3")
    assert set(runtime.policy.placers) == {"short", "medium", "long"}
    assert runtime.key_rules.tier_header == "x-tenant-tier"
    assert ("metadata", "user_id") in runtime.key_rules.body_fields
    assert runtime.key_rules.body_fields[0] == ("prompt_cache_key",)
    assert runtime.parse_limits.max_body_bytes == cfg.processor.max_body_bytes
    # The version identifies the file's bytes: same bytes, same version; any edit, a new one.
    assert load_runtime(CANONICAL).version == runtime.version
    assert compile_runtime(cfg, raw + b"\n# edited\n").version != runtime.version


def test_the_base_config_is_valid() -> None:
    """Guards the error cases below: each must fail because of its own edit only."""
    parse_config(base())


Edit = Callable[[dict[str, Any]], None]


def _set(path: tuple[str | int, ...], value: object) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        node: Any = doc
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return edit


def _delete(path: tuple[str | int, ...]) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        node: Any = doc
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]

    return edit


def _append_cluster(cluster: dict[str, Any]) -> Edit:
    return lambda doc: doc["clusters"].append(cluster)


def _all(*edits: Edit) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        for one in edits:
            one(doc)

    return edit


ERRORS: list[tuple[Edit, str]] = [
    (_set(("clusters", 2, "weight"), 0), "clusters[2].weight: must be > 0"),
    (_set(("clusters", 1, "weight"), -1.5), "clusters[1].weight: must be > 0"),
    (
        _append_cluster({"name": "c2", "endpoints": ["127.0.0.1:9"]}),
        "clusters[3].name: duplicate of clusters[1]",
    ),
    (
        _set(("classes", 0, "eligible"), ["c1", "c9"]),
        "classes[0].eligible[1]: no cluster named 'c9'",
    ),
    (
        _set(("classes", 0, "eligible"), ["c1", "c2", "c1"]),
        "classes[0].eligible[2]: duplicate of eligible[0]",
    ),
    (
        _set(("classes", 1, "max_input_tokens"), 100_000),
        "classes[1]: the last class must be a catch-all (no max_input_tokens, no tiers)",
    ),
    (
        _all(_set(("classes", 1, "tiers"), ["gold"]), _set(("session",), {"tier_header": "x-t"})),
        "classes[1]: the last class must be a catch-all (no max_input_tokens, no tiers)",
    ),
    (
        _set(("classes", 1, "name"), "short"),
        "classes[1].name: duplicate of classes[0]",
    ),
    (_set(("colour",), "blue"), "colour: unknown field"),
    (_set(("clusters", 0, "wieght"), 2), "clusters[0].wieght: unknown field"),
    (_set(("processor",), {"tls": True}), "processor.tls: unknown field"),
    (_delete(("version",)), "version: is required"),
    (_delete(("clusters",)), "clusters: is required"),
    (_set(("clusters",), []), "clusters: must have at least 1 item(s)"),
    (_set(("clusters", 0, "endpoints"), []), "clusters[0].endpoints: must have at least 1 item(s)"),
    (
        _set(("clusters", 1, "endpoints"), ["127.0.0.1:8002", "127.0.0.1:99999"]),
        "clusters[1].endpoints[1]: port 99999 is not in 1..65535",
    ),
    (
        _set(("clusters", 2, "name"), "extproc"),
        "clusters[2].name: 'extproc' is reserved for the rendered Envoy config",
    ),
    (
        _all(
            _set(("classes", 0, "tiers"), ["gold"]),
        ),
        "session.tier_header: required when a class lists tiers",
    ),
    (
        _set(("processor",), {"port": 10000}),
        "processor.port: port 10000 is also listener.port",
    ),
    (
        _set(("processor",), {"metrics_port": 9901}),
        "processor.metrics_port: port 9901 is also listener.admin_port",
    ),
    (_set(("listener",), {"port": 70000}), "listener.port: must be <= 65535"),
    (
        _set(("classes", 0, "budget"), {"tokens_per_second": 100, "burst_tokens": 10}),
        "classes[0].budget.burst_tokens: must be >= max_input_tokens - 1 (2047) or the largest "
        "requests of the class never fit",
    ),
    (
        _set(("classes", 0, "budget"), {"max_inflight_tokens": 1000}),
        "classes[0].budget.max_inflight_tokens: must be >= max_input_tokens - 1 (2047) or the "
        "largest requests of the class never fit",
    ),
    (
        _set(("classes", 0, "budget"), {"max_concurrent": -1}),
        "classes[0].budget.max_concurrent: must be >= 0",
    ),
    (_set(("prefix",), {"first_message_chars": 0}), "prefix.first_message_chars: must be >= 1"),
    (
        _set(("processor",), {"failure_mode": "maybe"}),
        "processor.failure_mode: Input should be 'open' or 'closed'",
    ),
    (
        _set(("session",), {"header": "x-fleet-session"}),
        "session.header: x-fleet-* headers are reserved for the processor",
    ),
    (
        _set(
            ("classes",),
            [
                {"name": "short", "max_input_tokens": 4096},
                {"name": "tiny", "max_input_tokens": 512},
                {"name": "rest"},
            ],
        ),
        "classes[1]: unreachable: every request it admits matches classes[0] ('short') first",
    ),
    (
        _all(
            _set(("session",), {"tier_header": "x-tier"}),
            _set(
                ("classes",),
                [
                    {"name": "short", "max_input_tokens": 2048},
                    {"name": "gold-short", "max_input_tokens": 1024, "tiers": ["gold"]},
                    {"name": "rest"},
                ],
            ),
        ),
        "classes[1]: unreachable: every request it admits matches classes[0] ('short') first",
    ),
]
ERROR_IDS = [
    "zero-weight",
    "negative-weight",
    "duplicate-cluster-name",
    "unknown-eligible-cluster",
    "duplicate-eligible-cluster",
    "last-class-has-a-token-bound",
    "last-class-has-tiers",
    "duplicate-class-name",
    "unknown-top-level-field",
    "unknown-cluster-field",
    "unknown-processor-field",
    "missing-version",
    "missing-clusters",
    "no-clusters",
    "cluster-without-endpoints",
    "endpoint-port-out-of-range",
    "cluster-name-reserved-by-the-renderer",
    "tiers-without-tier-header",
    "processor-port-clashes-with-listener",
    "metrics-port-clashes-with-admin",
    "listener-port-out-of-range",
    "burst-below-the-class-token-bound",
    "inflight-budget-below-the-class-token-bound",
    "negative-budget",
    "zero-first-message-chars",
    "failure-mode-not-open-or-closed",
    "session-header-in-the-fleet-namespace",
    "class-behind-a-wider-band",
    "tier-class-behind-an-untiered-class",
]


@pytest.mark.parametrize(("edit", "expected"), ERRORS, ids=ERROR_IDS)
def test_errors_name_the_path_of_the_bad_field(edit: Edit, expected: str) -> None:
    doc = copy.deepcopy(base())
    edit(doc)
    assert problems_of(doc) == [expected]


@pytest.mark.parametrize(
    ("version", "fragment"),
    [(2, "version:"), ("1", "version:"), (None, "version:")],
    ids=["version-2", "version-as-string", "version-null"],
)
def test_only_version_1_is_understood(version: object, fragment: str) -> None:
    doc = base()
    doc["version"] = version
    assert any(p.startswith(fragment) for p in problems_of(doc))


@pytest.mark.parametrize(
    ("name", "ok"),
    [("c1", True), ("gpu-a100-east", True), ("C1", False), ("a__b", False), ("-c", False)],
    ids=["simple", "dashes", "upper-case", "double-underscore-is-the-pair-separator", "dash-first"],
)
def test_cluster_names_are_safe_for_aggregate_names(name: str, ok: bool) -> None:
    doc = base()
    doc["clusters"][0]["name"] = name
    doc["classes"][0]["eligible"] = []
    if ok:
        parse_config(doc)
    else:
        assert any(p.startswith("clusters[0].name:") for p in problems_of(doc))


def test_a_tier_class_before_the_general_one_is_reachable() -> None:
    doc = base()
    doc["session"] = {"tier_header": "x-tier"}
    doc["classes"] = [
        {"name": "gold-short", "max_input_tokens": 4096, "tiers": ["gold"]},
        {"name": "short", "max_input_tokens": 2048},
        {"name": "medium", "max_input_tokens": 100_000},
        {"name": "rest"},
    ]
    parse_config(doc)


def test_every_problem_is_reported_at_once() -> None:
    doc = base()
    doc["classes"][0]["eligible"] = ["c7", "c8"]
    doc["classes"][1]["max_input_tokens"] = 5
    problems = problems_of(doc)
    assert any(p.startswith("classes[0].eligible[0]") for p in problems)
    assert any(p.startswith("classes[0].eligible[1]") for p in problems)
    assert any(p.startswith("classes[1]: the last class") for p in problems)


@pytest.mark.parametrize(
    "data", [[1, 2], "version: 1", None, 42], ids=["list", "string", "empty", "number"]
)
def test_a_document_that_is_not_a_mapping(data: object) -> None:
    assert problems_of(data) == ["(root): must be a mapping"]


def test_bad_yaml_names_the_file_and_the_position(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("version: 1\nclusters: [\n  {name: c1, endpoints: [a:1]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("(yaml):")
    assert "line" in info.value.problems[0]


def test_an_empty_file_is_not_a_config(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == ["(root): must be a mapping"]


def test_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    doc = base()
    doc["clusters"][2]["weight"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as info:
        load_runtime(path)
    assert str(info.value).startswith(f"{path}: invalid fleet config")
    assert info.value.problems == ["clusters[2].weight: must be > 0"]


def test_the_renderers_own_cluster_names_are_reserved() -> None:
    assert {EXTPROC_CLUSTER, FALLBACK_CLUSTER} <= RESERVED_CLUSTER_NAMES


# --- compiled runtime -------------------------------------------------------------------------


def test_defaults_fill_in_and_compile() -> None:
    cfg = parse_config({"version": 1, "clusters": [{"name": "only", "endpoints": ["h:1"]}]})
    runtime = compile_runtime(cfg)
    assert [c.name for c in runtime.policy.classes] == ["short", "medium", "long"]
    assert runtime.policy.classes[-1].max_input_tokens is None
    assert runtime.key_rules.header == "x-session-id"
    assert runtime.clusters[0].weight == 1.0


def test_eligible_clusters_restrict_placement() -> None:
    runtime = compile_runtime(parse_config(base()))
    headers = {"content-type": "application/json"}
    seen_short: set[str] = set()
    seen_long: set[str] = set()
    for i in range(300):
        small = orjson.dumps({"messages": [{"role": "user", "content": f"q{i}"}]})
        big = orjson.dumps({"messages": [{"role": "user", "content": f"q{i}" + "x" * 10_000}]})
        for body, seen, cls in ((small, seen_short, "short"), (big, seen_long, "long")):
            facts = parse_request(
                "/v1/chat/completions", headers, body, runtime.key_rules, runtime.parse_limits
            )
            assert isinstance(facts, RequestFacts)
            assert facts.session.source is KeySource.PREFIX
            route = runtime.policy.route(facts)
            assert route.request_class.name == cls
            seen.add(route.placement.primary)
            seen.add(route.placement.secondary or "")
    assert seen_short == {"c1", "c2"}
    assert seen_long == {"c1", "c2", "c3"}


def test_session_settings_reach_the_key_rules() -> None:
    doc = base()
    doc["session"] = {"header": None, "body_fields": ["metadata.tenant"], "tier_header": "x-tier"}
    doc["prefix"] = {"first_message_chars": 10, "system_chars": 0}
    rules = compile_runtime(parse_config(doc)).key_rules
    assert rules.header is None
    assert rules.body_fields == (("metadata", "tenant"),)
    assert rules.tier_header == "x-tier"
    assert rules.first_message_chars == 10
    assert rules.system_chars == 0


def test_clusters_are_probed_by_default_exactly_when_a_class_has_a_budget() -> None:
    """processor.probe_clusters unset: probing is on when a budget's charge matters (a
    secondary's budget must hold during a primary outage); an explicit value always wins."""
    assert not compile_runtime(parse_config(base())).probes_clusters
    budgeted = base()
    budgeted["classes"][1]["budget"] = {"max_concurrent": 4}
    assert compile_runtime(parse_config(budgeted)).probes_clusters
    budgeted["processor"] = {"probe_clusters": False}
    assert not compile_runtime(parse_config(budgeted)).probes_clusters
    plain = base()
    plain["processor"] = {"probe_clusters": True}
    assert compile_runtime(parse_config(plain)).probes_clusters
